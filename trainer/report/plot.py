"""Training curves as a PNG: train and eval loss, learning rate and gradient norm (and, where the
run logged them, model TFLOP/s per rank and peak memory) against consumed samples, from one or
more run folders' metrics.jsonl, each run labelled by its overrides.
Owns reading metrics.jsonl for plots; matplotlib is imported here only, and only when drawing."""
from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

METRICS, CURVES = "metrics.jsonl", "curves.png"


@dataclass
class Curves:
    """One run's series, each sorted by consumed samples."""
    label: str
    train: list[dict[str, Any]] = field(default_factory=list)  # step rows: loss, lr, grad_norm
    evals: list[tuple[int, float]] = field(default_factory=list)  # (consumed samples, eval loss)


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows; a line cut short by a killed run is skipped, not an error."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def read_curves(run_dir: Path, label: str | None = None) -> Curves:
    run_dir = Path(run_dir)
    rows = read_rows(run_dir)
    # A resumed run appends to the same file and may log a step again: the later row wins.
    train = {r["step"]: r for r in rows if "consumed_samples" in r and "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    curves = Curves(label if label is not None else run_label(run_dir))
    curves.train = [train[s] for s in sorted(train)]
    for step in sorted(evals):
        samples = _samples_at(step, train)
        if samples is not None:
            curves.evals.append((samples, evals[step]))
    return curves


def _samples_at(step: int, train: dict[int, dict[str, Any]]) -> int | None:
    """An eval row has no consumed_samples: take the train row of the same step, else scale the
    nearest train row (consumed samples = step x global batch; eval and log intervals differ)."""
    if step in train:
        return train[step]["consumed_samples"]
    if not train:
        return None
    nearest = min(train, key=lambda s: abs(s - step))
    return round(train[nearest]["consumed_samples"] * step / nearest) if nearest else None


def run_overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides Hydra saved in .hydra/overrides.yaml (None: not readable)."""
    try:
        overrides = yaml.safe_load((Path(run_dir) / ".hydra" / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return [str(o) for o in overrides] if isinstance(overrides, list) else None


def run_label(run_dir: Path) -> str:
    overrides = run_overrides(run_dir)
    return " ".join(overrides) if overrides else Path(run_dir).resolve().name


def legend_labels(run_dirs: list[Path]) -> tuple[list[str], list[str]]:
    """(label per run, overrides every run shares). Runs overlaid usually differ in one or two
    overrides: the legend shows those, the title the shared rest, so neither is unreadably long.
    One run shares all of its overrides and is labelled by its folder name."""
    overrides = [run_overrides(d) or [] for d in run_dirs]
    shared = [o for o in overrides[0] if all(o in other for other in overrides[1:])]
    labels = []
    for run_dir, own in zip(run_dirs, overrides):
        rest = [o for o in own if o not in shared]
        labels.append(" ".join(rest) if rest else Path(run_dir).resolve().name)
    # Same overrides and same folder name (outputs/a/default, outputs/b/default): add the parent.
    labels = [label if labels.count(label) == 1 else "/".join(Path(d).resolve().parts[-2:])
              for label, d in zip(labels, run_dirs)]
    return ["\n".join(textwrap.wrap(label, 60)) for label in labels], shared


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    """Draw every run's curves overlaid into one image at out. Raises ValueError naming the run
    folder when one has no step in its metrics.jsonl."""
    labels, shared = legend_labels(run_dirs)
    runs = [read_curves(d, label) for d, label in zip(run_dirs, labels)]
    for run_dir, run in zip(run_dirs, runs):
        if not run.train:
            raise ValueError(f"{run_dir} has no training steps in {METRICS}: not a run folder, "
                             "or the run stopped before it logged a step")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node or in a test
    import matplotlib.pyplot as plt
    from matplotlib.ticker import StrMethodFormatter

    speed = any("tflops_per_rank" in r for run in runs for r in run.train)  # older runs: none
    fig, axes = plt.subplots(5 if speed else 3, 1, figsize=(9, 14 if speed else 10),
                             sharex=True, height_ratios=(2, 1, 1, 1, 1) if speed else (2, 1, 1))
    loss_ax, lr_ax, norm_ax = axes[:3]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        samples = [r["consumed_samples"] for r in run.train]
        loss_ax.plot(samples, [r["loss"] for r in run.train], color=color, lw=1.2,
                     label=f"{run.label} train")
        if run.evals:
            loss_ax.plot(*zip(*run.evals), color=color, ls="--", marker="o", ms=4,
                         label=f"{run.label} eval")
        lr_ax.plot(samples, [r.get("lr") for r in run.train], color=color, lw=1.2)
        norm_ax.plot(samples, [r.get("grad_norm") for r in run.train], color=color, lw=1.2)
        if speed:
            axes[3].plot(samples, [r.get("tflops_per_rank") for r in run.train], color=color,
                         lw=1.2)
            axes[4].plot(samples, [r["peak_memory_bytes"] / 2**30 if "peak_memory_bytes" in r
                                   else None for r in run.train], color=color, lw=1.2)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("train (solid) and eval (dashed) loss")
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    norm_ax.set_ylabel("gradient norm")
    if speed:
        axes[3].set_ylabel("TFLOP/s per rank")
        axes[4].set_ylabel("peak memory (GiB)")
    axes[-1].set_xlabel("consumed samples")
    axes[-1].xaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    for ax in axes:
        ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=8, loc="upper right")
    if shared:
        what = "overrides" if len(runs) == 1 else "every run"
        fig.suptitle("\n".join(textwrap.wrap(f"{what}: " + " ".join(shared), 110)), fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_curves(run_dir: Path) -> Path | None:
    """curves.png in the run folder, at the end of every run (also a failed or interrupted one,
    so this never raises: a plot must not hide the run's own error). None when there is no step
    to draw."""
    try:
        if not any("consumed_samples" in r for r in read_rows(run_dir)):
            return None
        return plot_runs([Path(run_dir)], Path(run_dir) / CURVES)
    except Exception as error:  # noqa: BLE001  (see the docstring)
        print(f"{CURVES} not written: {type(error).__name__}: {error}", file=sys.stderr,
              flush=True)
        return None
