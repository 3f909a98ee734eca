"""What a run reports, from the command line: the console tee into launch.log (the ranks' output
included, stdout and stderr kept apart), curves.png at the end of every run (a failed one too),
`python -m trainer.plot` over real runs, and `launch.py --help`. The two training runs start side
by side (each pays the torch import) and are shared by the tests that read them."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from trainer.data.dataset import prepare
from trainer.units import MiB, size

from config_helpers import CONF_DIR, ROOT, finish

SMALL_RUN = ("train.micro_batch_size=4", "train.seq_length=32", "logger.log_interval=1",
             "train.eval_interval=2", "train.eval_samples=8", "schedule.lr_warmup_samples=8",
             "schedule.lr_warmup_fraction=null", "train.train_samples=32")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def start(*args: str, module: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK")}
    command = ["-m", module] if module else [str(ROOT / "launch.py")]
    return subprocess.Popen([sys.executable, *command, *args], text=True, cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def vm_hwm(pid: int) -> int | None:
    """The kernel's high-water mark of that process's resident set, in bytes (None: gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(re.search(r"^VmHWM:\s+(\d+) kB$", status, re.M)[1]) * 1024


def finish_watching(process: subprocess.Popen, timeout: float = 180) -> tuple[
        subprocess.CompletedProcess, list[tuple[str, int | None]]]:
    """finish(), reading stdout as it comes: each line with rank 0's VmHWM read here from
    /proc as the line arrived (rank 0's pid from launch.py's "started rank 0 (pid N)")."""
    lines: list[tuple[str, int | None]] = []
    stderr: list[str] = []

    def read_stdout() -> None:
        rank0 = None
        for line in process.stdout:
            rank0 = rank0 or (int(m[1]) if (m := re.search(r"rank 0 \(pid (\d+)\)", line))
                              else None)
            lines.append((line, vm_hwm(rank0) if rank0 else None))

    readers = [threading.Thread(target=read_stdout),
               threading.Thread(target=lambda: stderr.append(process.stderr.read()))]
    for reader in readers:
        reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    finally:
        for reader in readers:
            reader.join()
    out = subprocess.CompletedProcess(process.args, process.returncode,
                                      "".join(line for line, _ in lines), stderr[0])
    return out, lines


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """ok: two ranks started by launch.py, 4 steps, logged to TensorBoard too; its stdout's
    lines with rank 0's VmHWM as each arrived are "ok_lines". diverged: one process whose lr of
    1e8 from the first step (no warmup) makes the gradient norm nan at step 2, so the run fails
    after it has logged a step."""
    base = tmp_path_factory.mktemp("report")
    (base / "text").mkdir()
    for doc in range(4):
        (base / "text" / f"doc{doc}.txt").write_text(
            " ".join(f"word{(doc * 7 + i) % 40}" for i in range(800)))
    data = prepare(base / "text", base / "dataset", valid_fraction=0.2)
    overrides = {"ok": ("cluster.procs_per_node=2", "logger=tensorboard"),
                 "diverged": ("schedule.lr=1e8", "schedule.min_lr=0",
                              "schedule.lr_warmup_samples=0")}
    started = {name: start(f"data.path={data}", f"hydra.run.dir={base / name}", *SMALL_RUN,
                           *extra) for name, extra in overrides.items()}
    ok, ok_lines = finish_watching(started["ok"])
    return {"ok": (base / "ok", ok), "ok_lines": ok_lines,
            "diverged": (base / "diverged", finish(started["diverged"]))}


# ------------------------------------------------------------------------------ launch.log

def test_launch_log_is_the_console_of_every_rank(runs):
    run_dir, out = runs["ok"]
    assert out.returncode == 0, out.stderr
    log = (run_dir / "launch.log").read_text()
    # Nothing went to stderr, so the log is exactly what the terminal showed, in order.
    assert log.splitlines() == out.stdout.splitlines(), (log, out.stdout)
    assert log.splitlines()[0] == f"run folder: {run_dir}"
    assert "started rank 0 (pid " in log  # launch.py's own process
    # rank 0, a spawned process, prints the start line, the steps and the evaluations
    assert re.search(r"^2 rank\(s\), global batch 8 samples, 4 steps from step 0 \(samples 0 "
                     r"to 32\); cosine: lr 0\.001, warmup 8 samples, decay to 0\.0001 at 32 "
                     r"samples; weight decay 0\.1$", log, re.M), log
    assert len(re.findall(r"^step +\d/4 \|", log, re.M)) == 4
    assert len(re.findall(r"^eval at step \d", log, re.M)) == 2


# model=tiny at train.seq_length=32: a block's linears 4 x 64 x 64 (q, k, v, o) + 3 x 64 x 176
# (gate, up, down), two blocks, the head 64 x 256; causal attention 2 x 32 x 64 a block forward.
TINY_FLOPS_PER_TOKEN = 6 * (2 * (4 * 64 * 64 + 3 * 64 * 176) + 64 * 256) + 3 * 2 * (2 * 32 * 64)
LOCAL_PEAK_FP32 = 0.11e12  # conf/cluster/local.yaml


def test_steps_log_model_flops_mfu_peak_memory_and_data_wait_to_tensorboard_too(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, out = runs["ok"]
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2, 3, 4]
    for row in steps:
        tflops = row["tokens_per_s"] * TINY_FLOPS_PER_TOKEN / 2 / 1e12  # two ranks
        assert abs(row["tflops_per_rank"] / tflops - 1) < 1e-9, row
        assert abs(row["mfu"] / (tflops * 1e12 / LOCAL_PEAK_FP32) - 1) < 1e-9, row
        assert 0 < row["data_wait_share"] < 1, row
    line = next(line for line in out.stdout.splitlines() if line.startswith("step      4/4"))
    assert f"(MFU {steps[-1]['mfu']:.1%})" in line, line
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for key in ("loss", "grad_norm", "tflops_per_rank", "mfu", "data_wait_share", "eval_loss"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        expected = {row["step"]: row[key] for row in rows if key in row}
        assert logged.keys() == expected.keys(), key
        assert all(abs(logged[s] - v) <= 1e-6 * abs(v) for s, v in expected.items()), key
    # The end of the run holds like with like: the state rank 0 holds, counted tensor by tensor,
    # is the plan's; the resident set is printed beside the plan's peak, not as a ratio of it.
    planned = json.loads((run_dir / "layout.json").read_text())["memory"]["per_stage"][0]
    state = size(planned["total_bytes"])
    assert (f"\n  stage 0: state planned {state}, held {state} (1.00x); peak planned "
            f"{size(planned['peak_bytes'])}, resident set grew ") in out.stdout, out.stdout


def test_the_logged_peak_memory_is_rank_0s_own_high_water_mark(runs):
    """metrics.jsonl's peak_memory_bytes against rank 0's VmHWM that this test read from
    /proc/<pid>/status as that step's line arrived: the kernel's figure for the same process,
    read apart from the trainer. At most that (the figure is read before its line is printed,
    and the mark only rises) and within 16 MiB of it (rank 0 grows by under 2 MiB a step
    here); a figure in KiB, or another process's (launch.py's own peak is ~50 MiB, a rank's
    ~330 MiB), is far outside."""
    run_dir, out = runs["ok"]
    assert out.returncode == 0, out.stderr
    seen = {int(m[1]): hwm for line, hwm in runs["ok_lines"]
            if (m := re.match(r"step +(\d+)/4 \|", line))}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {row["step"]: row["peak_memory_bytes"] for row in rows if "loss" in row}
    assert logged.keys() == seen.keys() == {1, 2, 3, 4}, (logged, seen)
    for step, value in logged.items():
        assert seen[step] - 16 * MiB <= value <= seen[step], (step, value, seen[step])


def test_a_failed_run_logs_why_it_stopped(runs):
    run_dir, out = runs["diverged"]
    assert out.returncode == 1
    assert "Training diverged at step 2" in out.stderr
    lines = (run_dir / "launch.log").read_text().splitlines()
    assert lines[0] == f"run folder: {run_dir}"
    assert any(line.startswith("step      1/") for line in lines)
    # Hydra prints the error after the tee has ended: console_log adds it to the log itself.
    assert "Training diverged at step 2" in lines[-1]


def test_a_dry_run_leaves_no_launch_log(tmp_path):
    """Hydra's own file handler is off (conf/config.yaml): it would leave an empty launch.log in
    every folder, and write a second copy of any log record into the tee's file."""
    out = finish(start("dry_run=true", f"hydra.run.dir={tmp_path}"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "layout.json").exists() and not (tmp_path / "launch.log").exists()


TEE_SCRIPT = textwrap.dedent("""
    import logging, multiprocessing, os, sys
    from pathlib import Path
    from trainer.report.console import console_log

    def child():
        print("child out", flush=True)
        print("child err", file=sys.stderr, flush=True)

    if __name__ == "__main__":
        run_dir = Path(sys.argv[1])
        with console_log(run_dir / "silent", writer=False):
            print("not logged", flush=True)
        try:
            with console_log(run_dir, writer=True):
                print("parent out", flush=True)
                os.write(2, b"parent err at fd level\\n")
                logging.getLogger("x").warning("a log record")
                proc = multiprocessing.get_context("spawn").Process(target=child)
                proc.start()
                proc.join()
                print("last words")  # still in Python's buffer: console_log must flush it
                raise RuntimeError("boom")
        except RuntimeError:
            pass
        print("after the block", flush=True)
        print("after the block err", file=sys.stderr, flush=True)
""")


def test_the_tee_keeps_stdout_and_stderr_apart_and_restores_them(tmp_path):
    script = tmp_path / "tee.py"
    script.write_text(TEE_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    stdout, stderr = out.stdout.splitlines(), out.stderr.splitlines()
    assert stdout == ["not logged", f"run folder: {tmp_path / 'run'}", "parent out",
                      "child out", "last words", "after the block"], out.stdout
    assert "parent err at fd level" in stderr and "child err" in stderr
    assert "a log record" in out.stderr and "after the block err" in stderr
    log = (tmp_path / "run" / "launch.log").read_text().splitlines()
    assert set(log) == {f"run folder: {tmp_path / 'run'}", "parent out", "child out",
                        "last words", "parent err at fd level", "child err",
                        "a log record", "RuntimeError: boom"}, log
    assert log[-1] == "RuntimeError: boom"
    assert not (tmp_path / "run" / "silent").exists()  # writer=False does nothing


# ------------------------------------------------------------------------------ curves

def test_every_run_writes_curves_png_a_failed_one_too(runs):
    for name in ("ok", "diverged"):
        run_dir, out = runs[name]
        png = run_dir / "curves.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, (name, out.stderr)
        assert "curves.png not written" not in out.stderr


def test_plot_cli_overlays_two_runs_in_one_png(runs, tmp_path):
    (ok, _), (diverged, _) = runs["ok"], runs["diverged"]
    out = finish(start(str(ok), str(diverged), "-o", str(tmp_path / "both.png"),
                       module="trainer.plot"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"wrote {tmp_path / 'both.png'} (2 runs)"
    assert (tmp_path / "both.png").read_bytes()[:8] == PNG_MAGIC
    assert list(tmp_path.iterdir()) == [tmp_path / "both.png"]


def test_plot_cli_names_a_folder_without_metrics_in_one_line(tmp_path):
    out = finish(start(str(tmp_path), module="trainer.plot"))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"python -m trainer.plot: {tmp_path} has no metrics.jsonl: "
                                  "give a run folder (outputs/<run_name>/<overrides>) or a sweep "
                                  "folder (multirun/<run_name>)"), out.stderr


# ------------------------------------------------------------------------------ --help

def test_help_describes_every_group_and_lists_its_options():
    out = finish(start("--help"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for usage in ("dry_run=true", "python launch.py -m ", "--cfg job --resolve", "trainer.plot"):
        assert usage in text, usage
    groups_section = text.split("== Config groups ==")[1].split("== Options")[0]
    options_section = text.split("== Options")[1]
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
    assert len(groups) == 13, groups  # model ... debug; a new group needs a line in the help
    for group, folder in [(g, CONF_DIR / g) for g in groups] + [
            ("hydra/launcher", CONF_DIR / "hydra" / "launcher")]:
        described = re.search(rf"^  {re.escape(group)} +(\S.{{20,}})$", groups_section, re.M)
        assert described, f"{group} has no one-line description in --help"
        listed = re.search(rf"^{re.escape(group)}: (.+)$", options_section, re.M)
        assert listed, f"{group}'s options are not listed"
        options = set(listed.group(1).split(", "))
        assert {p.stem for p in folder.glob("*.yaml")} <= options, (group, options)
    assert "== Config ==" not in text  # not Hydra's value dump
    # Our text fits a terminal; Hydra writes each group's options on one line of its own.
    assert max(map(len, text.split("== Options")[0].splitlines())) <= 100
