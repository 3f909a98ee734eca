"""Which checkpoint folders are good: complete (DCP's .metadata, every data file at least as long
as the items it holds, meta.json, which rank 0 writes last) and unchanged since the save (each
file's CRC-32, recorded in meta.json). No process group here except agreed(), which splits the
checksums of one checkpoint over the ranks that are about to load it.

A damaged checkpoint (a full disk, a truncated copy, flipped bits) is never "the last good one":
a resume skips it with a line naming the file, and checkpoint.load of it is refused.
"""
from __future__ import annotations

import json
import mmap
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # torch is imported where a checkpoint is read: launch.py starts without it
    import torch.distributed as dist

PREFIX, TMP_SUFFIX = "step_", ".tmp"
META, METADATA = "meta.json", ".metadata"
CHECKSUMS = "checksums"  # meta.json: file name -> [size in bytes, CRC-32]
_BLOCK = 8 << 20  # bytes read per call: large enough that zlib, not Python, sets the pace

Verifier = Callable[[Path], "str | None"]  # what is wrong with a checkpoint folder, or None


def file_checksum(path: Path) -> list[int]:
    """[size, CRC-32] of a file, read in blocks into one buffer (no copy per block). The buffer
    is an anonymous mapping, unmapped on return: an 8 MiB block from malloc would raise glibc's
    mmap threshold when freed, and the next save's block would then stay in the writer thread's
    heap for good (the soak's ranks grew 8 MiB at their second save)."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f, mmap.mmap(-1, _BLOCK) as buffer:
        with memoryview(buffer) as view:
            while n := f.readinto(view):
                crc, size = zlib.crc32(view[:n], crc), size + n
    return [size, crc]


def read_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's meta.json; a ValueError names the file when it is missing or garbage."""
    meta_path = path / META
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"its {META} is missing (the save did not finish)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"its {META} is unreadable ({type(error).__name__}: "
                         f"{str(error)[:80]})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"its {META} is not a JSON object")
    return meta


def verify(path: Path, share: tuple[int, int] | None = (0, 1)) -> str | None:
    """What is wrong with a checkpoint folder, or None. Always: the structure (cheap, reads
    .metadata and meta.json). `share` (index, count): the checksums of every count-th file from
    index, so `count` ranks check a checkpoint between them; None: no checksums (a quick look
    before the ranks start, which check them)."""
    if not (path / METADATA).is_file():
        return f"it has no {METADATA} (the save did not finish)"
    import torch.distributed.checkpoint as dcp

    try:
        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as error:  # noqa: BLE001  (unpickling garbage can raise anything)
        why = (str(error).splitlines() or [""])[0][:80]
        return f"its {METADATA} is unreadable ({type(error).__name__}: {why})"
    if not isinstance(storage, dict):
        return f"its {METADATA} lists no stored data"
    ends: dict[str, int] = {}  # each data file holds many items
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None:
            return f"its data file {name} is missing"
        if size < end:
            return f"its data file {name} is truncated ({size} of at least {end} bytes)"
    try:
        recorded = read_meta(path).get(CHECKSUMS)
    except ValueError as error:
        return str(error)
    if recorded is None or share is None:
        return None  # a checkpoint from before checksums were recorded is taken as it is
    unlisted = sorted({METADATA, *ends} - set(recorded))
    if unlisted:
        return f"its {META} records no checksum of {unlisted[0]}"
    index, count = share
    for name in sorted(recorded)[index::count]:
        if not (path / name).is_file():
            return f"its file {name} is missing"
        if file_checksum(path / name) != list(recorded[name]):
            return (f"its file {name} does not match the checksum recorded at save (the bytes "
                    f"changed since)")
    return None


def agreed(group: dist.ProcessGroup | None) -> Verifier:
    """Collective verify: each rank of `group` checks its share of the checksums, and every rank
    gets the same answer (the first problem any rank found)."""
    import torch.distributed as dist

    def check(path: Path) -> str | None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        found: list[str | None] = [None] * size
        dist.all_gather_object(found, verify(path, (rank, size)), group=group)
        return next((problem for problem in found if problem is not None), None)

    return check


def finished(directory: Path) -> list[Path]:
    """The checkpoints a folder holds, oldest first (unfinished .tmp ones never count)."""
    return sorted(p for p in directory.glob(f"{PREFIX}*")
                  if p.is_dir() and not p.name.endswith(TMP_SUFFIX))


def latest(directory: Path, warn: Callable[[str], None] | None = None,
           check: Verifier = verify) -> Path | None:
    """The newest good checkpoint in a folder of them. A newer one that is damaged is skipped,
    with a line to `warn`: a run killed while a disk filled up must still resume from the
    checkpoint before."""
    for path in reversed(finished(directory)):
        problem = check(path)
        if problem is None:
            return path
        if warn is not None:
            warn(f"warning: skipped checkpoint {path}: {problem}")
    return None


def resolve(path: Path, warn: Callable[[str], None] | None = None,
            check: Verifier = verify, key: str = "checkpoint.load") -> Path:
    """checkpoint.load (or another `key` naming the path in messages): a checkpoint folder, or
    a folder of them (the latest good one)."""
    if (path / METADATA).exists():
        problem = check(path)
        if problem is not None:
            raise ValueError(f"{key}={path}: {problem}. Fix: point {key} at a good checkpoint "
                             f"(or at its folder, for the latest good one).")
        return path
    skipped: list[str] = []

    def skip(line: str) -> None:
        skipped.append(line)
        if warn is not None:
            warn(line)

    found = latest(path, skip, check) if path.is_dir() else None
    if found is None:
        bad = f"; {len(skipped)} there are damaged or incomplete" if skipped else ""
        raise FileNotFoundError(
            f"{key}={path}: no checkpoint there (a folder with {METADATA}, or a folder of "
            f"{PREFIX}* checkpoints){bad}. Fix: point {key} at one"
            f"{', or set it to null' if key == 'checkpoint.load' else ''}.")
    return found
