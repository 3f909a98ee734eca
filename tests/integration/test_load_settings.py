"""A checkpoint loaded into a model of other settings, from the command line
(trainer/checkpoint/match.py): what would drop a trained weight is refused (an untied head loaded
into a tied model); what a resume cannot continue is one line before any rank starts (other model
settings its run recorded, tied embeddings untied, an expert bias the checkpoint lacks); a
fine-tune from the same checkpoint goes on with one note, and an untied head starts as the tied
checkpoint's embedding (its first loss is the tied model's, exactly). A checkpoint that records no
model settings (written before they were recorded) still resumes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_launch import command, make_dataset, metrics
from test_safety import error_lines

from config_helpers import ROOT

RUN = ("train.seq_length=32", "train.micro_batch_size=2", "train.eval_interval=null",
       "logger.log_interval=1")
TIE, BIAS = "model.tie_word_embeddings", "model.moe_router_enable_expert_bias"
WITH_BIAS = ("model=tiny_moe", "model.moe_router_score_function=sigmoid", f"{BIAS}=true")


def launch_all(dataset: Path, *runs: tuple[Path, tuple[str, ...]]
               ) -> list[subprocess.CompletedProcess]:
    """launch.py runs side by side: (run folder, overrides) each."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK")}
    procs = [subprocess.Popen(command(*RUN, f"data.path={dataset}", f"hydra.run.dir={run_dir}",
                                      *overrides), cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for run_dir, overrides in runs]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def refused(out: subprocess.CompletedProcess, run_dir: Path, *named: str) -> str:
    """One line naming each of `named` and the fix, before anything of a run started."""
    assert out.returncode != 0 and "steps from step" not in out.stdout, out.stdout + out.stderr
    (line,) = error_lines(out.stderr)
    assert "Fix:" in line and all(part in line for part in named), (named, line)
    assert not run_dir.exists()
    return line


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory) -> dict[str, Path]:
    """Run folders of 4 steps (8 samples) each: the tiny model with tied embeddings, and the
    tiny mixture of experts (softmax router, no expert bias)."""
    root = tmp_path_factory.mktemp("trained")
    runs = {"tied": (f"{TIE}=true",), "moe": ("model=tiny_moe",)}
    for out in launch_all(dataset, *((root / name, ("train.train_samples=8", *extra))
                                     for name, extra in runs.items())):
        assert out.returncode == 0, out.stderr
    return {name: root / name for name in runs}


def last(run_dir: Path) -> Path:
    return max((run_dir / "checkpoints").glob("step_*"))


def test_tied_embeddings_untied_is_a_fine_tune_whose_head_starts_as_the_embedding(
        dataset, trained, tmp_path):
    tied = last(trained["tied"])
    (out,) = launch_all(dataset, (tmp_path / "resume", (f"checkpoint.load={tied}",
                                                        "train.train_samples=16")))
    refused(out, tmp_path / "resume", f"{TIE}=true", f"{TIE}=false", "no 'head.weight'",
            "checkpoint.finetune=true")
    fine_tune = (f"checkpoint.load={tied}", "checkpoint.finetune=true", "train.train_samples=8")
    untied, still_tied = launch_all(dataset, (tmp_path / "untied", fine_tune),
                                    (tmp_path / "tied", (*fine_tune, f"{TIE}=true")))
    assert untied.returncode == 0 and still_tied.returncode == 0, untied.stderr + still_tied.stderr
    assert (f"{TIE}=false: the output head starts as a copy of the checkpoint's embedding"
            in untied.stdout), untied.stdout
    # Step 1's loss is the loaded model's before any update: the same function, the same loss.
    first = [metrics(tmp_path / name)[0]["loss"] for name in ("untied", "tied")]
    assert first[0] == first[1], first
    # The other way, the trained untied head would be thrown away: refused, also to a fine-tune.
    (out,) = launch_all(dataset, (tmp_path / "tie_again", (
        f"checkpoint.load={last(tmp_path / 'untied')}", "checkpoint.finetune=true",
        f"{TIE}=true", "train.train_samples=8")))
    refused(out, tmp_path / "tie_again", "'head.weight'", f"{TIE}=true", f"Fix: set {TIE}=false")


def test_other_model_settings_are_refused_on_a_resume_and_one_note_on_a_fine_tune(
        dataset, trained, tmp_path):
    moe, other = last(trained["moe"]), ("model.moe_router_topk=1", "model.rope_theta=500000")
    own = tmp_path / "own"  # a copy of the run folder: the same command then resumes it
    shutil.copytree(trained["moe"], own)
    old = tmp_path / "old" / moe.name  # as written before meta.json recorded the model
    shutil.copytree(moe, old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["model"]
    (old / "meta.json").write_text(json.dumps(meta))
    load, again, fine_tune, unrecorded = launch_all(
        dataset, (tmp_path / "load", (f"checkpoint.load={moe}", "model=tiny_moe", *other,
                                      "train.train_samples=16")),
        (own, ("model=tiny_moe", "model.norm_eps=1e-6", "train.train_samples=16")),
        (tmp_path / "fine_tune", (f"checkpoint.load={moe}", "checkpoint.finetune=true",
                                  "model=tiny_moe", *other, "train.train_samples=8")),
        (tmp_path / "unrecorded", (f"checkpoint.load={old}", "model=tiny_moe", *other,
                                   "train.train_samples=16")))
    settings = ("model.moe_router_topk=1 (the checkpoint's 2)",
                "model.rope_theta=500000.0 (the checkpoint's 10000.0)")
    refused(load, tmp_path / "load", f"checkpoint.load={moe}", *settings,
            "Fix: set them back, or start a fine-tune from its weights (checkpoint.finetune=true)")
    assert again.returncode != 0 and "steps from step" not in again.stdout, again.stdout
    (line,) = error_lines(again.stderr)
    assert line.startswith(f"this run's latest checkpoint {own / 'checkpoints'}") and (
        "model.norm_eps=1e-06 (the checkpoint's 1e-05)" in line
        and f"checkpoint.load={last(own)} checkpoint.finetune=true, in another folder" in line
    ), line
    assert fine_tune.returncode == 0, fine_tune.stderr
    notes = [x for x in fine_tune.stdout.splitlines() if "other model settings" in x]
    assert len(notes) == 1 and all(part in notes[0] for part in settings), notes
    assert unrecorded.returncode == 0, unrecorded.stderr
    assert "8 steps from step 4" in unrecorded.stdout, unrecorded.stdout
    assert "other model settings" not in unrecorded.stdout, unrecorded.stdout


def test_an_expert_bias_the_checkpoint_lacks_is_a_fine_tunes_zero_not_a_resumes_traceback(
        dataset, trained, tmp_path):
    moe = last(trained["moe"])
    resumed, fine_tune = launch_all(
        dataset, (tmp_path / "resume", (f"checkpoint.load={moe}", *WITH_BIAS,
                                        "train.train_samples=16")),
        (tmp_path / "fine_tune", (f"checkpoint.load={moe}", "checkpoint.finetune=true",
                                  *WITH_BIAS, "train.train_samples=8")))
    assert "Traceback" not in resumed.stderr, resumed.stderr
    refused(resumed, tmp_path / "resume", "has no expert bias 'layers.0.mlp.router.expert_bias'",
            f"{BIAS}=false", f"{BIAS}=true", "checkpoint.finetune=true")
    assert fine_tune.returncode == 0, fine_tune.stderr
    assert f"{BIAS}=true: the routers' expert bias starts at zero" in fine_tune.stdout
