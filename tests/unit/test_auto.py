"""parallel=auto: the search's memory is the dry run's plan, its floor bounds its estimate, and
its choices are the ones worked out by hand; through Hydra, overrides constrain it and a config
that fits nowhere fails in one line."""
from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from parallel.layout import Layout
from trainer.auto.search import Problem, search
from trainer.compose.runspec import settle
from trainer.config import CPCommType, ModelConfig, Precision, RecomputeGranularity
from trainer.parts.assembly import parameter_shapes
from trainer.plan.cost import estimate, floor_s
from trainer.plan.fit import planned_peak
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions
from trainer.plan.stage_plan import step_per_stage

from config_helpers import CONF_DIR, ROOT, compose_config


def model(name: str, **changes) -> ModelConfig:
    cfg = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    return replace(ModelConfig(**cfg), **changes)


def hardware(name: str, **changes) -> Hardware:
    cfg = {**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "cluster" / f"{name}.yaml")),
           "gpus_per_nvlink_domain": 8, **changes}
    return Hardware.from_cluster(SimpleNamespace(**cfg))


LAYOUTS = [  # (world, Layout keywords, options)
    (64, dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=4,
              virtual_pipeline_model_parallel_size=2, global_batch_size=64),
     EngineOptions(Precision.bf16, RecomputeGranularity.full, 1,
                   pipeline_schedule="interleaved_1f1b")),
    (64, dict(tensor_parallel_num_weight_shards=8, tensor_parallel_num_sequence_shards=4,
              context_parallel_size=2),
     EngineOptions(Precision.bf16, RecomputeGranularity.selective,
                   cp_comm_type=CPCommType.all_gather, overlap_param_gather=True)),
    (64, dict(pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=5,
              global_batch_size=256), EngineOptions(Precision.fp32)),
    (16, dict(tensor_model_parallel_size=4, sequence_parallel=True, context_parallel_size=4),
     EngineOptions(Precision.bf16, cp_comm_type=CPCommType.a2a)),
    (8, dict(pipeline_model_parallel_size=8, global_batch_size=40), EngineOptions(
        Precision.fp32, pipeline_schedule="gpipe")),
]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("world,kwargs,options", LAYOUTS)
def test_the_search_sizes_a_layout_exactly_as_the_dry_runs_plan(world, kwargs, options, tied):
    m = model("llama3_1_8b", tie_word_embeddings=tied)
    layout = Layout(world, micro_batch_size=2, seq_length=1024, **kwargs)
    shapes = parameter_shapes(m)
    plan = [s["peak_bytes"] for s in step_per_stage(shapes, m, layout, options)]
    assert planned_peak(shapes, m, layout, options) == (max(plan), plan.index(max(plan)))


def test_the_floor_never_exceeds_the_estimate():
    """Under any option, and under peft=lora (whose backward skips the frozen weights'
    gradients, and whose messages carry the adapters' alone) too."""
    from trainer.parts.lora import Adapters

    m, hw = model("llama3_1_8b"), hardware("dgx_h100")
    lora = Adapters(16, frozenset({"q_proj", "v_proj", "down_proj"}), 0.0)
    checked = 0
    for (world, kwargs, _), precision, recompute, comm, overlap, adapters in itertools.product(
            LAYOUTS, Precision, [None, *RecomputeGranularity], CPCommType, [False, True],
            [None, lora]):
        layout = Layout(world, micro_batch_size=2, seq_length=1024, **kwargs)
        schedule = "interleaved_1f1b" if layout.virtual_pipeline_size > 1 else "1f1b"
        options = EngineOptions(precision, recompute, None, False, overlap, overlap, comm,
                                schedule, lora=adapters)
        assert floor_s(m, layout, precision, hw, adapters) <= \
            estimate(m, layout, options, hw).step_s
        checked += 1
    assert checked == len(LAYOUTS) * 2 * 3 * 3 * 2 * 2


def test_ranks_that_share_cores_hide_nothing_and_lose_only_part_of_the_bubble():
    """cluster=local: 4 ranks on its 2 cores take turns. A WS 4 layout's gathers cost the same
    with overlap as without (the cores that compute also move them); a PP 2 stage waiting in
    the bubble hands its core over (2 ranks a core, 2 stages: nothing lost), PP 4 loses
    (4 - 2) / (4 - 1) of it; 8 ranks on the same 2 cores keep PP 4's bubble free."""
    m = model("tiny", num_layers=4)
    shared = hardware("local", procs_per_node=4)
    assert shared.ranks_per_core == 2 and hardware("dgx_h100").ranks_per_core == 1
    on, off = (EngineOptions(overlap_param_gather=o, overlap_grad_reduce=o) for o in (True, False))
    ws = Layout(4, tensor_parallel_num_weight_shards=4, micro_batch_size=2, seq_length=256)
    assert estimate(m, ws, on, shared).step_s == estimate(m, ws, off, shared).step_s
    own = replace(shared, ranks_per_core=1.0)
    assert estimate(m, ws, on, own).step_s < estimate(m, ws, off, own).step_s
    for world, pp, share in ((4, 2, 0.0), (4, 4, 2 / 3), (8, 4, 0.0)):
        hw = hardware("local", procs_per_node=world)
        layout = Layout(world, pipeline_model_parallel_size=pp, micro_batch_size=2,
                        seq_length=256, global_batch_size=8 * world // pp)
        assert hw.bubble_share(pp) == pytest.approx(share)
        bubble = estimate(m, layout, on, hw).seconds["pipeline bubble"]
        alone = estimate(m, layout, on, replace(hw, ranks_per_core=1.0)).seconds
        assert bubble == pytest.approx(share * alone["pipeline bubble"])
        assert floor_s(m, layout, Precision.fp32, hw) <= estimate(m, layout, on, hw).step_s


def problem(m: ModelConfig, hw: Hardware, world: int, seq: int, gbs: int | None = None,
            precision: Precision = Precision.bf16, **fixed) -> Problem:
    return Problem(m, hw, world, 1, gbs, seq, precision, None,
                   tuple((k.replace("__", "."), v) for k, v in fixed.items()))


def test_a_model_that_fits_one_device_trains_data_parallel():
    """1B parameters in 16 bytes each fit an 80 GB H100 at a short sequence: on 8 of them
    nothing beats every rank keeping the whole model (no weight gathers, no TP messages)."""
    choice = search(problem(model("llama3_2_1b"), hardware("dgx_h100"), 8, 2048, gbs=64))
    layout = choice.chosen.layout
    assert (layout.tp_size, layout.gtp_remat_size, layout.runtime_context_parallel_size,
            layout.pp_size, layout.data_parallel_size) == (1, 1, 1, 1, 8)
    assert choice.chosen.values["train.recompute_granularity"] is None


def test_a_model_too_large_for_one_device_is_sharded_and_every_choice_is_a_layout():
    """70B parameters need 1.1 TB of state: on 64 H100s each rank must hold at most 1/14 of
    it, so no alternative keeps the whole model on a rank."""
    choice = search(problem(model("llama3_1_70b"), hardware("dgx_h100"), 64, 4096, gbs=64))
    for candidate in (choice.chosen, *choice.alternatives):
        lay = candidate.layout
        assert lay.weight_tile_size * lay.pp_size >= 14, candidate.describe()
        assert candidate.peak_bytes <= choice.budget_bytes
        rebuilt = Layout(64, **{k: candidate.values[f"parallel.{k}"] for k in (
            "tensor_model_parallel_size", "sequence_parallel", "tensor_parallel_num_weight_shards",
            "tensor_parallel_num_sequence_shards", "context_parallel_size",
            "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")},
            micro_batch_size=1, global_batch_size=64, seq_length=4096)
        assert rebuilt == lay
    assert choice.dropped["planned peak over the device memory less its margin"] > 0


def test_fixed_keys_constrain_the_search():
    p = problem(model("llama3_1_8b"), hardware("nvl72", gpus_per_nvlink_domain=64), 64, 32768,
                parallel__tensor_model_parallel_size=2, parallel__context_parallel_size=1,
                train__recompute_granularity="selective")
    choice = search(p)
    for c in (choice.chosen, *choice.alternatives):
        assert c.layout.tp_size == 2 and c.layout.context_parallel_size == 1
        assert c.values["train.recompute_granularity"] == "selective"


def test_no_layout_fits_in_one_line_with_the_nearest_miss():
    with pytest.raises(ValueError) as error:
        search(problem(model("llama3_1_70b"), hardware("dgx_h100"), 8, 131072))
    message = str(error.value)
    assert "\n" not in message and "no layout of world_size=8 fits" in message
    assert "the nearest, TP=" in message and "Fix: about" in message


def test_the_no_fit_fix_offers_a_shorter_sequence_only_where_the_state_alone_fits():
    # 70B on 8 H100s: ~131 GiB of weights, gradients and Adam state a rank whatever the tokens.
    held = str(pytest.raises(ValueError, search, problem(
        model("llama3_1_70b"), hardware("dgx_h100"), 8, 131072)).value)
    assert "of it weights, gradients and optimizer state" in held
    assert "seq_length" not in held.split("Fix:")[1] and "a smaller model" in held
    # 8B on 8 H100s at 256k tokens: the state fits, the activations do not.
    long = str(pytest.raises(ValueError, search, problem(
        model("llama3_1_8b"), hardware("dgx_h100"), 8, 262144)).value)
    assert "a shorter train.seq_length (about 131072)" in long, long
    shorter = search(problem(model("llama3_1_8b"), hardware("dgx_h100"), 8, 131072))
    assert shorter.chosen.peak_bytes <= hardware("dgx_h100").budget_bytes  # the fix fits


SEED = ["cluster.num_nodes=16", "cluster.procs_per_node=8", "cluster.gpus_per_nvlink_domain=64",
        "model=llama3_1_8b", "train.micro_batch_size=1", "train.global_batch_size=1",
        "train.seq_length=131072", "train.precision=bf16", "cluster=nvl72"]


def test_the_seed_example_is_chosen_at_least_as_fast_as_the_seeds_layout():
    """The seed's 128-rank layout (WS 64, SS 64, CP 2) under the same model and cost model."""
    auto = settle(compose_config(*SEED, "parallel=auto"))
    hand = settle(compose_config(*SEED, "parallel.tensor_parallel_num_weight_shards=64",
                                 "parallel.tensor_parallel_num_sequence_shards=64",
                                 "parallel.context_parallel_size=2"))
    hw = auto.auto.hardware
    from trainer.plan.options import EngineOptions as Options

    hand_s = estimate(hand.config.model, hand.layout, Options.from_config(hand.config), hw)
    assert auto.auto.chosen.estimate.step_s <= hand_s.step_s
    assert auto.layout == auto.auto.chosen.layout  # what settles is what was chosen
    print(f"\nseed: hand {hand_s.step_s:.3f} s ({hand_s.dominant}); auto "
          f"{auto.auto.chosen.describe()} {auto.auto.chosen.estimate.step_s:.3f} s")


def test_overrides_are_kept_and_the_choice_shows_in_the_resolved_config():
    out = subprocess.run([sys.executable, "launch.py", "parallel=auto", "model=llama3_1_8b",
                          "cluster=dgx_h100", "train.seq_length=8192", "train.precision=bf16",
                          "train.micro_batch_size=1", "train.global_batch_size=64",
                          "parallel.pipeline_model_parallel_size=2", "--cfg", "job", "--resolve"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    resolved = OmegaConf.create(out)
    assert resolved.parallel.pipeline_model_parallel_size == 2
    assert "${" not in out and isinstance(resolved.parallel.tensor_model_parallel_size, int)
    spec = settle(compose_config("parallel=auto", "model=llama3_1_8b", "cluster=dgx_h100",
                                 "train.seq_length=8192", "train.precision=bf16",
                                 "train.micro_batch_size=1", "train.global_batch_size=64",
                                 "parallel.pipeline_model_parallel_size=2"))
    assert spec.layout.tp_size == resolved.parallel.tensor_model_parallel_size
    assert spec.layout.pp_size == 2


def test_no_fit_through_the_cli_is_one_line_before_anything_starts():
    run = subprocess.run([sys.executable, "launch.py", "parallel=auto", "model=llama3_1_70b",
                          "cluster=dgx_h100", "cluster.num_nodes=1", "train.seq_length=131072",
                          "train.micro_batch_size=1", "dry_run=true"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    lines = [line for line in run.stderr.splitlines() if "no layout" in line]
    assert len(lines) == 1 and "Fix:" in lines[0] and "Traceback" not in run.stderr


def test_under_muon_the_search_plans_its_state_update_and_time():
    """optim=muon: one momentum where AdamW keeps two moments lets a layout fit with less
    sharding, its update's Newton-Schulz work and exchange are a row of the estimate, and
    the search's floor (the model's Newton-Schulz FLOPs over every rank, or its largest
    matrix) stays under each candidate's Muon row."""
    from trainer.config import OptimConfig
    from trainer.plan.muon import muon_plan

    m, hw = model("llama3_1_8b"), hardware("dgx_h100")
    optim = OptimConfig(name="muon", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                        clip_grad=1.0)
    muon = muon_plan(m, optim)
    adamw = search(problem(m, hw, 16, 4096, gbs=64))
    choice = search(replace(problem(m, hw, 16, 4096, gbs=64), muon=muon))
    for candidate in (choice.chosen, *choice.alternatives):
        row = candidate.estimate.seconds["muon update"]
        assert 0 < muon.floor_s(16, hw) <= row, candidate.describe()
    assert "muon update" not in adamw.chosen.estimate.seconds
    # the same layout planned both ways: Muon's state is smaller
    layout = choice.chosen.layout
    options = EngineOptions(Precision.bf16)
    shapes = parameter_shapes(m)
    with_muon = planned_peak(shapes, m, layout, options, muon)
    assert with_muon[0] < planned_peak(shapes, m, layout, options)[0]


@pytest.mark.parametrize("world,kwargs,options", LAYOUTS[:2])
def test_under_muon_the_search_sizes_a_layout_exactly_as_the_dry_runs_plan(world, kwargs,
                                                                           options):
    from trainer.config import OptimConfig
    from trainer.plan.muon import muon_plan

    m = model("llama3_1_8b")
    muon = muon_plan(m, OptimConfig(name="muon", weight_decay=0.1, beta1=0.9, beta2=0.95,
                                    eps=1e-8, clip_grad=1.0))
    layout = Layout(world, micro_batch_size=2, seq_length=1024, **kwargs)
    shapes = parameter_shapes(m)
    plan = [s["peak_bytes"] for s in step_per_stage(shapes, m, layout, options, muon)]
    assert planned_peak(shapes, m, layout, options, muon) == (max(plan), plan.index(max(plan)))
    assert max(plan) != max(s["peak_bytes"] for s in step_per_stage(shapes, m, layout, options))


def test_lora_plans_the_adapters_state_only_so_70b_fits_one_node():
    """Llama 3.1 70B at 4,096 tokens on 8 H100s: full fine-tuning fits no layout (its state
    alone is 131 GiB a rank), LoRA fits (the frozen weights without gradients or Adam state),
    and its planned peak is what the dry run's memory plan says for the chosen layout."""
    from trainer.config import PeftConfig
    from trainer.parts.assembly import parameter_shapes
    from trainer.plan.memory import memory_per_stage

    m, hw = model("llama3_1_70b"), hardware("dgx_h100")
    with pytest.raises(ValueError, match="no layout of world_size=8 fits"):
        search(problem(m, hw, 8, 4096, gbs=64))
    peft = PeftConfig("lora", 16, 32.0, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj",
                                              "gate_proj", "up_proj", "down_proj"])
    choice = search(replace(problem(m, hw, 8, 4096, gbs=64), peft=peft))
    layout = choice.chosen.layout
    state = max(s.total_bytes for s in memory_per_stage(
        parameter_shapes(m, peft), m.num_layers, layout, m.tie_word_embeddings, lora=True))
    full = memory_per_stage(parameter_shapes(m), m.num_layers, layout, m.tie_word_embeddings)
    print(f"\n70B LoRA on 8 H100s: {choice.chosen.describe()}; state {state / 2**30:.1f} GiB "
          f"a rank, full fine-tuning's {full[0].total_bytes / 2**30:.1f} GiB")
    assert choice.chosen.peak_bytes <= choice.budget_bytes
    assert state < full[0].total_bytes / 3  # fp32 weights only, against 16 bytes a weight
