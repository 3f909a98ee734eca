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
from dataclasses import fields
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

from trainer.config import ModelConfig, PeftConfig
from trainer.parts.assembly import BLOCKS, parameter_shapes
from trainer.parts.lora import ADAPTERS, targets

PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def recorded_peft(ckpt: Path) -> PeftConfig | None:
    """The peft config the checkpoint's run recorded in meta.json (None: full fine-tuning)."""
    meta = json.loads((ckpt / "meta.json").read_text())
    values = meta.get("peft")
    if not values:
        return None
    known = {f.name for f in fields(PeftConfig)}
    return PeftConfig(**{k: v for k, v in values.items() if k in known})


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
    from trainer.checkpoint.hf import one_process

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
        rows = _part_rows(model, within, full.shape[0], len(names))
        start = 0
        for projection, count in zip(names, rows):
            a_name = f"{module}{ADAPTERS}.{projection}.lora_A.weight"
            if a_name in shapes:
                b_name = a_name.replace("lora_A", "lora_B")
                a = load_tensor(ckpt, a_name, shapes[a_name])
                b = load_tensor(ckpt, b_name, shapes[b_name])
                full[start:start + count] += scaling * (b @ a)
            start += count
        return full

    return merged


def _part_rows(model: ModelConfig, module: str, rows: int, parts: int) -> list[int]:
    from trainer.parts.assembly import parallel_plan

    sizes = parallel_plan(model).linears[module][1]
    sizes = sizes if len(sizes) == parts else (1,)
    return [rows * s // sum(sizes) for s in sizes]


def export_adapter(ckpt: Path, out_dir: Path, model: ModelConfig, peft: PeftConfig,
                   dtype: torch.dtype, base: str) -> list[Path]:
    """The checkpoint's adapters alone, as PEFT writes them (`base`: what the adapter config
    names as its base model)."""
    from safetensors.torch import save_file

    from trainer.checkpoint.hf import _new_folder
    from trainer.checkpoint.hf_families import hf_parts

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
