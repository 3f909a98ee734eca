"""Small or read-only disks for the tests of a full or unwritable one: a tmpfs mounted on a
folder for the length of a `with` block (the tests run as root; where mounting is not allowed
the test is skipped)."""
from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


@contextmanager
def tmpfs(folder: Path, options: str) -> Iterator[Path]:
    """`folder` (made here) as a tmpfs mounted with `options` ("size=600k", "ro,size=1m")."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
