"""Tests of run_ranks: results, subgroups, and how failures, hangs and crashes are reported."""
from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankFailure, RankTimeout, run_ranks


def _all_reduce_rank(rank, scale):
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return {"rank": rank, "world": dist.get_world_size(), "sum": t.item()}


def test_all_reduce_results_in_rank_order():
    results = run_ranks(4, _all_reduce_rank, 2.0)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["world"] == 4 for r in results)
    assert [r["sum"] for r in results] == [12.0] * 4  # 2 * (0 + 1 + 2 + 3)


def _kwargs_and_single_rank(rank, *, value):
    dist.barrier()
    return (rank, dist.get_world_size(), value)


def test_world_size_one_and_kwargs():
    assert run_ranks(1, _kwargs_and_single_rank, value="x") == [(0, 1, "x")]


def _subgroup(rank):
    group = dist.new_group([0, 2])  # collective over all ranks, even those outside the group
    if rank not in (0, 2):
        return None
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=group)
    return (dist.get_rank(group), dist.get_world_size(group), t.item())


def test_subgroup():
    assert run_ranks(4, _subgroup) == [(0, 2, 4.0), None, (1, 2, 4.0), None]


def _tensors(rank):
    g = torch.Generator().manual_seed(rank)
    return {"x": torch.randn(3, 5, generator=g),
            "parts": [torch.arange(rank + 1), torch.ones(2, dtype=torch.bfloat16)]}


def test_tensors_come_back_equal():
    results = run_ranks(2, _tensors)
    for rank, res in enumerate(results):
        expected = torch.randn(3, 5, generator=torch.Generator().manual_seed(rank))
        assert torch.equal(res["x"], expected)
        assert torch.equal(res["parts"][0], torch.arange(rank + 1))
        assert res["parts"][1].dtype == torch.bfloat16
        assert torch.equal(res["parts"][1], torch.ones(2, dtype=torch.bfloat16))


def _raise_on_1_others_in_world_collective(rank):
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.all_reduce(torch.ones(1))  # waits for rank 1 forever (until pg_timeout)


def test_raising_rank_is_reported_quickly():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(4, _raise_on_1_others_in_world_collective, timeout=60)
    assert time.monotonic() - start < 45  # not the 60 s deadline: reported on failure
    e = info.value
    assert e.ranks[0] == 1
    assert "rank 1 " in str(e) and "ValueError: boom from rank one" in str(e)
    assert "boom from rank one" in e.errors[1] and e.exitcodes[1] == 1
    # Each other rank was killed, or gloo noticed the closed connection first and it failed
    # right after rank 1; then it is reported too, after rank 1. gloo words a dead peer as
    # "closed" (an orderly end of stream) or "reset" (a read that met the reset: 1 run in ~12).
    for r in (0, 2, 3):
        if e.exitcodes[r] != -signal.SIGKILL:
            assert r in e.ranks[1:]
            assert re.search(r"Connection (closed|reset) by peer", e.errors[r]), e.errors[r]


def _raise_on_1_others_blocked(rank):
    group = dist.new_group([0, 2, 3])  # without rank 1: its death cannot disturb this group
    if rank == 1:
        time.sleep(0.3)  # let the others block first
        raise ValueError("boom from rank one")
    if rank == 3:
        time.sleep(60)
    dist.all_reduce(torch.ones(1), group=group)  # ranks 0 and 2 block here, waiting for 3


def test_blocked_ranks_are_killed_on_failure():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(4, _raise_on_1_others_blocked, timeout=60)
    assert time.monotonic() - start < 45  # not the 60 s deadline: reported on failure
    e = info.value
    assert e.ranks == [1] and "boom from rank one" in str(e)
    assert {r: e.exitcodes[r] for r in (0, 2, 3)} == {r: -signal.SIGKILL for r in (0, 2, 3)}
    assert "killed the still-running ranks 0, 2, 3" in str(e)


def _hang_on_2(rank):
    if rank == 2:
        time.sleep(1000)
    return rank


def test_hung_rank_times_out():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(4, _hang_on_2, timeout=3)
    elapsed = time.monotonic() - start
    assert 3 <= elapsed < 30  # never before the deadline; the bound only says it ended (busy cores)
    e = info.value
    assert e.ranks == [2]
    assert "rank 2 of 4 had not finished" in str(e)
    assert "_hang_on_2" in e.stacks[2]  # the hung rank's stack, dumped before the kill


def _hang_in_collective(rank):
    if rank == 1:
        time.sleep(1000)
    dist.all_reduce(torch.ones(1))


def test_hung_collective_surfaces_as_error_in_rank():
    with pytest.raises(RankFailure) as info:
        run_ranks(3, _hang_in_collective, timeout=30, pg_timeout=1)
    e = info.value
    assert 1 not in e.ranks and set(e.ranks) <= {0, 2}
    assert e.exitcodes[1] == -signal.SIGKILL


def _exit_3_on_1(rank):
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _sigkill_self_on_0(rank):
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


@pytest.mark.parametrize("fn, rank, code",
                         [(_exit_3_on_1, 1, 3), (_sigkill_self_on_0, 0, -signal.SIGKILL)])
def test_rank_dying_without_traceback_reports_exit_code(fn, rank, code):
    with pytest.raises(RankFailure) as info:
        run_ranks(3, fn, timeout=30)
    e = info.value
    assert e.ranks[0] == rank and e.exitcodes[rank] == code
    assert f"rank {rank} exited without a traceback" in str(e)
    assert f"exit code {code}" in str(e)


def _exit_0_without_result(rank):
    os._exit(0)


def test_rank_exiting_zero_without_result_is_a_failure():
    with pytest.raises(RankFailure, match="without writing a result"):
        run_ranks(2, _exit_0_without_result, timeout=30)


def _unpicklable(rank):
    return lambda: rank


def test_unpicklable_result_is_a_failure():
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _unpicklable, timeout=30)
    assert set(info.value.ranks) <= {0, 1} and "pickle" in str(info.value).lower()


def test_temp_files_are_cleaned_up(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    run_ranks(2, _all_reduce_rank, 1.0)
    with pytest.raises(RankFailure):
        run_ranks(2, _exit_3_on_1, timeout=30)
    assert list(tmp_path.iterdir()) == []


def _record_pid_and_sleep(rank, directory):
    (directory / f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(60)


def _run_and_hang(directory):
    tempfile.tempdir = str(directory)  # run_ranks cannot remove its files when SIGKILLed
    try:
        run_ranks(2, _record_pid_and_sleep, directory, timeout=60)
    finally:
        os._exit(0)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_the_test_process(tmp_path):
    test_process = multiprocessing.get_context("fork").Process(target=_run_and_hang,
                                                               args=(tmp_path,))
    test_process.start()
    deadline = time.monotonic() + 10
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    os.kill(test_process.pid, signal.SIGKILL)  # no chance to kill its ranks itself
    test_process.join()
    deadline = time.monotonic() + 5
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(map(_alive, pids))
