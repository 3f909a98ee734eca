"""bench/gpu_mfu.py as far as a CPU allows: the --cpu-smoke run's JSON, and the refusal to run
without a CUDA device. The GPU figures themselves come from running the script on a GPU."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_mfu.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_mfu") / "results.json"
    proc = run_script("--cpu-smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_smoke_runs_plain_and_reports_te_skipped(smoke):
    assert smoke["cpu_smoke"] is True and smoke["peak_flops"] is None
    plain = smoke["variants"]["plain"]
    assert plain["status"] == "ok"
    assert plain["step_time_s"]["median"] > 0 and len(plain["step_time_s"]["all"]) == 2
    assert plain["tokens_per_s"] > 0 and plain["mfu"] is None
    for variant in ("te_bf16", "te_fp8"):
        entry = smoke["variants"][variant]
        assert entry["status"] == "skipped" and entry["reason"], entry


def test_flops_per_token_follows_the_stated_formula(smoke):
    m, s = smoke["model"], smoke["seq_length"]
    h, f, layers, vocab = m["hidden_size"], m["ffn_hidden_size"], m["num_layers"], m["vocab_size"]
    # Per block: qkv 3h^2 + out h^2 + gate_up 2hf + down fh + two norms; then final norm and
    # the output head. The input embedding table is not counted.
    non_embedding = layers * (4 * h * h + 3 * h * f + 2 * h) + h + vocab * h
    assert m["params"]["non_embedding"] == non_embedding
    assert m["params"]["total"] == non_embedding + vocab * h
    assert smoke["flops_per_token"] == 6 * non_embedding + 12 * layers * h * s
    assert "6 * non_embedding_params + 12 * num_layers * hidden_size * seq_length" in \
        smoke["flops_formula"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="would run the full GPU benchmark")
def test_without_cuda_and_without_smoke_it_refuses(tmp_path):
    out = tmp_path / "results.json"
    proc = run_script("--out", str(out))
    assert proc.returncode != 0
    assert "no CUDA device" in proc.stderr
    assert not out.exists()


def test_attention_kernel_check_passes_on_the_cpu_kernel(tmp_path):
    """bench/gpu_attention.py --cpu-smoke: the chunk-pair attention every cp_comm_type uses,
    per rank of runtime CP 4, against torch's causal SDPA over the whole sequence."""
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_attention.py"),
                           "--cpu-smoke", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["dtypes"]["float32"]["max_relative"]["dq"] < 1e-5
    for dtype, entry in result["dtypes"].items():
        assert entry["status"] == "ok", (dtype, entry)
        assert max(entry["max_relative"].values()) <= entry["tolerance"], dtype
