"""peft=lora on every axis: one process equals each layout (fp64 at 1e-10, fp32 at 1e-5), the
frozen base never moves, never forms a gradient message and holds no optimizer state, and the
memory plan's state is what the ranks allocate.

The adapters split as their projections do (trainer.parts.lora): B of q|k|v and gate|up by rows
over TP, A of o and down by columns; the other factor whole. Every layout below trains the same
adapters on the same global batch as one process: TP with and without SP, GTP_remat weight
shards (the adapters' split factors join the block's bundle; the frozen base is gathered and
never reduced), sequence shards with CP, pipeline stages, and EP on a mixture of experts: one
adapter per routed expert (gate_proj and down_proj name them there), split over EP as the
experts are, and under ETP (TP's size by default) B of gate|up split as its rows, A of down as
its columns, the other factor whole and its gradient summed over ETP.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel.layout import Layout
from trainer.config import PeftConfig, Precision, RecomputeGranularity
from trainer.parts.assembly import parameter_shapes
from trainer.parts.lora import is_adapter
from trainer.plan.memory import memory_per_stage
from trainer.plan.options import EngineOptions
from trainer.train.batch import rank_micro_batches
from trainer.train.compile import graph_breaks
from trainer.train.compile import graphs as compiled_graphs
from trainer.train.engine import build_engine
from trainer.train.step import train_step
from trainer.train.throughput import state_bytes

from harness import run_ranks
from test_moe_parity import MODELS
from test_parity import (
    OPTIM,
    SEED,
    TINY,
    TOLERANCE,
    make_data,
    make_layout,
    one_process_cache,
    relative,
)

PEFT = PeftConfig("lora", lora_rank=4, lora_alpha=8.0, lora_dropout=0.0,
                  target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
LR = 1e-2  # large enough that B (zero at the start) and then A move in three steps
LAYOUTS = {  # name -> (world, Layout keywords, model)
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), TINY),
    "tp2": (2, dict(tensor_model_parallel_size=2), TINY),
    "ws3_padded": (3, dict(tensor_parallel_num_weight_shards=3), TINY),
    "ws2_ss2_cp2": (4, dict(tensor_parallel_num_weight_shards=2,
                            tensor_parallel_num_sequence_shards=2, context_parallel_size=2),
                    TINY),
    "pp2_dp2": (4, dict(pipeline_model_parallel_size=2), replace(TINY, num_layers=4)),
    "ep2": (2, dict(expert_model_parallel_size=2), MODELS["aux_z"]),
    "tp2_sp_ep2": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                           expert_model_parallel_size=2), MODELS["aux_z"]),
    # what a block's backward replays runs the adapters' hooks again, inside the bundle's gather
    "ws2_full_recompute": (2, dict(tensor_parallel_num_weight_shards=2), TINY),
    "tp2_sp_selective_recompute": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True),
                                   TINY),
}
OPTIONS = {"ws2_full_recompute": EngineOptions(recompute_granularity=RecomputeGranularity.full),
           "tp2_sp_selective_recompute": EngineOptions(
               recompute_granularity=RecomputeGranularity.selective)}
CASES = [*((name, torch.float64) for name in LAYOUTS), ("ws2_ss2_cp2", torch.float32)]


def train(rank: int, layout: Layout, batches: list[torch.Tensor], dtype: torch.dtype,
          model=TINY, options: EngineOptions = EngineOptions(), peft: PeftConfig = PEFT) -> dict:
    torch.set_default_dtype(dtype)
    engine = build_engine(model, OPTIM, SEED, layout, torch.device("cpu"), options, peft=peft)
    start = engine.model.full_state_dict()
    stats = engine.groups.world.stats
    stats.bytes.clear()
    losses, norms, graphs = [], [], []
    for batch in batches:
        micro_batches = rank_micro_batches(lambda idx, b=batch: b[idx], layout, rank)
        for mb in micro_batches:  # inputs may not hold the ignore marker; labels keep it
            mb.tokens = mb.tokens.clamp(min=0)
        step = train_step(engine.model, engine.optimizer, micro_batches, LR)
        losses.append(step.loss)
        norms.append(step.grad_norm)  # before clipping: every rank's gradients, counted once
        graphs.append(compiled_graphs())  # compiled so far (no recompile: the same each step)
    first_of_stage = not any(layout.coords(rank)[:-1])
    end = engine.model.full_state_dict()
    return {"losses": losses, "norms": norms, "graphs": graphs, "breaks": set(graph_breaks()),
            "start": start if first_of_stage else None,
            "end": end if first_of_stage else None, "bytes": dict(stats.bytes),
            "grads": [n for n, p in engine.model.module.named_parameters() if p.grad is not None],
            "trains": [n for n, p in engine.model.module.named_parameters() if p.requires_grad],
            "frozen_dtypes": {n: p.dtype for n, p in engine.model.module.named_parameters()
                              if not p.requires_grad}, "state": state_bytes(engine)}


@pytest.fixture(scope="module")
def one_process():
    return one_process_cache(lambda one, batches, dtype, model: run_ranks(
        1, train, one, batches, dtype, model)[0])


@pytest.mark.parametrize("name,dtype", [pytest.param(n, d, id=f"{n}-{str(d)[6:]}")
                                        for n, d in CASES])
def test_lora_under_a_layout_matches_one_process(name, dtype, one_process):
    world, kwargs, model = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    batches, ref = one_process(model, layout, dtype)
    results = run_ranks(world, train, layout, batches, dtype, model,
                        OPTIONS.get(name, EngineOptions()), timeout=180)
    end, start = {}, {}
    for result in results:
        end |= result["end"] or {}
        start |= result["start"] or {}
    assert set(end) == set(ref["end"])
    adapters = [n for n in ref["end"] if is_adapter(n)]
    worst = {n: relative(end[n], ref["end"][n]) for n in adapters}
    loss = max(relative(a, b) for a, b in zip(results[0]["losses"], ref["losses"]))
    norm = max(relative(a, b) for a, b in zip(results[0]["norms"], ref["norms"]))
    print(f"\nLoRA {name} {dtype}: loss {loss:.2e}, gradient norm {norm:.2e}, adapters "
          f"{max(worst.values()):.2e} (worst {max(worst, key=worst.get)})")
    assert loss <= TOLERANCE[dtype] and max(worst.values()) <= TOLERANCE[dtype], worst
    assert norm <= TOLERANCE[dtype]
    for n in adapters:  # every adapter trained: B from zero, then A
        assert relative(ref["end"][n], ref["start"][n]) > 1e-3, n
    if model.num_moe_experts:  # the routed experts' own, one per expert
        assert any(".experts." in n and ref["end"][n].ndim == 3 for n in adapters)
    for n in end:  # the base did not move, on any rank
        if not is_adapter(n):
            assert torch.equal(end[n], start[n]), n
    for result in results:  # only adapters train or hold gradients
        assert result["trains"] and all(is_adapter(n) for n in result["trains"])
        assert all(is_adapter(n) for n in result["grads"])


def test_compiled_lora_matches_one_process(one_process, tmp_path, monkeypatch):
    """train.compile=blocks with adapters (their forward hooks traced into each block's graph)
    under WS 2 in fp32: within test_parity's 1e-5 of the eager one-process run. Each rank
    compiles two graphs in the first step and none after, with no break: the first block's
    input carries no gradient (the frozen embedding feeds it), so it gets a graph of its own,
    and every later block runs the other."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    layout = make_layout(2, dict(tensor_parallel_num_weight_shards=2))
    batches, ref = one_process(TINY, layout, torch.float32)
    results = run_ranks(2, train, layout, batches, torch.float32, TINY,
                        EngineOptions(compile_blocks=True), timeout=300)
    adapters = [n for n in ref["end"] if is_adapter(n)]
    worst = max(relative(results[0]["end"][n], ref["end"][n]) for n in adapters)
    loss = max(relative(a, b) for a, b in zip(results[0]["losses"], ref["losses"]))
    print(f"\nLoRA ws2 compiled fp32: loss {loss:.2e}, adapters {worst:.2e}")
    assert loss <= TOLERANCE[torch.float32] and worst <= TOLERANCE[torch.float32]
    for result in results:  # the first step's two graphs, none after, no break
        assert result["graphs"] == [2] * len(batches) and not result["breaks"], result


BF16_BASE = replace(PEFT, base_precision=Precision.bf16)


@pytest.mark.parametrize("name", ["ws2_ss2_cp2", "pp2_dp2"])
def test_a_bf16_base_trains_as_the_fp32_base_does_in_bf16(name):
    """peft.base_precision=bf16 under train.precision=bf16: the frozen matrices are held in
    bf16 (autocast would round them so at each use), so the run equals the fp32 base's bit for
    bit, in half the bytes, which the plan counts (the embedding and norms stay fp32)."""
    world, kwargs, model = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    batches = make_data(layout.global_batch_size, model)
    bf16 = EngineOptions(Precision.bf16)
    half, full = (run_ranks(world, train, layout, batches, torch.float32, model, bf16, peft,
                            timeout=180) for peft in (BF16_BASE, PEFT))
    assert half[0]["losses"] == full[0]["losses"]
    for a, b in zip(half, full):
        for n in a["end"] or {}:  # the adapters alike, the base its fp32 values rounded
            assert torch.equal(a["end"][n], b["end"][n].to(a["end"][n].dtype)), n
        kept = a["frozen_dtypes"]  # matrices in bf16; the embedding and the norms in fp32
        assert all((d == torch.bfloat16) == ("norm" not in n and not n.startswith("embed."))
                   for n, d in kept.items()), kept
    planned = memory_per_stage(parameter_shapes(model, PEFT), model.num_layers, layout,
                               model.tie_word_embeddings, lora=True, base_bf16=True)
    for rank, result in enumerate(half):
        assert result["state"] == planned[layout.coords(rank)[-1]].total_bytes, rank
    print(f"\nbf16 base {name}: losses equal the fp32 base's, state {half[0]['state']:,} B "
          f"(fp32 base {full[0]['state']:,} B)")
    assert half[0]["state"] < full[0]["state"]


def test_weight_shards_send_the_adapters_gradients_only():
    """Under WS 2 the gradient reduce-scatter over GTP_remat carries the adapters' split
    factors (their rows padded to the shard count), not the frozen base: the bytes of every
    step's messages are the adapters' alone."""
    layout = make_layout(2, dict(tensor_parallel_num_weight_shards=2))
    batches = make_data(layout.global_batch_size)
    result = run_ranks(2, train, layout, batches, torch.float64)[0]
    shapes = parameter_shapes(TINY, PEFT)
    # split factors over GTP_remat: B of a column projection, A of a row one (1 of 2 rows each)
    split = [s for n, s in shapes.items() if is_adapter(n) and (
        ("qkv_lora" in n or "gate_up_lora" in n) == n.endswith("lora_B.weight"))]
    per_message = sum(layout.shard_rows(rows) * cols for rows, cols in split)
    passes = len(batches) * layout.num_microbatches  # each pass through a block reduces once
    sent = result["bytes"].get(("gtp_remat", "reduce_scatter"), 0)
    print(f"\nWS 2 gradient reduce-scatter: {sent:,} B sent, adapters' {per_message:,} "
          f"elements x {passes} passes")
    assert sent == (layout.gtp_remat_size - 1) * per_message * 8 * passes


def measured_state(rank: int, layout: Layout, model) -> int:
    engine = build_engine(model, OPTIM, SEED, layout, torch.device("cpu"), peft=PEFT)
    micro_batches = rank_micro_batches(
        lambda idx: make_data(layout.global_batch_size, model)[0].clamp(min=0)[idx],
        layout, rank)
    train_step(engine.model, engine.optimizer, micro_batches, LR)  # Adam's moments exist
    return state_bytes(engine)


@pytest.mark.parametrize("name", ["tp2_sp", "ws3_padded", "pp2_dp2", "tp2_sp_ep2"])
def test_the_planned_lora_state_is_what_the_ranks_allocate(name):
    """Weights (the frozen base's shards and the adapters), the adapters' gradients and Adam
    state: planned bytes equal the allocated ones on every rank."""
    world, kwargs, model = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    measured = run_ranks(world, measured_state, layout, model)
    planned = memory_per_stage(parameter_shapes(model, PEFT), model.num_layers, layout,
                               model.tie_word_embeddings, lora=True)
    for rank, got in enumerate(measured):
        want = planned[layout.coords(rank)[-1]].total_bytes
        assert got == want, (rank, got, want)
    full = memory_per_stage(parameter_shapes(model), model.num_layers, layout,
                            model.tie_word_embeddings)
    print(f"\nLoRA state {name}: {measured[0]:,} B a rank, full fine-tuning "
          f"{full[0].total_bytes:,} B ({measured[0] / full[0].total_bytes:.3f})")
