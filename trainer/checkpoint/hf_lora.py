"""peft=lora's adapters out of a checkpoint: merged into the base weights (python -m trainer.hf
export), or alone in Hugging Face PEFT's format (export --adapter-only): adapter_config.json and
adapter_model.safetensors, which PeftModel.from_pretrained puts on transformers' base model.

PEFT names an adapter by its projection's module path under the PeftModel wrapper:
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. Ours is
`layers.0.attn.qkv_lora.q_proj.lora_A.weight`; the projection's Hugging Face path comes from
the family's own mapping (hf_families.hf_parts), so every family the export knows is covered.

A routed expert's adapter goes out as PEFT wrote it for transformers 4's per-expert modules
(`...mlp.experts.3.gate_proj.lora_A.weight`, [r, h]), which PEFT 0.21 reads into transformers
5's fused experts: gate and up together at rank 2r (their Bs block-diagonal) and alpha 2 alpha,
the same update (tests/integration/test_lora_hf.py holds the logits equal).
"""
from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.hf import _new_folder, one_process
from trainer.checkpoint.hf_families import MAPPINGS, hf_parts
from trainer.config import ModelConfig, PeftConfig, Precision
from trainer.parts.assembly import BLOCKS, parameter_shapes
from trainer.parts.families import hf_family
from trainer.parts.lora import ADAPTERS, check_peft, is_expert_projection, projections, targets

PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def recorded_peft(ckpt: Path) -> PeftConfig | None:
    """The peft config the checkpoint's run recorded in meta.json (None: full fine-tuning)."""
    meta = json.loads((ckpt / "meta.json").read_text())
    values = meta.get("peft")
    if not values:
        return None
    known = {f.name for f in fields(PeftConfig)}
    peft = PeftConfig(**{k: v for k, v in values.items() if k in known})
    return replace(peft, base_precision=Precision(peft.base_precision))


def adapter_tensors(model: ModelConfig, peft: PeftConfig) -> dict[str, tuple[int, ...]]:
    """Our adapter parameters and their shapes (what the checkpoint holds beside the base)."""
    base = parameter_shapes(model)
    return {n: s for n, s in parameter_shapes(model, peft).items() if n not in base}


def hf_keys(model: ModelConfig, ours: str, hf_parts: dict[str, list[tuple[str, int]]]
            ) -> list[str]:
    """An adapter factor's keys in PEFT's file: layers.0.attn.qkv_lora.q_proj.lora_A.weight ->
    [base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight] (the base tensor of that
    part, less .weight, and the factor); a routed expert's, one key per expert, in order."""
    module, _, rest = ours.partition(f"{ADAPTERS}.")
    projection, factor = rest.split(".")[:2]
    block, within = module.split(".", 2)[1:]
    if is_expert_projection(within):  # each expert's parts in the fused order
        names = [n for n, _, _ in projections(model, int(block))[within]]
        entries = hf_parts[module][names.index(projection)::len(names)]
        paths = [name.removesuffix(".weight") for name, _ in entries]
    else:
        paths = [name.removesuffix(".weight") for name, _ in hf_parts[f"{module}.weight"]
                 if name.removesuffix(".weight").rsplit(".", 1)[-1] == projection]
    if not paths:
        raise ValueError(f"{ours}: the family's Hugging Face names have no {projection} under "
                         f"{module}")
    return [f"{PEFT_PREFIX}{path}.{factor}.weight" for path in paths]


def load_tensor(ckpt: Path, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    full = torch.zeros(shape, dtype=torch.float32)
    with one_process():
        dcp.load({f"model.{name}": full}, checkpoint_id=ckpt, no_dist=True)
    return full


def merge_into(model: ModelConfig, peft: PeftConfig, ckpt: Path
               ) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """For the merged export: base parameter `name`'s value with each adapted part's rows
    plus (alpha / r) B A."""
    shapes, scaling = adapter_tensors(model, peft), peft.lora_alpha / peft.lora_rank
    fused_by_module = {m: n for m, n in targets(model).items()}

    def merged(name: str, full: torch.Tensor) -> torch.Tensor:
        if not name.startswith(f"{BLOCKS}."):
            return full
        module = name.removesuffix(".weight")  # (a routed experts' weight has no .weight)
        within = module.split(".", 2)[2]  # attn.qkv
        names = fused_by_module.get(within)
        if names is None:
            return full
        # each fused part's rows in order: an adapter's part is where its name is
        block = int(module.split(".", 2)[1])
        start = 0
        for projection, _, count in projections(model, block)[within]:
            a_name = f"{module}{ADAPTERS}.{projection}.lora_A.weight"
            if a_name in shapes:
                b_name = a_name.replace("lora_A", "lora_B")
                a = load_tensor(ckpt, a_name, shapes[a_name])
                b = load_tensor(ckpt, b_name, shapes[b_name])
                full[..., start:start + count, :] += scaling * (b @ a)  # each expert's
            start += count
        return full

    return merged


MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
# Hugging Face model types whose per-expert adapters PEFT 0.21 reads into transformers 5's
# fused experts (its _MOE_TARGET_MODULE_MAPPING; gpt-oss's experts were fused before, so
# PEFT has no per-expert form of them).
PER_EXPERT_TYPES = ("mixtral", "qwen3_moe", "deepseek_v3")


def check_peft_reads(model: ModelConfig, peft: PeftConfig) -> None:
    """An adapter PEFT would load as something else is refused. On a mixture of experts
    (transformers 5's fused experts) PEFT 0.21 reads gate_proj, up_proj and down_proj as the
    routed experts' (as we do), gate and up only together, and nothing else by those names:
    adapters on a dense block's MLP would be dropped (a missing-keys warning)."""
    mlp = sorted(set(peft.target_modules) & set(MLP_NAMES))
    if model.num_moe_experts is None or not mlp:
        return
    fix = ("export the merged model (python -m trainer.hf export CKPT OUT), or adapt the "
           "attention only (q_proj, k_proj, v_proj, o_proj)")
    dense = [i for i in range(model.num_layers) if not model.is_moe_block(i)]
    if dense:
        raise ValueError(f"export --adapter-only: peft.target_modules has {', '.join(mlp)} on "
                         f"a mixture of experts whose block {dense[0]} is dense: PEFT reads "
                         f"those names as the routed experts' only and would drop the dense "
                         f"MLPs' adapters. Fix: {fix}.")
    model_type = MAPPINGS[hf_family(model).name].model_type
    if model_type not in PER_EXPERT_TYPES:
        raise ValueError(f"export --adapter-only: the routed experts' adapters of a "
                         f"{model_type} model, which PEFT has no per-expert form of (its "
                         f"experts are fused in transformers). Fix: {fix}.")
    if len(set(mlp) & {"gate_proj", "up_proj"}) == 1:
        raise ValueError(f"export --adapter-only: peft.target_modules has "
                         f"{', '.join(sorted(set(mlp) & {'gate_proj', 'up_proj'}))} without "
                         f"the other, which PEFT refuses on fused experts (gate|up is one "
                         f"weight there). Fix: {fix}, or adapt gate_proj and up_proj both.")


def export_adapter(ckpt: Path, out_dir: Path, model: ModelConfig, peft: PeftConfig,
                   dtype: torch.dtype, base: str) -> list[Path]:
    """The checkpoint's adapters alone, as PEFT writes them (`base`: what the adapter config
    names as its base model)."""
    from safetensors.torch import save_file

    from trainer.checkpoint.dcp import saved_entries

    check_peft_reads(model, peft)
    saved = saved_entries(ckpt)
    for name, shape in adapter_tensors(model, peft).items():
        entry = saved.get(f"model.{name}")
        if entry is None or tuple(entry.size) != shape:
            raise ValueError(f"{ckpt} has no adapter {name!r} of shape {shape}, which its "
                             f"meta.json's peft promises. Fix: export a checkpoint its own run "
                             f"wrote.")
    parts, tensors = hf_parts(model), {}
    for name, shape in adapter_tensors(model, peft).items():
        value = load_tensor(ckpt, name, shape).to(dtype)
        keys = hf_keys(model, name, parts)  # a routed expert's: one per expert
        tensors |= {key: v.contiguous() for key, v in
                    zip(keys, value if len(shape) == 3 else [value])}
    projections = sorted({key.rsplit(".", 3)[-3] for key in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": peft.lora_rank,
              "lora_alpha": peft.lora_alpha, "lora_dropout": peft.lora_dropout,
              "target_modules": projections, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "base_model_name_or_path": base, "inference_mode": True}
    with _new_folder(out_dir) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return [out_dir / ADAPTER_WEIGHTS, out_dir / ADAPTER_CONFIG]


# adapter_config.json keys whose non-default values change what LoRA computes (ours: plain LoRA)
PLAIN = {"use_dora": False, "use_rslora": False, "bias": "none", "fan_in_fan_out": False,
         "rank_pattern": {}, "alpha_pattern": {}}


def read_adapter(adapter_dir: Path, model: ModelConfig
                 ) -> tuple[PeftConfig, dict[str, torch.Tensor]]:
    """An adapter PEFT wrote (PeftModel.save_pretrained) for `model`: its config as ours and
    its tensors by our names, checked: one line naming the file and the fix."""
    from safetensors import safe_open

    config_path, weights_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    fix = "point --adapter at a folder PeftModel.save_pretrained wrote for this base model"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist. Fix: {fix}.")
    config = json.loads(config_path.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{config_path}: peft_type {config.get('peft_type')!r} is not LORA, the "
                         f"only adapter this trainer trains. Fix: {fix}.")
    for key, plain in PLAIN.items():
        if config.get(key, plain) not in (plain, None):
            raise ValueError(f"{config_path}: {key}={config[key]!r} is not plain LoRA, which "
                             f"is what peft=lora trains ({key}={plain!r}). Fix: use an adapter "
                             f"without it.")
    if config.get("target_parameters"):
        raise ValueError(f"{config_path}: target_parameters={config['target_parameters']!r}: "
                         f"adapters on transformers 5's fused expert weights are read here in "
                         f"PEFT's per-expert form only (gate_proj, up_proj, down_proj in "
                         f"target_modules, as export --adapter-only writes them). Fix: {fix}.")
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        raise ValueError(f"{config_path}: target_modules {targets!r} is not a list of "
                         f"projection names (a pattern is not read here). Fix: save the adapter "
                         f"with target_modules as a list, e.g. [q_proj, v_proj].")
    # a family's own names of its experts' projections (Mixtral's w1, w3, w2) are ours
    _, theirs = hf_family(model).expert_names
    ours = dict(zip(theirs, MLP_NAMES)) if model.num_moe_experts is not None else {}
    peft = PeftConfig("lora", int(config.get("r", 8)), float(config.get("lora_alpha", 8)),
                      float(config.get("lora_dropout", 0.0)),
                      sorted(ours.get(t, t) for t in targets))
    try:
        check_peft(model, peft)
    except ValueError as error:
        raise ValueError(f"{config_path}: {error}") from None
    parts, tensors = hf_parts(model), {}
    with safe_open(str(weights_path), "pt") as f:
        found = set(f.keys())
        for name, shape in adapter_tensors(model, peft).items():
            keys, values = hf_keys(model, name, parts), []
            for key in keys:  # a routed expert's: one per expert
                if key not in found:
                    raise ValueError(f"{weights_path} has no {key!r}, which its config's "
                                     f"target_modules and r={peft.lora_rank} promise. Fix: "
                                     f"{fix}.")
                values.append(f.get_tensor(key))
                found.discard(key)
            tensor = torch.stack(values) if len(shape) == 3 else values[0]
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{weights_path}: {keys[0]!r} is {tuple(values[0].shape)}, "
                                 f"this model's adapter is {shape[-2:]}. Fix: {fix}.")
            tensors[name] = tensor.to(torch.float32)
    if found:
        raise ValueError(f"{weights_path} holds {len(found)} tensor(s) this trainer's LoRA has "
                         f"no place for, e.g. {sorted(found)[0]!r}. Fix: {fix}.")
    return peft, tensors
