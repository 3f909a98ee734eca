"""The run folder's life. Hydra creates it (with .hydra/ inside) before launch.py's main runs.
While a run uses it, the process that supervises the run (launch.py for the ranks it starts, rank
0 under torchrun or submitit) holds an flock on <run dir>/run.lock: two runs in one folder would
interleave their metrics and overwrite each other's checkpoints. It also holds one on its
checkpoint folder (`.<name>.lock` beside it, so the lock of the default <run dir>/checkpoints
lives in the run folder and needs no checkpoint folder yet): two runs in different folders with
one checkpoint.dir would resume each other's checkpoints and overwrite the later ones. A command
that fails before it trains leaves no empty folder behind, and never touches the files of an
earlier run.

The kernel releases an flock when its holder dies, kill -9 included, so a lock left by a killed
run is never stale: the next run takes it without anyone deleting files. The file itself stays
(removing it while another process opens it would let two runs lock two different files).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from hydra.errors import CompactHydraException

from trainer.config import RUN_CHECKPOINTS

LOCK_NAME = "run.lock"


class RunFolderBusy(CompactHydraException):
    """Another live run holds the run folder (one line: who, and the fix)."""


class StrayRank(CompactHydraException):
    """RANK and the rest are in the environment but name no rank of a live run (no rank 0
    listens, or RANK is past WORLD_SIZE): the folder Hydra made for it is its own to remove."""


@contextmanager
def run_lock(run_dir: Path, hold: bool = True) -> Iterator[None]:
    """Hold the run folder's lock while the block runs; hold=False (ranks other than 0 of a
    torchrun or submitit job): rank 0 holds it for them."""
    with _flock(run_dir / LOCK_NAME, hold, lambda holder: (
            f"run folder {run_dir} is in use by {holder}: two runs in one folder would mix "
            f"their metrics and checkpoints. Fix: wait for that run to end (or stop it; this "
            f"command then resumes it), or give this run another folder with "
            f"hydra.run.dir=<path>.")):
        yield


@contextmanager
def checkpoint_lock(save_dir: Path, hold: bool = True) -> Iterator[None]:
    """Hold the lock of the folder the run saves checkpoints into (and resumes from)."""
    folder = save_dir.resolve()
    with _flock(folder.parent / f".{folder.name}.lock", hold, lambda holder: (
            f"checkpoint folder {save_dir} is in use by {holder}: two runs saving into one "
            f"folder would resume each other's checkpoints and overwrite them. Fix: wait for "
            f"that run to end, or give this run its own checkpoint.dir.")):
        yield


@contextmanager
def _flock(path: Path, hold: bool, busy: Callable[[str], str]) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if needed) while the block runs; if another
    process holds it, RunFolderBusy with busy(who holds it)."""
    if not hold:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 400, 0).decode(errors="replace").strip()
            raise RunFolderBusy(busy(_describe(holder) if holder else
                                     "a run that is just starting")) from None
        # Who holds it, for the message a second run prints. Written after the lock is taken,
        # so the holder's own line is the only one in the file.
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} host {socket.gethostname()} "
                     f"started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _describe(holder: str) -> str:
    """'pid 12 host h started 2025-01-02 03:04:05' -> 'pid 12 on host h (since 2025-...)'."""
    words = holder.split()
    if len(words) >= 6 and words[0] == "pid" and words[2] == "host" and words[4] == "started":
        return f"pid {words[1]} on host {words[3]} (since {' '.join(words[5:])})"
    return holder


# What a command writes before it has anything of a run: Hydra's record of the composed config
# and its job log, and the locks taken before anything else (run_lock, and checkpoint_lock of the
# default checkpoint folder).
BEFORE_THE_RUN = frozenset({".hydra", "launch.log", LOCK_NAME, f".{RUN_CHECKPOINTS}.lock"})
# Entering, these are Hydra's alone: a lock file left behind means a run used the folder (or is
# starting in it right now), so the folder is not this command's to remove.
HYDRA_ONLY = frozenset({".hydra", "launch.log"})


@contextmanager
def run_folder(run_dir: Path) -> Iterator[Path]:
    """Remove run_dir if the block fails and the folder holds nothing but what a command writes
    before its run starts, and held nothing more when the block began."""
    hydra_only, alone = _entries(run_dir) <= HYDRA_ONLY, _alone()
    try:
        yield run_dir
    except BaseException as error:
        alone = alone or isinstance(error, StrayRank)
        if hydra_only and alone and _entries(run_dir) <= BEFORE_THE_RUN:
            _remove_unless_locked(run_dir)
        raise


def _remove_unless_locked(run_dir: Path) -> None:
    """Another command may have started in the folder meanwhile (the one that made this one fail
    with RunFolderBusy, say): while it holds the lock, the folder is its."""
    lock = run_dir / LOCK_NAME
    if not lock.exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    with lock.open("a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        shutil.rmtree(run_dir, ignore_errors=True)  # still holding it: nobody starts in between


def _entries(run_dir: Path) -> set[str]:
    return {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()


def _alone() -> bool:
    """Whether this process is the run's only one or its rank 0. The other ranks of a torchrun
    or SLURM job share rank 0's folder, which may not have a file of the run in it yet."""
    for name in ("RANK", "SUBMITIT_LOCAL_GLOBALID", "SLURM_PROCID"):  # torchrun, submitit
        # A RANK without MASTER_ADDR is left over in the shell, not torchrun's (launch.py
        # refuses to start on it, and the folder it made is removed).
        if name in os.environ and (name != "RANK" or "MASTER_ADDR" in os.environ):
            return os.environ[name] == "0"
    return True
