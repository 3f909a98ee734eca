"""Layout changes: what the seed PR promises stays the same when the layout changes.

Sample counts: CP and sequence shards change who reads a sample, not how many samples a step
consumes, so consumed samples and the learning rate stay identical step for step.

Checkpoints: a checkpoint written under one layout loads under another with weights and Adam
moments bit-exact, and the run continues the same sample stream.

For each layout change X -> Y: job A trains 3 steps under X with the trainer's own loop and
saves, then reports its in-memory parameters and moments; job B builds the engine under Y,
loads, and reports the same; they must be equal bit for bit. Job C continues under Y to step 6
with the loop; job D trains 6 steps under X uninterrupted: C's steps 4..6 must consume the same
samples at the same learning rates as D's, with losses equal up to the layouts' float rounding
(the parity suite's fp32 tolerance, 1e-5 relative).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import dcp as checkpoint
from trainer.compose.runspec import settle
from trainer.data.dataset import prepare
from trainer.plan.options import EngineOptions
from trainer.train.engine import build_engine
from trainer.train.loop import Trainer

from config_helpers import compose_config
from harness import run_ranks

STEPS_BEFORE, STEPS_TOTAL, GBS = 3, 6, 8
BASE = ("train.seq_length=32", "train.micro_batch_size=2",
        f"train.global_batch_size={GBS}", "train.eval_interval=null", "logger.log_interval=1",
        "schedule.lr_warmup_samples=8", "schedule.lr_warmup_fraction=null",
        f"schedule.lr_decay_samples={STEPS_TOTAL * GBS}")

# name -> (layout X overrides, layout Y overrides)
CHANGES = {
    "cp1_to_cp2_with_sequence_shards_2": (
        ("cluster.procs_per_node=4", "parallel.tensor_parallel_num_weight_shards=2",
         "parallel.tensor_parallel_num_sequence_shards=2"),
        ("cluster.procs_per_node=4", "parallel.tensor_parallel_num_weight_shards=2",
         "parallel.tensor_parallel_num_sequence_shards=2", "parallel.context_parallel_size=2")),
    "weight_shards_2_to_4": (
        ("cluster.procs_per_node=4", "parallel.tensor_parallel_num_weight_shards=2"),
        ("cluster.procs_per_node=4", "parallel.tensor_parallel_num_weight_shards=4")),
    "dp2_to_dp4": (("cluster.procs_per_node=2",), ("cluster.procs_per_node=4",)),
    # cp_comm_type changes how attention communicates, never what a checkpoint holds
    "cp2_p2p_to_cp4_a2a": (
        ("cluster.procs_per_node=2", "parallel.context_parallel_size=2",
         "parallel.cp_comm_type=p2p"),
        ("cluster.procs_per_node=4", "parallel.context_parallel_size=4",
         "parallel.cp_comm_type=a2a")),
    # peft=lora: the frozen base and the adapters (moments of the adapters only) reshard
    "lora_ws2_dp2_to_tp2_sp": (
        ("peft=lora", "cluster.procs_per_node=4", "parallel.tensor_parallel_num_weight_shards=2"),
        ("peft=lora", "cluster.procs_per_node=2", "parallel.tensor_model_parallel_size=2",
         "parallel.sequence_parallel=true")),
    # ... and a mixture of experts' per-expert adapters: split over EP and ETP 2 (B of gate|up
    # by rows, A of down by columns, the other factors whole over ETP), then in one process
    "lora_moe_tp2_sp_etp2_ep2_to_one_process": (
        ("peft=lora", "model=tiny_moe", "cluster.procs_per_node=4",
         "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
         "parallel.expert_model_parallel_size=2"),
        ("peft=lora", "model=tiny_moe")),
    "tp1_to_tp2_sp": (
        ("cluster.procs_per_node=2",),
        ("cluster.procs_per_node=2", "parallel.tensor_model_parallel_size=2",
         "parallel.sequence_parallel=true")),
    # Pipeline stages hold their blocks under the single-device names: any split loads any
    # other. Tied embeddings: the last stage's copy is not saved twice, nor its moments.
    "pp2_tied_to_pp1": (
        ("cluster.procs_per_node=2", "parallel.pipeline_model_parallel_size=2",
         "model.tie_word_embeddings=true"),
        ("cluster.procs_per_node=2", "model.tie_word_embeddings=true")),
    "pp1_to_pp2_interleaved": (
        ("cluster.procs_per_node=2", "model.num_layers=4"),
        ("cluster.procs_per_node=2", "model.num_layers=4",
         "parallel.pipeline_model_parallel_size=2",
         "parallel.virtual_pipeline_model_parallel_size=2",
         "parallel.pipeline_schedule=interleaved_1f1b")),
    "pp2_weight_shards_2_to_pp4": (
        ("cluster.procs_per_node=4", "model.num_layers=4",
         "parallel.pipeline_model_parallel_size=2", "parallel.tensor_parallel_num_weight_shards=2"),
        ("cluster.procs_per_node=4", "model.num_layers=4",
         "parallel.pipeline_model_parallel_size=4")),
    # A mixture of experts' experts split over EP 2, then 4; then whole on each rank, their
    # state over expert DP 4 (and the dense weights in weight shards).
    "moe_ep2_to_ep4": (
        ("model=tiny_moe", "cluster.procs_per_node=4", "parallel.expert_model_parallel_size=2"),
        ("model=tiny_moe", "cluster.procs_per_node=4", "parallel.expert_model_parallel_size=4")),
    "moe_ep4_to_ep1_weight_shards_2": (
        ("model=tiny_moe", "cluster.procs_per_node=4", "parallel.expert_model_parallel_size=4"),
        ("model=tiny_moe", "cluster.procs_per_node=4",
         "parallel.tensor_parallel_num_weight_shards=2")),
    # Under TP 2 with SP (experts whole, ETP 1) and EP 2, then on one process.
    "moe_tp2_sp_ep2_to_one_process": (
        ("model=tiny_moe", "cluster.procs_per_node=4", "parallel.tensor_model_parallel_size=2",
         "parallel.sequence_parallel=true", "parallel.expert_tensor_parallel_size=1",
         "parallel.expert_model_parallel_size=2"),
        ("model=tiny_moe",)),
    # Each expert split over ETP 2 (as TP's ranks, with SP), then whole under EP 4.
    "moe_tp2_sp_etp2_to_ep4": (
        ("model=tiny_moe", "cluster.procs_per_node=4", "parallel.tensor_model_parallel_size=2",
         "parallel.sequence_parallel=true"),
        ("model=tiny_moe", "cluster.procs_per_node=4", "parallel.expert_model_parallel_size=4")),
    # DeepSeek-V3's model (multi-latent attention, its router's expert bias, a multi-token
    # prediction depth whose stage holds a copy of the embedding) under TP 2 with SP, PP 2 and
    # EP 2, then under CP 2 and EP 4 without stages, trained by optim=muon: Muon's momentum of
    # its sharded, whole and expert matrices and AdamW's moments of the rest (the embedding,
    # head, norms, router), each resharded. (AdamW's whole state: the cases above.)
    "deepseek_muon_tp2_sp_pp2_ep2_to_cp2_ep4": (
        ("optim=muon", "model=tiny_deepseek", "cluster.procs_per_node=4",
         "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
         "parallel.pipeline_model_parallel_size=2", "parallel.expert_tensor_parallel_size=1",
         "parallel.expert_model_parallel_size=2"),
        ("optim=muon", "model=tiny_deepseek", "cluster.procs_per_node=4",
         "parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=4")),
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("text")
    gen = torch.Generator().manual_seed(0)
    words = ["layout", "shard", "rank", "token", "gather", "scatter", "loss", "step", "batch"]
    for doc in range(12):
        picks = torch.randint(0, len(words), (400,), generator=gen).tolist()
        (src / f"doc{doc:02d}.txt").write_text(" ".join(words[i] for i in picks) + "\n")
    return prepare(src, tmp_path_factory.mktemp("data") / "dataset", valid_fraction=0.1)


def settings_for(dataset: Path, run_dir: Path, overrides: tuple[str, ...], *extra: str):
    model = () if any(o.startswith("model=") for o in overrides) else ("model=tiny",)
    return settle(compose_config(*model, *BASE, *overrides, f"data.path={dataset}",
                                 f"checkpoint.dir={run_dir / 'checkpoints'}", *extra))


def state_chunks(engine) -> dict:
    """This rank's parameters and Adam moments at their global offsets (collective)."""
    model, optimizer = engine.model, engine.optimizer
    views = optimizer.moment_views(optimizer.gather_moments())
    chunks, shapes = {}, {}
    for name, param in model.module.named_parameters():
        shapes[name] = model.global_shape(name)
        moments = views.get(name, {})  # none: a copy (its owner has them), or frozen
        for kind, tensor in {"param": param.data, **moments}.items():
            chunks[kind, name] = [(o, t.clone()) for o, t in model.global_chunks(name, tensor)]
    return {"chunks": chunks, "shapes": shapes}


def assemble(results: list[dict]) -> dict[tuple[str, str], torch.Tensor]:
    """Full tensors from every rank's chunks; replicas must agree exactly."""
    full: dict[tuple[str, str], torch.Tensor] = {}
    for result in results:
        for key, chunks in result["chunks"].items():
            target = full.setdefault(key, torch.full(result["shapes"][key[1]], math.nan))
            for offsets, tensor in chunks:
                region = target[tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape))]
                written = ~region.isnan()
                assert torch.equal(region[written], tensor[written]), key
                region.copy_(tensor)
    for key, tensor in full.items():
        assert not tensor.isnan().any(), f"{key}: some values held by no rank"
    return full


def job_train_and_save(rank, spec, run_dir):
    trainer = Trainer(spec, run_dir, torch.device("cpu"))
    records = trainer.run(keep_records=True)  # saves at its last step
    return {"records": records, "state": state_chunks(trainer.engine)}


def job_load(rank, spec, path):
    settings = spec.config
    engine = build_engine(settings.model, settings.optim, settings.train.seed, spec.layout,
                          torch.device("cpu"), EngineOptions.from_config(settings),
                          peft=settings.peft)
    state = checkpoint.load(engine, path)
    return {"train_state": state, "state": state_chunks(engine)}


def job_run(rank, spec, run_dir):
    return Trainer(spec, run_dir, torch.device("cpu")).run(keep_records=True)


@pytest.mark.parametrize("change", list(CHANGES))
def test_checkpoint_loads_under_another_layout(change, dataset, tmp_path):
    before, after = CHANGES[change]
    x_spec = settings_for(dataset, tmp_path / "a", before,
                          f"train.train_samples={STEPS_BEFORE * GBS}")
    y_spec = settings_for(dataset, tmp_path / "c", after,
                          f"train.train_samples={STEPS_TOTAL * GBS}")
    x_layout, y_layout = x_spec.layout, y_spec.layout
    assert x_layout.derived() != y_layout.derived()
    a = run_ranks(x_layout.world_size, job_train_and_save, x_spec, tmp_path / "a")
    saved = tmp_path / "a" / "checkpoints" / f"step_{STEPS_BEFORE:08d}"

    b = run_ranks(y_layout.world_size, job_load, y_spec, saved)
    expected, loaded = assemble([r["state"] for r in a]), assemble([r["state"] for r in b])
    assert expected.keys() == loaded.keys()
    for key in expected:
        assert torch.equal(expected[key], loaded[key]), f"{change}: {key} differs after loading"
    assert all(loaded[kind, name].abs().sum() > 0 for kind, name in loaded)  # trained moments
    assert b[0]["train_state"].consumed_samples == STEPS_BEFORE * GBS

    y_resume = settings_for(dataset, tmp_path / "c", after,
                               f"train.train_samples={STEPS_TOTAL * GBS}",
                               f"checkpoint.load={saved}")
    c = run_ranks(y_layout.world_size, job_run, y_resume, tmp_path / "c")[0]
    x_full = settings_for(dataset, tmp_path / "d", before,
                             f"train.train_samples={STEPS_TOTAL * GBS}")
    d = run_ranks(x_layout.world_size, job_run, x_full, tmp_path / "d")[0]
    assert [r["step"] for r in c] == list(range(STEPS_BEFORE + 1, STEPS_TOTAL + 1))
    assert [r["loss"] for r in d[:STEPS_BEFORE]] == [r["loss"] for r in a[0]["records"]]
    for resumed, straight in zip(c, d[STEPS_BEFORE:]):
        assert resumed["consumed_samples"] == straight["consumed_samples"]
        assert resumed["lr"] == straight["lr"]
        assert abs(resumed["loss"] - straight["loss"]) <= 1e-5 * abs(straight["loss"]), change


@pytest.mark.parametrize("changed", [
    ("parallel.tensor_parallel_num_sequence_shards=2",),
    ("parallel.context_parallel_size=2",),
])
def test_sequence_shards_and_cp_leave_sample_counts_alone(changed, dataset, tmp_path):
    base = ("cluster.procs_per_node=4", "parallel.tensor_parallel_num_weight_shards=2",
            f"train.train_samples={4 * GBS}")
    runs = {}
    for name, overrides in (("base", base), ("changed", base + changed)):
        spec = settings_for(dataset, tmp_path / name, overrides)
        runs[name] = (spec.layout, run_ranks(4, job_run, spec, tmp_path / name)[0])
    (base_layout, base_records), (new_layout, new_records) = runs["base"], runs["changed"]
    # Different work per rank ...
    assert new_layout.runtime_context_parallel_size == 2 * base_layout.runtime_context_parallel_size
    assert new_layout.batch_parallel_size < base_layout.batch_parallel_size
    # ... the same samples, steps and learning rates.
    assert [r["consumed_samples"] for r in new_records] == [8, 16, 24, 32]
    assert ([r["consumed_samples"] for r in new_records]
            == [r["consumed_samples"] for r in base_records])
    assert [r["lr"] for r in new_records] == [r["lr"] for r in base_records]
    for new, old in zip(new_records, base_records):
        assert abs(new["loss"] - old["loss"]) <= 1e-5 * abs(old["loss"])
    # Each step logs the bytes this rank sent; a fixed layout sends the same every step.
    assert new_records[0]["comm_bytes"]["all_gather"] > 0
    assert all(r["comm_bytes"] == new_records[0]["comm_bytes"] for r in new_records)
