"""Dependencies run one way: parallel/ never imports trainer/, and compose time is a floor: the
rooms the resolver, the checks, the dry run and the search use import no torch and nothing above
them (compose-time validation must stay fast)."""
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
    """parallel/layout/ (the Layout, the axes it reads, the pipeline schedules' tables and the
    parallel plan's type) imports the standard library and itself only."""
    stdlib = {"__future__", "dataclasses", "functools", "math", "typing", "collections",
              "itertools"}
    for path in (ROOT / "parallel" / "layout").rglob("*.py"):
        outside = {m for m in imported_modules(path) - stdlib
                   if not (m == "parallel.layout" or m.startswith("parallel.layout."))}
        assert not outside, f"{path} imports {sorted(outside)}"


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


# The compose-time floor, lowest first: the rooms of trainer/ below every room that imports
# torch (ARCHITECTURE.md), with parallel/layout/ under them and the Hydra plugins on them.
FLOOR_ROOMS = ("units", "config", "values", "parts", "checks", "plan", "data", "auto",
               "compose")

def on_the_floor(module: str) -> bool:
    return (room_of(module) in FLOOR_ROOMS or module == "parallel.layout"
            or module.startswith(("parallel.layout.", "hydra_plugins.")))


def test_the_compose_floor_imports_no_torch_and_nothing_above_it():
    """A rule of the floor, not of listed files: no module on it names torch (not even lazily)
    or imports a module off the floor, so nothing the resolver runs can reach torch."""
    floor = [name for name in MODULES if on_the_floor(name)]
    assert {room_of(name) for name in floor} - {None} == set(FLOOR_ROOMS)
    heavy = [name for name in floor
             if any(m.split(".")[0] == "torch" for m in imported_modules(MODULES[name]))]
    assert not heavy, f"modules on the compose floor import torch: {heavy}"
    above = [f"{name} -> {dep}" for name in floor for dep in project_imports(name)
             if not on_the_floor(dep) and dep not in ("trainer", "parallel")]
    assert not above, f"the compose floor imports rooms above it: {above}"


def test_every_room_above_the_floor_sits_above_it():
    """The floor's rooms come first in ROOMS, so the one-way rule puts every other room above."""
    assert ROOMS[:len(FLOOR_ROOMS)] == FLOOR_ROOMS


def test_the_model_does_not_know_it_is_parallel():
    """Only the plan (pure data, sized from the model's config) is shared with parallel/, and
    the attention kernels the model runs on one process too under a sliding window or sinks
    (calls and kernels: torch and numpy only, no group, no layout); the model's code and its
    parts import none of the rest."""
    model = [name for name in MODULES if name.startswith(("trainer.model", "trainer.parts"))]
    shared = {f"{name} -> {m}" for name in model for m in project_imports(name)
              if m.startswith("parallel")}
    assert shared == {"trainer.parts.assembly -> parallel.layout.parallel_plan",
                      "trainer.parts.tokens -> parallel.layout",
                      "trainer.model.attention -> parallel.context.calls",
                      "trainer.model.attention -> parallel.context.kernels",
                      "trainer.model.generate -> parallel.context.calls",
                      "trainer.model.generate -> parallel.context.kernels"}
    kernels = {m for name in ("parallel.context.calls", "parallel.context.kernels")
               for m in project_imports(name)}
    assert kernels == {"parallel.context.calls"}, kernels


def test_launching_sits_on_top():
    """Nothing imports trainer.launch but launch.py (the composition root, outside MODULES)."""
    users = {f"{name} -> {dep}" for name in MODULES if not name.startswith("trainer.launch")
             for dep in project_imports(name) if dep.startswith("trainer.launch")}
    assert not users, users


# The rooms of trainer/, lowest first (ARCHITECTURE.md): each imports only rooms below it, so
# no two rooms import each other. The compose floor's rooms first; the entry points people type
# sit on top.
ROOMS = (*FLOOR_ROOMS, "model", "checkpoint", "train", "report", "launch", "hf", "prepare",
         "generate", "plot")


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "trainer" and len(parts) > 1 else None


def test_every_room_of_trainer_is_placed():
    assert {room_of(name) for name in MODULES} - {None} == set(ROOMS)


def test_the_rooms_of_trainer_import_one_way():
    upward = [f"{name} -> {dep}" for name in MODULES if room_of(name)
              for dep in project_imports(name) if room_of(dep) and room_of(dep) != room_of(name)
              and ROOMS.index(room_of(dep)) > ROOMS.index(room_of(name))]
    assert not upward, f"imports that run back up: {upward}"


def layout_sizes() -> set[str]:
    """The Layout's fields and properties (its sizes), read from parallel/layout/__init__.py."""
    tree = ast.parse((ROOT / "parallel" / "layout" / "__init__.py").read_text())
    (layout,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Layout"]
    names = {item.target.id for item in layout.body
             if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return names | {item.name for item in layout.body if isinstance(item, ast.FunctionDef)
                    and any(ast.unparse(d).endswith("property") for d in item.decorator_list)}


def derived_sizes(source: str, sizes: set[str]) -> list[str]:
    """Products and quotients of two sizes of one layout (`layout.a * layout.b`)."""
    def size(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in sizes
                and isinstance(node.value, ast.Name) and "layout" in node.value.id)
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.BinOp) and isinstance(node.op, (
                ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)) and size(node.left) and size(node.right)]


# Products of layout sizes that are not a size of the layout, each with why.
NOT_SIZES = {"layout.model_and_context_parallel_size * layout.virtual_pipeline_size":
             "parallel=auto's tie-break between equally fast layouts: how finely one is cut"}


def test_sizes_are_asked_of_the_layout():
    """A size that follows from other layout sizes is a Layout property, never re-derived."""
    sizes = layout_sizes()
    assert {"weight_tile_size", "micro_batch_times_batch_parallel_size", "tp_size"} <= sizes
    found = [f"{name}:{hit}" for name, path in MODULES.items()
             if path != ROOT / "parallel" / "layout.py"
             for hit in derived_sizes(path.read_text(), sizes)
             if hit.split(": ", 1)[1] not in NOT_SIZES]
    assert not found, found


def test_the_size_check_finds_a_re_derived_size():
    """The check above can fail: it finds the product the Layout names weight_tile_size, and
    leaves a size times a number alone."""
    sizes = layout_sizes()
    assert derived_sizes("tile = step_layout.tp_size * step_layout.gtp_remat_size\n", sizes)
    assert not derived_sizes("rows = layout.tp_size * 2\n", sizes)


def test_the_test_oracles_stay_out_of_the_product():
    """megatron-core (the schedule's and ramp-up's oracle), peft and trl are test tooling (the
    test extra): no module a run, a command or a benchmark imports names them. (transformers is
    the test extra's too, but `trainer.hf standin` builds its stand-in model with it and
    bench/hf_interop.py times against it, both on purpose.)"""
    oracles = {"megatron", "peft", "trl"}
    tops = ("trainer", "parallel", "hydra_plugins", "bench")
    paths = [ROOT / "launch.py"] + [p for top in tops for p in (ROOT / top).rglob("*.py")]
    for path in paths:
        found = {m.split(".")[0] for m in imported_modules(path)} & oracles
        assert not found, f"{path.relative_to(ROOT)} imports {sorted(found)}"
