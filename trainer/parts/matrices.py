"""The model's hidden matrices: the parameters optim=muon orthogonalises, from the config alone.

Muon takes every linear's 2-D weight but the embedding, the output head and the linears a part
leaves to AdamW (a router: trainer.parts.part.Part.adamw_linears), and each expert's matrix of a
3-D expert weight. Everything else (norms, biases, sinks, the embedding and head, routers) and
every parameter the config's optim.adamw_params patterns name goes to AdamW. The checks, the dry
run and the optimizer all ask this module, so the split they state is the one it makes.
"""
from __future__ import annotations

from fnmatch import fnmatchcase

from trainer.config import ModelConfig, OptimConfig
from trainer.parts.assembly import ADAMW_LINEARS, EMBEDDING, HEAD, parameter_shapes, tp_style

# a part's AdamW linear, matched at a name boundary ("layers.0.mlp.router", not "...xrouter")
ADAMW_SUFFIXES = tuple(f".{name}" for name in ADAMW_LINEARS)


def is_muon_shape(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the built-in rule gives parameter `name` to Muon (before optim.adamw_params)."""
    if len(shape) == 3:  # an expert weight [experts, out, in]; expert biases are 3-D too
        return not name.endswith("bias")
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    module = name.removesuffix(".weight")
    if module in (EMBEDDING, HEAD) or f".{module}".endswith(ADAMW_SUFFIXES):
        return False
    try:
        tp_style(module)  # a linear of some part (split by TP or kept whole)
    except ValueError:
        return False
    return True


def muon_parameters(shapes: dict[str, tuple[int, ...]], adamw_params: list[str]) -> list[str]:
    """The parameters Muon updates, in the model's order; the rest go to AdamW."""
    return [n for n, s in shapes.items() if is_muon_shape(n, s)
            and not any(fnmatchcase(n, p) for p in adamw_params)]


def unmatched_patterns(shapes: dict[str, tuple[int, ...]], adamw_params: list[str]) -> list[str]:
    """optim.adamw_params patterns that name no parameter of the model (a typo trains every
    matrix with Muon silently otherwise)."""
    return [p for p in adamw_params if not any(fnmatchcase(n, p) for n in shapes)]


def muon_names(model: ModelConfig, optim: OptimConfig) -> frozenset[str]:
    """The parameters this run's optimizer gives Muon (none under adamw)."""
    if optim.name != "muon":
        return frozenset()
    return frozenset(muon_parameters(parameter_shapes(model), list(optim.adamw_params)))
