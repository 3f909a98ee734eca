"""Tensor parallel with sequence parallel (Megatron's TP/SP): each weight split column- or
row-wise over tp; with SP the activations between blocks split along the sequence over it too.
Its layers and step: parallel.tensor; its terms of the plan: trainer.plan.axis_costs.tensor.
"""
from __future__ import annotations

from parallel.layout.axes.axis import Axis, Group, Key, off

TENSOR = Axis(
    "tensor parallel", (off("tensor_model_parallel_size"), Key("sequence_parallel", flag=True)),
    {"tp": "tp_size"},
    (Group("tp", ("tp",), "tensor parallel: splits each weight column/row-wise; SP splits "
           "activations over it", "weight"),),
    {"shard": "parallel.tensor:shard_layers"})
