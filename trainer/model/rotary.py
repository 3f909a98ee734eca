"""Rotary position embeddings, shared by every attention part: the frequencies of model.rope_type
(plain rope, Llama 3's scaling, linear scaling, or YaRN; a windowed block's own base) and their
application at global token positions.

Positions are global, so a sequence split over ranks (SP, CP, sequence shards) rotates the same.
The angles are formed in fp32 whatever the compute dtype, as Megatron and transformers do; the
rotation runs in fp32 at least (fp64 for fp64 inputs).
"""
from __future__ import annotations

import math

import torch

from trainer.config import ModelConfig
from trainer.parts.attention import LLAMA3_ROPE_CONTEXT, LLAMA3_ROPE_HIGH, LLAMA3_ROPE_LOW


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times: 0.1 * mscale *
    ln(factor) + 1 (1 without stretching)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_correction(cfg: ModelConfig) -> float:
    """What multi-latent attention multiplies its softmax scale by: yarn_mscale(factor,
    mscale_all_dim)^2 under YaRN with mscale_all_dim set (DeepSeek-V3's), else 1."""
    if cfg.rope_type != "yarn" or not cfg.mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim) ** 2


def rotary_frequencies(cfg: ModelConfig, dim: int, device: torch.device | None = None,
                       window: int | None = None) -> tuple[torch.Tensor, float]:
    """([dim / 2] fp32 frequencies, the factor cos and sin are multiplied by) for a rotary
    part `dim` wide, of a block whose sliding window is `window` (None: global): a windowed
    block turns at model.rotary_base_local where it is set (Gemma 3's local layers), unscaled."""
    half = dim // 2
    if window is not None and cfg.rotary_base_local is not None:
        return cfg.rotary_base_local ** (
            -torch.arange(half, device=device, dtype=torch.float32) / half), 1.0
    if cfg.rope_type == "yarn":  # spelled as transformers' and DeepSeek's YaRN forms them
        exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
        return _yarn(cfg, 1.0 / cfg.rope_theta ** exponents, dim), (
            yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale)
            / yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim))
    # theta^(-i / half): within an ulp of transformers' 1 / theta^(2i / d)
    freqs = cfg.rope_theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    if cfg.seq_len_interpolation_factor is not None:  # linear: positions / factor
        freqs = freqs / cfg.seq_len_interpolation_factor
    if not cfg.use_rope_scaling:
        return freqs, 1.0
    factor = cfg.rope_scaling_factor
    context, low, high = LLAMA3_ROPE_CONTEXT, LLAMA3_ROPE_LOW, LLAMA3_ROPE_HIGH
    wavelength = 2 * math.pi / freqs
    scaled = torch.where(wavelength > context / low, freqs / factor, freqs)
    smooth = (context / wavelength - low) / (high - low)
    between = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled), 1.0


def _yarn(cfg: ModelConfig, freqs: torch.Tensor, dim: int) -> torch.Tensor:
    """YaRN's frequencies: the dims that turn fewer than beta_slow times over the original
    context interpolated (divided by the factor), those turning more than beta_fast times kept,
    a linear ramp between (its ends rounded outwards to whole dims, as DeepSeek's reference,
    unless model.yarn_correction_range_round_to_int=false: gpt-oss's truncate false)."""
    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(cfg.original_max_position_embeddings
                              / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
    low, high = dim_of(cfg.beta_fast), dim_of(cfg.beta_slow)
    if cfg.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # a ramp of no width
    ramp = ((torch.arange(dim // 2, device=freqs.device, dtype=torch.float32) - low)
            / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: extrapolated as trained, 0: interpolated
    return freqs / cfg.rotary_scaling_factor * (1 - kept) + freqs * kept


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                 factor: float = 1.0) -> torch.Tensor:
    """Rotary embedding of x [batch, seq, heads, dim] at integer `positions` [batch, seq], its
    halves rotated as pairs (Llama's layout), cos and sin times `factor`."""
    half = x.shape[-1] // 2
    angles = positions.to(torch.float32)[..., None] * freqs  # [batch, seq, half]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    # fp32 at least; fp64 stays fp64, so a gradient summed over ranks (MLA's shared key)
    # is never rounded to fp32 on its way
    dtype = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x[..., :half].to(dtype), x[..., half:].to(dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)
