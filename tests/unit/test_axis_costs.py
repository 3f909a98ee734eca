"""The cost registry (trainer.plan.axis_costs) is the axis registry's other half: one entry an
axis, in its order, and what the cost model, the search, the dry run and the engine read from
the two registries is what they named by hand before."""
from __future__ import annotations

import dataclasses

import pytest

from parallel.build import CommOptions, comm_options
from parallel.layout import Layout
from parallel.layout.axes import COMM_KEYS
from parallel.layout.axes import REGISTRY as AXES
from trainer.auto.search import GIVEN
from trainer.config import CPCommType, ModelConfig
from trainer.plan.axis_costs import (
    MODEL_RULES,
    REGISTRY,
    SEARCH_ORDER,
    context,
    describe_inputs,
    expert,
    pipeline,
    tensor,
)
from trainer.plan.cost import KINDS
from trainer.plan.options import EngineOptions


def test_one_cost_entry_an_axis_in_the_registrys_order():
    assert [c.axis for c in REGISTRY] == [a.name for a in AXES]
    assert MODEL_RULES == (tensor.check_model, context.check_model, expert.check_model,
                           pipeline.check_model)
    # EP divides a stage's ranks: the search asks it after PP.
    assert [c.axis for c in SEARCH_ORDER] == [
        "tensor parallel", "GTP_remat weight and sequence shards", "context parallel",
        "data parallel", "pipeline parallel", "expert parallel"]


def test_the_cost_models_rows_are_the_axes_kinds_in_order():
    assert KINDS == ("compute", "tensor parallel", "weight gathers", "context parallel",
                     "expert dispatch", "pipeline sends", "optimizer reduce", "pipeline bubble")


def test_every_comm_option_is_an_axiss_and_the_engine_reads_each_by_its_key():
    owned = [name for axis in AXES for name in axis.comm_options]
    assert sorted(owned) == sorted(f.name for f in dataclasses.fields(CommOptions))
    assert len(set(COMM_KEYS)) == len(COMM_KEYS)
    assert GIVEN[-3:] == ("parallel.grad_reduce_in_bf16", "parallel.overlap_param_gather",
                          "parallel.overlap_grad_reduce")
    options = EngineOptions(grad_reduce_in_bf16=True, overlap_param_gather=True,
                            cp_comm_type=CPCommType.a2a, pipeline_schedule="gpipe")
    model = ModelConfig(moe_token_dispatcher_type="allgather")
    sections = {"parallel": options, "model": model}
    comm = comm_options(lambda key: getattr(sections[key.split(".")[0]], key.split(".")[1]))
    assert comm == CommOptions(True, True, False, "a2a", "gpipe", "allgather")


def test_the_dry_runs_inputs_line_is_the_axes_inputs_in_order():
    layout = Layout(64, tensor_model_parallel_size=2, sequence_parallel=True,
                    tensor_parallel_num_weight_shards=8, tensor_parallel_num_sequence_shards=4,
                    context_parallel_size=2, expert_model_parallel_size=2,
                    pipeline_model_parallel_size=2)
    assert describe_inputs(layout) == ("TP=2 SP=on weight_shards=8 sequence_shards=4 CP=2 "
                                       "EP=2 ETP=2 PP=2")


def test_a_windows_p2p_exchange_costs_the_chunks_it_reaches():
    """Under CP 8 over 16k tokens (chunks of 1k), a 1k window's block sends two chunks' K/V
    (each of a rank's chunks to the rank whose next chunk reaches it) and takes two chunks'
    fp32 gradients back, where the ring sends 7 hops of both chunks forward and 7 + 8 in
    backward; a model windowed every other block pays the mean; a window past the sequence
    pays the ring's."""
    from trainer.plan.hardware import Hardware

    hw = Hardware(80, 0.9, 989, 67, 0.5, nvlink_bandwidth_gbs=450, network_bandwidth_gbs=50,
                  link_latency_us=0.0, gpus_per_nvlink_domain=8)
    layout = Layout(8, context_parallel_size=8, seq_length=16384, micro_batch_size=1)
    full = ModelConfig(name="llama", vocab_size=1024, hidden_size=4096, num_layers=4,
                       num_heads=32, num_query_groups=8, ffn_hidden_size=11008, rope_theta=1e4,
                       norm_eps=1e-5, init_std=0.02)
    every = dataclasses.replace(full, window_size=1024)
    alternate = dataclasses.replace(every, window_attn_skip_freq=2)
    wide = dataclasses.replace(every, window_size=16384)
    T, e, link = layout.context_local_length, 2, hw.link(layout, "context")
    kv = 2 * T * full.kv_size * e  # the rank's K/V: two chunks

    def seconds(m):
        return context.context_seconds(m, layout, CPCommType.p2p, hw, T, e, 0.0, False)
    ring = (7 * link.send(kv), 7 * link.send(kv) + 8 * link.send(kv / e * 4))
    window = (link.send(kv), link.send(kv / e * 4))
    assert seconds(full) == pytest.approx(ring, rel=1e-12)
    assert seconds(wide) == pytest.approx(ring, rel=1e-12)
    assert seconds(every) == pytest.approx(window, rel=1e-12)
    assert seconds(alternate) == pytest.approx(tuple((a + b) / 2 for a, b in zip(ring, window)),
                                               rel=1e-12)
    assert sum(seconds(every)) == pytest.approx(sum(ring) / 10)  # 3 sends of the ring's 30
