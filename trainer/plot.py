"""python -m trainer.plot RUN_DIR [RUN_DIR ...] [-o OUT.png]: one PNG of train and eval loss,
learning rate, gradient norm, model TFLOP/s per rank and peak memory against consumed samples,
the runs overlaid and labelled by their overrides. Owns the command line only; the drawing is
trainer/report/plot.py's."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.report.plot import METRICS, plot_runs

EXIT_BAD_INPUT = 2  # what argparse uses for a bad command line


def expand(run_dir: Path) -> list[Path]:
    """A run folder, or a sweep folder (multirun/<run_name>) standing for its points' folders."""
    if (run_dir / METRICS).is_file():
        return [run_dir]
    points = sorted(p.parent for p in run_dir.glob(f"*/{METRICS}")) if run_dir.is_dir() else []
    if not points:
        why = "does not exist" if not run_dir.exists() else f"has no {METRICS}"
        raise ValueError(f"{run_dir} {why}: give a run folder (outputs/<run_name>/<overrides>) "
                         "or a sweep folder (multirun/<run_name>)")
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.plot",
        description="Plot train/eval loss, learning rate, gradient norm, model TFLOP/s per rank "
                    "and peak memory against consumed samples for one or more runs, overlaid in "
                    "one PNG.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="a run folder with metrics.jsonl, or a sweep folder of them")
    parser.add_argument("-o", "--output", type=Path, default=Path("curves.png"),
                        help="the image to write (default: curves.png here)")
    args = parser.parse_args(argv)
    try:
        run_dirs = [d for given in args.run_dirs for d in expand(given)]
        out = plot_runs(run_dirs, args.output)
    except ValueError as error:
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {out} ({len(run_dirs)} run{'s' if len(run_dirs) != 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
