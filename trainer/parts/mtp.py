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
"""
from __future__ import annotations

from trainer.config import ModelConfig
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
