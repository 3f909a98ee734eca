"""How sizes and durations are written for people: one way everywhere (the progress line, the
measured dry run, checkpoint saves, imports and exports, tokenizing). Standard library only, so
compose-time code may use it too."""
from __future__ import annotations

MiB, GiB = 2**20, 2**30


def duration(seconds: float) -> str:
    """7m21s; 1h02m from an hour on."""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def size(nbytes: int) -> str:
    """1.5 MiB below a GiB, 2.25 GiB from there on."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"
