"""Hugging Face safetensors read and written one tensor at a time.

Reading: safetensors' own safe_open maps a file and hands out one tensor per call, for a single
model.safetensors or a sharded set (model.safetensors.index.json names each tensor's file).

Writing: the format is an 8-byte little-endian header length, a JSON header (every tensor's
dtype, shape and byte range) and then the tensors' bytes back to back. The header needs only
shapes, which are known before any value, so a writer can stream: write the header, then each
tensor as it is produced, and never hold more than one. safetensors' own save_file takes a dict
of every tensor at once, which for a 70B model is the whole model in memory. Files are cut at
max_shard_bytes, with the index Hugging Face reads, as save_pretrained does.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_ALIGN = 8  # the header is padded with spaces so the data starts 8-byte aligned


class SafetensorsReader:
    """The tensors of a Hugging Face model folder by name, opened lazily. Every file's header
    (names, dtypes, shapes) is read and checked up front, so a missing shard, a truncated file
    or an absent tensor is known before anything is written."""

    def __init__(self, folder: Path):
        self.folder = folder
        weight_map = None
        if (folder / INDEX).is_file():
            try:
                index = json.loads((folder / INDEX).read_text())
            except ValueError:  # not JSON, or not UTF-8
                index = None
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not (isinstance(weight_map, dict)
                    and all(isinstance(f, str) for f in weight_map.values())):
                raise ValueError(f"{folder / INDEX} is not a safetensors index (JSON with a "
                                 f"weight_map of tensor names to files). Fix: re-save the model "
                                 f"with save_pretrained.")
            files = sorted(set(weight_map.values()))
        elif (folder / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise FileNotFoundError(f"{folder} has neither {SINGLE} nor {INDEX}. Fix: point at "
                                    f"a folder written by save_pretrained (safetensors).")
        self.files: dict[str, Path] = {}
        self.specs: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> (dtype, shape)
        for file in files:
            if not (folder / file).is_file():
                raise FileNotFoundError(f"{folder / file} (named by {INDEX}) is missing. Fix: "
                                        f"copy every shard of the model.")
            for name, spec in read_header(folder / file).items():
                self.files[name], self.specs[name] = folder / file, spec
        for name, file in (weight_map or {}).items():
            if self.files.get(name) != folder / file:
                raise ValueError(f"{folder / INDEX} places {name!r} in {file}, which does not "
                                 f"hold it. Fix: copy every shard of the model again.")

    def names(self) -> set[str]:
        return set(self.files)

    def spec(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """(safetensors dtype, shape) from the header, or None if no file holds `name`."""
        return self.specs.get(name)

    def get(self, name: str) -> torch.Tensor:
        path = self.files.get(name)
        if path is None:
            raise ValueError(f"{self.folder}: the weights have no tensor {name!r}. Fix: check "
                             f"that the folder holds the whole model its config.json describes.")
        # Opened per tensor: a file kept open keeps every page read so far mapped (and counted
        # in the process's resident memory); reading the header again is cheap.
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of a safetensors file, from its header alone; a file that is not
    one, or is shorter (a cut copy) or longer than its header says, is refused in one line."""
    fix = "Fix: copy the file again, or re-save the model with save_pretrained."
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            if 8 + length > size:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
        specs = {name: (entry["dtype"], tuple(entry["shape"]), int(entry["data_offsets"][1]))
                 for name, entry in header.items() if name != "__metadata__"}
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as error:
        raise ValueError(f"{path} is not a safetensors file ({size} bytes; {error!r:.60}). "
                         f"{fix}") from None
    want = 8 + length + max((end for _, _, end in specs.values()), default=0)
    if size != want:
        what = "truncated" if size < want else "longer than its header says"
        raise ValueError(f"{path} is {what}: {size} bytes, its header describes {want}. {fix}")
    return {name: (dtype, shape) for name, (dtype, shape, _) in specs.items()}


def write_streamed(folder: Path, specs: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                   tensors: Iterator[tuple[str, torch.Tensor]],
                   max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write the tensors `specs` announces (name, shape, in the order `tensors` yields them) as
    safetensors files in `folder`, one tensor in memory at a time. Returns the files written."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(names, shards):
        with open(folder / file, "wb") as out:
            out.write(_header(shard, dtype, itemsize))
            for name, shape in shard:
                got_name, tensor = next(tensors)
                if got_name != name or tuple(tensor.shape) != shape:
                    raise ValueError(f"expected {name} {shape}, got {got_name} "
                                     f"{tuple(tensor.shape)}")
                out.write(tensor.to(dtype).contiguous().view(-1).view(torch.uint8).numpy())
    if len(shards) > 1:
        weight_map = {name: file for file, shard in zip(names, shards) for name, _ in shard}
        total = sum(math.prod(shape) for _, shape in specs) * itemsize
        (folder / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return [folder / name for name in names]


def _header(shard: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, itemsize: int) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shard:
        end = offset + math.prod(shape) * itemsize
        entries[name] = {"dtype": DTYPES[dtype], "shape": list(shape),
                         "data_offsets": [offset, end]}
        offset = end
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % _ALIGN)
    return struct.pack("<Q", len(header)) + header
