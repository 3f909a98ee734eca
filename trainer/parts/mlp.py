"""The dense MLP: a gated linear unit, down(act(gate(x)) * up(x)) with gate and up fused, SwiGLU
unless model.activation_func says (the part "swiglu"; a mixture of experts' shared expert is one
too). Its layer: trainer.model.mlp; the activation keys' rules, which the experts share.
"""
from __future__ import annotations

import math

from trainer.config import ModelConfig, RecomputeGranularity
from trainer.parts.part import HfNames, Part, Shapes
from trainer.parts.tokens import FP32, Tokens
from trainer.values import finite, one_of

# model.activation_func: the gate's function (trainer.model.mlp.GATE_FUNCTIONS builds them)
ACTIVATION_FUNCS = ("silu", "fast_gelu", "quick_gelu")


def swiglu_shapes(h: int, f: int, prefix: str = "", bias: bool = False) -> Shapes:
    if not bias:
        return {f"{prefix}gate_up.weight": (2 * f, h), f"{prefix}down.weight": (h, f)}
    return {f"{prefix}gate_up.weight": (2 * f, h), f"{prefix}gate_up.bias": (2 * f,),
            f"{prefix}down.weight": (h, f), f"{prefix}down.bias": (h,)}


def kept_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
               cp_comm_type=None) -> int:
    """gate_up's input T*h*e, its output, act(gate) and the product 4*T*f/t*e, and what the
    activation keeps beyond (activation_units); selective recompute keeps only gate_up's
    output and the product."""
    kept = 3 if recompute is RecomputeGranularity.selective else 4 + activation_units(m)
    return k.T * m.hidden_size * e + kept * k.T * m.ffn_hidden_size // k.t * e


def lora_kept_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
                    cp_comm_type, adapted: frozenset[str], grad_in: bool, dropout: bool) -> int:
    """Its weights frozen (peft=lora): gate_up's input only for its adapters (the rank's own
    tokens Tr*h*e, contiguous and cast once: trainer.model.lora), the product only for down's
    adapter (its dropped copy with dropout), and of the rest nothing where neither gate_up's
    input nor its output carries a gradient (the first block, nothing adapted before), unless
    selective recompute keeps its activation's inputs all the same."""
    gate_up = bool(adapted & {"gate_proj", "up_proj"})
    product = k.T * m.ffn_hidden_size // k.t * e if "down_proj" in adapted else 0
    if not (grad_in or gate_up or recompute is RecomputeGranularity.selective):
        return product
    own = k.Tr * m.hidden_size * e if gate_up else 0
    return (own + kept_bytes(m, k, e, recompute) - k.T * m.hidden_size * e
            - k.T * m.ffn_hidden_size // k.t * e + product)


def activation_units(m: ModelConfig) -> int:
    """What the gated activation keeps beyond SwiGLU's, in tensors as wide as the MLP's inner
    width (the experts' too; none under selective recompute, which keeps its inputs alone):
    quick_gelu its sigmoid, glu_linear_offset the shifted up, a clamp the clamped gate and,
    without an offset, the clamped up (which the product then keeps). silu and fast_gelu keep
    what SwiGLU keeps: their input, a view of gate_up's output."""
    clamp = m.activation_func_clamp_value is not None
    return ((m.activation_func == "quick_gelu") + bool(m.glu_linear_offset)
            + (clamp * (2 if not m.glu_linear_offset else 1)))


def backward_bytes(m: ModelConfig, k: Tokens, e: int, selective: bool) -> int:
    """The most a block's backward forms beside what the block keeps, counted by the
    allocator: the gradient entering it (the residual stream's, fp32) and the largest of its
    MLP's three moments. The down projection's: the gradient of its input and of its weight (and,
    with SP, the output gradient gathered over TP); the product's: the gradients of silu(gate) and
    of up beside the first's, its own input freed (under selective recompute silu(gate) is
    rebuilt for it); the gate/up projection's: its weight's gradient and its input's, the MLP's
    activations and gradients freed but its own output gradient. A weight's gradient under bf16
    is formed narrow, then widened."""
    h, f, t = m.hidden_size, m.ffn_hidden_size, k.t
    narrow = e if e != FP32 else 0
    product = k.T * f // t * e  # one [T, f/t] in the compute dtype
    down = h * f // t * (FP32 + narrow)  # the down projection's weight gradient
    gathered_grad = k.T * h * e if k.sp else 0
    rebuilt = product if selective else 0
    moments = (product + down + gathered_grad,
               2 * product + rebuilt,
               2 * down + k.T * h * e - 2 * product)  # the gate/up weight is twice down's
    return k.Tr * h * FP32 + max(moments)


def split_bytes(m: ModelConfig, k: Tokens, e: int) -> int:
    """Under a split backward the product's moment (the largest) also holds the down
    projection's input, silu(gate) * up, kept for its W where the whole backward frees it
    with the down projection's backward: one [T, f/t] in the compute dtype."""
    return k.T * m.ffn_hidden_size // k.t * e


def hf_names(cfg: ModelConfig, ours: str, theirs: str, family) -> HfNames:
    f, h = cfg.ffn_hidden_size, cfg.hidden_size
    return {f"{ours}mlp.gate_up.weight": [(f"{theirs}mlp.{p}_proj.weight", f)
                                          for p in ("gate", "up")],
            f"{ours}mlp.down.weight": [(f"{theirs}mlp.down_proj.weight", h)]}


def activation_rules(model: ModelConfig) -> None:
    """The MLP activation's keys, of the dense MLP and the experts alike."""
    one_of("model.activation_func", model.activation_func, ACTIVATION_FUNCS,
           "gated MLP activation")
    offset = model.glu_linear_offset
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) \
            or not math.isfinite(offset):
        raise ValueError(f"model.glu_linear_offset={offset!r} must be a finite number (added to "
                         f"up before the product). Fix: use 0.0, or gpt-oss's 1.0.")
    if model.activation_func_clamp_value is not None:
        finite("model.activation_func_clamp_value", model.activation_func_clamp_value, 0,
               False, fix="use gpt-oss's 7.0, or null for no clamp")


SWIGLU = Part(
    "swiglu", "mlp", "trainer.model.mlp:dense_mlp",
    lambda cfg: swiglu_shapes(cfg.hidden_size, cfg.ffn_hidden_size, "", cfg.add_bias_linear),
    tp_styles={"gate_up": "column", "down": "row"},
    lora_targets={"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)},
    fused=lambda cfg: {"gate_up": (1, 1)},  # gate | up: each TP rank keeps rows of both
    residual_outputs=("down.weight",),
    hook="activation_fn",  # silu(gate) * up: recomputed rather than kept (selective)
    kept_bytes=kept_bytes, lora_kept_bytes=lora_kept_bytes, backward_bytes=backward_bytes,
    split_bytes=split_bytes,
    hf_names=hf_names, rules=activation_rules)
