"""A hang explains itself. Each rank runs a watch thread that reads which collective the rank
waits in (parallel.comm.CommStats.waiting). When one wait passes cluster.timeout_s, the rank asks
every rank for its Python stacks, waits for them, names the ranks that never reached the
collective the others wait in, and ends with HUNG_EXIT; launch.py reports that line.

Every rank writes its stacks (all threads) to the run folder's stacks/rank_R.txt when asked: by a
hang, or by SIGUSR1 to launch.py or to any rank, which leaves the run going. The request is a
file, stacks/request, that every watch polls: it reaches ranks on other nodes through the
shared run folder, and a rank blocked in a collective still answers (the watch is a thread, and
collectives release the interpreter). The process group's own timeout is set GRACE_S later than
cluster.timeout_s (backend_timeout_s), so the stacks are written before a backend gives up.

SIGUSR1 is blocked in a rank's threads from its start (hold_dump_signal) and taken by the watch
thread with sigtimedwait, so it arrives even while the main thread sits in a collective; a
Python handler covers a thread that was started before the block.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # no torch here: launch.py's supervisor imports this module
    from parallel.comm import CommStats

STACKS, REQUEST, SUMMARY = "stacks", "request", "summary.txt"
HUNG_EXIT = 124  # a rank that ended a hung run (timeout(1)'s code)
POLL_S = 0.5  # how often a watch looks at its rank's wait and at the request file
GATHER_S = 10.0  # how long the rank that found the hang waits for the others' stacks
GRACE_S = 30  # the process group's timeout beyond cluster.timeout_s (covers GATHER_S)
DUMP_SIGNAL = signal.SIGUSR1


def backend_timeout_s(timeout_s: float) -> float:
    """The process groups' timeout: later than the watch, so the stacks are written first."""
    return timeout_s + GRACE_S


def hold_dump_signal() -> None:
    """At a rank's start, before it starts threads: they inherit the block, and the watch takes
    the signal with sigtimedwait."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {DUMP_SIGNAL})


def stacks_folder(run_dir: Path) -> Path:
    return Path(run_dir) / STACKS


def request_stacks(run_dir: Path, reason: str) -> None:
    """Ask every rank of the run for its stacks (atomically: a watch never reads half)."""
    folder = stacks_folder(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{REQUEST}.{os.getpid()}"
    tmp.write_text(f"{time.time_ns()} {reason}\n")
    os.replace(tmp, folder / REQUEST)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns  # a rename makes a new inode


class HangWatch:
    """`with HangWatch(...)`: the watch runs while the block does (the rank's training)."""

    def __init__(self, stats: CommStats, rank: int, world_size: int, run_dir: Path,
                 timeout_s: float):
        self.stats, self.rank, self.world_size = stats, rank, world_size
        self.run_dir, self.timeout_s = Path(run_dir), timeout_s
        self.folder = stacks_folder(run_dir)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="hang-watch")
        self._previous: Any = None

    def __enter__(self) -> HangWatch:
        hold_dump_signal()
        self._previous = signal.signal(DUMP_SIGNAL, self._on_signal)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        signal.signal(DUMP_SIGNAL, self._previous)

    def _on_signal(self, signum: int, frame: Any) -> None:
        request_stacks(self.run_dir, f"SIGUSR1 to rank {self.rank}")

    def _watch(self) -> None:
        seen = _stamp(self.folder / REQUEST)
        while not self._stop.is_set():
            if signal.sigtimedwait({DUMP_SIGNAL}, POLL_S) is not None:
                request_stacks(self.run_dir, f"SIGUSR1 to rank {self.rank}")
            stamp = _stamp(self.folder / REQUEST)
            if stamp is not None and stamp != seen:
                seen = stamp
                self.dump()
            wait = self.stats.waiting
            if wait is not None and time.monotonic() - wait.since > self.timeout_s:
                self._end_hung_run()

    def state(self) -> dict[str, Any]:
        """What this rank is doing, as the first line of its stacks file says it."""
        wait = self.stats.waiting
        if wait is None:
            return {"rank": self.rank, "waiting": None, "waits_done": self.stats.waits_done}
        return {"rank": self.rank, "waits_done": self.stats.waits_done,
                "waiting": {"group": wait.group, "op": wait.op, "ranks": list(wait.ranks),
                            "seconds": round(time.monotonic() - wait.since, 1)}}

    def dump(self) -> Path:
        """This rank's stacks, every thread's, into stacks/rank_R.txt (replaced whole)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        state = self.state()
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [json.dumps(state), describe(state), ""]
        for ident, frame in sys._current_frames().items():
            lines.append(f"Thread {names.get(ident, '?')} ({ident}):")
            lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
            lines.append("")
        path = self.folder / f"rank_{self.rank}.txt"
        tmp = self.folder / f".rank_{self.rank}.txt.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)
        return path

    def _end_hung_run(self) -> None:
        """Ask for every rank's stacks, wait for them, write and print the summary, and end this
        rank (the main thread is stuck in the collective: only an exit ends it)."""
        asked = time.time()
        wait = self.stats.waiting
        request_stacks(self.run_dir, f"hang: rank {self.rank} waited in {wait.op if wait else '?'}")
        self.dump()
        deadline = time.monotonic() + GATHER_S
        while time.monotonic() < deadline and len(fresh_dumps(self.folder, asked)) < \
                self.world_size:
            time.sleep(POLL_S / 5)
        line = hang_summary(fresh_dumps(self.folder, asked), self.world_size, self.timeout_s,
                            self.folder)
        tmp = self.folder / f".{SUMMARY}.{self.rank}"
        tmp.write_text(line + "\n")
        os.replace(tmp, self.folder / SUMMARY)
        os.write(2, f"rank {self.rank}: {line}\n".encode())
        os._exit(HUNG_EXIT)


def describe(state: dict[str, Any]) -> str:
    wait = state["waiting"]
    if wait is None:
        return f"rank {state['rank']} is in no collective ({state['waits_done']} waits ended)"
    return (f"rank {state['rank']} waits in {wait['op']} over {wait['group']} (ranks "
            f"{_ranks(wait['ranks'])}) for {wait['seconds']} s")


def fresh_dumps(folder: Path, since: float) -> dict[int, dict[str, Any]]:
    """The first lines of the stacks files written since `since` (time.time()), by rank."""
    found = {}
    for path in folder.glob("rank_*.txt"):
        try:
            if path.stat().st_mtime < since:
                continue
            with path.open() as f:
                state = json.loads(f.readline())
        except (OSError, ValueError):
            continue
        found[state["rank"]] = state
    return found


def hang_summary(states: dict[int, dict[str, Any]], world_size: int, timeout_s: float,
                 folder: Path) -> str:
    """One line: each collective ranks wait in, who of its group never reached it, the ranks
    in no collective and the ranks that wrote no stacks."""
    parts, waiting = [], {}
    for rank, state in sorted(states.items()):
        if state["waiting"] is not None:
            wait = state["waiting"]
            waiting.setdefault((wait["group"], wait["op"], tuple(wait["ranks"])), []).append(rank)
    for (group, op, members), ranks in waiting.items():
        missing = [r for r in members if r not in ranks]
        parts.append(f"rank(s) {_ranks(ranks)} wait in {op} over {group} (ranks "
                     f"{_ranks(members)})" + (f" that rank(s) {_ranks(missing)} never reached"
                                               if missing else ""))
    idle = [r for r, s in sorted(states.items()) if s["waiting"] is None]
    if idle:
        parts.append(f"rank(s) {_ranks(idle)} in no collective")
    silent = [r for r in range(world_size) if r not in states]
    if silent:
        parts.append(f"rank(s) {_ranks(silent)} wrote no stacks (stuck outside Python, or gone)")
    return (f"the run hung: a collective waited over cluster.timeout_s={timeout_s:g} s: "
            f"{'; '.join(parts)}. Each rank's Python stacks: {folder}/rank_R.txt. Fix: look "
            f"where the ranks that did not reach it are in their stacks (data, a disk, a step "
            f"of other shapes); raise cluster.timeout_s if a step legitimately waits longer.")


def _ranks(ranks: Any) -> str:
    return ", ".join(map(str, ranks))
