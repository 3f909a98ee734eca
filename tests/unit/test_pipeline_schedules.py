"""The pipeline schedules against orders and figures worked out by hand (Megatron's rules for
1F1B and the interleaved schedule), their invariants over a grid, and the simulator's deadlock
report."""
from __future__ import annotations

import itertools

import pytest

from parallel.layout.pipeline_schedules import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    SPLIT_BACKWARD,
    Action,
    ideal_bubble_fraction,
    in_flight,
    message_bytes,
    message_counts,
    model_chunk,
    stage_actions,
)
from parallel.layout.pipeline_simulation import simulate, simulate_orders


def order(text: str) -> list[Action]:
    """'F0 B1.1' -> [Action(F, 0, 0), Action(B, 1, 1)]: kind, micro-batch, optional .chunk."""
    actions = []
    for token in text.split():
        microbatch, _, chunk = token[1:].partition(".")
        actions.append(Action(token[0], int(microbatch), int(chunk or 0)))
    return actions


def valid_cases():
    """Every (schedule, pp, m, v) of the grid that the schedule accepts."""
    for schedule, pp, m, v in itertools.product(WHOLE_BACKWARD, range(1, 9), range(1, 13),
                                                range(1, 5)):
        if schedule == "interleaved_1f1b" and (v < 2 or m % pp):
            continue
        if schedule != "interleaved_1f1b" and v != 1:
            continue
        yield schedule, pp, m, v


WHOLE_BACKWARD = [s for s in SCHEDULES if s not in SPLIT_BACKWARD]
VALID_CASES = list(valid_cases())


# ------------------------------------------------------------------------- exact action lists


def test_model_chunk_places_chunks_round_robin_over_stages():
    assert [model_chunk(stage, 0, 4) for stage in range(4)] == [0, 1, 2, 3]
    assert [model_chunk(stage, 1, 4) for stage in range(4)] == [4, 5, 6, 7]


def test_1f1b_pp2_m3():
    # Stage 0 warms up with pp - 0 - 1 = 1 forward; the last stage alternates from the start.
    assert stage_actions("1f1b", 0, 2, 3) == order("F0 F1 B0 F2 B1 B2")
    assert stage_actions("1f1b", 1, 2, 3) == order("F0 B0 F1 B1 F2 B2")


def test_1f1b_warmup_is_capped_by_microbatches():
    # pp=4 stage 0 would warm up 3, but there are only 2 micro-batches.
    assert stage_actions("1f1b", 0, 4, 2) == order("F0 F1 B0 B1")
    assert stage_actions("1f1b", 1, 4, 3) == order("F0 F1 F2 B0 B1 B2")


def test_gpipe_is_all_forwards_then_all_backwards():
    for stage in range(3):
        assert stage_actions("gpipe", stage, 3, 2) == order("F0 F1 B0 B1")


def test_interleaved_pp2_v2_m2():
    # Forwards k=0..3: chunk (k // 2) % 2 = 0 0 1 1, micro-batch k % 2 = 0 1 0 1; backwards run
    # chunk 1 - (k // 2) % 2 = 1 1 0 0. Stage 0 warmup min(2 + 2, 4) = 4: all forwards first.
    assert stage_actions("interleaved_1f1b", 0, 2, 2, 2) == order(
        "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0")
    # Stage 1 warmup min(0 + 2, 4) = 2, then two F+B pairs, then two backwards.
    assert stage_actions("interleaved_1f1b", 1, 2, 2, 2) == order(
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0")


def test_interleaved_pp2_v2_m4_stage0_has_a_steady_state():
    # total 8, warmup 4. Forward k=4..7: micro-batch (k // 4) * 2 + k % 2 = 2 3 2 3, chunk
    # (k // 2) % 2 = 0 0 1 1; backward k=0..7: micro-batch 0 1 0 1 2 3 2 3, chunk 1 1 0 0 1 1 0 0.
    assert stage_actions("interleaved_1f1b", 0, 2, 4, 2) == order(
        "F0.0 F1.0 F0.1 F1.1 "
        "F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 "
        "B2.1 B3.1 B2.0 B3.0")


# ------------------------------------------------------------------------ invariants, grid


# The grid tests loop inside one test each (a parametrized grid of ~800 cases costs more in
# pytest's bookkeeping than in the checks); the assert message names the failing case.


def test_every_action_once_and_forward_before_backward():
    for schedule, pp, m, v in VALID_CASES:
        expected = {(kind, mb, chunk) for kind in (FORWARD, BACKWARD) for mb in range(m)
                    for chunk in range(v)}
        for stage in range(pp):
            case = (schedule, stage, pp, m, v)
            keys = [(a.kind, a.microbatch, a.chunk) for a in stage_actions(*case)]
            assert len(keys) == len(expected) and set(keys) == expected, case
            position = {key: index for index, key in enumerate(keys)}
            for mb, chunk in itertools.product(range(m), range(v)):
                assert position[(FORWARD, mb, chunk)] < position[(BACKWARD, mb, chunk)], case


@pytest.mark.parametrize("forward_time,backward_time", [(1.0, 1.0), (1.0, 2.0)])
def test_simulated_bubble_is_the_ideal_one(forward_time, backward_time):
    # Uniform times, no hop: fill and drain cost pp - 1 slots of 1/v stage, whatever F and B
    # cost. simulate() raising would mean a deadlocking schedule.
    for schedule, pp, m, v in VALID_CASES:
        case = (schedule, pp, m, v)
        result = simulate(schedule, pp, m, v, forward_time, backward_time)
        assert abs(result.bubble_fraction - ideal_bubble_fraction(pp, m, v)) < 1e-12, case
        assert result.busy == pytest.approx([m * (forward_time + backward_time)] * pp), case


def test_in_flight_of_1f1b_and_gpipe():
    for pp, m in itertools.product(range(1, 9), range(1, 13)):
        one_f_one_b = [in_flight(stage_actions("1f1b", s, pp, m)) for s in range(pp)]
        assert one_f_one_b == [min(pp - s, m) for s in range(pp)], (pp, m)
        assert [in_flight(stage_actions("gpipe", s, pp, m)) for s in range(pp)] == [m] * pp


def test_in_flight_of_interleaved_first_stage():
    for schedule, pp, m, v in VALID_CASES:
        if schedule == "interleaved_1f1b":
            expected = min((pp - 1) * 2 + (v - 1) * pp + 1, m * v)
            assert in_flight(stage_actions(schedule, 0, pp, m, v)) == expected, (pp, m, v)


def test_simulation_reports_in_flight_per_stage():
    assert simulate("1f1b", 4, 8).in_flight == (4, 3, 2, 1)


def test_in_flight_counts_chunks_separately():
    assert in_flight(order("F0.0 F0.1 B0.1 F1.0 B0.0 B1.0")) == 2
    assert in_flight([]) == 0


# ---------------------------------------------------------------------- simulator by hand


def test_simulate_1f1b_pp2_m3_by_hand():
    # (m + pp - 1) slots of F + B = 4 * 3; each stage computes 3 * 3.
    result = simulate("1f1b", 2, 3)
    assert result.makespan == 12.0 and result.busy == (9.0, 9.0)
    assert result.bubble_fraction == pytest.approx(0.25, abs=1e-12)
    assert ideal_bubble_fraction(2, 3) == 0.25


def test_simulate_adds_hop_time_between_stages():
    # Stage 0 F 0-1, hop, stage 1 F 1.5-2.5 and B 2.5-4.5, hop, stage 0 B 5-7.
    result = simulate("1f1b", 2, 1, hop_time=0.5)
    assert result.makespan == 7.0 and result.busy == (3.0, 3.0)


def test_simulate_interleaved_chunks_take_a_share_of_the_stage_time():
    # pp=1, v=2, m=1: F chunk 0, F chunk 1, B chunk 1, B chunk 0, each half of F or B.
    result = simulate("interleaved_1f1b", 1, 1, 2, forward_time=1.0, backward_time=2.0)
    assert result.makespan == 3.0 and result.bubble_fraction == 0.0


def test_ideal_bubble_fraction_interleaved():
    assert ideal_bubble_fraction(4, 8, 2) == 3 / 19


# ------------------------------------------------------------------------ errors and deadlock


def test_deadlocking_orders_raise_naming_the_stuck_actions():
    # Stage 0 runs B0 before F1, but stage 1 wants F1 before it sends B0 back.
    orders = [order("F0 B0 F1 B1"), order("F0 F1 B0 B1")]
    with pytest.raises(RuntimeError, match="deadlock") as error:
        simulate_orders(orders, pp=2)
    assert "stage 0: B(mb=0, chunk=0)" in str(error.value)
    assert "stage 1: F(mb=1, chunk=0)" in str(error.value)


def test_last_stage_backward_before_its_forward_deadlocks():
    with pytest.raises(RuntimeError, match="stage 1: B"):
        simulate_orders([order("F0 B0"), order("B0 F0")], pp=2)


def test_simulate_orders_needs_one_order_per_stage():
    with pytest.raises(ValueError, match="one per stage"):
        simulate_orders([order("F0 B0")], pp=2)


@pytest.mark.parametrize("args,message", [
    (("zb", 0, 2, 4), "unknown pipeline schedule 'zb'.*1f1b"),
    (("1f1b", 0, 2, 4, 2), "virtual must be 1"),
    (("gpipe", 0, 2, 4, 2), "virtual must be 1"),
    (("interleaved_1f1b", 0, 2, 4, 1), "virtual >= 2"),
    (("interleaved_1f1b", 0, 4, 6, 2), "multiple of pp"),
    (("1f1b", 2, 2, 4), "stage=2 is out of range"),
    (("1f1b", -1, 2, 4), "stage=-1 is out of range"),
    (("gpipe", 0, 2, 0), "microbatches=0"),
])
def test_invalid_arguments_raise_naming_the_problem(args, message):
    with pytest.raises(ValueError, match=message):
        stage_actions(*args)


@pytest.mark.parametrize("args,message", [
    (("zb", 2, 4), "unknown pipeline schedule"),
    (("gpipe", 2, 4, 2), "virtual must be 1"),
    (("interleaved_1f1b", 4, 6, 2), "multiple of pp"),
    (("1f1b", 0, 4), "pp=0 must be >= 1"),
])
def test_simulate_validates_like_stage_actions(args, message):
    with pytest.raises(ValueError, match=message):
        simulate(*args)


def test_ideal_bubble_fraction_rejects_non_positive_sizes():
    with pytest.raises(ValueError, match="must all be >= 1"):
        ideal_bubble_fraction(2, 0)


def test_messages_a_stage_holds_at_once():
    """1F1B over two stages, four micro-batches (F0 F1 B0 F2 B1 F3 B2 B3 on the first stage).
    The first stage receives gradients only: in its cool-down a backward holds its own and the
    next backward's, posted one action ahead. The last receives hidden states only: a backward
    holds the next forward's message (hidden states and positions), a forward its positions.
    One stage receives nothing."""
    first = message_counts(stage_actions("1f1b", 0, 2, 4), 0, 2)
    last = message_counts(stage_actions("1f1b", 1, 2, 4), 1, 2)
    assert first == {(2, 0)} and last == {(1, 1)}
    assert message_counts(stage_actions("1f1b", 0, 1, 4), 0, 1) == {(0, 0)}
    assert message_bytes({(1, 1)}, 1000, 10) == 1010
    assert message_bytes({(2, 0), (1, 3)}, 1000, 10) == 2000
