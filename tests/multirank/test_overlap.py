"""Overlapped and bf16 GTP_remat communication, on gloo ranks with model=tiny (test_parity's
data, steps and helpers).

Overlap (parallel.overlap_param_gather, parallel.overlap_grad_reduce) changes when messages
move, never what they carry or the order of any sum: fp32 training is bit-identical with it on
or off, and so are the bytes and calls per step. It keeps at most two blocks' gathered weights
alive (a weakref census of every gathered buffer; one without overlap), and its early
collectives really are asynchronous (counted in CommStats.overlapped).

bf16 gathers move bf16 copies of the fp32 shards. Autocast casts a gathered weight to bf16
before use anyway, so ws4_ss2 trains as one bf16 process does up to the order of sums (bf16
matmuls over other token splits, fp32 all-reduces): observed 1.4e-5 relative on the loss and
4.5e-5 on the gradient norm over 3 steps, asserted 1e-4 and 5e-4. Gradients reduce-scattered
in bf16 add bf16 rounding of the sums: observed 1.8e-5 and 5.5e-5, asserted 2e-4 and 1e-3.
Against fp32, test_parity's bf16 bounds (loss 1e-2, gradient norm 5e-2; observed 1.2e-5 and
~2e-3: the compute really was bf16).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel.bundle import _Gathered
from parallel.parallelize import ParallelModel
from trainer.config import Precision
from trainer.plan.options import EngineOptions
from trainer.train.batch import rank_micro_batches
from trainer.train.engine import build_engine
from trainer.train.step import train_step

from harness import run_ranks
from test_parity import (
    LAYOUTS,
    OPTIM,
    SEED,
    TINY,
    make_data,
    make_layout,
    reference,
    relative,
    train_rank,
)

OVERLAP = EngineOptions(overlap_param_gather=True, overlap_grad_reduce=True)


def train_each(rank: int, layout, batches, dtype, options: list[EngineOptions]) -> list[dict]:
    return [train_rank(rank, layout, batches, dtype, o) for o in options]


@pytest.mark.parametrize("name", ["ws2", "ws4_ss2", "every_axis"])
def test_overlap_trains_bit_identically(name):
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    batches = make_data(layout.global_batch_size)
    off, on = run_ranks(world, train_each, layout, batches, torch.float32,
                        [EngineOptions(), OVERLAP], timeout=180)[0]
    worst = max(relative(on["params"][k], v) for k, v in off["params"].items())
    print(f"\noverlap {name}: losses {on['losses']} (off: {off['losses']}), params {worst}")
    assert on["losses"] == off["losses"] and on["norms"] == off["norms"]
    assert all(torch.equal(on["params"][k], v) for k, v in off["params"].items())


def test_bf16_gathers_train_like_one_bf16_process():
    world, kwargs = LAYOUTS["ws4_ss2"]
    layout = make_layout(world, kwargs)
    batches = make_data(layout.global_batch_size)
    bf16 = EngineOptions(Precision.bf16)
    variants = [bf16, replace(OVERLAP, precision=Precision.bf16),
                replace(OVERLAP, precision=Precision.bf16, grad_reduce_in_bf16=True)]
    off, on, bf16_reduce = run_ranks(world, train_each, layout, batches, torch.float32,
                                     variants, timeout=180)[0]
    one = replace(make_layout(1, {}), global_batch_size=layout.global_batch_size)
    single = run_ranks(1, train_rank, one, batches, torch.float32, bf16)[0]
    fp32 = run_ranks(1, reference, batches, torch.float32)[0]
    assert on["losses"] == off["losses"] and on["norms"] == off["norms"]
    for got, loss_tol, norm_tol in ((on, 1e-4, 5e-4), (bf16_reduce, 2e-4, 1e-3)):
        worst = {ref_name: (max(relative(a, b) for a, b in zip(got["losses"], ref["losses"])),
                            max(relative(a, b) for a, b in zip(got["norms"], ref["norms"])))
                 for ref_name, ref in (("bf16 process", single), ("fp32", fp32))}
        print(f"\nbf16 ws4_ss2 (reduce in bf16: {got is bf16_reduce}): worst relative "
              f"(loss, grad norm) against {worst}")
        (loss, norm), (loss_fp32, norm_fp32) = worst["bf16 process"], worst["fp32"]
        assert loss < loss_tol and norm < norm_tol
        assert loss_fp32 < 1e-2 and 1e-4 < norm_fp32 < 5e-2
    # bf16 sums of the gradients are not fp32 ones: the flag really acted.
    assert bf16_reduce["norms"] != on["norms"]


def census_step(rank: int, layout, batch, options: EngineOptions) -> dict:
    """One step of a 4-block model, counting the blocks that hold gathered weights (a message
    in flight, or the members' weights cut from it) whenever a gather is made or cut. Counted
    from the bundles' own references: a message gloo's worker thread still holds for a moment
    after its wait() is not the trainer's to free."""
    seen: dict[int, object] = {}
    peak = [0]
    init, weights = _Gathered.__init__, _Gathered.weights

    def count(bundle):
        seen[id(bundle)] = bundle
        live = {key for key, b in seen.items() if b.live_gathers() > 0} | {id(bundle)}
        peak[0] = max(peak[0], len(live))

    def counted_init(self, pending, bundle):
        init(self, pending, bundle)
        count(bundle)

    def counted_weights(self):
        out = weights(self)
        count(self._bundle)
        return out

    _Gathered.__init__, _Gathered.weights = counted_init, counted_weights
    engine = build_engine(replace(TINY, num_layers=4), OPTIM, SEED, layout, torch.device("cpu"),
                          options)
    stats = engine.groups.stats
    stats.reset()
    micro_batches = rank_micro_batches(lambda idx: batch[idx].clamp(min=0), layout, rank)
    result = train_step(engine.model, engine.optimizer, micro_batches, 1e-3)
    _Gathered.__init__, _Gathered.weights = init, weights
    return {"peak": peak[0], "loss": result.loss, "bytes": dict(stats.bytes),
            "calls": dict(stats.calls), "overlapped": dict(stats.overlapped)}


def census_each(rank: int, layout, batch) -> list[dict]:
    return [census_step(rank, layout, batch, o) for o in (EngineOptions(), OVERLAP)]


def test_overlap_keeps_two_blocks_gathered_and_is_asynchronous():
    layout = make_layout(2, dict(tensor_parallel_num_weight_shards=2))
    blocks, micro = 4, layout.num_microbatches
    off, on = run_ranks(2, census_each, layout, make_data(layout.global_batch_size)[0],
                        timeout=120)[0]
    assert (off["peak"], on["peak"]) == (1, 2)
    assert on["loss"] == off["loss"]
    assert on["bytes"] == off["bytes"] and on["calls"] == off["calls"]  # the same messages
    # Per micro-batch every block's gather but the first in each direction starts early (one
    # block ahead), and every block's reduce-scatter runs on while earlier blocks compute.
    assert off["overlapped"] == {}
    assert on["overlapped"] == {("gtp_remat", "all_gather"): micro * 2 * (blocks - 1),
                                ("gtp_remat", "reduce_scatter"): micro * blocks}


FINISHING = ("finish_grads", "_finish_grad_reduce", "_reduce_replicated_grads",
             "_reduce_embedding_grads")


def finishing_step(rank: int, layout, batch) -> list[str]:
    """One overlapped step of a tied model over two stages, recording the ParallelModel's
    gradient-finishing calls in order (a forked rank: the class is patched in it alone)."""
    calls: list[str] = []

    def record(name: str):
        method = getattr(ParallelModel, name)

        def recorded(self):
            calls.append(name)
            return method(self)
        return recorded

    for name in FINISHING:
        setattr(ParallelModel, name, record(name))
    engine = build_engine(replace(TINY, tie_word_embeddings=True), OPTIM, SEED, layout,
                          torch.device("cpu"), OVERLAP)
    micro_batches = rank_micro_batches(lambda idx: batch[idx].clamp(min=0), layout, rank)
    train_step(engine.model, engine.optimizer, micro_batches, 1e-3)
    return calls


def test_a_step_finishes_its_gradients_with_one_call():
    """Reduce-scatters in flight, replicated tensors, then the tied embedding over its stages:
    one call of the step, the three in that order."""
    layout = make_layout(2, dict(pipeline_model_parallel_size=2))
    calls = run_ranks(2, finishing_step, layout, make_data(layout.global_batch_size)[0],
                      timeout=120)
    assert calls == [list(FINISHING)] * 2
