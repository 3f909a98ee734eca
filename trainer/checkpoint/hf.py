"""Hugging Face models in and out (Llama, Qwen3, Mixtral, Qwen3-MoE: trainer.checkpoint.
hf_families maps each family's config and names onto ours): config.json <-> ModelConfig,
safetensors <-> our DCP checkpoints, one tensor at a time (`python -m trainer.hf`).

The two models agree without any permutation (tests/integration/test_hf.py holds their logits
equal): the rotary embedding's convention is the same (two halves, frequencies theta^(-2i/d),
and Llama 3's rope scaling, the only scaling modelled: any other is refused), our fused qkv is
cat(q_proj, k_proj, v_proj) on the rows and gate_up is cat(gate_proj, up_proj). The vocabulary
is padded on the way in (zero rows, never looked up or predicted) and cut on the way out.

An import writes a weights-only checkpoint: DCP tensors `model.<name>` at their single-device
shape, so checkpoint.load reads it under any layout (with checkpoint.finetune=true, since it
holds no optimizer state, step or data position), and OUT/model.yaml, the model config.
Both ways check what they can before writing (the safetensors headers; the checkpoint's DCP
.metadata against the model) and write into a hidden folder of their own, renamed into place.
DeepSeek's multi-token prediction layers (hf_families.hf_parts) come in and go out with the
model; their copies of the embedding and head are checked equal on the way in, kept once, and
written again on the way out. A tensor a family's files lay out otherwise than our rows
(hf_families.layouts: DeepSeek's interleaved rotary rows, gpt-oss's fused experts) is moved
into our rows on the way in and back on the way out, element for element.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.adapters import base_of, peft_record
from trainer.checkpoint.dcp import (
    Chunked,
    ChunkSavePlanner,
    check_loadable,
    saved_entries,
    write_meta,
)
from trainer.checkpoint.hf_families import (
    ARCHITECTURES,
    hf_config,
    hf_copies,
    hf_parts,
    layers_from,
    layouts,
    model_config,
    unbuilt,
)
from trainer.checkpoint.hf_layout import Layout
from trainer.checkpoint.integrity import CHECKSUMS, METADATA, file_checksum
from trainer.checkpoint.match import weights
from trainer.checkpoint.safetensors_io import SafetensorsReader, write_streamed
from trainer.checks import check_model
from trainer.config import ModelConfig, PeftConfig
from trainer.parts.assembly import buffer_shapes, parameter_shapes
from trainer.parts.lora import is_adapter
from trainer.units import duration, size

WEIGHTS_ONLY = "weights_only"  # meta.json key of an imported checkpoint
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names of what we import
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class Paced:
    """Progress of a copy whose total is known: a line when it starts, then at most one every
    `every` seconds with the share done and the time left at this pace, and one at the end."""

    def __init__(self, what: str, total_bytes: int, say: Callable[[str], None] | None,
                 every: float = 2.0):
        self.what, self.total, self.say, self.every = what, max(total_bytes, 1), say, every
        self.done, self.started = 0, time.perf_counter()
        self.said = self.started
        if say is not None:
            say(f"{what}: {size(total_bytes)} of weights")

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.say is None or (now - self.said < self.every and self.done < self.total):
            return
        self.said, elapsed, share = now, now - self.started, self.done / self.total
        left = elapsed / share * (1 - share)
        self.say(f"  {share:4.0%} ({size(self.done)}) in {elapsed:.0f} s, "
                 f"{duration(left)} left")


def import_hf(hf_dir: Path, out_dir: Path, say: Callable[[str], None] | None = None,
              adapter: Callable[[ModelConfig], tuple[PeftConfig, dict]] | None = None
              ) -> ModelConfig:
    """HF_DIR (config.json + safetensors) -> OUT_DIR: a weights-only DCP checkpoint in fp32
    (the trainer's master weights) and model.yaml. say: told the progress (python -m
    trainer.hf prints it). adapter: reads a LoRA adapter PEFT saved for the model (its peft
    config, its tensors by our names: hf_lora.read_adapter), imported beside the base
    (meta.json records the config)."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist. Fix: point at a Hugging Face "
                                f"model folder (config.json and *.safetensors).")
    config = _read_mapping(config_path, str(config_path), "use the config.json "
                           "save_pretrained wrote for the model")
    model = model_config(config, config_path)  # first: a bad config.json is named as such
    reader = SafetensorsReader(hf_dir)
    model = _held_depths(model, reader, config_path, say)
    parts, stored = hf_parts(model), layouts(model, config)
    shapes = _shapes(model, parts)
    _check_weights(reader, model, shapes, parts, stored, config_path)
    peft, adapters = adapter(model) if adapter is not None else (None, {})
    shapes |= {name: tuple(t.shape) for name, t in adapters.items()}
    paced = Paced(f"importing {hf_dir} into {out_dir} (fp32)",
                  sum(4 * torch.Size(shape).numel() for shape in shapes.values()), say)

    def value(name: str) -> torch.Tensor:  # asked by DCP one tensor at a time, while writing
        if name in adapters:
            return adapters[name]
        pieces = [_ours(reader.get(hf_name).to(torch.float32), stored.get(hf_name))
                  for hf_name, _ in parts[name]]
        full = torch.zeros(shapes[name], dtype=torch.float32)  # padding rows stay zero
        torch.cat(pieces, out=_rows(full)[:sum(rows for _, rows in parts[name])])
        paced.advance(full.nbytes)
        return full

    with _new_folder(out_dir) as tmp:
        _write_import(tmp, shapes, value, hf_dir, model, peft)
    return model


def _held_depths(model: ModelConfig, reader: SafetensorsReader, config_path: Path,
                 say: Callable[[str], None] | None) -> ModelConfig:
    """The model without multi-token prediction where its config.json names depths
    (num_nextn_predict_layers) and the files hold no layer past the blocks: transformers saves
    none (and writes its default of 1), so a fine-tune it saved imports as what it holds; files
    holding part of them are refused by _check_weights, naming what is missing."""
    if not model.mtp_num_layers or layers_from(reader.names(), model.num_layers):
        return model
    if say is not None:
        say(f"{config_path.name} names num_nextn_predict_layers={model.mtp_num_layers}, and the "
            f"weights hold no layer past the {model.num_layers} blocks: imported without "
            f"multi-token prediction (model.mtp_num_layers null)")
    return replace(model, mtp_num_layers=None)


def _shapes(model: ModelConfig, parts: dict[str, list[tuple[str, int]]]
            ) -> dict[str, tuple[int, ...]]:
    """What an import writes and an export reads: every parameter, and the buffers a family
    names (DeepSeek-V3's expert bias)."""
    return parameter_shapes(model) | {name: shape for name, shape in buffer_shapes(model).items()
                                      if name in parts}


def _ours(tensor: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """A tensor as read from the files, as our rows (its Layout's), or as it is."""
    return tensor if layout is None else layout.to_ours(tensor)


def _on_disk(rows: int, shape: tuple[int, ...], layout: Layout | None) -> tuple[int, ...]:
    """The shape a Hugging Face tensor of `rows` of our parameter (`shape`) has in the files:
    its Layout's, else those rows of the parameter's last dim."""
    return layout.shape if layout is not None and layout.shape else (rows, *shape[1:][-1:])


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter as rows of its last dim (experts [E, rows, cols] as [E*rows, cols]; a norm
    as it is), the view hf_families' parts concatenate."""
    return tensor.view(-1, tensor.shape[-1]) if tensor.ndim > 2 else tensor


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
                   stored: dict[str, Layout], config_path: Path) -> None:
    """Before anything is written: every tensor the config implies is in the safetensors
    headers, at its shape and a float dtype, and no other is (a model we would import in part)."""
    hf_dir, fix = config_path.parent, "use the config.json these weights were saved with"
    for name, pieces in parts.items():
        for hf_name, rows in pieces:
            spec = reader.spec(hf_name)
            want = _on_disk(rows, shapes[name], stored.get(hf_name))
            if spec is None:
                depths = f" and {model.mtp_num_layers} multi-token prediction layers" \
                    if model.mtp_num_layers else ""
                raise ValueError(f"{hf_dir}: the weights have no tensor {hf_name!r}, which "
                                 f"{config_path.name} implies ({model.num_layers} layers"
                                 f"{depths}). Fix: copy the whole model, or {fix}.")
            if spec[1] != want:
                raise ValueError(f"{hf_dir}: {hf_name} has shape {spec[1]}; "
                                 f"{config_path.name} implies {want}. Fix: {fix}.")
            if spec[0] not in FLOAT_DTYPES:
                raise ValueError(f"{hf_dir}: {hf_name} is {spec[0]}, not one of "
                                 f"{', '.join(FLOAT_DTYPES)}. Fix: import an unquantized model.")
    copies = hf_copies(model)
    unused = (reader.names() - {n for p in parts.values() for n, _ in p} - {"lm_head.weight"}
              - set(copies))
    what = unbuilt(model, unused)
    if what:
        raise ValueError(f"{hf_dir}: the weights hold {what}. Fix: set num_nextn_predict_layers "
                         f"to the multi-token prediction layers they hold, or import a copy of "
                         f"the folder without them.")
    if unused:
        raise ValueError(f"{hf_dir}: tensors this model does not have, e.g. "
                         f"{sorted(unused)[0]!r}. Fix: import a plain model of "
                         f"{', '.join(ARCHITECTURES)}, or {fix}.")
    _check_copies(reader, copies, hf_dir)


def _check_copies(reader: SafetensorsReader, copies: dict[str, str], hf_dir: Path) -> None:
    """Each copy of the embedding or head that a multi-token prediction layer holds
    (hf_families.hf_copies) equals the model's own, as fp32 (what the import keeps): an import
    keeps one. One absent is nothing lost."""
    for name, source in copies.items():
        if reader.spec(name) is None:
            continue
        theirs, own = reader.get(name), reader.get(source)
        if theirs.shape != own.shape or not torch.equal(theirs.float(), own.float()):
            raise ValueError(f"{hf_dir}: {name} differs from {source}, which DeepSeek's files "
                             f"repeat there (a multi-token prediction layer shares the model's "
                             f"embedding and head; this trainer keeps one). Fix: import a copy of "
                             f"the folder whose {name} is {source}'s, or without it.")


def _write_import(out_dir: Path, shapes: dict[str, tuple[int, ...]],
                  value: Callable[[str], torch.Tensor], hf_dir: Path, model: ModelConfig,
                  peft: PeftConfig | None = None) -> None:
    # Each tensor whole, planned from its shape alone (a meta tensor carries no values).
    tensors = {f"model.{n}": Chunked(s, [((0,) * len(s), torch.empty(s, device="meta"))])
               for n, s in shapes.items()}
    with one_process():
        # One file per tensor: DCP's writer keeps every tensor of a file until the file is
        # done, so a single file would hold the whole model at once.
        dcp.save({}, storage_writer=dcp.FileSystemWriter(out_dir, single_file_per_rank=False),
                 planner=_LazySavePlanner(tensors, value), no_dist=True)
    for name in TOKENIZER_FILES:  # kept for python -m trainer.generate and trainer.prepare
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, out_dir / name)
    (out_dir / "model.yaml").write_text(
        f"# Imported from {hf_dir.resolve()} by python -m trainer.hf import\n"
        + yaml.safe_dump(asdict(model), sort_keys=False))
    # Every DCP file's checksum, as a training checkpoint records them (trainer.checkpoint.
    # integrity checks them when a run loads the import).
    checksums = {f.name: file_checksum(f) for f in sorted(out_dir.iterdir())
                 if f.name == METADATA or f.suffix == ".distcp"}
    write_meta(out_dir, {WEIGHTS_ONLY: True, "source": str(hf_dir.resolve()),
                         "model": asdict(model), "step": 0, "consumed_samples": 0,
                         "peft": peft_record(peft) if peft else None, CHECKSUMS: checksums})


@contextlib.contextmanager
def one_process() -> Iterator[None]:
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
    saved = saved_entries(ckpt)
    if base_of(ckpt):  # a LoRA checkpoint: its adapters' shapes are checked
        return model  # where they are read (hf_lora); its base is checked where it is read
    # No weight of the checkpoint left out (an untied head under a tied --model), none missing.
    # peft=lora's adapters are beside the base (trainer.checkpoint.hf_lora reads them)
    weights({n.removeprefix("model.") for n in saved if n.startswith("model.")
             and not is_adapter(n)}, model, where, True, fix)
    check_loadable(ckpt, parameter_shapes(model), finetune=True, where=where, fix=fix,
                   saved=saved)
    return model



def copy_tokenizer(ckpt: Path, hf_dir: Path) -> Path | None:
    """The Hugging Face tokenizer the checkpoint records (its run's dataset's, or the one an
    import kept) copied into an export; returns the folder it came from, or None."""
    recorded = json.loads((ckpt / "meta.json").read_text()).get("tokenizer")
    folder = ckpt if (ckpt / "tokenizer.json").is_file() else None
    if recorded and recorded != "byte" and Path(recorded).is_file():
        folder = Path(recorded).parent
    if folder is None:
        return None
    for name in TOKENIZER_FILES:
        if (folder / name).is_file() and not (hf_dir / name).exists():
            shutil.copy(folder / name, hf_dir / name)
    return folder


def export_hf(ckpt: Path, hf_dir: Path, model: ModelConfig, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int = 5 * 2**30, say: Callable[[str], None] | None = None,
              merge: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> list[Path]:
    """A checkpoint (any layout wrote it) -> HF_DIR with config.json and safetensors that
    transformers loads (the family: hf_families.architecture_of); one tensor in memory at a
    time. say: told the progress; merge: each weight as written (peft=lora's adapters merged
    in: trainer.checkpoint.hf_lora)."""
    parts = hf_parts(model)
    shapes, config = _shapes(model, parts), hf_config(model, dtype)  # refuses what no family holds
    stored = layouts(model, config)
    saved = saved_entries(ckpt)
    copies_of: dict[str, list[str]] = {}  # DeepSeek's copies of the embedding and head
    for copy, source in hf_copies(model).items():
        copies_of.setdefault(source, []).append(copy)
    specs = [(written, _on_disk(rows, shapes[name], stored.get(hf_name))) for name in parts
             for hf_name, rows in parts[name] for written in (hf_name,
                                                               *copies_of.get(hf_name, ()))]

    paced = Paced(f"exporting {ckpt} to {hf_dir} ({str(dtype).removeprefix('torch.')})",
                  sum(4 * torch.Size(shapes[name]).numel() for name in parts), say)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, pieces in parts.items():
            full = torch.zeros(shapes[name], dtype=torch.float32)
            if f"model.{name}" in saved:  # a buffer it lacks is at its start, as load_model's
                with one_process():
                    dcp.load({f"model.{name}": full}, checkpoint_id=ckpt, no_dist=True)
            paced.advance(full.nbytes)
            full = merge(name, full) if merge else full
            split = _rows(full)[:sum(r for _, r in pieces)].split([r for _, r in pieces])
            for (hf_name, _), rows in zip(pieces, split):
                if hf_name in stored:
                    rows = stored[hf_name].to_theirs(rows)
                yield from ((written, rows) for written in (hf_name,
                                                            *copies_of.get(hf_name, ())))

    with _new_folder(hf_dir) as tmp:
        files = write_streamed(tmp, specs, dtype, tensors(), max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return [hf_dir / f.name for f in files]
