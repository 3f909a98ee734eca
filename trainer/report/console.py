"""Console output of a run, also written to the run folder's launch.log: an fd-level tee of this
process's stdout and stderr, which the ranks it spawns inherit. Owns launch.log (Hydra's job log
file handler is off in conf/config.yaml, so there is one writer). Of its own it writes only the
run folder line, and into the log the error that ended the run."""
from __future__ import annotations

import os
import select
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

LOG_NAME = "launch.log"
CHUNK = 65536
POLL_S = 0.05  # how often a copier looks for the stop flag while its pipe is quiet


class _Tee:
    """One of fds 1 and 2 pointed at a pipe; a thread copies the pipe to the original file and
    appends it to launch.log. One pipe per fd, so stdout stays stdout and stderr stays stderr."""

    def __init__(self, fd: int, log: BinaryIO, lock: threading.Lock):
        self.fd, self.log, self.lock = fd, log, lock
        self.original = os.dup(fd)
        self.read_end, write_end = os.pipe()
        os.dup2(write_end, fd)  # from now on, this process and its children write into the pipe
        os.close(write_end)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._copy, name=f"console-tee-{fd}", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        # EOF never comes while a child still holds the write end (multiprocessing's resource
        # tracker lives until the interpreter exits), so the thread also stops on a flag, once the
        # pipe has been drained.
        pending = b""
        while True:
            readable, _, _ = select.select([self.read_end], [], [], POLL_S)
            if not readable and not self.stop.is_set():
                continue
            data = os.read(self.read_end, CHUNK) if readable else b""
            if not data:
                self._write_log(pending)
                return
            self._write_terminal(data)
            # The log gets whole lines only: a print to stderr can arrive as two writes (text,
            # then newline), and the other stream's line must not land between them.
            pending += data
            cut = len(pending) if len(pending) > CHUNK else pending.rfind(b"\n") + 1
            self._write_log(pending[:cut])
            pending = pending[cut:]

    def _write_log(self, data: bytes) -> None:
        if data:
            with self.lock:  # one stream's lines must not cut into the other's
                self.log.write(data)

    def _write_terminal(self, data: bytes) -> None:
        try:
            while data:
                data = data[os.write(self.original, data):]
        except OSError:
            pass  # a closed terminal or reader must not cost the log its lines

    def close(self) -> None:
        """Point the fd back at the original file and drain what is still in the pipe."""
        os.dup2(self.original, self.fd)
        self.stop.set()
        self.thread.join()
        os.close(self.read_end)  # a lingering child's later writes then fail instead of block
        os.close(self.original)


@contextmanager
def console_log(run_dir: Path, writer: bool) -> Iterator[None]:
    """Tee fds 1 and 2 into run_dir/launch.log while the block runs (writer=False: do nothing).

    The tee is below Python's sys.stdout, so print, logging, tracebacks and the output of spawned
    rank processes all land in the log, as do writes from C code."""
    if not writer:
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    # Unbuffered append: a run that is killed keeps every line written so far, and a relaunch of
    # the same folder (a resume) continues the same log.
    log = open(run_dir / LOG_NAME, "ab", buffering=0)
    lock = threading.Lock()
    _flush()  # what Python still buffers was written before the tee; it must not land in it
    tees: list[_Tee] = []
    failure = None
    try:
        for fd in (1, 2):
            tees.append(_Tee(fd, log, lock))
        print(f"run folder: {run_dir}", flush=True)
        yield
    except BaseException as error:
        failure = f"{type(error).__name__}: {error}".strip()
        raise
    finally:
        _flush()
        for tee in reversed(tees):
            tee.close()
        if failure is not None:
            # Hydra prints the error after this block has ended, so only the terminal would see
            # it: the log gets the same line, so it says why the run stopped.
            log.write(f"{failure}\n".encode())
        log.close()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass  # a closed or replaced stream has nothing of ours to flush
