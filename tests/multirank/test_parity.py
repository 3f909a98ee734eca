"""Parity: every layout trains the same model as one process on the same global batch.

Each case trains model=tiny for 3 optimizer steps of 2 micro-batches per batch lane with the
trainer's own step (trainer.step.train_step) on gloo ranks, and compares per-step loss, gradient
norm and the final full parameters with a plain single-process loop (torch AdamW,
clip_grad_norm_, F.cross_entropy). About a tenth of the labels are ignored, at random, so ranks
hold different numbers of loss tokens and the loss normalisation is really tested.

Tolerance. A layout changes only the order of float sums (all-reduce, split matmuls, the
vocab-parallel softmax). In fp32 that moves losses and gradient norms by about 1e-7 relative
and parameters by up to a few 1e-6 (in the 2-norm): AdamW divides each gradient by its own
magnitude, so the few elements whose gradient nearly cancels (|g| ~ 1e-8, near eps) carry the
rounding into the update. We assert 1e-5. The same cases in fp64 agree to about 1e-13, which
shows the engine itself is exact; there we assert 1e-10.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from parallel.layout import Layout
from trainer.config import ModelConfig, OptimConfig, Precision
from trainer.model.transformer import Transformer
from trainer.plan.options import EngineOptions
from trainer.train import routing
from trainer.train.batch import rank_micro_batches
from trainer.train.compile import graphs as compiled_graphs
from trainer.train.engine import build_engine
from trainer.train.step import IGNORE, train_step

from harness import run_ranks

TINY = ModelConfig(name="llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                   ffn_hidden_size=176, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02)
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
STEPS, MICRO, MICRO_BATCHES, SEQ, SEED = 3, 2, 2, 32, 1234
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
LRS = (1e-3, 1e-3, 5e-4)
MOVED = "layers.0.attn.o.weight"  # a weight training must move

# name -> (world size, Layout keyword arguments)
LAYOUTS = {
    "dp2": (2, {}),
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "ws2": (2, dict(tensor_parallel_num_weight_shards=2)),
    "ws4": (4, dict(tensor_parallel_num_weight_shards=4)),
    "ws4_ss2": (4, dict(tensor_parallel_num_weight_shards=4,
                        tensor_parallel_num_sequence_shards=2)),
    "ws2_dp2": (4, dict(tensor_parallel_num_weight_shards=2)),
    # Branches: TP without SP under weight sharding; CP with TP but no SP; rows that do not
    # divide over GTP_remat (64-row weights over 3 shards: padding).
    "tp2_ws4": (4, dict(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=4)),
    "tp2_cp2": (4, dict(tensor_model_parallel_size=2, context_parallel_size=2)),
    "ws3_padded": (3, dict(tensor_parallel_num_weight_shards=3)),
}
# Context-parallel layouts; tests/multirank/test_context_parallel.py runs each under every
# cp_comm_type (the other tests here use some of them under the default, p2p).
CONTEXT_LAYOUTS = {
    "cp2": (2, dict(context_parallel_size=2)),
    "cp4": (4, dict(context_parallel_size=4)),
    "cp2_ws2_ss2": (4, dict(context_parallel_size=2, tensor_parallel_num_weight_shards=2,
                            tensor_parallel_num_sequence_shards=2)),
    "every_axis": (8, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                           tensor_parallel_num_weight_shards=4,
                           tensor_parallel_num_sequence_shards=4, context_parallel_size=2)),
    "runtime_cp8": (8, dict(context_parallel_size=2, tensor_parallel_num_weight_shards=4,
                            tensor_parallel_num_sequence_shards=4)),
}
NON_CONTEXT = list(LAYOUTS)
LAYOUTS |= CONTEXT_LAYOUTS


def make_layout(world: int, kwargs: dict, micro_batches: int = MICRO_BATCHES) -> Layout:
    # The batch lanes do not depend on interleaving, whose own rule needs the batch first.
    lanes = Layout(world, **{k: v for k, v in kwargs.items()
                             if k != "virtual_pipeline_model_parallel_size"}).batch_parallel_size
    return Layout(world, micro_batch_size=MICRO, seq_length=SEQ,
                  global_batch_size=MICRO * lanes * micro_batches, **kwargs)


def one_process_of(layout: Layout) -> Layout:
    """One process running `layout`'s global batch: a micro-batch of as many samples as the
    layout's batch lanes run at once, so the micro-batches sum in the same groups."""
    samples = layout.micro_batch_size * layout.batch_parallel_size
    return Layout(1, micro_batch_size=samples, seq_length=layout.seq_length,
                  global_batch_size=layout.global_batch_size)


def one_process_cache(run: Callable[..., dict]) -> Callable:
    """get(model, layout, dtype, *extra) -> (batches, run(one_process_of(layout), batches,
    dtype, model, *extra)): a suite's one-process reference on a layout's global batch (extra:
    its own settings, an optimizer config), each computed once."""
    cache: dict[tuple, tuple] = {}

    def get(model: ModelConfig, layout: Layout, dtype: torch.dtype, *extra) -> tuple[list, dict]:
        samples = layout.micro_batch_size * layout.batch_parallel_size
        key = (repr(model), layout.global_batch_size, samples, dtype, repr(extra))
        if key not in cache:
            batches = make_data(layout.global_batch_size, model)
            cache[key] = (batches, run(one_process_of(layout), batches, dtype, model, *extra))
        return cache[key]

    return get


def make_data(global_batch_size: int, model: ModelConfig = TINY) -> list[torch.Tensor]:
    """STEPS global batches of [GBS, SEQ + 1] tokens; label positions to ignore are marked by
    setting the token to IGNORE (only in positions 1.., which are labels only)."""
    gen = torch.Generator().manual_seed(SEED)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, model.vocab_size, (global_batch_size, SEQ + 1), generator=gen)
        ignored = torch.rand(global_batch_size, SEQ + 1, generator=gen) < 0.1
        ignored[:, 0] = False
        batches.append(torch.where(ignored, IGNORE, tokens))
    return batches


class _OneProcess:
    """The sums over ranks of a mixture of experts' step, in one process."""

    size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


ONE_PROCESS = type("Groups", (), {"token_distinct": _OneProcess()})()


def reference_model(model_cfg: ModelConfig) -> tuple[Transformer, torch.optim.AdamW,
                                                     torch.Tensor]:
    """The plain model at the layouts' initial weights, torch's AdamW (decay on matrices only,
    as the sharded optimizer) and a copy of the first attention's output projection (training
    must move it; every attention part has one)."""
    model = Transformer(model_cfg)
    model.init_weights(SEED)
    initial_q = model.get_parameter(MOVED).detach().clone()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPTIM.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps, foreach=False)
    return model, opt, initial_q


def reference_update(model: Transformer, opt: torch.optim.AdamW, lr: float) -> float:
    """Clip as the trainer does, step at `lr`; the gradient norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad).item()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    return norm


def reference_backward(model: Transformer, batch: torch.Tensor, samples: int) -> float:
    """One global batch's forward and backward in micro-batches of `samples`, the loss summed
    over its tokens and divided by their count (as the trainer's step); the loss."""
    inputs, labels = batch[:, :-1].clamp(min=0), batch[:, 1:]
    count = int((labels != IGNORE).sum())
    total = 0.0
    for x, y in zip(inputs.split(samples), labels.split(samples)):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum",
                               ignore_index=IGNORE) / count
        loss.backward()
        total += loss.item()
    return total


def reference(rank: int, batches: list[torch.Tensor], dtype: torch.dtype,
              model_cfg: ModelConfig = TINY, samples: int = MICRO) -> dict:
    """The plain single-process loop the layouts must match (run in a child process too, so
    the test process itself never changes its default dtype), in micro-batches of `samples`
    (a mixture of experts' balance losses are over a layout's whole micro-batch: micro x
    batch_parallel_size samples)."""
    torch.set_default_dtype(dtype)
    model, opt, initial_q = reference_model(model_cfg)
    losses, norms, moe = [], [], []
    for batch, lr in zip(batches, LRS):
        opt.zero_grad()
        routing.begin(model, len(batch) // samples)
        total = reference_backward(model, batch, samples)
        norms.append(reference_update(model, opt, lr))
        moe.append(routing.finish(model, ONE_PROCESS))  # an expert bias moves after the update
        losses.append(total)
    params = {name: p.detach() for name, p in model.named_parameters()}  # a tied weight once
    return {"losses": losses, "norms": norms, "params": params, "initial_q": initial_q,
            "moe": moe, "biases": {n: b.detach() for n, b in model.named_buffers()}}


def train_rank(rank: int, layout: Layout, batches: list[torch.Tensor], dtype: torch.dtype,
               options: EngineOptions = EngineOptions(), model: ModelConfig = TINY,
               optim: OptimConfig = OPTIM) -> dict:
    torch.set_default_dtype(dtype)
    engine = build_engine(model, optim, SEED, layout, torch.device("cpu"), options)
    losses, norms, moe, graphs = [], [], [], []
    for batch, lr in zip(batches, LRS):
        micro_batches = rank_micro_batches(lambda idx, b=batch: b[idx], layout, rank)
        for mb in micro_batches:  # inputs may not hold the ignore marker; labels keep it
            mb.tokens = mb.tokens.clamp(min=0)
        result = train_step(engine.model, engine.optimizer, micro_batches, lr)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        moe.append(result.moe)
        if options.compile_blocks:  # graphs compiled so far (test_compile: no recompile)
            graphs.append(compiled_graphs())
    params = engine.model.full_state_dict()  # this rank's pipeline stage
    first_of_stage = not any(layout.coords(rank)[:-1])
    return {"losses": losses, "norms": norms, "params": params if first_of_stage else None,
            "moe": moe, "biases": {n: b.detach() for n, b in engine.model.module.named_buffers()},
            "graphs": graphs}


def case_id(case: tuple) -> str:
    """A (layout, model, dtype, options) case's test id: the layout, the model, the CP type
    where the layout has CP and the recompute granularity where set, then the dtype."""
    layout, model, dtype, options = case
    extra = [options.cp_comm_type.value] if "cp" in layout or layout == "every_axis" else []
    if options.recompute_granularity is not None:
        extra.append(options.recompute_granularity.value)
    return "_".join([layout, model, *extra]) + f"-{str(dtype)[6:]}"


def relative(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    """||a - b|| / ||b|| (a scalar's relative error; a tensor's in the 2-norm)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def reference_cache():
    """get(global_batch_size, dtype, model) -> (batches, the one-process reference), each
    computed once."""
    cache: dict[tuple, tuple] = {}

    def get(global_batch_size: int, dtype: torch.dtype, model: ModelConfig = TINY):
        key = (global_batch_size, dtype, repr(model))
        if key not in cache:
            batches = make_data(global_batch_size, model)
            cache[key] = (batches, run_ranks(1, reference, batches, dtype, model)[0])
        return cache[key]

    return get


@pytest.fixture(scope="module")
def references():
    return reference_cache()


def assert_parity(results: list[dict], ref: dict, dtype: torch.dtype, label: str) -> None:
    """Every rank reports the same loss and norm; loss, norm and full parameters match the
    one-process reference within TOLERANCE, after training really moved the weights."""
    for result in results:
        assert result["losses"] == results[0]["losses"]
        assert result["norms"] == results[0]["norms"]
    got = {**results[0], "params": {}}  # every pipeline stage's first rank has its stage's
    for result in results:
        got["params"] |= result["params"] or {}
    by_param = {k: relative(got["params"][k], v) for k, v in ref["params"].items()}
    worst = {
        "loss": max(relative(a, b) for a, b in zip(got["losses"], ref["losses"])),
        "grad_norm": max(relative(a, b) for a, b in zip(got["norms"], ref["norms"])),
        "params": max(by_param.values()),
    }
    print(f"\nparity {label} {dtype}: max relative difference {worst} (worst parameter: "
          f"{max(by_param, key=by_param.get)})")
    assert set(got["params"]) == set(ref["params"])
    assert all(value <= TOLERANCE[dtype] for value in worst.values()), worst
    # Training moved the weights: a parity of untouched weights would prove nothing.
    assert relative(got["params"][MOVED], ref["initial_q"]) > 1e-3


# fp64 shows the engine exact on the layouts that reach every code path: data parallel, TP with
# SP, sequence shards, TP without SP under weight shards, padded rows.
FP64 = ("dp2", "tp2_sp", "ws4_ss2", "tp2_ws4", "ws3_padded")
PARAMS = [pytest.param(name, dtype, id=f"{name}-{label}") for name in NON_CONTEXT
          for dtype, label in ((torch.float32, "fp32"), (torch.float64, "fp64"))
          if dtype == torch.float32 or name in FP64]


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_layout_matches_one_process(name, dtype, references):
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    batches, ref = references(layout.global_batch_size, dtype)
    results = run_ranks(world, train_rank, layout, batches, dtype, timeout=120)
    assert_parity(results, ref, dtype, f"{name} (world {world})")


@pytest.mark.parametrize("name", ["ws2", "tp2_sp", "cp2_ws2_ss2"])
def test_bf16_autocast_trains_close_to_fp32(name, references):
    """bf16 changes the arithmetic, so no parity: the losses stay within bf16 rounding of the
    fp32 reference, and differ from it (autocast really ran)."""
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    batches, ref = references(layout.global_batch_size, torch.float32)
    got = run_ranks(world, train_rank, layout, batches, torch.float32,
                    EngineOptions(Precision.bf16), timeout=120)[0]
    assert_close_to_fp32(got, ref, f"bf16 {name}")


def assert_close_to_fp32(got: dict, ref: dict, label: str) -> None:
    """A bf16 run's losses and norms within bf16 rounding of the fp32 reference, and not
    equal to it (autocast really ran)."""
    losses = [relative(a, b) for a, b in zip(got["losses"], ref["losses"])]
    norms = [relative(a, b) for a, b in zip(got["norms"], ref["norms"])]
    print(f"\n{label}: relative differences to fp32: loss {losses}, grad norm {norms}")
    assert max(losses) < 1e-2 and max(norms) < 5e-2
    assert max(norms) > 1e-4  # far above fp32 rounding (1e-7): the compute was bf16
