"""Benchmark: our GTP_remat weight sharding (TP 1, weight shards = world) against PyTorch FSDP2.

Both train the same Transformer (same config and init seed) on the same batches (rank r takes
samples [r*M, (r+1)*M) of each global batch), divide the summed token loss by the global token
count, sum gradients over ranks (FSDP2 averages by default; we make it sum) and use the same
AdamW (foreach=False, clipping at 1.0). Each repetition of each implementation runs in fresh
forked gloo ranks. Not a test: it prints step times, memory and their ratio ours / fsdp2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

# Imported here, once, rather than lazily in every forked rank (1-5 s each on a busy machine):
# torch.optim imports torch._dynamo on first use, fully_shard the DTensor machinery.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from ranks import run_ranks  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import ModelConfig, OptimConfig  # noqa: E402
from trainer.model.transformer import Transformer  # noqa: E402
from trainer.train.batch import rank_micro_batches  # noqa: E402
from trainer.train.engine import build_engine  # noqa: E402
from trainer.train.step import train_step  # noqa: E402

MODEL = ModelConfig(name="llama", vocab_size=256, hidden_size=256, num_layers=4, num_heads=8,
                    ffn_hidden_size=688, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02)
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
MICRO, SEQ, SEED, LR = 4, 128, 1234, 1e-3  # each rank: one micro-batch of MICRO x SEQ tokens
MODES = {"quick": dict(warmup=2, steps=6, repeats=3), "full": dict(warmup=5, steps=30, repeats=5)}
TOLERANCE = 1e-5  # relative; both compute the same sums in fp32, in a different order
IMPLS = ("ours", "fsdp2")

# A rank's step: global batch [GBS, SEQ + 1] -> (global mean token loss, gradient norm).
Step = Callable[[torch.Tensor], tuple[float, float]]


def make_layout(world: int) -> Layout:
    """One micro-batch per rank: rank r's lane is samples [r * MICRO, (r + 1) * MICRO)."""
    return Layout(world, tensor_parallel_num_weight_shards=world, micro_batch_size=MICRO,
                  global_batch_size=MICRO * world, seq_length=SEQ)


def make_batches(count: int, world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, MODEL.vocab_size, (MICRO * world, SEQ + 1), generator=gen)
            for _ in range(count)]


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors` (DTensors: their local shard), each counted once:
    parameters living as views into one flat buffer count the buffer, padding included."""
    storages = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def optimizer_tensors(adam: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in adam.state.values() for t in state.values()
            if isinstance(t, torch.Tensor)]


def build_ours(rank: int, world: int) -> tuple[Step, Callable[[], int]]:
    layout = make_layout(world)
    assert layout.micro_batch_samples(layout.batch_partition(rank), 0) == range(
        rank * MICRO, (rank + 1) * MICRO), "both implementations must see the same samples"
    engine = build_engine(MODEL, OPTIM, SEED, layout, torch.device("cpu"))

    def step(batch: torch.Tensor) -> tuple[float, float]:
        micro_batches = rank_micro_batches(lambda idx: batch[idx], layout, rank)
        result = train_step(engine.model, engine.optimizer, micro_batches, LR)
        return result.loss, result.grad_norm

    def held() -> int:
        params = list(engine.model.parameters())
        return held_bytes(params + [p.grad for p in params if p.grad is not None]
                          + optimizer_tensors(engine.optimizer.adam))

    return step, held


def build_fsdp2(rank: int, world: int) -> tuple[Step, Callable[[], int]]:
    model = Transformer(MODEL)
    model.init_weights(SEED)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, do not average, over ranks: the loss is already divided by the global token
            # count. A divide factor alone would ask gloo for PREMUL_SUM, which it lacks; forcing
            # sum reductions makes FSDP2 reduce with SUM and divide by 1 (a no-op) afterwards.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    params = list(model.parameters())
    adam = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": OPTIM.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=LR, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps, foreach=False)

    def step(batch: torch.Tensor) -> tuple[float, float]:
        rows = batch[rank * MICRO:(rank + 1) * MICRO]
        inputs, labels = rows[:, :-1], rows[:, 1:]
        count = torch.tensor(float(labels.numel()), dtype=torch.float64)
        dist.all_reduce(count)  # as train_step: the global loss-token count
        adam.zero_grad()
        logits = model(inputs)
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                   reduction="sum")
        (loss_sum / count.item()).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, OPTIM.clip_grad)
        adam.step()
        total = loss_sum.detach().double()
        dist.all_reduce(total)
        return total.item() / count.item(), grad_norm.full_tensor().item()

    def held() -> int:
        return held_bytes(params + [p.grad for p in params if p.grad is not None]
                          + optimizer_tensors(adam))

    return step, held


BUILDERS = {"ours": build_ours, "fsdp2": build_fsdp2}


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). A forked child starts at its RSS at fork."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def run_rank(rank: int, world: int, impl: str, warmup: int, steps: int) -> dict:
    batches = make_batches(warmup + steps, world)
    before = peak_rss_bytes()
    step, held = BUILDERS[impl](rank, world)
    firsts, times = None, []
    for batch in batches:
        dist.barrier()  # every rank starts the step together; the step ends in an all-reduce
        start = time.perf_counter()
        loss, grad_norm = step(batch)
        times.append(time.perf_counter() - start)
        firsts = firsts or {"first_loss": loss, "first_grad_norm": grad_norm}
    return {"times": times[warmup:], **firsts, "held": held(),
            "rss": peak_rss_bytes() - before}


def measure(world: int, quick: bool = True) -> dict:
    """Step time (median over repetitions of each repetition's mean step, a step timed by its
    slowest rank), its min/max, ours / fsdp2, and per-rank memory for both implementations."""
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("measure() forks its ranks: call it without a process group")
    mode = MODES["quick" if quick else "full"]
    started = time.monotonic()
    reps: dict[str, list[list[dict]]] = {impl: [] for impl in IMPLS}
    for _ in range(mode["repeats"]):
        for impl in IMPLS:  # interleaved, so drifting machine load hits both alike
            reps[impl].append(run_ranks(world, run_rank, world, impl, mode["warmup"],
                                        mode["steps"], timeout=300))
    out: dict = {"world": world, "mode": "quick" if quick else "full",
                 "warmup_steps": mode["warmup"], "timed_steps": mode["steps"],
                 "repetitions": mode["repeats"], "micro_batch_size": MICRO, "seq_length": SEQ,
                 "parameters": sum(p.numel() for p in Transformer(MODEL).parameters())}
    for impl, runs in reps.items():
        means = [statistics.fmean(map(max, zip(*(r["times"] for r in ranks)))) for ranks in runs]
        out[impl] = {
            "step_s_median": statistics.median(means), "step_s_min": min(means),
            "step_s_max": max(means), "step_s_reps": means,
            "peak_rss_increase_bytes_per_rank": [
                int(statistics.median(run[rank]["rss"] for run in runs)) for rank in range(world)],
            "persistent_bytes_per_rank": [r["held"] for r in runs[0]],
            "first_loss": runs[0][0]["first_loss"],
            "first_grad_norm": runs[0][0]["first_grad_norm"],
        }
    check_same_computation(out)
    out["ratio"] = out["ours"]["step_s_median"] / out["fsdp2"]["step_s_median"]
    out["wall_s"] = time.monotonic() - started
    return out


def check_same_computation(out: dict) -> None:
    """A comparison of different computations would be meaningless. The gradient norm also
    catches gradients averaged instead of summed, which the loss (and AdamW) would not."""
    for key in ("first_loss", "first_grad_norm"):
        ours, fsdp2 = out["ours"][key], out["fsdp2"][key]
        out[f"{key}_relative_difference"] = difference = abs(ours - fsdp2) / abs(fsdp2)
        if difference > TOLERANCE:
            raise RuntimeError(f"{key.replace('_', ' ')} differs: ours {ours!r}, fsdp2 "
                               f"{fsdp2!r} (relative {difference:.2e} > {TOLERANCE}): the two "
                               f"implementations do not compute the same thing")


def print_table(result: dict) -> None:
    mib = 2 ** 20
    print(f"\nworld {result['world']}, {result['mode']}: {result['warmup_steps']} warm-up + "
          f"{result['timed_steps']} timed steps x {result['repetitions']} repetitions; "
          f"{result['parameters'] / 1e6:.2f}M parameters; micro-batch {result['micro_batch_size']}"
          f" x seq {result['seq_length']} per rank; {result['wall_s']:.1f} s")
    print(f"{'impl':<6} {'step s: median [min, max]':<28} {'peak RSS +MiB/rank':<20} "
          f"{'persistent MiB/rank':<20} first loss")
    for impl in IMPLS:
        r = result[impl]
        rss = max(r["peak_rss_increase_bytes_per_rank"]) / mib
        held = max(r["persistent_bytes_per_rank"]) / mib
        spread = f"{r['step_s_median']:.4f} [{r['step_s_min']:.4f}, {r['step_s_max']:.4f}]"
        print(f"{impl:<6} {spread:<28} {rss:<20.1f} {held:<20.2f} {r['first_loss']:.6f}")
    print(f"ratio ours / fsdp2: {result['ratio']:.3f} (goal <= 1.0)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2], help="ranks (one or more)")
    parser.add_argument("--full", action="store_true", help="more steps and repetitions")
    args = parser.parse_args()
    for world in args.world:
        result = measure(world, quick=not args.full)
        print_table(result)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
