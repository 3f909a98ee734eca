"""ShardBundle: the GTP-sharded linears of one transformer block, gathered and reduce-scattered
together (one message for all of them instead of one each), optionally overlapped with compute:
the next block's gather runs while this block computes, and a block's gradient reduce-scatter
runs while the blocks before it run their backward. Only the messages and their timing change:
the shards, their gradients' sums (values and order), the optimizer and checkpoints do not.

A bundled linear is a pair of torch.library operators (forward, and backward through
register_autograd) rather than an autograd.Function, so torch.compile keeps a block whole
around it: the compiled graph calls the operator, which runs the bundle's Python eagerly
inside. torch's operators take tensors and numbers only, so a bundle is named by a key (a
0-dim tensor: a number would be baked into the graph, and each block would compile its own).
"""
from __future__ import annotations

import itertools
import weakref
from collections import deque
from typing import Callable

import torch
import torch.nn.functional as F

from parallel.build import Build
from parallel.comm import Group, Pending
from parallel.sharding import (
    IN_MASTER_DTYPE,
    CommDtypes,
    autocast_input,
    held_input,
    linear_weight_grad,
)
from parallel.weight_grads import DeferredWeightGrads, run_now_or_defer


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now: a forward run from there is activation
    recompute, whose uses the original forward already counted."""
    return torch._C._current_graph_task_id() != -1


class GradReduceQueue:
    """Gradient reduce-scatters in flight, finished (waited, then accumulated) oldest first. Each
    holds a block's full-size gradient message, so at most `depth` are in flight; finish() ends
    them all (before the optimizer reads the gradients). A bundle's results are accumulated in
    the order they started, as without overlap, so the sums are the same."""

    def __init__(self, depth: int = 2):
        self.depth = depth
        self._queue: deque[tuple[Pending, Callable[[torch.Tensor], None]]] = deque()

    def put(self, pending: Pending, accumulate: Callable[[torch.Tensor], None]) -> None:
        self._queue.append((pending, accumulate))
        while len(self._queue) > self.depth:
            self._finish_oldest()

    def finish(self) -> None:
        while self._queue:
            self._finish_oldest()

    def __len__(self) -> int:
        return len(self._queue)

    def _finish_oldest(self) -> None:
        pending, accumulate = self._queue.popleft()
        accumulate(pending.wait())


class _Pass:
    """One forward pass through a bundle's block: its recorded uses whose backward has not run
    yet, and the gradient message their backwards fill. A pipeline runs several passes
    (micro-batches) forward before their backwards, so each pass's gradients are reduced, and
    the weights its backward gathered freed, when that pass's own backward is done. Backwards
    run in the order of their forwards (every schedule here), so a backward use belongs to the
    oldest pass with uses left; were one out of order, a message would carry another pass's
    gradients, and each would still be reduced once: the sums do not change."""

    def __init__(self) -> None:
        self.pending = 0  # uses whose weight gradient is not in the message yet
        self.inputs_pending = 0  # uses whose input gradient is not formed yet (the weights' use)
        # The reduce-scatter's message, row i rank i's rows of every member (padding zero):
        # each use's gradient is added into its member's place as it is formed, so a block's
        # gradients are held once, not as well in pieces and padded copies.
        self.message: torch.Tensor | None = None


class _Gathered:
    """One all-gather of a bundle's shards, maybe still in flight; weights() waits for it and
    cuts the message into each member's full TP-local weight."""

    def __init__(self, pending: Pending, bundle: ShardBundle):
        self._pending: Pending | None = pending
        self._bundle = bundle
        self._weights: list[torch.Tensor] | None = None
        self.used = False  # its first use starts the neighbour's gather (overlap)
        self.forward_pass = _Pass()  # the pass these weights serve, when gathered for forward

    def weights(self) -> list[torch.Tensor]:
        if self._weights is None:
            size = self._bundle.group.size
            gathered = self._pending.wait().view(size, -1)  # row i: rank i's shards
            self._pending, self._weights, offset = None, [], 0
            for shard, rows in self._bundle.members:
                block = gathered[:, offset:offset + shard.numel()]
                self._weights.append(block.reshape(size * shard.shape[0], *shard.shape[1:])[:rows])
                offset += shard.numel()
        return self._weights

    def wait(self) -> None:
        """Complete the collective, so the bundle can drop it (its buffers are being written)."""
        if self._pending is not None:
            self._pending.wait()


class ShardBundle:
    """Sharded linears of one block, gathered and reduce-scattered together. No assumption on
    how often a member runs per forward, nor on activation recompute:

    forward: the first use gathers every member's weight (unless the previous block already
    started it); they are freed when the block's forward ends (release_forward, a forward hook
    on the block set by parallelize), so a member may run twice.
    backward: every use recorded in the autograd graph is counted, per forward pass; the first
    backward use gathers the weights again, each use's gradient is added to its member's, and
    when the pass's last counted use is done one reduce-scatter returns all shard gradients,
    and the gathered weights are freed.
    recompute: a forward run inside backward (the block's own, before its backward) takes the
    backward's gather, so recompute and backward share one; it is not a recorded use.
    overlap (parallelize links neighbours): the first forward use starts `next`'s gather, the
    first backward use starts `previous`'s, so at most two blocks' weights are alive at once;
    with a reduce queue the reduce-scatter is started and finished later (GradReduceQueue).
    """

    def __init__(self, group: Group, dtypes: CommDtypes = IN_MASTER_DTYPE,
                 reduce_queue: GradReduceQueue | None = None,
                 weight_grads: DeferredWeightGrads | None = None):
        self.group, self.dtypes, self.reduce_queue = group, dtypes, reduce_queue
        # A split backward's (parallel.weight_grads): a use's input gradient in I, its weight
        # gradient in W; the weights gathered for backward go when the pass's last I use is
        # done, the reduce-scatter starts when its last W use is.
        self.weight_grads = weight_grads
        self.members: list[tuple[torch.nn.Parameter, int]] = []  # (shard, TP-local rows)
        self.next: ShardBundle | None = None  # the block after this one in forward
        self.previous: ShardBundle | None = None
        self._forward: _Gathered | None = None
        self._backward: _Gathered | None = None
        self._pending = 0  # recorded uses whose backward has not run yet, over all passes
        self._passes: deque[_Pass] = deque()  # passes with uses left, oldest first
        self.key = torch.tensor(next(_KEYS), device="cpu")  # how its operators find it
        _BUNDLES[int(self.key)] = self

    def add(self, shard: torch.nn.Parameter, rows: int) -> int:
        self.members.append((shard, rows))
        return len(self.members) - 1

    def uses_owed(self) -> int:
        """Recorded forward uses whose backward has not run (0 once a step's backward ends)."""
        return self._pending

    def live_gathers(self) -> int:
        """Gathered weight sets this bundle holds (in flight or not): 0, 1 or 2."""
        return (self._forward is not None) + (self._backward is not None)

    def _gather(self, early: bool = False) -> _Gathered:
        """`early`: started for a later use (overlap), so asynchronous; otherwise needed now."""
        flat = torch.cat([shard.detach().reshape(-1) for shard, _ in self.members])
        if self.dtypes.gather is not None:
            flat = flat.to(self.dtypes.gather)
        pending = self.group.start_all_gather(flat) if early else Pending(
            self.group.all_gather(flat), None)
        return _Gathered(pending, self)

    def prefetch_forward(self) -> None:
        if self._forward is None:
            self._forward = self._gather(early=True)

    def prefetch_backward(self) -> None:
        if self._backward is None:
            self._backward = self._gather(early=True)

    def forward_weight(self, index: int, needs_grad: bool) -> torch.Tensor:
        """`needs_grad`: this use enters the autograd graph, so (outside a recompute) its
        backward will come, and is counted in this forward's pass."""
        if _in_backward():  # recompute: the original forward counted this use
            return self._backward_weights()[index]
        if self._forward is None:
            self._forward = self._gather()
        if not self._forward.used:
            self._forward.used = True
            if self.next is not None:
                self.next.prefetch_forward()
        if needs_grad:
            this = self._forward.forward_pass
            if this.pending == 0:
                self._passes.append(this)
            this.pending += 1
            this.inputs_pending += 1
            self._pending += 1
        return self._forward.weights()[index]

    def release_forward(self) -> None:
        if self._forward is not None:
            self._forward.wait()
            self._forward = None

    def backward_weight(self, index: int) -> torch.Tensor:
        return self._backward_weights()[index]

    def _backward_weights(self) -> list[torch.Tensor]:
        if self._backward is None:
            self._backward = self._gather()
        if not self._backward.used:
            self._backward.used = True
            # Only a block whose backward will come (recorded uses): nothing else frees it.
            if self.previous is not None and self.previous._inputs_owed():
                self.previous.prefetch_backward()
        return self._backward.weights()

    def trains(self, index: int) -> bool:
        """Whether member `index` trains: a frozen one (peft=lora's base) forms no gradient."""
        return self.members[index][0].requires_grad

    def _trained(self) -> list[tuple[torch.nn.Parameter, int]]:
        """The members whose gradients the reduce-scatter's message carries, in order."""
        return [member for member in self.members if member[0].requires_grad]

    def _inputs_owed(self) -> bool:
        """Whether a recorded use's input gradient is still to come (a backward gather will)."""
        return any(p.inputs_pending for p in self._passes)

    def input_done(self) -> _Pass:
        """One use's input gradient is formed (its I, or its whole backward): the pass it
        belongs to (the oldest with input gradients owed; backwards run in the order of their
        forwards). The pass's last one frees the weights gathered for backward."""
        forward_pass = next((p for p in self._passes if p.inputs_pending > 0), None)
        if forward_pass is None:
            raise RuntimeError("a bundled linear's backward ran with no forward use left to "
                               "account for: its gradient would be lost")
        forward_pass.inputs_pending -= 1
        if forward_pass.inputs_pending == 0:
            self._backward = None  # the pass's input gradients are done: its weights go
        return forward_pass

    def add_grad(self, forward_pass: _Pass, index: int, grad_full: torch.Tensor | None
                 ) -> None:
        """Member `index`'s gradient of one use of `forward_pass` (None for a frozen member:
        the use is only accounted for). The pass's last one starts the reduce-scatter."""
        if grad_full is not None:
            self._place(forward_pass, index, grad_full)
        self._pending -= 1
        forward_pass.pending -= 1
        if forward_pass.pending > 0:
            return
        self._passes.remove(forward_pass)  # the oldest, but for a W run out of order
        if forward_pass.message is None:  # every use was a frozen member's
            return
        flat, forward_pass.message = forward_pass.message.view(-1), None
        if self.dtypes.reduce is not None:
            flat = flat.to(self.dtypes.reduce)
        if self.reduce_queue is None:
            self._accumulate(self.group.reduce_scatter(flat))
        else:
            self.reduce_queue.put(self.group.start_reduce_scatter(flat), self._accumulate)

    def _place(self, forward_pass: _Pass, index: int, grad_full: torch.Tensor) -> None:
        """Add one use's full TP-local gradient into its member's place of the message (the
        trained members' shards only: a frozen one is never sent)."""
        size, trained = self.group.size, self._trained()
        if forward_pass.message is None:
            total = sum(shard.numel() for shard, _ in trained)
            forward_pass.message = grad_full.new_zeros((size, total))
        shard, rows = self.members[index]
        offset = 0
        for member, _ in trained:  # the members before it that the message carries
            if member is shard:
                break
            offset += member.numel()
        # rank r holds rows [r*per, (r+1)*per) of the full weight (the last ones padding)
        per, rest = shard.shape[0], shard.shape[1:]
        place = forward_pass.message[:, offset:offset + shard.numel()].view(size, per, *rest)
        whole, left = divmod(rows, per)
        place[:whole].add_(grad_full[:whole * per].view(whole, per, *rest))
        if left:
            place[whole, :left].add_(grad_full[whole * per:])

    def _accumulate(self, mine: torch.Tensor) -> None:
        """Add this rank's summed rows to the shards' (master dtype) gradients."""
        offset = 0
        for shard, _ in self._trained():
            grad = mine[offset:offset + shard.numel()].view_as(shard)
            offset += shard.numel()
            if shard.grad is None:
                shard.grad = grad.to(shard.dtype, copy=True)
            else:
                shard.grad.add_(grad)


def link(bundles: list[ShardBundle]) -> None:
    """Overlap the gathers of consecutive blocks (`bundles` in forward order)."""
    for before, after in zip(bundles, bundles[1:]):
        before.next, after.previous = after, before


# key -> bundle, for the operators below (weak: a dropped model's bundles go with it)
_BUNDLES: weakref.WeakValueDictionary[int, ShardBundle] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@torch.library.custom_op("gtp::bundled_linear", mutates_args=())
def _forward(x: torch.Tensor, shard: torch.Tensor, key: torch.Tensor, index: int, rows: int,
             needs_grad: bool) -> torch.Tensor:
    """y = x @ W^T with W (rows x in) the bundle's gathered member `index`, in x's dtype.
    `shard` is the parameter whose gradient the bundle forms: an input, so that autograd
    records the backward even when x needs no gradient."""
    weight = _BUNDLES[int(key)].forward_weight(index, needs_grad)
    return F.linear(x, weight.to(x.dtype))


@_forward.register_fake
def _(x, shard, key, index, rows, needs_grad):
    return x.new_empty(*x.shape[:-1], rows)


@torch.library.custom_op("gtp::bundled_linear_backward", mutates_args=())
def _backward(grad_y: torch.Tensor, x: torch.Tensor, key: torch.Tensor, index: int
              ) -> torch.Tensor:
    """x's gradient; the member's weight gradient goes into the bundle's message, now or, in
    a split backward's I, at its W."""
    bundle = _BUNDLES[int(key)]
    grad_x = grad_y @ bundle.backward_weight(index).to(grad_y.dtype)
    forward_pass = bundle.input_done()
    x = held_input(x)

    def weight_grad() -> None:
        grad_w = None
        if bundle.trains(index):
            grad_w = linear_weight_grad(grad_y, x).to(bundle.members[index][0].dtype)
        bundle.add_grad(forward_pass, index, grad_w)

    run_now_or_defer(bundle.weight_grads, weight_grad, grad_y, x)
    return grad_x


@_backward.register_fake
def _(grad_y, x, key, index):
    return grad_y.new_empty(*grad_y.shape[:-1], x.shape[-1])


def _save(ctx, inputs, output) -> None:
    x, _, key, ctx.index, _, _ = inputs
    ctx.save_for_backward(x, key)


def _grads(ctx, grad_y):
    x, key = ctx.saved_tensors
    # the shard's gradient was added by the bundle
    return _backward(grad_y, x, key, ctx.index), None, None, None, None, None


torch.library.register_autograd("gtp::bundled_linear", _grads, setup_context=_save)


_EAGER: dict[str, Callable] = {}  # the forward operator kept out of compiled graphs


def compile_ready() -> None:
    """Before blocks are compiled (trainer.train.compile): the forward operator's twin that a
    compiled graph runs eagerly (bundled_linear's one case). Made here, not at import:
    torch.compiler.disable imports dynamo, about a second of every rank's start."""
    _EAGER.setdefault("forward", torch.compiler.disable(_forward))


def bundled_linear(x: torch.Tensor, shard: torch.Tensor, key: torch.Tensor, index: int,
                   rows: int) -> torch.Tensor:
    """x @ W^T for member `index` (TP-local `rows`) of the bundle named by `key`."""
    # Autograd runs the backward only under grad mode with an input that needs a gradient.
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or shard.requires_grad)
    x = autocast_input(x)  # saved for backward in the matmul's dtype
    if needs_grad and not x.requires_grad and torch.compiler.is_compiling():
        # A compiled backward would drop an operator whose output (x's gradient) nobody
        # uses, and the bundle would never get this use's gradient: run this one eagerly.
        if "forward" not in _EAGER:
            raise RuntimeError("blocks with bundled linears compiled without "
                               "parallel.bundle.compile_ready()")
        return _EAGER["forward"](x, shard, key, index, rows, needs_grad)
    return _forward(x, shard, key, index, rows, needs_grad)


def bundle_blocks(build: Build) -> None:
    """GTP_remat's step of parallelize (wire): the sharded linears of each block join one
    bundle (one gather and one reduce-scatter per block, not per weight); a block's gathered
    weights live for its forward; with overlap_param_gather each bundle starts the next one's
    gather, within a chunk (its blocks run one after another)."""
    gtp, plan, options = build.groups.gtp_remat, build.plan, build.options
    if gtp.size == 1:
        return
    queue = GradReduceQueue() if options.overlap_grad_reduce else None
    bundles: dict[str, ShardBundle] = {}
    for name, child in build.model.named_modules():  # blocks in forward order
        if hasattr(child, "join_bundle") and name.startswith(f"{plan.blocks}."):
            block = ".".join(name.split(".")[:2])
            if block not in bundles:
                bundles[block] = ShardBundle(gtp, build.dtypes, queue, build.weight_grads)
            child.join_bundle(bundles[block])
    for block, bundle in bundles.items():
        build.model.get_submodule(block).register_forward_hook(
            lambda module, args, output, bundle=bundle: bundle.release_forward())
    if options.overlap_param_gather:
        chunk_of = {f"{plan.blocks}.{i}": c for c, blocks in enumerate(build.part.chunks)
                    for i in blocks}
        for chunk in range(len(build.part.chunks)):
            link([b for name, b in bundles.items() if chunk_of[name] == chunk])
