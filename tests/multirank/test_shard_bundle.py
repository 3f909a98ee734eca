"""ShardBundle makes no assumption on how often a member runs per forward: a block that uses
each of its sharded linears twice, with and without activation recompute (the block's forward
run again inside backward), gives the outputs and summed gradients of one process in fp64, and
no gathered weight outlives its use. 2 gloo ranks, weight shards 2, rows that 2 does not divide
(padding)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel.comm import CommStats
from parallel.groups import build_groups
from parallel.layout import Layout
from parallel.sharding import ShardBundle
from parallel.tensor import ParallelLinear

from harness import run_ranks


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 5, bias=False), nn.Linear(5, 6, bias=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.b(self.a(0.5 * x))


def reference(world: int) -> tuple[dict, list]:
    torch.manual_seed(0)
    block = Twice().double()
    outs = []
    for rank in range(world):
        x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        out = block(x)
        out.square().sum().backward()
        outs.append(out.detach())
    return {n: p.grad for n, p in block.named_parameters()}, outs


def run_bundle(rank, recompute: bool):
    layout = Layout(2, tensor_parallel_num_weight_shards=2)
    groups = build_groups(layout, CommStats())
    torch.manual_seed(0)
    block = Twice().double()
    bundle = ShardBundle(groups.gtp_remat)
    for name in ("a", "b"):
        layer = ParallelLinear(getattr(block, name), "column", groups.tp, groups.gtp_remat,
                               False, name)
        layer.join_bundle(bundle)
        setattr(block, name, layer)
    block.register_forward_hook(lambda *args: bundle.release_forward())
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    out = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
    freed_after_forward = bundle._forward is None
    out.square().sum().backward()
    with torch.no_grad():  # not recorded: no backward is owed
        block(x)
    return {"out": out.detach(), "grads": {n: p.grad for n, p in block.named_parameters()},
            "freed": freed_after_forward and bundle._forward is None and bundle._backward is None,
            "pending": bundle._pending}


@pytest.mark.parametrize("recompute", [False, True])
def test_a_member_used_twice_per_forward_gives_one_process_gradients(recompute):
    ref_grads, ref_outs = reference(2)
    results = run_ranks(2, run_bundle, recompute, timeout=60)
    for rank, result in enumerate(results):
        assert torch.allclose(result["out"], ref_outs[rank], rtol=1e-12, atol=0)
        assert result["freed"] and result["pending"] == 0
        for name, grad in result["grads"].items():
            full = ref_grads[name]
            rows = F.pad(full, (0, 0, 0, 2 * grad.shape[0] - full.shape[0]))  # padded rows
            mine = rows[rank * grad.shape[0]:(rank + 1) * grad.shape[0]]
            assert torch.allclose(grad, mine, rtol=1e-10, atol=1e-14), (rank, name)
