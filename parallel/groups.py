"""build_groups: the only place process groups are created, once, from the Layout.

Every rank creates every group in the same order (torch requires it), keeps the ones it belongs
to, and checks each against the Layout. The result is an explicit value passed to whoever needs
a group; there are no module-level groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from parallel.comm import CommStats, Group
from parallel.layout import GROUP_NAMES, Layout


@dataclass(frozen=True)
class Groups:
    """This rank's groups (axes in brackets; parallel.layout says what each is for)."""

    world: Group
    tp: Group  # [tp]
    gtp_remat: Group  # [seq, batch]: weight shards beyond TP
    weight_tile: Group  # [tp, seq, batch]: one full copy of the weights
    weight_replica: Group  # [cp, dp]: same weight shard; gradients summed, optimizer sharded
    model_parallel: Group  # [tp, seq, batch, pp]
    pp: Group  # [pp]
    embedding: Group | None  # first and last stage; None on a middle stage (not a member)
    context: Group  # [seq, cp]: runtime CP
    batch_lane: Group  # [batch, dp]
    token_distinct: Group  # [seq, batch, cp, dp]: the loss is summed here
    # The expert view (parallel.layout.axes.expert): [etp], [ep], [edp]
    expert_tensor_parallel: Group
    expert_model_parallel: Group  # different experts; tokens exchanged by all-to-all
    expert_data_parallel: Group  # the same experts: gradients summed, optimizer sharded
    stats: CommStats


def build_groups(layout: Layout, stats: CommStats | None = None,
                 timeout: timedelta | None = None) -> Groups:
    """Collective: every rank of the initialised default process group must call it.
    `timeout`: how long a collective of these groups waits for a peer before it fails (torch's
    new_group does not inherit the default group's; it would wait 30 minutes)."""
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs torch.distributed to be initialised first")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(
            f"the process group has {world} ranks but the layout's world_size is "
            f"{layout.world_size} (cluster.num_nodes x cluster.procs_per_node). Fix: launch "
            f"{layout.world_size} processes, or change cluster.*.")
    stats = CommStats() if stats is None else stats
    handles: dict[tuple[int, ...], dist.ProcessGroup | None] = {
        tuple(range(world)): dist.group.WORLD}
    mine: dict[str, Group] = {"world": Group("world", list(range(world)), rank,
                                             dist.group.WORLD, stats)}
    for name in GROUP_NAMES:
        for ranks in layout.groups(name):
            key = tuple(ranks)
            if key not in handles:
                # A one-rank group needs no process group; same-ranks groups share one.
                handles[key] = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                mine[name] = Group(name, ranks, rank, handles[key], stats)
    for name, group in mine.items():
        _check_against_layout(name, group, layout, rank)
    return Groups(**{name: mine.get(name) for name in ("world", *GROUP_NAMES)}, stats=stats)


def _check_against_layout(name: str, group: Group, layout: Layout, rank: int) -> None:
    expected = list(range(layout.world_size)) if name == "world" else layout.group(name, rank)
    actual = group.ranks
    if group.handle is not None:
        actual = dist.get_process_group_ranks(group.handle)
    if actual != expected or group.rank != expected.index(rank):
        raise AssertionError(f"rank {rank}: group {name} is {actual}, the layout says {expected}")
