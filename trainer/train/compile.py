"""train.compile=blocks: regional compilation, each transformer block by torch.compile.

Compiling the block, not the model, as torchtitan does: every block of a model shares one
compiled graph (the parameters are the graph's inputs), so the compile time is that of one
block whatever the depth, and the pipeline's stages, the loss and the optimizer stay eager.

The block is compiled in place (nn.Module.compile), after the parallel layers, context
parallel's attention and recompute are applied: the graph is the block this rank runs, its
hooks included, and no module or parameter name changes. A collective ends a graph: dynamo does
not trace our counted collectives (parallel.comm.kept_eager), which run eagerly
between the compiled regions, and a GTP_remat bundle's linear, which decides at run time
whether a forward is a recompute, ends one too. graph_breaks() names where the breaks are.

Counting: CompileWatch counts the graphs each training step compiles and the seconds dynamo and
inductor spent on them; any graph after the first step is a recompile, printed as it happens
and summed at the end.
"""
from __future__ import annotations

import os
import re
import time
from collections import Counter

from torch import nn

from parallel import bundle, comm
from parallel.layout.parallel_plan import ParallelPlan


def compile_blocks(model: nn.Module, plan: ParallelPlan, chunks: list[range]) -> None:
    """Compile each block this rank runs, in place. Compiling is lazy: the first forward pays
    for it."""
    comm.compile_ready()
    bundle.compile_ready()
    blocks = model.get_submodule(plan.blocks)
    for chunk in chunks:
        for index in chunk:
            blocks[str(index)].compile()


def graphs() -> int:
    """Graphs dynamo compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def compile_seconds() -> float:
    """Seconds dynamo and inductor spent compiling in this process so far: forward and backward
    graphs, waiting for inductor's compile workers included (dynamo's own timers)."""
    from torch._dynamo.utils import calculate_time_spent
    return float(calculate_time_spent()["total_wall_time"])


def cache_hits() -> tuple[int, int]:
    """(found, compiled): inductor graphs taken from the cache and compiled anew, so far."""
    from torch._dynamo.utils import counters
    found = counters["inductor"]
    return int(found["fxgraph_cache_hit"]), int(found["fxgraph_cache_miss"])


def graph_breaks() -> Counter:
    """Where dynamo broke a graph -> how many times it did while compiling (in this process so
    far): the function it would not trace (Group.all_gather: a collective kept eager), or the
    first line of its reason."""
    from torch._dynamo.utils import counters
    where: Counter = Counter()
    for reason, count in counters["graph_break"].items():
        found = re.search(r"<function (\S+) at|<built-in function (\w+)>", reason)
        where[next(g for g in found.groups() if g) if found else reason.splitlines()[0]] += count
    return where


COMPILE_CACHE = "compile_cache"  # in the run folder


def use_cache(folder: os.PathLike | str) -> None:
    """Inductor's and the FX graph caches in `folder`, so a resumed run (the same folder) finds
    the kernels its first start compiled. Set before the first compile."""
    os.makedirs(folder, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


class CompileWatch:
    """What compiling costs a run, measured around each training step: the graphs the first
    step compiled, the seconds compiling took and the step's, then any graph a later step
    compiles (a recompile: a guard failed, e.g. a new shape). Evaluation's graphs (no autograd)
    are not training steps."""

    def __init__(self) -> None:
        self.first_done = False
        self.recompiles = 0
        self.seconds = 0.0  # compiling, in the training steps so far
        self._before, self._compiling, self._started = 0, 0.0, 0.0

    def start(self) -> None:
        self._before, self._compiling = graphs(), compile_seconds()
        self._started = time.perf_counter()

    def end(self, step: int) -> str | None:
        """A line to print, or None."""
        new, spent = graphs() - self._before, compile_seconds() - self._compiling
        self.seconds += spent
        if not self.first_done:
            self.first_done = True
            found, compiled = cache_hits()
            return (f"train.compile=blocks: step {step} compiled {new} graph(s) in {spent:.1f} s "
                    f"of its {time.perf_counter() - self._started:.1f} s; "
                    f"inductor: {found} found in the cache, {compiled} compiled")
        self.recompiles += new
        if new:
            return (f"warning: train.compile=blocks recompiled {new} graph(s) in step {step}, "
                    f"{spent:.1f} s (a guard failed: TORCH_LOGS=recompiles says which)")
        return None

    def summary(self) -> str:
        return (f"train.compile=blocks: {self.recompiles} recompile(s) after the first step; "
                f"{self.seconds:.1f} s compiling in training steps; "
                f"graph breaks at {dict(graph_breaks()) or 'none'}")
