"""The zero-bubble schedules: each stage's order is torch.distributed.pipelining's own (the
oracle: its ScheduleInterleavedZeroBubble with one chunk a rank is ZB-H1, its
ScheduleZBVZeroBubble is ZB-V), none deadlocks, the bubbles are the paper's, and the split
backward (I, then W) forms the gradients a whole backward forms, bit for bit."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from parallel.layout.pipeline_schedules import (
    BACKWARD,
    FORWARD,
    INPUT,
    WEIGHT,
    Action,
    in_flight,
    message_counts,
    model_chunk,
    stage_actions,
    stage_of,
    weights_pending,
)
from parallel.layout.pipeline_simulation import simulate
from parallel.sharding import sharded_linear
from parallel.weight_grads import DeferredWeightGrads

GRID = list(itertools.product(range(1, 9), range(1, 17)))  # (pp, micro-batches)
TORCH_KIND = {"FORWARD": FORWARD, "BACKWARD_INPUT": INPUT, "BACKWARD_WEIGHT": WEIGHT,
              "FULL_BACKWARD": BACKWARD}


def torch_order(schedule: str, pp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's actions for `rank` (its per-rank builder, called without the process group its
    constructor needs), as (kind, micro-batch, model chunk), its idle slots left out."""
    from torch.distributed.pipelining import schedules

    if schedule == "zb_h1":
        fields = SimpleNamespace(n_local_stages=1, pp_group_size=pp, _n_microbatches=m,
                                 microbatches_per_round=m // max(1, m // pp))
        ops = schedules.ScheduleInterleavedZeroBubble._calculate_single_rank_operations(
            fields, rank)
    else:
        fields = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
        ops = schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations(fields, rank)
    return [(TORCH_KIND[a.computation_type.name], a.microbatch_index, a.stage_index)
            for a in ops if a is not None]


def ours(schedule: str, pp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    v = 2 if schedule == "zbv" else 1
    return [(a.kind, a.microbatch, model_chunk(rank, a.chunk, pp, schedule == "zbv"))
            for a in stage_actions(schedule, rank, pp, m, v)]


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv"])
def test_each_rank_runs_torchs_order(schedule):
    for pp, m in GRID:
        for rank in range(pp):
            assert ours(schedule, pp, m, rank) == torch_order(schedule, pp, m, rank), \
                (schedule, pp, m, rank)


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv"])
def test_every_action_once_in_dependency_order_and_no_deadlock(schedule):
    v = 2 if schedule == "zbv" else 1
    for pp, m in GRID:
        for stage in range(pp):
            actions = stage_actions(schedule, stage, pp, m, v)
            keys = [(a.kind, a.microbatch, a.chunk) for a in actions]
            expected = {(k, mb, c) for k in (FORWARD, INPUT, WEIGHT) for mb in range(m)
                        for c in range(v)}
            assert len(keys) == len(expected) and set(keys) == expected
            at = {key: i for i, key in enumerate(keys)}
            for mb, c in itertools.product(range(m), range(v)):
                assert at[(FORWARD, mb, c)] < at[(INPUT, mb, c)] < at[(WEIGHT, mb, c)]
        simulate(schedule, pp, m, v)  # raises on a deadlock


def test_zb_h1_by_hand():
    # Stage 1 of 2 delays its first W (one per stage index) to the end.
    text = "F0 I0 F1 I1 W0 F2 I2 W1 W2"
    assert stage_actions("zb_h1", 1, 2, 3) == [Action(t[0], int(t[1]), 0) for t in text.split()]
    # pp 2, m 1, F = I = W = 1: stage 0 F 0-1, stage 1 F 1-2 I 2-3 W 3-4, stage 0 I 3-4 W 4-5:
    # 5 long, each stage busy 3. 1f1b (B = 2): 6 long, busy 3.
    assert simulate("zb_h1", 2, 1).makespan == 5.0
    assert simulate("1f1b", 2, 1).makespan == 6.0


@pytest.mark.parametrize("pp", [2, 4])
def test_simulated_bubbles_meet_the_goals(pp):
    # F = I = W: the paper's setting. The goals are over 1f1b's ideal bubble at 8 micro-batches.
    one_f_one_b = simulate("1f1b", pp, 8).bubble_fraction
    assert simulate("zb_h1", pp, 8).bubble_fraction / one_f_one_b <= 0.45
    assert simulate("zbv", pp, 8, 2).bubble_fraction / one_f_one_b <= 0.25


def test_what_each_stage_keeps():
    # zb_h1: 1f1b's activations (pp - stage until I) and stage + 1 pairs awaiting W.
    for pp, m in ((4, 8), (2, 3)):
        actions = [stage_actions("zb_h1", s, pp, m) for s in range(pp)]
        assert [in_flight(a) for a in actions] == [min(pp - s, m) for s in range(pp)]
        assert [weights_pending(a) for a in actions] == [min(s + 1, m) for s in range(pp)]
    # zbv: 2 pp chunk-halves (pp micro-batches of a whole stage) on every stage.
    assert [in_flight(stage_actions("zbv", s, 4, 8, 2)) for s in range(4)] == [8] * 4
    assert weights_pending(stage_actions("1f1b", 0, 4, 8)) == 0


def test_the_v_turns_on_the_last_stage():
    assert [model_chunk(s, 1, 4, v_shape=True) for s in range(4)] == [7, 6, 5, 4]
    assert [stage_of(c, 4, v_shape=True) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    # The last stage of 2 hands its chunk-0 output to chunk 1 itself: no receive for it, but the
    # gradient chunk 1's I hands back is held until chunk 0's I.
    assert message_counts(stage_actions("zbv", 1, 2, 8, 2), 1, 2, 2, v_shape=True) == {
        (1, 2), (2, 1)}


# ------------------------------------------------------------------- the split backward


class _Group:
    size = 1


def _grads(dtype: torch.dtype, split: bool, autocast: bool, recompute: bool
           ) -> list[torch.Tensor]:
    """A norm between two linears (as in a block): the input's and every weight's gradient,
    from one whole backward or from I then W."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=dtype, requires_grad=True)
    w1 = torch.randn(12, 8, dtype=dtype, requires_grad=True)
    w2 = torch.randn(8, 12, dtype=dtype, requires_grad=True)
    norm = torch.randn(12, dtype=dtype, requires_grad=True)
    store = DeferredWeightGrads() if split else None

    def block(x: torch.Tensor) -> torch.Tensor:
        h = sharded_linear(x, w1, _Group(), 12, weight_grads=store)
        h = F.rms_norm(h, (12,), norm.to(h.dtype))
        return sharded_linear(h, w2, _Group(), 8, weight_grads=store)

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        # full recompute's checkpoint hands the saved tensors back detached: the deferred
        # gradients must still reach the parameters
        y = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
    loss = y.float().square().sum()
    if not split:
        loss.backward()
        return [x.grad, w1.grad, w2.grad, norm.grad]
    with store.collect() as collected:
        loss.backward()
    assert w1.grad is None and w2.grad is None and norm.grad is not None  # I: not the linears'
    before = norm.grad.clone()
    assert collected.held_bytes() > 0
    collected.run()
    assert torch.equal(norm.grad, before)
    return [x.grad, w1.grad, w2.grad, norm.grad]


@pytest.mark.parametrize("dtype,autocast,recompute", [
    (torch.float64, False, False), (torch.float32, False, False), (torch.float32, True, False),
    (torch.float64, False, True), (torch.float32, True, True)])
def test_input_then_weight_is_the_whole_backward_bit_for_bit(dtype, autocast, recompute):
    whole, split = (_grads(dtype, s, autocast, recompute) for s in (False, True))
    for a, b in zip(whole, split):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_collections_do_not_nest():
    store = DeferredWeightGrads()
    with store.collect():
        with pytest.raises(RuntimeError, match="inside another"):
            with store.collect():
                pass
    assert not store.defer(lambda: None)  # closed: the caller runs it now
