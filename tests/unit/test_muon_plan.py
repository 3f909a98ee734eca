"""optim=muon without torch's ranks: which parameters Muon takes, the update's scale against
torch's own rule and the formulas, and the owners' balance."""
from __future__ import annotations

import math

import pytest
import torch.optim._muon as torch_muon
from test_families import preset

from trainer.parts.assembly import parameter_shapes
from trainer.parts.matrices import muon_parameters, unmatched_patterns
from trainer.plan.muon import assign_owners, ns_flops, scale_factor


def test_muon_takes_the_hidden_matrices_and_leaves_the_rest_to_adamw():
    shapes = parameter_shapes(preset("tiny_deepseek"))
    taken = set(muon_parameters(shapes, []))
    for name in ("layers.0.attn.q_down.weight", "layers.0.attn.kv_up.weight",
                 "layers.0.attn.o.weight", "layers.1.mlp.experts.gate_up",
                 "layers.1.mlp.shared.down.weight", "mtp.depths.0.eh_proj.weight",
                 "mtp.depths.0.block.mlp.experts.down"):
        assert name in taken, name
    for name in ("embed.weight", "head.weight", "norm.weight", "layers.1.mlp.router.weight",
                 "layers.0.attn.q_latent_norm.weight", "mtp.depths.0.enorm.weight"):
        assert name in shapes and name not in taken, name
    gpt_oss = parameter_shapes(preset("tiny_gpt_oss"))
    taken = set(muon_parameters(gpt_oss, []))
    assert "layers.0.mlp.experts.gate_up" in taken
    for name in ("layers.0.mlp.experts.gate_up_bias", "layers.0.attn.sinks",
                 "layers.0.attn.qkv.bias", "layers.0.mlp.router.bias"):
        assert name in gpt_oss and name not in taken, name


def test_adamw_params_moves_matrices_and_a_pattern_that_names_nothing_is_reported():
    shapes = parameter_shapes(preset("tiny_moe"))
    moved = muon_parameters(shapes, ["layers.*.attn.*"])
    assert not any(".attn." in name for name in moved)
    assert "layers.0.mlp.experts.down" in moved
    assert unmatched_patterns(shapes, ["layers.*.attn.*", "layers.*.atn.*"]) == ["layers.*.atn.*"]


@pytest.mark.parametrize("rows, cols", [(192, 64), (64, 176), (64, 64)])
def test_scale_modes_against_torch_and_the_formulas(rows, cols):
    """torch.optim.Muon's two modes are ours times the extra factor: original is
    shape_scaling x 1, match_rms_adamw spectral x 0.2; unit_rms_norm is Scion's sqrt(rows/cols),
    written here."""
    shape = (rows, cols)
    original = torch_muon._adjust_lr(1.0, "original", shape)
    assert scale_factor(rows, cols, "shape_scaling") == original
    assert 0.2 * scale_factor(rows, cols, "spectral") == torch_muon._adjust_lr(
        1.0, "match_rms_adamw", shape)
    assert scale_factor(rows, cols, "unit_rms_norm") == pytest.approx(math.sqrt(rows / cols),
                                                                       rel=1e-15)
    with pytest.raises(ValueError, match="unknown muon scale mode"):
        scale_factor(rows, cols, "rms")


def test_owners_take_the_costliest_first_onto_the_least_loaded():
    # by cost: 7 -> slot 0, 5 -> 1, 4 -> 1 (5 < 7), the first 3 -> 0 (7 < 9), the other -> 1
    assert assign_owners([3, 7, 4, 5, 3], 2) == [0, 0, 1, 1, 1]
    assert assign_owners([1, 1, 1], 4) == [0, 1, 2]
    # a square m x m iteration: per step 4 m^3 + 2 m^3
    assert ns_flops(8, 8, 5) == 5 * 6 * 8 ** 3
    assert ns_flops(8, 32, 1) == ns_flops(32, 8, 1) == 4 * 8 * 8 * 32 + 2 * 8 ** 3
