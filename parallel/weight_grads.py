"""The split backward of the zero-bubble schedules: a chunk's backward runs as I (the gradient of
its input, which the previous stage waits for) and, later, W (its weights' gradients).

One autograd backward is I. The linears (every ParallelLinear: plain, GTP-sharded or bundled)
compute their input's gradient there and, while a collection is open, leave their weight's
gradient as a closure holding what it needs (their input as saved for backward and the gradient
of their output); W runs the closures. The other parameters (norms, biases, the embedding, a
convolution, a decay) get their gradients in I, as autograd forms them: they cost little, and
leaving them there keeps every autograd formula as it is. So what W holds is exactly the
linears' inputs and output gradients, and I + W compute today's backward op for op: the same
matmuls on the same operands, each weight's gradient accumulated in the same order.

What a closure does after its matmul is the layer's own: accumulate into the parameter's
gradient, reduce-scatter it over gtp_remat (a sharded linear), or add it to its bundle's
message, whose reduce-scatter starts when the bundle's last use of that forward pass has its W.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

WeightGrad = Callable[[], None]


class DeferredWeightGrads:
    """Shared by a rank's linears (parallelize sets it where the schedule splits the
    backward); the runner opens a collection around each I and runs it as that pair's W."""

    def __init__(self) -> None:
        self._open: Collected | None = None

    @contextmanager
    def collect(self) -> Iterator[Collected]:
        """The weight gradients the backward run inside leaves (W runs them in the order
        autograd met their linears)."""
        if self._open is not None:
            raise RuntimeError("a split backward's collection opened inside another")
        self._open = Collected()
        try:
            yield self._open
        finally:
            self._open = None

    def defer(self, weight_grad: WeightGrad, *holds: torch.Tensor) -> bool:
        """Keep `weight_grad` (which holds the tensors `holds`) for W if a collection is open
        (True); else the caller runs it now, as a whole backward does."""
        if self._open is None:
            return False
        self._open.grads.append(weight_grad)
        self._open.holds.extend(holds)
        return True


class Collected:
    """One I's weight gradients, run by its W, and the tensors they hold until then."""

    def __init__(self) -> None:
        self.grads: list[WeightGrad] = []
        self.holds: list[torch.Tensor] = []

    def run(self) -> None:
        grads, self.grads, self.holds = self.grads, [], []
        with torch.no_grad():  # as inside autograd's backward
            for weight_grad in grads:
                weight_grad()

    def held_bytes(self) -> int:
        """Bytes of the distinct storages the gradients hold (the measured dry run's)."""
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in self.holds}.values())


def run_now_or_defer(store: DeferredWeightGrads | None, weight_grad: WeightGrad,
                     *holds: torch.Tensor) -> None:
    """A linear's backward: its weight gradient now, or as W's where a collection is open."""
    if store is None or not store.defer(weight_grad, *holds):
        weight_grad()


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad` into param.grad as autograd's AccumulateGrad does (the first one is kept as
    it is), so a deferred gradient sums in the same order and to the same bits."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
