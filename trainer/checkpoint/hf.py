"""Hugging Face Llama and Qwen3 models in and out: config.json <-> ModelConfig, safetensors <->
our DCP checkpoints, one tensor at a time (`python -m trainer.hf`). Qwen3 is Llama's block with
an RMSNorm over each head of q and k (model.qk_layernorm) and heads that may be wider than
hidden / heads (model.kv_channels).

The two models agree without any permutation (../shared/notes/scale.md): the rotary
embedding's convention is the same (two halves, frequencies theta^(-2i/d), and Llama 3's rope
scaling, the only scaling modelled: any other is refused), our fused qkv is
cat(q_proj, k_proj, v_proj) on the rows and gate_up is cat(gate_proj, up_proj). The vocabulary
is padded on the way in (zero rows, never looked up or predicted) and cut on the way out.

An import writes a weights-only checkpoint: DCP tensors `model.<name>` at their single-device
shape, so checkpoint.load reads it under any layout (with checkpoint.finetune=true, since it
holds no optimizer state, step or data position), and OUT/model.yaml, the model config.
Both ways check what they can before writing (the safetensors headers; the checkpoint's DCP
.metadata against the model) and write into a hidden folder of their own, renamed into place.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import warnings
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.dcp import Chunked, ChunkSavePlanner, check_loadable, write_meta
from trainer.checkpoint.integrity import CHECKSUMS, METADATA, file_checksum
from trainer.checkpoint.safetensors_io import SafetensorsReader, write_streamed
from trainer.checks import check_model
from trainer.config import ModelConfig
from trainer.model.plan import parameter_shapes
from trainer.model.transformer import LLAMA3_ROPE_CONTEXT, LLAMA3_ROPE_HIGH, LLAMA3_ROPE_LOW

ARCHITECTURE = "LlamaForCausalLM"
QWEN3 = "Qwen3ForCausalLM"  # Llama's with qk_layernorm
ARCHITECTURES = (ARCHITECTURE, QWEN3)
WEIGHTS_ONLY = "weights_only"  # meta.json key of an imported checkpoint
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names of what we import


def model_config(hf: dict, source: Path) -> ModelConfig:
    """Our ModelConfig of a Hugging Face Llama config.json; what we cannot model is refused in
    one line."""
    def need(key: str, ok: bool, fix: str) -> None:
        if not ok:
            raise ValueError(f"{source}: {key}={hf.get(key)!r} is not supported. Fix: {fix}.")

    architecture = (hf.get("architectures") or [ARCHITECTURE])[0]
    need("architectures", architecture in ARCHITECTURES,
         f"import a model of one of {', '.join(ARCHITECTURES)}")
    need("use_sliding_window", not hf.get("use_sliding_window", False),
         "use a model with full attention in every layer")
    missing = [key for key in REQUIRED if not isinstance(hf.get(key), int)]
    if missing:
        raise ValueError(f"{source} has no integer {missing[0]}. Fix: use the config.json "
                         f"save_pretrained wrote for the model.")
    need("hidden_act", hf.get("hidden_act", "silu") == "silu", "use a SwiGLU (silu) model")
    for key in ("attention_bias", "mlp_bias"):
        need(key, not hf.get(key, False), "use a model without biases")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    rope = hf.get("rope_parameters") or {}  # transformers 5; 4 spells it rope_theta/rope_scaling
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                         else None)
    factor = _llama3_rope_factor(scaling, source) if scaling else None
    groups = hf.get("num_key_value_heads") or heads
    model = ModelConfig(
        name="llama", vocab_size=hf["vocab_size"], hidden_size=hidden,
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        ffn_hidden_size=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", 0.02)),
        num_query_groups=None if groups == heads else groups,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        use_rope_scaling=factor is not None, rope_scaling_factor=factor or 8.0,
        kv_channels=None if head_dim * heads == hidden else head_dim,
        qk_layernorm=architecture == QWEN3)
    try:
        check_model(model)
    except ValueError as error:
        raise ValueError(f"{source} gives a model we cannot build: {error}") from None
    return model


def _llama3_rope_factor(scaling: dict, source: Path) -> float:
    """The factor of Llama 3's rope scaling; any other scaling is refused (it would change
    every position's rotation, silently)."""
    kind = scaling.get("rope_type", scaling.get("type"))
    fixed = {"low_freq_factor": LLAMA3_ROPE_LOW, "high_freq_factor": LLAMA3_ROPE_HIGH,
             "original_max_position_embeddings": LLAMA3_ROPE_CONTEXT}
    if kind != "llama3" or any(float(scaling.get(k, v)) != v for k, v in fixed.items()):
        raise ValueError(f"{source}: rope scaling {scaling} is not supported: only Llama 3's "
                         f"(rope_type llama3 with {fixed}) is modelled. Fix: import a model "
                         f"with that rope scaling or none.")
    return float(scaling["factor"])


def hf_config(model: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json for transformers' LlamaForCausalLM (both rope spellings, 4 and 5)."""
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    scaling = None
    if model.use_rope_scaling:
        scaling = {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                   "low_freq_factor": LLAMA3_ROPE_LOW, "high_freq_factor": LLAMA3_ROPE_HIGH,
                   "original_max_position_embeddings": LLAMA3_ROPE_CONTEXT}
        rope = {**scaling, "rope_theta": model.rope_theta}
    family = {"architectures": [QWEN3], "model_type": "qwen3", "use_sliding_window": False,
              "max_window_layers": model.num_layers} if model.qk_layernorm else \
        {"architectures": [ARCHITECTURE], "model_type": "llama"}
    return {
        **family, "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.query_groups, "head_dim": model.head_dim,
        "hidden_act": "silu", "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_theta,
        "rope_parameters": rope, "rope_scaling": scaling,
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": model.tie_word_embeddings, "initializer_range": model.init_std,
        "dtype": str(dtype).removeprefix("torch."),
    }


def hf_parts(model: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Our parameter name -> the Hugging Face tensors it is the row-wise concatenation of,
    with their rows. The vocabulary rows are the unpadded ones."""
    h, kv, f, vocab = model.hidden_size, model.kv_size, model.ffn_hidden_size, model.vocab_size
    q, d = model.q_size, model.head_dim
    out = {"embed.weight": [("model.embed_tokens.weight", vocab)]}
    for i in range(model.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out |= {
            f"{ours}attn_norm.weight": [(f"{theirs}input_layernorm.weight", h)],
            f"{ours}attn.qkv.weight": [(f"{theirs}self_attn.{p}_proj.weight", rows)
                                       for p, rows in (("q", q), ("k", kv), ("v", kv))],
            f"{ours}attn.o.weight": [(f"{theirs}self_attn.o_proj.weight", h)],
            **({f"{ours}attn.{p}_norm.weight": [(f"{theirs}self_attn.{p}_norm.weight", d)]
                for p in ("q", "k")} if model.qk_layernorm else {}),
            f"{ours}mlp_norm.weight": [(f"{theirs}post_attention_layernorm.weight", h)],
            f"{ours}mlp.gate_up.weight": [(f"{theirs}mlp.{p}_proj.weight", f)
                                          for p in ("gate", "up")],
            f"{ours}mlp.down.weight": [(f"{theirs}mlp.down_proj.weight", h)],
        }
    out["norm.weight"] = [("model.norm.weight", h)]
    if not model.tie_word_embeddings:
        out["head.weight"] = [("lm_head.weight", vocab)]
    return out


def import_hf(hf_dir: Path, out_dir: Path) -> ModelConfig:
    """HF_DIR (config.json + safetensors) -> OUT_DIR: a weights-only DCP checkpoint in fp32
    (the trainer's master weights) and model.yaml."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist. Fix: point at a Hugging Face "
                                f"model folder (config.json and *.safetensors).")
    model = model_config(_read_mapping(config_path, str(config_path), "use the config.json "
                                       "save_pretrained wrote for the model"), config_path)
    reader, shapes, parts = SafetensorsReader(hf_dir), parameter_shapes(model), hf_parts(model)
    _check_weights(reader, model, shapes, parts, config_path)

    def value(name: str) -> torch.Tensor:  # asked by DCP one tensor at a time, while writing
        pieces = [reader.get(hf_name).to(torch.float32) for hf_name, _ in parts[name]]
        full = torch.zeros(shapes[name], dtype=torch.float32)  # padding rows stay zero
        torch.cat(pieces, out=full[:sum(rows for _, rows in parts[name])])
        return full

    with _new_folder(out_dir) as tmp:
        _write_import(tmp, shapes, value, hf_dir, model)
    return model


def _read_mapping(path: Path, name: str, fix: str) -> dict:
    """The mapping a .json or YAML file holds; anything else is one line naming it (`name`)."""
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        values = (json.loads if kind == "JSON" else yaml.safe_load)(path.read_text())
    except (yaml.YAMLError, OSError, ValueError) as error:  # ValueError: not JSON, not UTF-8
        why = " ".join(str(error).split())[:120]
        raise ValueError(f"{name} is not readable {kind} ({why}). Fix: {fix}.") from None
    if not isinstance(values, dict):
        raise ValueError(f"{name} holds a {type(values).__name__}, not a mapping. Fix: {fix}.")
    return values


def _check_weights(reader: SafetensorsReader, model: ModelConfig,
                   shapes: dict[str, tuple[int, ...]], parts: dict[str, list[tuple[str, int]]],
                   config_path: Path) -> None:
    """Before anything is written: every tensor the config implies is in the safetensors
    headers, at its shape and a float dtype, and no other is (a model we would import in part)."""
    hf_dir, fix = config_path.parent, "use the config.json these weights were saved with"
    for name, pieces in parts.items():
        for hf_name, rows in pieces:
            spec, want = reader.spec(hf_name), (rows, *shapes[name][1:])
            if spec is None:
                raise ValueError(f"{hf_dir}: the weights have no tensor {hf_name!r}, which "
                                 f"{config_path.name} implies ({model.num_layers} layers). Fix: "
                                 f"copy the whole model, or {fix}.")
            if spec[1] != want:
                raise ValueError(f"{hf_dir}: {hf_name} has shape {spec[1]}; "
                                 f"{config_path.name} implies {want}. Fix: {fix}.")
            if spec[0] not in FLOAT_DTYPES:
                raise ValueError(f"{hf_dir}: {hf_name} is {spec[0]}, not one of "
                                 f"{', '.join(FLOAT_DTYPES)}. Fix: import an unquantized model.")
    unused = reader.names() - {n for p in parts.values() for n, _ in p} - {"lm_head.weight"}
    if unused:
        raise ValueError(f"{hf_dir}: tensors this model does not have, e.g. "
                         f"{sorted(unused)[0]!r}. Fix: import a plain {' or '.join(ARCHITECTURES)}"
                         f", or {fix}.")


def _write_import(out_dir: Path, shapes: dict[str, tuple[int, ...]],
                  value: Callable[[str], torch.Tensor], hf_dir: Path, model: ModelConfig) -> None:
    # Each tensor whole, planned from its shape alone (a meta tensor carries no values).
    tensors = {f"model.{n}": Chunked(s, [((0,) * len(s), torch.empty(s, device="meta"))])
               for n, s in shapes.items()}
    with _one_process():
        # One file per tensor: DCP's writer keeps every tensor of a file until the file is
        # done, so a single file would hold the whole model at once.
        dcp.save({}, storage_writer=dcp.FileSystemWriter(out_dir, single_file_per_rank=False),
                 planner=_LazySavePlanner(tensors, value), no_dist=True)
    (out_dir / "model.yaml").write_text(
        f"# Imported from {hf_dir.resolve()} by python -m trainer.hf import\n"
        + yaml.safe_dump(asdict(model), sort_keys=False))
    # Every DCP file's checksum, as a training checkpoint records them (trainer.checkpoint.
    # integrity checks them when a run loads the import).
    checksums = {f.name: file_checksum(f) for f in sorted(out_dir.iterdir())
                 if f.name == METADATA or f.suffix == ".distcp"}
    write_meta(out_dir, {WEIGHTS_ONLY: True, "source": str(hf_dir.resolve()),
                         "model": asdict(model), "step": 0, "consumed_samples": 0,
                         CHECKSUMS: checksums})


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP without a process group, as intended here: its warning that it assumes one process
    is silenced, and a failure inside it is raised as itself (DCP wraps it in a
    CheckpointException whose text is the whole traceback)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            yield
        except CheckpointException as wrapped:
            if not wrapped.failures:
                raise
            raise min(wrapped.failures.items())[1][0] from None


@contextlib.contextmanager
def _new_folder(path: Path) -> Iterator[Path]:
    """A hidden sibling to write into, renamed to `path` when done: `path` is either absent or
    complete. An existing non-empty `path` is refused rather than mixed with stale files."""
    fix = "Fix: choose a new folder, or remove it first."
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{path} already exists and is not empty. {fix}")
    # Unique: two writers of the same `path` never share a temporary folder.
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as error:
        raise ValueError(f"{path} cannot be written here ({error.strerror}: {error.filename})."
                         f" Fix: choose a folder you can write.") from None
    try:
        yield tmp
        try:
            os.rename(tmp, path)  # atomic; replaces an empty folder only, never a full one
        except OSError:
            raise ValueError(f"{path} appeared while this was written (another export or "
                             f"import into it?); it was left as it is. {fix}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _LazySavePlanner(ChunkSavePlanner):
    """Plans writes from shapes and asks `value(name)` for each tensor only when DCP writes
    it, so a single tensor is in memory at a time."""

    def __init__(self, tensors: dict[str, Chunked], value: Callable[[str], torch.Tensor]):
        super().__init__(tensors)
        self.value = value

    def resolve_data(self, write_item):
        return self.value(write_item.index.fqn.removeprefix("model."))


def read_model_config(ckpt: Path, model_yaml: Path | None) -> ModelConfig:
    """The model of a checkpoint: `model_yaml` (a model config file) if given, else what the
    checkpoint's meta.json recorded; checked against the checkpoint's tensors (DCP's
    .metadata), so a wrong one is refused before anything is written."""
    fix = "pass --model with the model config it was trained with (e.g. conf/model/tiny.yaml)"
    if model_yaml is not None:
        source, where = f"--model {model_yaml}", f"checkpoint {ckpt} with --model {model_yaml}"
        values = _read_mapping(model_yaml, source, fix)
        fix += ", or leave --model out (the checkpoint's meta.json records it)"
    else:
        source, where = str(ckpt / "meta.json"), f"checkpoint {ckpt}"
        values = _read_mapping(ckpt / "meta.json", source, fix).get("model")
        if not isinstance(values, dict):
            raise ValueError(f"{source} does not record the model. Fix: {fix}.")
    # Typed and checked as the trainer's config is; keys ModelConfig does not know are left out.
    known = {f.name for f in fields(ModelConfig)}
    try:
        model = OmegaConf.to_object(OmegaConf.merge(
            OmegaConf.structured(ModelConfig), {k: v for k, v in values.items() if k in known}))
        check_model(model)
    except (OmegaConfBaseException, ValueError) as error:
        why = (str(error).splitlines() or [type(error).__name__])[0]
        raise ValueError(f"{source}: {why}. Fix: {fix}.") from None
    check_loadable(ckpt, parameter_shapes(model), finetune=True, where=where, fix=fix)
    return model


def export_hf(ckpt: Path, hf_dir: Path, model: ModelConfig, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """A checkpoint (any layout wrote it) -> HF_DIR with config.json and safetensors that
    transformers' LlamaForCausalLM loads; one tensor in memory at a time."""
    shapes, parts = parameter_shapes(model), hf_parts(model)
    specs = [(hf_name, (rows, *shapes[name][1:]))
             for name in parts for hf_name, rows in parts[name]]

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, pieces in parts.items():
            full = torch.empty(shapes[name], dtype=torch.float32)
            with _one_process():
                dcp.load({f"model.{name}": full}, checkpoint_id=ckpt, no_dist=True)
            yield from zip((n for n, _ in pieces),
                           full[:sum(r for _, r in pieces)].split([r for _, r in pieces]))

    with _new_folder(hf_dir) as tmp:
        files = write_streamed(tmp, specs, dtype, tensors(), max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2))
    return [hf_dir / f.name for f in files]
