"""Every experiment preset dry-runs (in process, through launch.settle like a real run)."""
from __future__ import annotations

import builtins
import json

import pytest
import torch

from trainer.compose.runspec import settle
from trainer.model.transformer import Transformer
from trainer.report.dry_run import dry_run

from config_helpers import CONF_DIR, compose_config

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_dry_runs(experiment, tmp_path, capsys):
    spec = settle(compose_config(f"experiment={experiment}"))
    layout = spec.layout
    record = dry_run(spec, tmp_path)
    assert json.loads((tmp_path / "layout.json").read_text())["derived"] == layout.derived()
    assert record["warnings"] == []  # the presets keep each weight tile inside one domain
    # The one-process count is checked against the torch module itself (not the plan's own
    # shapes), and each rank's share against that count: sharding over the tile shrinks a
    # rank's parameters by about the tile size; norms stay whole, so allow a little more.
    with torch.device("meta"):
        numel = sum(p.numel() for p in Transformer(spec.config.model).parameters())
    assert record["memory"]["unsharded"]["parameters"] == numel
    tile = layout.tp_size * layout.gtp_remat_size
    assert record["memory"]["per_stage"][0]["parameters"] <= 1.05 * numel / tile
    assert f"gtp-trainer dry run: {experiment}" in capsys.readouterr().out


def test_seed_presets_give_the_seed_numbers():
    ws64 = settle(compose_config("experiment=seed_ws64_tp2_sp")).layout
    assert (ws64.gtp_remat_size, ws64.gtp_remat_num_sequence_shards,
            ws64.gtp_remat_num_batch_shards) == (32, 8, 4)
    big = settle(compose_config("experiment=seed_128rank_cp2")).layout
    assert (big.world_size, big.data_parallel_size, big.batch_parallel_size,
            big.runtime_context_parallel_size, big.num_weight_replicas) == (128, 1, 1, 128, 2)


def test_the_measured_dry_run_says_its_plan_first_and_then_what_it_measures(tmp_path, capsys,
                                                                            monkeypatch):
    """The plan is printed and layout.json written before the measurement starts (a person sees
    it at once, a killed run leaves it); then a line per phase: the build, the first forward's
    pace with the time the whole measurement takes, the passes, the update, the measured table,
    and layout.json again with "measured"."""
    spec = settle(compose_config("cluster.procs_per_node=2",
                                 "parallel.tensor_parallel_num_weight_shards=2", "dry_run=true",
                                 "dry_run_rank=1", "train.precision=fp32"))
    written = []
    real_print = print

    def watching_print(*args, **kwargs):  # whether layout.json exists as measuring begins
        if args and str(args[0]).startswith("measuring rank"):
            written.append((tmp_path / "layout.json").exists())
        real_print(*args, **kwargs)

    monkeypatch.setattr(builtins, "print", watching_print)
    record = dry_run(spec, tmp_path)
    monkeypatch.undo()
    out = capsys.readouterr().out
    order = ["gtp-trainer dry run", f"wrote {tmp_path / 'layout.json'}\n",
             "measuring rank 1 of a simulated world of 2 on cpu: building its engine",
             "  built in ", "  step 1: the first forward took ", "  step 1: 2/2 passes done",
             "  step 1: optimizer update", "  step 2 (counted by the allocator): optimizer update",
             "measured (rank 1 of a simulated world of 2, cpu)",
             f"wrote {tmp_path / 'layout.json'} (with what was measured)"]
    places = [out.find(text) for text in order]
    assert -1 not in places and places == sorted(places), list(zip(order, places))
    assert written == [True]
    assert json.loads((tmp_path / "layout.json").read_text())["measured"] == record["measured"]


def test_a_slow_measured_step_is_announced_with_the_fix(monkeypatch):
    """The measured example of docs/dry-run.md on a CPU whose bf16 matrix products run at 4
    GFLOP/s and fp32 at 100 (as on the machine the issue was found on; this one's AMX runs bf16
    at ~700): one line with the rate, at least how long, and the fp32 fix. In fp32 at that rate,
    or small, nothing is said."""
    from trainer.config import Precision
    from trainer.train import measured_rank

    rates = {Precision.bf16: 4e9, Precision.fp32: 1e11}
    monkeypatch.setattr(measured_rank, "matmul_flops", lambda precision: rates[precision])
    example = ["experiment=seed_128rank_cp2", "model.num_layers=2", "train.seq_length=8192"]
    line = measured_rank.slow_step_warning(settle(compose_config(*example)))
    assert line is not None and line.startswith(
        "bf16 matrix products run at 4.0 GFLOP/s on this CPU: measuring this rank's step "
        "(twice on CPU) will take at least "), line
    assert "; train.precision=fp32 measures the same sizes in about " in line
    assert measured_rank.slow_step_warning(settle(compose_config(*example, "train.precision=fp32",
                                                           "train.seq_length=2048"))) is None
    assert measured_rank.slow_step_warning(settle(compose_config("model=tiny"))) is None


def test_the_report_room_only_formats():
    """trainer/report/ names no torch, not even lazily: the measured rank is built and stepped
    by trainer.train.measured_rank (and its allocator count, trainer.train.allocations)."""
    import ast
    from pathlib import Path

    import trainer.report

    for path in Path(trainer.report.__file__).parent.glob("*.py"):
        modules = {alias.name for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module}
        assert not {m for m in modules if m.split(".")[0] == "torch"}, path
