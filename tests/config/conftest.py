"""Fixtures of the command-line tests in this folder."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> Path:
    """A folder to put first on PYTHONPATH: `import torch` there fails loudly (compose-time
    code must not import it)."""
    folder = tmp_path_factory.mktemp("no_torch")
    (folder / "torch").mkdir()
    (folder / "torch" / "__init__.py").write_text("raise ImportError('torch imported')\n")
    return folder
