"""Multi-token prediction (DeepSeek-V3's MTP modules; Megatron's mtp_num_layers): D depths after
the model's blocks, on its last pipeline stage. Depth k takes depth k - 1's hidden state h (the
model's final-normed output for k = 1) and the embedding e of the token k ahead, and computes

    h_k = norm_k(block_k(eh_proj_k([enorm_k(e) ; hnorm_k(h)])))

whose logits, by the model's own output head, predict the token k + 1 ahead. The embedding and
the head are the model's (under pipeline parallel the last stage holds a copy of the embedding,
as tied embeddings do). Each depth's block is of the last block's kind (trainer.parts
.block_parts). Its layer: trainer.model.mtp.

eh_proj (2h -> h) stays whole on every rank, as multi-latent attention's down-projections:
under sequence parallel it runs on the rank's own tokens, whose residual stream it starts, so
nothing is gathered; Megatron splits it by columns and gathers its output instead. Its
gradient is summed over TP as a norm's.

Its terms of the memory plan (kept_bytes; trainer.plan.activations adds them to the head's),
each a tensor autograd keeps, as tests/multirank/test_step_memory.py measures them; symbols as
in trainer.plan.activations. Each depth keeps (beside its ids ahead and labels, the batch's, as
the model's own ids are left out):

    enorm       the embedding (fp32, on the residual stream's tokens) and its normalised copy
                2*Tr*h fp32, and its rsqrt Tr fp32
    hnorm       its input, the hidden state Tr*h fp32, unless that is the head's input already
                (fp32 without SP: one storage); its normalised copy Tr*h and rsqrt Tr fp32
    eh_proj     its input [enorm(e) ; hnorm(h)] Tr*2h*e, and under bf16 autocast's copy of its
                whole weight 2*h*h*e
    block       its block's kept bytes, recomputed as the model's blocks are: its residual
                stream is eh_proj's output, in the compute dtype, so its two norms keep their
                input, normalised input and rsqrt in e (2 x (2*Tr*h + Tr)*e), not fp32; full
                recompute keeps that input only, Tr*h*e; under bf16 without weight sharding
                autocast's copies of its block's weights (the plan's autocast term)
    norm        its input, normalised input and rsqrt in the stream's dtype: (2*Tr*h + Tr)*e
    head        the head's input T*h*e (gathered under SP) and the loss's softmax T*V/t fp32

The losses' backward runs first, one at a time, the last depth's first (autograd takes the
latest node first, and the losses were formed after every head), so the step's loss moment is
the last depth's: all that is kept plus one loss's buffers, as without MTP; its forward holds
every head's logits while the last loss is formed. Then the heads' and depths' backward, the
last depth's first: a depth's block runs its backward with the model's blocks' and head's
activations still kept (the other losses' softmax freed, their logits' gradients waiting for
their heads, and the head weight's gradient of the depths' uses waiting for the model's head),
its own norm, head input and softmax freed (after_block_bytes).
"""
from __future__ import annotations

from trainer.config import ModelConfig
from trainer.parts.tokens import FP32, Tokens
from trainer.values import finite, positive_int

MTP = "mtp"  # the Transformer's module of the depths: mtp.<depth>.<name>
EH_PROJ = "eh_proj"


def depth_shapes(cfg: ModelConfig, block: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
    """One depth's parameter shapes, in its layer's order; `block`: its block's (the last
    block's shapes)."""
    h = cfg.hidden_size
    return {"enorm.weight": (h,), "hnorm.weight": (h,), f"{EH_PROJ}.weight": (h, 2 * h),
            **{f"block.{name}": shape for name, shape in block.items()},
            "norm.weight": (h,)}


def depths(cfg: ModelConfig) -> int:
    return cfg.mtp_num_layers or 0


def kept_bytes(cfg: ModelConfig, k: Tokens, e: int, block: int) -> int:
    """What one depth keeps for its backward (the module docstring); `block`: its block's
    kept bytes (trainer.plan.activations.mtp_block_bytes)."""
    h, Tr = cfg.hidden_size, k.Tr
    embedded = 2 * Tr * h * FP32 + Tr * FP32
    shared = e == FP32 and not k.sp  # hnorm's input is the head's input
    hidden = (0 if shared else Tr * h * FP32) + Tr * h * FP32 + Tr * FP32
    eh_proj = Tr * 2 * h * e + (0 if e == FP32 else 2 * h * h * e)
    return embedded + hidden + eh_proj + block + after_block_bytes(cfg, k, e)


def after_block_bytes(cfg: ModelConfig, k: Tokens, e: int) -> int:
    """Of a depth's kept bytes, those after its block: its norm's (in the stream's dtype), the
    head's input and the loss's softmax."""
    h = cfg.hidden_size
    return (2 * k.Tr * h + k.Tr) * e + k.T * h * e + k.T * (cfg.padded_vocab_size // k.t) * FP32


def hf_names(cfg: ModelConfig, ours: str, theirs: str) -> dict[str, list[tuple[str, int]]]:
    """A depth's own tensors as DeepSeek-V3's files name them (`theirs`: its layer,
    model.layers.<num_hidden_layers + depth>., read so by vLLM's and SGLang's loaders), with
    their rows; its block's tensors are its block parts' names under the same layer. eh_proj's
    input is [enorm(e) ; hnorm(h)] there too, so its columns need no reordering."""
    h = cfg.hidden_size
    return {f"{ours}enorm.weight": [(f"{theirs}enorm.weight", h)],
            f"{ours}hnorm.weight": [(f"{theirs}hnorm.weight", h)],
            f"{ours}{EH_PROJ}.weight": [(f"{theirs}eh_proj.weight", h)],
            f"{ours}norm.weight": [(f"{theirs}shared_head.norm.weight", h)]}


def rules(model: ModelConfig) -> None:
    if model.mtp_num_layers is not None:
        positive_int("model.mtp_num_layers", model.mtp_num_layers,
                     "use DeepSeek-V3's 1, or null for no multi-token prediction")
    finite("model.mtp_loss_scaling_factor", model.mtp_loss_scaling_factor, 0, True,
           fix="use Megatron's 0.1 (DeepSeek-V3 trains with 0.3, then 0.1)")


def check_sequence(model: ModelConfig, seq_length: int) -> None:
    """A depth k predicts the token k + 1 ahead: the deepest needs a sequence longer than D."""
    if depths(model) >= seq_length:
        raise ValueError(
            f"model.mtp_num_layers={model.mtp_num_layers} predicts tokens up to "
            f"{model.mtp_num_layers + 1} ahead, past every position of train.seq_length="
            f"{seq_length}. Fix: use fewer depths (DeepSeek-V3's 1) or a longer sequence.")
