"""peft=lora's adapters out of a checkpoint: merged into the base weights (python -m trainer.hf
export), or alone in Hugging Face PEFT's format (export --adapter-only): adapter_config.json and
adapter_model.safetensors, which PeftModel.from_pretrained puts on transformers' base model.

PEFT names an adapter by its projection's module path under the PeftModel wrapper:
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. Ours is
`layers.0.attn.qkv_lora.q_proj.lora_A.weight`; the projection's Hugging Face path comes from
the family's own mapping (hf_families.hf_parts), so every family the export knows is covered.
"""
from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.hf import _new_folder, one_process
from trainer.checkpoint.hf_families import hf_parts
from trainer.config import ModelConfig, PeftConfig, Precision
from trainer.parts.assembly import BLOCKS, parameter_shapes
from trainer.parts.lora import ADAPTERS, check_peft, projections, targets

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


def hf_module(ours: str, hf_parts: dict[str, list[tuple[str, int]]]) -> str:
    """An adapter's projection as transformers names it: layers.0.attn.qkv_lora.q_proj.lora_A
    .weight -> model.layers.0.self_attn.q_proj (the base tensor of that part, less .weight)."""
    module, _, rest = ours.partition(f"{ADAPTERS}.")
    projection = rest.split(".")[0]
    for hf_name, _ in hf_parts[f"{module}.weight"]:
        path = hf_name.removesuffix(".weight")
        if path.rsplit(".", 1)[-1] == projection:
            return path
    raise ValueError(f"{ours}: the family's Hugging Face names have no {projection} under "
                     f"{module}")


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
        if not name.startswith(f"{BLOCKS}.") or not name.endswith(".weight"):
            return full
        module = name.removesuffix(".weight")
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
                full[start:start + count] += scaling * (b @ a)
            start += count
        return full

    return merged


MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def check_peft_reads(model: ModelConfig, peft: PeftConfig) -> None:
    """An adapter PEFT would load as something else is refused: on a mixture of experts
    (transformers 5's fused experts) PEFT 0.21 reads gate_proj, up_proj and down_proj in
    target_modules as the routed experts' weights, which take no adapters here, and drops
    ours on the dense MLPs (a missing-keys warning, the base's logits)."""
    mlp = sorted(set(peft.target_modules) & set(MLP_NAMES))
    if model.num_moe_experts is not None and mlp:
        raise ValueError(f"export --adapter-only: peft.target_modules has {', '.join(mlp)} on a "
                         f"mixture-of-experts model (model.num_moe_experts="
                         f"{model.num_moe_experts}), which PEFT reads as its routed experts' "
                         f"weights and would load without our adapters. Fix: export the merged "
                         f"model (python -m trainer.hf export CKPT OUT), or adapt the attention "
                         f"only (q_proj, k_proj, v_proj, o_proj).")


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
    parts = hf_parts(model)
    tensors = {f"{PEFT_PREFIX}{hf_module(name, parts)}.{name.rsplit('.', 2)[-2]}.weight":
               load_tensor(ckpt, name, shape).to(dtype).contiguous()
               for name, shape in adapter_tensors(model, peft).items()}
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
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        raise ValueError(f"{config_path}: target_modules {targets!r} is not a list of "
                         f"projection names (a pattern is not read here). Fix: save the adapter "
                         f"with target_modules as a list, e.g. [q_proj, v_proj].")
    peft = PeftConfig("lora", int(config.get("r", 8)), float(config.get("lora_alpha", 8)),
                      float(config.get("lora_dropout", 0.0)), sorted(targets))
    try:
        check_peft(model, peft)
    except ValueError as error:
        raise ValueError(f"{config_path}: {error}") from None
    parts, tensors = hf_parts(model), {}
    with safe_open(str(weights_path), "pt") as f:
        found = set(f.keys())
        for name, shape in adapter_tensors(model, peft).items():
            key = f"{PEFT_PREFIX}{hf_module(name, parts)}.{name.rsplit('.', 2)[-2]}.weight"
            if key not in found:
                raise ValueError(f"{weights_path} has no {key!r}, which its config's "
                                 f"target_modules and r={peft.lora_rank} promise. Fix: {fix}.")
            tensor = f.get_tensor(key)
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{weights_path}: {key!r} is {tuple(tensor.shape)}, this "
                                 f"model's adapter is {shape}. Fix: {fix}.")
            tensors[name] = tensor.to(torch.float32)
            found.discard(key)
    if found:
        raise ValueError(f"{weights_path} holds {len(found)} tensor(s) this trainer's LoRA has "
                         f"no place for, e.g. {sorted(found)[0]!r}. Fix: {fix}.")
    return peft, tensors
