"""Dependencies run one way: parallel/ never imports trainer/, layout.py and the Hydra plugin
import no torch (compose-time validation must stay fast)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

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


# ------------------------------------------------------------------ the rooms' dependency rules
PACKAGES = ("trainer", "parallel", "hydra_plugins")


def project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = project_modules()


def project_imports(name: str) -> set[str]:
    """The project modules `name` imports (a package import counts as its __init__)."""
    out = set()
    for imported in imported_modules(MODULES[name]):
        while imported and imported not in MODULES:
            imported = imported.rpartition(".")[0]
        if imported and imported != name:
            out.add(imported)
    return out


def closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for dep in project_imports(todo.pop()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_module_imports_itself_back():
    cycles = [name for name in MODULES if name in closure(name)]
    assert not cycles, f"import cycles through {cycles}"


# Modules that run at compose time (the resolver, the sweeper, settle, the dry run's checks):
# nothing they import, directly or not, may import torch.
COMPOSE_TIME = ("trainer.config", "trainer.compose.runspec", "trainer.compose.sweeps",
                "trainer.compose.resolvers", "trainer.auto.search",
                "hydra_plugins.gtp_trainer_resolvers")


@pytest.mark.parametrize("name", COMPOSE_TIME)
def test_compose_time_modules_import_no_torch(name):
    heavy = {module for module in {name} | closure(name)
             if any(m.split(".")[0] == "torch" for m in imported_modules(MODULES[module]))}
    assert not heavy, f"{name} imports torch through {sorted(heavy)}"


def test_the_model_does_not_know_it_is_parallel():
    """Only the plan (pure data, sized from the model's config) is shared with parallel/; the
    model's code imports none of it."""
    assert not {m for m in project_imports("trainer.model.transformer") if m.startswith("parallel")}
    assert {m for m in project_imports("trainer.model.plan")} == {"parallel.plan", "trainer.config"}


def test_launching_sits_on_top():
    """Nothing below trainer.launch imports it, except the loop's stop-at-a-step-boundary signal
    watch; launch.py is the composition root."""
    users = {name for name in MODULES if not name.startswith("trainer.launch")
             for dep in project_imports(name) if dep.startswith("trainer.launch")}
    assert users <= {"trainer.train.loop"}
    assert {d for d in project_imports("trainer.train.loop") if d.startswith("trainer.launch")} \
        <= {"trainer.train.signals"}
