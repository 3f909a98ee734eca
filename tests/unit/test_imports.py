"""Dependencies run one way: parallel/ never imports trainer/, layout.py and the Hydra plugin
import no torch (compose-time validation must stay fast)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_parallel_never_imports_trainer():
    for path in (ROOT / "parallel").rglob("*.py"):
        assert not any(m.split(".")[0] == "trainer" for m in imported_modules(path)), path


def test_layout_is_pure_python():
    assert imported_modules(ROOT / "parallel" / "layout.py") <= {
        "__future__", "dataclasses", "functools", "math", "typing"}


def test_hydra_finds_the_plugin_on_its_own_and_compose_imports_no_torch():
    code = (
        "import sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "from omegaconf import OmegaConf\n"
        "import trainer.config\n"
        f"with initialize_config_dir(config_dir={str(ROOT / 'conf')!r}, version_base='1.3'):\n"
        "    cfg = compose(config_name='config', overrides=['cluster.procs_per_node=4'])\n"
        "OmegaConf.resolve(cfg)\n"
        "assert cfg.layout.data_parallel_size == 4\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
