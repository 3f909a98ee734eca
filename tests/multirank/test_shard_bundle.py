"""ShardBundle makes no assumption on how often a member runs per forward, nor on activation
recompute: a chain of blocks that use each of their sharded linears twice gives the outputs
and summed gradients of one process in fp64, without recompute and with the block's forward run
again inside backward, whether the replay fires the block's hooks (checkpoint around the
block's __call__, as trainer.train.recompute does) or not (an instance `forward` overridden
by a checkpointed one). A replay takes the backward's gather (one gather for recompute and
backward, not two), counts no use, and its weights are freed with the backward's. With overlap
(neighbours linked, a gradient-reduce queue) the results are identical, at most two blocks'
weights are alive at once (one without), and the early collectives really are asynchronous.
Compiled (torch.compile of each block, as train.compile=blocks), the same within fp64 rounding:
the first block's input needs no gradient, so a compiled backward would drop its linears'
operators (nothing uses their input gradients) and lose their weight gradients; bundled_linear
runs those eagerly. 2 gloo ranks, weight shards 2, rows that 2 does not divide (padding)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel import comm
from parallel.bundle import GradReduceQueue, ShardBundle, compile_ready, link
from parallel.comm import CommStats
from parallel.groups import build_groups
from parallel.layout import Layout
from parallel.tensor import ParallelLinear

from harness import run_ranks

BLOCKS = 3


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 5, bias=False), nn.Linear(5, 6, bias=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.b(self.a(0.5 * x))


def make_blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Twice() for _ in range(BLOCKS))).double()


def make_input(rank: int) -> torch.Tensor:
    return torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))


def reference(world: int) -> tuple[dict, list]:
    blocks = make_blocks()
    outs = []
    for rank in range(world):
        out = blocks(make_input(rank))
        out.square().sum().backward()
        outs.append(out.detach())
    return {n: p.grad for n, p in blocks.named_parameters()}, outs


def override_forward(block: nn.Module) -> None:
    """Recompute whose replay bypasses the block's hooks (only its forward runs again)."""
    forward = block.forward
    block.forward = lambda x: checkpoint(forward, x, use_reentrant=False)


def run_chain(rank: int, recompute: str | None, overlap: bool) -> dict:
    groups = build_groups(Layout(2, tensor_parallel_num_weight_shards=2), CommStats())
    blocks, queue = make_blocks(), GradReduceQueue() if overlap else None
    bundles, peak = [], [0]
    for block in blocks:
        bundle = ShardBundle(groups.gtp_remat, reduce_queue=queue)
        for name in ("a", "b"):
            layer = ParallelLinear(getattr(block, name), "column", groups.tp, groups.gtp_remat,
                                   False, name)
            layer.join_bundle(bundle)
            setattr(block, name, layer)
        block.register_forward_hook(lambda *args, bundle=bundle: bundle.release_forward())
        if recompute == "override":
            override_forward(block)
        if recompute == "compiled":
            comm.compile_ready()
            compile_ready()
            block.compile()

        def census(early=False, gather=bundle._gather):  # weight sets alive with the new one
            peak[0] = max(peak[0], 1 + sum(b.live_gathers() for b in bundles))
            return gather(early)

        bundle._gather = census
        bundles.append(bundle)
    if overlap:
        link(bundles)
    x = make_input(rank)
    out = x
    for block in blocks:
        out = checkpoint(block, out, use_reentrant=False, early_stop=False) if (
            recompute == "call") else block(out)
    freed_after_forward = not any(b.live_gathers() for b in bundles)
    out.square().sum().backward()
    if queue is not None:
        assert len(queue) > 0  # still in flight after backward: only finish() completes them
        queue.finish()
    stats = groups.gtp_remat.stats
    gathers, overlapped = stats.calls[("gtp_remat", "all_gather")], dict(stats.overlapped)
    with torch.no_grad():  # not recorded: no backward is owed
        blocks(x)
    return {"out": out.detach(), "grads": {n: p.grad for n, p in blocks.named_parameters()},
            "freed": freed_after_forward and not any(b.live_gathers() for b in bundles),
            "pending": [b._pending for b in bundles], "gathers": gathers, "peak": peak[0],
            "overlapped": overlapped}


def run_both(rank: int, recompute: str | None) -> dict:
    return {overlap: run_chain(rank, recompute, overlap) for overlap in (False, True)}


@pytest.mark.parametrize("recompute", [None, "call", "override", "compiled"])
def test_members_used_twice_per_forward_give_one_process_gradients(recompute):
    ref_grads, ref_outs = reference(2)
    results = run_ranks(2, run_both, recompute, timeout=60)
    for rank, both in enumerate(results):
        for overlap, result in both.items():
            assert torch.allclose(result["out"], ref_outs[rank], rtol=1e-12, atol=1e-15)
            assert result["freed"] and result["pending"] == [0] * BLOCKS
            # One gather per block forward and one for its backward, the replay included.
            assert result["gathers"] == 2 * BLOCKS, (overlap, result["gathers"])
            assert result["peak"] == (2 if overlap else 1), (overlap, result["peak"])
            for name, grad in result["grads"].items():
                full = ref_grads[name]
                rows = F.pad(full, (0, 0, 0, 2 * grad.shape[0] - full.shape[0]))  # padding
                mine = rows[rank * grad.shape[0]:(rank + 1) * grad.shape[0]]
                assert torch.allclose(grad, mine, rtol=1e-10, atol=1e-14), (rank, name)
        # Overlap moves the same messages at other times: the same bits.
        off, on = both[False], both[True]
        assert torch.equal(off["out"], on["out"])
        assert all(torch.equal(off["grads"][n], on["grads"][n]) for n in off["grads"])
        # Every gather but the first of each direction, and every reduce-scatter, started early.
        assert off["overlapped"] == {}
        assert on["overlapped"] == {("gtp_remat", "all_gather"): 2 * (BLOCKS - 1),
                                    ("gtp_remat", "reduce_scatter"): BLOCKS}
