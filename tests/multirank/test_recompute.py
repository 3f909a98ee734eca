"""Activation recompute (train.recompute_granularity) trains the same model and keeps less.

Parity: each granularity (selective; full; full for the first block only) trains the same
parameters as the same layout without recompute, on layouts with weight sharding, TP + SP and
context parallel (test_parity's cases, 2 steps of 2 micro-batches; ws2 in bf16 too). A
replay runs the same kernels on the same inputs, so on CPU the results are bit-for-bit equal
(measured: 0.0 for losses, gradient norms and every parameter) and the test asserts
equality. In fp64 the ws2 cases also match one process to 1e-10 (measured ~3e-16), tying
recompute to the reference.

Memory: on one process, the tensors autograd keeps for backward (distinct storages, weights
excluded) shrink with each granularity, the recomputed functions really run twice, and the
model keeps its module and parameter names.
"""
from __future__ import annotations

import collections
import functools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from parallel.layout import Layout
from trainer.config import Precision, RecomputeGranularity
from trainer.model.transformer import Transformer
from trainer.parts.assembly import parallel_plan
from trainer.plan.options import EngineOptions
from trainer.train.engine import build_engine
from trainer.train.recompute import apply_recompute

from harness import run_ranks
from test_parity import (
    LAYOUTS,
    MICRO,
    OPTIM,
    SEED,
    SEQ,
    TINY,
    make_data,
    make_layout,
    reference,
    relative,
    train_rank,
)

STEPS = 2  # the second step is the first to use weights updated after a replay
VARIANTS = {  # name -> options
    "none": EngineOptions(),
    "selective": EngineOptions(recompute_granularity=RecomputeGranularity.selective),
    "full": EngineOptions(recompute_granularity=RecomputeGranularity.full),
    "full_first_1": EngineOptions(recompute_granularity=RecomputeGranularity.full,
                                  recompute_num_layers=1),
}


def train_variants(rank: int, layout: Layout, batches: list[torch.Tensor], dtype: torch.dtype,
                   precision: Precision = Precision.fp32) -> dict:
    """Every variant on the same ranks, one after the other (one process start, not four)."""
    return {name: train_rank(rank, layout, batches, dtype, replace(options, precision=precision))
            for name, options in VARIANTS.items()}


def differences(got: dict, want: dict) -> dict[str, float]:
    return {
        "loss": max(relative(a, b) for a, b in zip(got["losses"], want["losses"])),
        "grad_norm": max(relative(a, b) for a, b in zip(got["norms"], want["norms"])),
        "params": max(relative(got["params"][k], v) for k, v in want["params"].items()),
    }


@pytest.mark.parametrize("name, precision", [
    ("ws2", Precision.fp32), ("tp2_sp", Precision.fp32), ("cp2_ws2_ss2", Precision.fp32),
    ("ws2", Precision.bf16),  # the replay runs under the forward's autocast
], ids=["ws2", "tp2_sp", "cp2_ws2_ss2", "ws2_bf16"])
def test_recompute_trains_bit_for_bit_like_keeping_activations(name, precision):
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    batches = make_data(layout.global_batch_size)[:STEPS]
    results = run_ranks(world, train_variants, layout, batches, torch.float32, precision,
                        timeout=120)[0]
    base = results["none"]
    for variant, got in results.items():
        print(f"\nrecompute {variant} {name} {precision.value}: vs none "
              f"{differences(got, base)}")
        assert got["losses"] == base["losses"] and got["norms"] == base["norms"], variant
        assert got["params"].keys() == base["params"].keys()
        for key, value in base["params"].items():
            assert torch.equal(got["params"][key], value), (variant, key)


def test_recompute_matches_one_process_in_fp64():
    world, kwargs = LAYOUTS["ws2"]
    layout = make_layout(world, kwargs)
    batches = make_data(layout.global_batch_size)[:STEPS]
    ref = run_ranks(1, reference, batches, torch.float64)[0]
    results = run_ranks(world, train_variants, layout, batches, torch.float64, timeout=120)[0]
    for variant, got in results.items():
        worst = differences(got, ref)
        print(f"\nrecompute {variant} ws2 fp64: vs one process {worst}")
        assert all(value <= 1e-10 for value in worst.values()), (variant, worst)


COUNTED = ("scaled_dot_product_attention", "silu", "linear")  # attention core, MLP act, GEMMs


def _counted(fn, name: str, calls: collections.Counter, *args, **kwargs):
    calls[name] += 1
    return fn(*args, **kwargs)


class SavedActivations:
    """The storages autograd packs for backward inside the `with`, weights excluded: what
    the step keeps alive between its forward and its backward (a view counts its storage
    once; a checkpointed function's inputs count, what it drops does not)."""

    def __init__(self, weights: list[torch.Tensor]):
        self.weights = {w.untyped_storage().data_ptr() for w in weights}
        self.sizes: dict[int, int] = {}  # storage address -> bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.weights:
            self.sizes[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def saved_and_calls(rank: int) -> dict:
    """Per variant, one micro-batch on one process: the activations kept for backward and
    how often F.* ran in forward and in forward + backward. F.* is patched in this forked
    rank only."""
    calls: collections.Counter = collections.Counter()
    for fn_name in COUNTED:
        setattr(F, fn_name, functools.partial(_counted, getattr(F, fn_name), fn_name, calls))
    layout = Layout(1, micro_batch_size=MICRO, seq_length=SEQ)
    tokens = torch.randint(0, TINY.vocab_size, (MICRO, SEQ),
                           generator=torch.Generator().manual_seed(SEED))
    positions = torch.arange(SEQ).expand(MICRO, SEQ)
    out = {}
    for name, options in VARIANTS.items():
        engine = build_engine(TINY, OPTIM, SEED, layout, torch.device("cpu"), options)
        calls.clear()
        with SavedActivations(list(engine.model.parameters())) as saved:
            loss = engine.model.token_losses(engine.model(tokens, positions), tokens).sum()
        forward = dict(calls)
        loss.backward()
        out[name] = {"tensors": len(saved.sizes), "bytes": sum(saved.sizes.values()),
                     "forward": forward, "total": dict(calls), "loss": loss.item(),
                     "names": [n for n, _ in engine.model.named_parameters()],
                     "modules": [type(m).__name__ for m in engine.model.module.layers.values()]}
    return out


def test_recompute_runs_again_in_backward_and_keeps_fewer_activations():
    got = run_ranks(1, saved_and_calls, timeout=60)[0]
    for name, value in got.items():
        print(f"\nrecompute {name}: {value['tensors']} saved storages, {value['bytes']} bytes; "
              f"calls forward {value['forward']}, forward + backward {value['total']}")
    layers = TINY.num_layers
    per_block = 4  # qkv, o, gate_up, down
    forward = {"scaled_dot_product_attention": layers, "silu": layers,
               "linear": layers * per_block + 1}  # + the head
    replayed = {  # what backward runs again, per variant
        "none": {},
        "selective": {"scaled_dot_product_attention": layers, "silu": layers},
        "full": {"scaled_dot_product_attention": layers, "silu": layers,
                 "linear": layers * per_block},
        "full_first_1": {"scaled_dot_product_attention": 1, "silu": 1, "linear": per_block},
    }
    for name, extra in replayed.items():
        assert got[name]["forward"] == forward, name
        assert got[name]["total"] == {k: v + extra.get(k, 0) for k, v in forward.items()}, name
        assert got[name]["loss"] == got["none"]["loss"], name
        assert got[name]["names"] == got["none"]["names"], name  # layers.0.attn.qkv.weight ...
    assert got["full"]["modules"] == ["RecomputedBlock"] * layers
    kept = {name: value["bytes"] for name, value in got.items()}
    # selective drops at least silu(gate) [micro, seq, ffn] per block; full keeps each
    # block's input only, so less than a block's worth of activations per block.
    assert kept["none"] - kept["selective"] >= layers * MICRO * SEQ * TINY.ffn_hidden_size * 4
    assert kept["full"] < kept["full_first_1"] < kept["selective"] < kept["none"]
    assert kept["full"] * 4 < kept["none"]


def test_recompute_is_applied_once_and_needs_the_plans_hooks():
    """On the plain model (no ranks): a second apply is refused, and selective on a plan that
    names no hooks fails in one line with the fix instead of silently keeping everything."""
    with torch.device("meta"):
        model = Transformer(TINY)
    blocks = [range(TINY.num_layers)]
    apply_recompute(model, parallel_plan(TINY), VARIANTS["selective"], blocks)
    with pytest.raises(RuntimeError, match="already applied"):
        apply_recompute(model, parallel_plan(TINY), VARIANTS["full"], blocks)
    with torch.device("meta"):
        model = Transformer(TINY)
    with pytest.raises(ValueError, match="recompute_granularity=full"):
        apply_recompute(model, replace(parallel_plan(TINY), recompute_hooks=()),
                        VARIANTS["selective"], blocks)
