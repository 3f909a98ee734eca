"""The local sizes of one micro-batch on a rank, and the bytes of the dtypes the plan counts in:
what every term of the memory plan and the cost model (trainer.plan.activations, the axes'
terms in trainer.plan.axis_costs) is written in. Symbols as in trainer.plan.activations.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.layout import Layout
from trainer.config import Precision

FP32 = 4


def compute_bytes(precision: Precision) -> int:
    return 2 if precision is Precision.bf16 else FP32


@dataclass(frozen=True)
class Tokens:
    """The local sizes of one micro-batch on a rank."""

    b: int
    s: int  # this rank's tokens of one sequence
    S: int  # the whole sequence (cp_comm_type=all_gather holds its K/V)
    t: int  # TP
    sp: bool
    cp: bool
    ep: int = 1  # EP: a mixture of experts' layer holds num_moe_experts / ep experts here
    etp: int = 1  # ETP: and 1/etp of each of them (the rows of every ETP peer pass here)

    @classmethod
    def of(cls, layout: Layout) -> Tokens:
        return cls(layout.micro_batch_size, layout.context_local_length, layout.seq_length,
                   layout.tp_size, layout.sp_degree > 1,
                   layout.runtime_context_parallel_size > 1, layout.ep_size, layout.etp_size)

    @property
    def T(self) -> int:
        return self.b * self.s

    @property
    def Tr(self) -> int:
        return self.T // self.t if self.sp else self.T
