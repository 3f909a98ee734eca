"""train.objective=dpo on packed preference pairs: every layout equals one process (fp64 at
1e-10, fp32 at 1e-5), the first step's loss is ln 2 (policy and reference are the same model),
and the reference is the base: the model with its adapters off (peft=lora), or a frozen copy
(full fine-tuning).

The pairs are prepared by trainer.prepare's own code (--preference, byte tokenizer) and packed
whole by the sample stream, so a pair's two documents are in one sample, apart; under context
parallel a document's tokens sit on several ranks (its log-probability sums meet in one
all-reduce), under pipelines the loss is on the last stage.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from parallel.layout import Layout
from trainer.config import DpoConfig, PeftConfig
from trainer.data.dataset import TokenDataset, prepare
from trainer.data.stream import SampleStream
from trainer.model.lora import adapters_off
from trainer.parts.lora import is_adapter
from trainer.train.batch import DocumentRules, rank_micro_batches
from trainer.train.dpo import Dpo
from trainer.train.engine import build_engine, build_reference
from trainer.train.step import train_step

from harness import run_ranks
from test_moe_parity import MODELS
from test_parity import OPTIM, SEED, TINY, TOLERANCE, make_layout, one_process_of, relative

PEFT = PeftConfig("lora", lora_rank=4, lora_alpha=8.0, lora_dropout=0.0,
                  target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
SEQ, MICRO, STEPS, LR = 64, 2, 3, 1e-2
RULES = DocumentRules(reset_attention_mask=True, reset_position_ids=True)
DPO = DpoConfig(beta=0.1, loss_type="sigmoid", label_smoothing=0.0)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """Arithmetic prompts with a right and a wrong answer, through prepare --preference."""
    src = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    gen = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(120):
        a, b, off = (int(v) for v in torch.randint(1, 60, (3,), generator=gen))
        lines.append(json.dumps({"prompt": f"{a} + {b} = ", "chosen": f"{a + b}.",
                                 "rejected": f"{a + b + off}, I think."}))
    src.write_text("\n".join(lines) + "\n")
    return prepare(src, tmp_path_factory.mktemp("data") / "pairs", 0.0, preference=True)


def train(rank: int, layout: Layout, data: Path, dtype: torch.dtype, model, peft, cfg) -> dict:
    torch.set_default_dtype(dtype)
    engine = build_engine(model, OPTIM, SEED, layout, torch.device("cpu"), peft=peft)
    if peft is not None:
        dpo = Dpo(cfg, None, functools.partial(adapters_off, engine.model.module))
    else:  # full fine-tuning: a frozen copy at the same start
        dpo = Dpo(cfg, build_reference(model, SEED, engine, torch.device("cpu")))
    stream = SampleStream(TokenDataset.open(data), "train", SEQ, 0, shuffle=False, pack=True)
    losses, metrics = [], []
    for step in range(STEPS):
        micro_batches = rank_micro_batches(stream, layout, rank, rules=RULES,
                                           offset=step * layout.global_batch_size)
        result = train_step(engine.model, engine.optimizer, micro_batches, LR, dpo=dpo)
        losses.append(result.loss)
        metrics.append(result.dpo)
    params = engine.model.full_state_dict()  # collective: this rank's pipeline stage
    first_of_stage = not any(layout.coords(rank)[:-1])
    return {"losses": losses, "metrics": metrics, "params": params if first_of_stage else None}


LAYOUTS = {  # name -> (world, Layout keywords, model, peft)
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), TINY, PEFT),
    "cp2": (2, dict(context_parallel_size=2), TINY, PEFT),
    "ws2_ss2": (4, dict(tensor_parallel_num_weight_shards=2,
                        tensor_parallel_num_sequence_shards=2), TINY, PEFT),
    "pp2_dp2": (4, dict(pipeline_model_parallel_size=2), replace(TINY, num_layers=4), PEFT),
    "ep2": (2, dict(expert_model_parallel_size=2), MODELS["aux_z"], PEFT),
    "full_tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), TINY, None),
}
CASES = [*((n, torch.float64) for n in LAYOUTS), ("cp2", torch.float32)]


@pytest.fixture(scope="module")
def one_process(pairs):
    cache: dict[tuple, dict] = {}

    def get(layout: Layout, dtype: torch.dtype, model, peft) -> dict:
        samples = layout.micro_batch_size * layout.batch_parallel_size
        key = (repr(model), repr(peft), layout.global_batch_size, samples, dtype)
        if key not in cache:
            cache[key] = run_ranks(1, train, one_process_of(layout), pairs, dtype, model, peft,
                                   DPO)[0]
        return cache[key]

    return get


def layout_of(world: int, kwargs: dict) -> Layout:
    base = make_layout(world, kwargs)
    return Layout(world, micro_batch_size=MICRO, seq_length=SEQ,
                  global_batch_size=base.global_batch_size, **kwargs)


@pytest.mark.parametrize("name,dtype", [pytest.param(n, d, id=f"{n}-{str(d)[6:]}")
                                        for n, d in CASES])
def test_dpo_under_a_layout_matches_one_process(name, dtype, pairs, one_process):
    world, kwargs, model, peft = LAYOUTS[name]
    layout = layout_of(world, kwargs)
    ref = one_process(layout, dtype, model, peft)
    results = run_ranks(world, train, layout, pairs, dtype, model, peft, DPO, timeout=180)
    params = {}
    for result in results:
        params |= result["params"] or {}
    trained = [n for n in ref["params"] if peft is None or is_adapter(n)]
    worst = {n: relative(params[n], ref["params"][n]) for n in trained}
    loss = max(relative(a, b) for a, b in zip(results[0]["losses"], ref["losses"]))
    margins = max(abs(a["rewards/margins"] - b["rewards/margins"])
                  for a, b in zip(results[0]["metrics"], ref["metrics"]))
    print(f"\nDPO {name} {dtype}: loss {loss:.2e}, parameters {max(worst.values()):.2e} "
          f"(worst {max(worst, key=worst.get)}), margins {margins:.1e}")
    assert loss <= TOLERANCE[dtype] and max(worst.values()) <= TOLERANCE[dtype], worst
    # the policy starts as its reference: ln 2, no margin
    assert ref["losses"][0] == pytest.approx(math.log(2), rel=1e-12 if dtype == torch.float64
                                             else 1e-6)
    assert ref["metrics"][0]["rewards/margins"] == 0.0
    assert ref["metrics"][-1]["rewards/margins"] != 0.0  # it trained


def counted_transients(rank: int, layout: Layout, data: Path, model, peft, cfg) -> int:
    """The micro-batches' transient of a second step (the reference pass included), counted
    by the allocator above the state, as the measured dry run counts an LM step's."""
    from trainer.train.allocations import Allocations

    engine = build_engine(model, OPTIM, SEED, layout, torch.device("cpu"), peft=peft)
    dpo = None if cfg is None else \
        Dpo(cfg, None, functools.partial(adapters_off, engine.model.module)) if peft else \
        Dpo(cfg, build_reference(model, SEED, engine, torch.device("cpu")))
    stream = SampleStream(TokenDataset.open(data), "train", MEMORY_SEQ, 0, shuffle=False,
                          pack=True)
    micro_batches = rank_micro_batches(stream, layout, rank, rules=RULES)
    train_step(engine.model, engine.optimizer, micro_batches, LR, dpo=dpo)
    with Allocations() as counted:
        train_step(engine.model, engine.optimizer, micro_batches, LR, counted.mark, dpo=dpo)
    return counted.phase("micro_batches").transient_bytes


MEMORY_SEQ = 512
MEMORY_MODEL = replace(TINY, vocab_size=512, hidden_size=256, num_heads=4, ffn_hidden_size=688)


@pytest.mark.parametrize("peft", [PEFT, None], ids=["lora", "full"])
def test_a_dpo_step_holds_what_an_lm_step_holds(peft, pairs):
    """The reference pass (adapters off, or the frozen copy) runs without gradients before the
    policy's micro-batches: it adds nothing to their peak, so the memory plan's step (an LM
    step's) stands for a DPO step's. The allocator counts both on the same packed pairs."""
    layout = Layout(1, micro_batch_size=2, seq_length=MEMORY_SEQ, global_batch_size=4)
    dpo, lm = (run_ranks(1, counted_transients, layout, pairs, MEMORY_MODEL, peft, cfg)[0]
               for cfg in (DPO, None))
    print(f"\nDPO step ({'LoRA' if peft else 'full'}): micro-batches {dpo:,} B, an LM step's "
          f"{lm:,} B ({dpo / lm - 1:+.2%})")
    assert abs(dpo / lm - 1) < 0.02
