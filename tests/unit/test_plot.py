"""trainer/report/plot.py and `python -m trainer.plot` on hand-written metrics.jsonl files: eval
rows placed by consumed samples, resumed runs, labels from .hydra/overrides.yaml, write_curves
never raising, and the command line's one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from trainer.report.plot import legend_labels, read_curves, write_curves

from config_helpers import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GBS = 8


def step_row(step: int, loss: float | None = None) -> dict:
    return {"step": step, "consumed_samples": step * GBS, "loss": loss or 5.0 - 0.1 * step,
            "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0}


def eval_row(step: int, loss: float) -> dict:
    return {"step": step, "eval_loss": loss, "eval_samples": 16}


def make_run(folder: Path, rows: list[dict], overrides: list[str] | None = None,
             tail: str = "") -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    if overrides is not None:
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    return folder


def plot_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.plot", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)


def test_eval_rows_are_placed_by_the_train_row_of_their_step(tmp_path):
    # log_interval 2, eval every 3 steps: step 3 has no train row, step 6 has one
    rows = [step_row(2), step_row(4), eval_row(3, 4.5), step_row(6), eval_row(6, 4.2)]
    curves = read_curves(make_run(tmp_path / "run", rows))
    assert [r["consumed_samples"] for r in curves.train] == [16, 32, 48]
    assert curves.evals == [(3 * GBS, 4.5), (6 * GBS, 4.2)]


def test_a_resumed_run_keeps_the_later_row_of_a_step_and_skips_a_cut_line(tmp_path):
    rows = [step_row(1), step_row(2), step_row(3, loss=9.0), step_row(2, loss=7.0), step_row(3)]
    curves = read_curves(make_run(tmp_path / "run", rows, tail='{"step": 4, "consu'))
    assert [(r["step"], r["loss"]) for r in curves.train] == [(1, 4.9), (2, 7.0), (3, 4.7)]


def test_labels_show_the_overrides_that_differ_and_share_the_rest(tmp_path):
    a = make_run(tmp_path / "a", [step_row(1)], ["model=tiny", "schedule.lr=1e-3"])
    b = make_run(tmp_path / "b", [step_row(1)], ["model=tiny", "schedule.lr=3e-3"])
    c = make_run(tmp_path / "c", [step_row(1)])  # no .hydra: the folder name
    assert legend_labels([a, b]) == (["schedule.lr=1e-3", "schedule.lr=3e-3"], ["model=tiny"])
    assert legend_labels([a, c]) == (["model=tiny schedule.lr=1e-3", "c"], [])
    assert legend_labels([a]) == (["a"], ["model=tiny", "schedule.lr=1e-3"])
    twins = [make_run(tmp_path / parent / "default", [step_row(1)], ["model=tiny"])
             for parent in ("x", "y")]
    assert legend_labels(twins) == (["x/default", "y/default"], ["model=tiny"])


def test_write_curves_writes_a_png_into_the_run_folder(tmp_path):
    run = make_run(tmp_path / "run", [step_row(1), step_row(2), eval_row(2, 4.0)], ["x=1"])
    assert write_curves(run) == run / "curves.png"
    assert (run / "curves.png").read_bytes()[:8] == PNG_MAGIC


def png_height(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[20:24], "big")  # the IHDR chunk's height


def test_runs_that_logged_their_speed_get_the_tflops_and_memory_panels(tmp_path):
    speed = {"tflops_per_rank": 0.03, "peak_memory_bytes": 2**29}
    plain = make_run(tmp_path / "plain", [step_row(1), step_row(2)])
    fast = make_run(tmp_path / "fast", [step_row(1) | speed, step_row(2) | speed])
    heights = {run.name: png_height(write_curves(run)) for run in (plain, fast)}
    # 10 and 14 inches at 110 dpi: three panels, or five (TFLOP/s per rank, peak memory)
    assert heights == {"plain": 1100, "fast": 1540}


def test_write_curves_returns_none_without_steps_and_never_raises(tmp_path, capsys):
    assert write_curves(tmp_path / "missing") is None
    assert write_curves(make_run(tmp_path / "empty", [])) is None
    assert write_curves(make_run(tmp_path / "evals_only", [eval_row(2, 4.0)])) is None
    assert write_curves(make_run(tmp_path / "garbage", [], tail="[1, 2]\nnot json\n")) is None
    blocked = make_run(tmp_path / "blocked", [step_row(1)])
    (blocked / "curves.png").mkdir()  # savefig fails: one line on stderr, no exception
    assert write_curves(blocked) is None
    assert capsys.readouterr().err.startswith("curves.png not written: ")


def test_importing_the_plot_module_does_not_import_matplotlib():
    code = "import sys, trainer.report.plot; assert 'matplotlib' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr


def test_cli_overlays_runs_and_a_sweep_folder_stands_for_its_points(tmp_path):
    make_run(tmp_path / "sweep" / "lr=1", [step_row(1), step_row(2)], ["lr=1"])
    make_run(tmp_path / "sweep" / "lr=2", [step_row(1), step_row(2)], ["lr=2"])
    single = make_run(tmp_path / "single", [step_row(1)], [])
    out = plot_cli(str(tmp_path / "sweep"), str(single), "-o", str(tmp_path / "out" / "c.png"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"wrote {tmp_path / 'out' / 'c.png'} (3 runs)"
    assert (tmp_path / "out" / "c.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_bad_run_folders_are_one_line_with_exit_code_2(tmp_path):
    empty, bare = make_run(tmp_path / "empty", []), tmp_path / "bare"
    bare.mkdir()
    cases = {tmp_path / "nowhere": "does not exist", bare: "has no metrics.jsonl",
             empty: "has no training steps in metrics.jsonl"}
    for folder, text in cases.items():
        out = plot_cli(str(folder))
        assert out.returncode == 2 and out.stdout == "", (folder, out)
        assert out.stderr.count("\n") == 1 and f"{folder} {text}" in out.stderr, out.stderr
