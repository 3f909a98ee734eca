"""What a run does when things go wrong around it, from the command line: launch.py killed with
-9 (its ranks die with it; the run folder's lock goes with it; the relaunch resumes and logs each
step once), a second run into a folder in use, ctrl-C / SIGTERM (save, exit non-zero, one line;
a second one stops at once), corrupt checkpoints, and failed commands that leave no empty folder.

Every launch pays the torch import on two busy cores, so each test chains what it needs into as
few launches as it can, and every wait is on an event (a file, a line, an exit) with a generous
limit rather than on a timing window.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from test_launch import Run, finish, make_dataset, metrics, rank_pids, start

TWO_RANKS = ("cluster.procs_per_node=2",)
LONG = "train.train_samples=400000"  # never reached: the test stops it


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


def wait_until(condition, limit: float, what: str, run: Run | None = None) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if run is not None:
            assert run.poll() is None, run.finish()
        assert time.monotonic() < deadline, f"waited {limit} s for {what}"
        time.sleep(0.1)


def wait_for_steps(run_dir: Path, steps: int, run: Run, limit: float = 180) -> None:
    wait_until(lambda: len(metrics(run_dir)) >= steps, limit, f"{steps} steps", run)


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its (dead) parent's reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (FileNotFoundError, IndexError, ValueError):
            pass
    return found


def rank_of(pid: int) -> str | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((v[5:].decode() for v in environ if v.startswith(b"RANK=")), None)


def error_lines(err: str) -> list[str]:
    """stderr without Hydra's frame around an error (its header and its HYDRA_FULL_ERROR hint)."""
    return [line for line in err.splitlines() if line.strip() and not line.startswith(
        ("Error executing job with overrides", "Set the environment variable HYDRA_FULL_ERROR"))]


def test_kill_9_of_launch_py_takes_the_ranks_and_the_lock_and_a_relaunch_logs_each_step_once(
        dataset, tmp_path):
    run_dir = tmp_path / "run"
    # A checkpoint at step 2, then a long run from it that saves nothing more before it dies.
    code, _, err = finish(start(dataset, run_dir, *TWO_RANKS, "train.train_samples=8"))
    assert code == 0, err
    run = start(dataset, run_dir, *TWO_RANKS, LONG)
    pids = rank_pids(run)
    wait_for_steps(run_dir, 6, run)
    descendants = [pid for rank in children(run.proc.pid) for pid in (rank, *children(rank))]
    assert set(pids.values()) <= set(descendants)

    # The folder is in use: a second command into it stops at once, says who holds it.
    code, _, err = finish(start(dataset, run_dir, *TWO_RANKS, LONG), timeout=120)
    assert code != 0
    lines = error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"run folder {run_dir} is in use by pid {run.proc.pid} on host " in lines[0]
    assert "Fix: " in lines[0] and "hydra.run.dir=" in lines[0]
    assert (run_dir / "config.yaml").exists()  # the failed command left the run's files alone

    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(timeout=30)
    wait_until(lambda: not any(alive(pid) for pid in descendants), 15,
               f"the ranks {pids} (and helpers {descendants}) to die with launch.py")
    killed_at = metrics(run_dir)[-1]["step"]
    assert killed_at >= 6

    # Nobody deletes the lock: the kernel released it. Same folder, a run a little longer than
    # the killed one got: it resumes from step 2 and logs steps 3.. again, each once.
    code, out, err = finish(start(dataset, run_dir, *TWO_RANKS,
                                  f"train.train_samples={4 * (killed_at + 2)}"))
    assert code == 0, err
    assert f"{killed_at + 2} steps from step 2" in out
    assert f"metrics.jsonl: dropped {killed_at - 2} row(s) after step 2" in out
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, killed_at + 3))


def test_ctrl_c_saves_every_rank_and_exits_non_zero_in_one_line(dataset, tmp_path):
    run = start(dataset, tmp_path, *TWO_RANKS, LONG, own_group=True)
    rank_pids(run)
    wait_for_steps(tmp_path, 3, run)
    # A terminal's ctrl-C: SIGINT to the whole process group, launch.py and both ranks.
    os.killpg(run.proc.pid, signal.SIGINT)
    code, out, err = finish(run, timeout=120)
    assert code != 0
    lines = error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    step = metrics(tmp_path)[-1]["step"]
    assert lines[0] == (f"interrupted by SIGINT at step {step}: saved "
                        f"{tmp_path / 'checkpoints' / f'step_{step:08d}'}; run the same command "
                        f"again to resume")
    assert (tmp_path / "checkpoints" / f"step_{step:08d}" / "meta.json").exists()


def test_sigterm_to_launch_py_alone_is_forwarded_and_saves(dataset, tmp_path):
    run = start(dataset, tmp_path, *TWO_RANKS, LONG)
    rank_pids(run)
    wait_for_steps(tmp_path, 3, run)
    run.send_signal(signal.SIGTERM)  # the parent only: it forwards to the ranks
    code, _, err = finish(run, timeout=120)
    assert code != 0
    step = metrics(tmp_path)[-1]["step"]
    assert error_lines(err) == [f"interrupted by SIGTERM at step {step}: saved "
                                f"{tmp_path / 'checkpoints' / f'step_{step:08d}'}; run the same "
                                f"command again to resume"], err


def test_a_second_interrupt_stops_the_ranks_at_once_without_saving(dataset, tmp_path):
    run = start(dataset, tmp_path, *TWO_RANKS, LONG)
    pids = rank_pids(run)
    wait_for_steps(tmp_path, 3, run)
    os.kill(pids[1], signal.SIGSTOP)  # rank 0 now waits for rank 1: no step can finish
    run.send_signal(signal.SIGINT)
    time.sleep(1.5)  # the repeat reaches rank 0; rank 1 holds its SIGINT pending
    run.send_signal(signal.SIGINT)
    code, _, err = finish(run, timeout=30)  # far less than cluster.timeout_s=20 + a save
    assert code != 0
    assert error_lines(err) == ["interrupted by a second SIGINT: stopped at once, without "
                                "saving; run the same command again to resume from the last "
                                "checkpoint"], err
    assert not (tmp_path / "checkpoints").exists()
    wait_until(lambda: not any(alive(pid) for pid in pids.values()), 15, "the ranks to die")


def test_ctrl_c_under_torchrun_saves_though_the_agent_forwards_it_again(dataset, tmp_path):
    run = start(dataset, tmp_path, *TWO_RANKS, LONG, torchrun=2, own_group=True)
    wait_for_steps(tmp_path, 3, run)
    os.killpg(run.proc.pid, signal.SIGINT)  # the ranks get it from the terminal and the agent
    code, _, err = finish(run, timeout=120)
    assert code != 0
    step = metrics(tmp_path)[-1]["step"]
    assert (f"interrupted by SIGINT at step {step}: saved "
            f"{tmp_path / 'checkpoints' / f'step_{step:08d}'}; run the same command again to "
            f"resume") in err
    assert "second SIGINT" not in err
    assert (tmp_path / "checkpoints" / f"step_{step:08d}" / "meta.json").exists()


def test_a_second_interrupt_stops_a_torchrun_rank_at_once_by_itself(dataset, tmp_path):
    run = start(dataset, tmp_path, *TWO_RANKS, LONG, torchrun=2)
    wait_for_steps(tmp_path, 3, run)
    workers = {rank_of(pid): pid for pid in children(run.proc.pid)}  # torchrun's agent's
    rank0, rank1 = workers["0"], workers["1"]
    os.kill(rank1, signal.SIGSTOP)
    os.kill(rank0, signal.SIGINT)
    time.sleep(1.5)  # later than a duplicate of the same ctrl-C would come
    os.kill(rank0, signal.SIGINT)
    wait_until(lambda: not alive(rank0), 10, "rank 0 to exit at once")
    os.kill(rank1, signal.SIGKILL)
    code, _, err = finish(run, timeout=60)
    assert code != 0
    assert ("interrupted by a second SIGINT: stopped at once, without saving; run the same "
            "command again to resume from the last checkpoint") in err
    assert not (tmp_path / "checkpoints").exists()


def test_one_process_interrupt_is_one_line(dataset, tmp_path):
    run = start(dataset, tmp_path, LONG)
    wait_for_steps(tmp_path, 3, run)
    run.send_signal(signal.SIGINT)
    code, _, err = finish(run, timeout=120)
    assert code != 0
    step = metrics(tmp_path)[-1]["step"]
    assert error_lines(err) == [f"interrupted by SIGINT at step {step}: saved "
                                f"{tmp_path / 'checkpoints' / f'step_{step:08d}'}; run the same "
                                f"command again to resume"], err


def test_a_corrupt_latest_checkpoint_is_skipped_and_a_corrupt_one_to_load_is_named(dataset,
                                                                                   tmp_path):
    run_dir, every_2 = tmp_path / "run", "checkpoint.save_interval=2"
    code, _, err = finish(start(dataset, run_dir, "train.train_samples=16", every_2))  # 8 steps
    assert code == 0, err
    ckpts = run_dir / "checkpoints"
    data = max((ckpts / "step_00000008").glob("*.distcp"), key=lambda p: p.stat().st_size)
    cut = data.stat().st_size // 2
    os.truncate(data, cut)  # a copy cut short, a disk that filled up
    (ckpts / "step_00000006" / ".metadata").write_bytes(b"\x80\x04 not a pickle")
    (ckpts / "step_00000004" / "meta.json").unlink()  # a save that never finished

    # Loading a corrupt one by name: one line naming it, before any rank starts; and a bad
    # value: neither failed command touches the earlier run's files.
    bad_load = start(dataset, run_dir, "train.train_samples=24",
                     f"checkpoint.load={ckpts / 'step_00000006'}")
    bad_value = start(dataset, run_dir, "train.train_samples=24", "optim.beta1=1.5")
    code, out, err = finish(bad_load)
    assert code != 0 and "started" not in out and "step " not in out
    (line,) = error_lines(err)
    assert line.startswith(f"checkpoint.load={ckpts / 'step_00000006'}: its .metadata is "
                           f"unreadable (") and "Fix: point checkpoint.load at" in line, err
    code, _, err = finish(bad_value)
    assert code != 0 and "optim.beta1=1.5" in err
    assert len(metrics(run_dir)) == 8 and (run_dir / "config.yaml").exists()

    code, out, err = finish(start(dataset, run_dir, "train.train_samples=24", every_2))
    assert code == 0, err
    skipped = [line for line in out.splitlines() if line.startswith("warning: skipped")]
    assert skipped == [
        f"warning: skipped checkpoint {ckpts / 'step_00000008'}: its data file {data.name} is "
        f"truncated ({cut} of at least " + skipped[0].split("at least ")[1],
        f"warning: skipped checkpoint {ckpts / 'step_00000006'}: its .metadata is unreadable ("
        + skipped[1].split("unreadable (")[1],
        f"warning: skipped checkpoint {ckpts / 'step_00000004'}: its meta.json is missing (the "
        f"save did not finish)"], out
    assert "12 steps from step 2" in out
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, 13))


def test_a_command_that_fails_before_training_leaves_no_folder(dataset, tmp_path):
    (tmp_path / "empty").mkdir()
    cases = {"beta1": "optim.beta1=1.5", "samples": "train.train_samples=7",  # at compose time
             "load": f"checkpoint.load={tmp_path / 'empty'}"}  # after the folder's lock
    runs = {name: start(dataset, tmp_path / name, override) for name, override in cases.items()}
    for name, run in runs.items():
        code, out, err = finish(run)
        assert code != 0 and "Traceback" not in err, err
        assert len(error_lines(err)) == 1, err
        assert not (tmp_path / name).exists(), sorted(p.name for p in (tmp_path / name).iterdir())
