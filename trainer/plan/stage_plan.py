"""A pipeline stage's step in the memory plan: what its schedule keeps at once (the pairs in
flight, what W waits for, autocast's copies), the transients of its moments
(trainer.plan.moments) and its peak beside its state (trainer.plan.memory); and the plan the
dry run prints, every stage's.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from parallel.layout import Layout
from parallel.layout.pipeline_schedules import (
    V_SHAPED,
    Action,
    in_flight,
    last_stage,
    message_bytes,
    message_counts,
    stage_actions,
    weights_pending,
)
from trainer.config import ModelConfig, PeftConfig
from trainer.parts import BlockParts, block_parts
from trainer.parts.assembly import block_buffer_bytes, parameter_shapes
from trainer.parts.lora import Adapters
from trainer.parts.moe import dispatch_rows
from trainer.parts.tokens import Tokens, compute_bytes
from trainer.plan.activations import stage_chunk_bytes, stage_weight_grad_bytes
from trainer.plan.axis_costs.pipeline import (
    Kept,
    kept_bytes,
    message_sizes,
    stage_activation_bytes,
)
from trainer.plan.memory import ModelWeights, StageWeights, unsharded_memory
from trainer.plan.moments import StepMemory, autocast_copy_bytes, step_memory
from trainer.plan.muon import MuonPlan, owner_balance
from trainer.plan.options import EngineOptions


def stage_kept(m: ModelConfig, layout: Layout, options: EngineOptions, stage: StageWeights,
               actions: list[Action] | None = None) -> Kept:
    """What a stage's schedule keeps at once: its pairs' activations in flight (and what W
    waits for) and their autocast copies, walking `actions` (the stage's schedule), or where
    None, by kept_bytes' closed forms."""
    number, schedule = stage.memory.stage, options.pipeline_schedule
    last = number == last_stage(schedule, layout.pp_size, layout.virtual_pipeline_size)
    chunks = list(stage.chunks)
    per_chunk = stage_chunk_bytes(m, layout, options, chunks, last)
    weights = stage_weight_grad_bytes(m, layout, options, chunks, last)
    copies = autocast_copy_bytes(m, layout, options, chunks, stage.block_gathered,
                                 stage.ends_gathered, last, number == 0, stage.depth_gathered,
                                 _kind_weights(m, stage))
    if actions is None:
        return kept_bytes(per_chunk, schedule, number, layout, weights, copies)
    return stage_activation_bytes(per_chunk, actions, weights, copies)


def _kind_weights(m: ModelConfig, stage: StageWeights) -> dict[BlockParts, int]:
    """Each kind of block's gathered 2-D weights on the stage (the larger, if two)."""
    kinds: dict[BlockParts, int] = {}
    for block, gathered in zip(stage.memory.blocks, stage.gathered_by_block):
        parts = block_parts(m, block)
        kinds[parts] = max(kinds.get(parts, 0), gathered)
    return kinds


def stage_step(m: ModelConfig, layout: Layout, options: EngineOptions, stage: StageWeights,
               kept: Kept, messages: set[tuple[int, int]]) -> StepMemory:
    """A stage's activations and transients of one micro-batch, given what its schedule keeps
    (`kept`: stage_kept) and the messages it holds at once
    (parallel.layout.pipeline_schedules.message_counts)."""
    number = stage.memory.stage
    v = layout.virtual_pipeline_size
    last = number == last_stage(options.pipeline_schedule, layout.pp_size, v)
    return step_memory(m, layout, options, list(stage.chunks), stage.block_gathered,
                       stage.ends_gathered, kept.activations, last, number == 0,
                       message_bytes(messages, *message_sizes(m, layout)),
                       (stage.depth_gathered, stage.depth_largest), _kind_weights(m, stage),
                       kept.copies)


def stage_peak(stage: StageWeights, step: StepMemory) -> int:
    """A stage's rank at its most: its state, plus the step's transients or, once the
    micro-batches are done and those are gone, the optimizer update's."""
    return stage.memory.total_bytes + max(step.transient_bytes, stage.memory.update_bytes)


def _planned_step(m: ModelConfig, layout: Layout, options: EngineOptions,
                  stage: StageWeights) -> dict[str, int]:
    number, pp, v = stage.memory.stage, layout.pp_size, layout.virtual_pipeline_size
    schedule = options.pipeline_schedule
    actions = stage_actions(schedule, number, pp, layout.num_microbatches, v)
    kept = stage_kept(m, layout, options, stage, actions)
    messages = message_counts(actions, number, pp, v, schedule in V_SHAPED)
    step = stage_step(m, layout, options, stage, kept, messages)
    return {**asdict(step), "transient_bytes": step.transient_bytes,
            "peak_bytes": stage_peak(stage, step),
            "in_flight": in_flight(actions), "weights_pending": weights_pending(actions)}


def step_per_stage(shapes: dict[str, tuple[int, ...]], model: ModelConfig, layout: Layout,
                   options: EngineOptions, muon: MuonPlan | None = None
                   ) -> list[dict[str, int]]:
    """Each stage's activations and transients of one micro-batch, walking its schedule, and
    its planned peak: state plus all of them (options.lora: peft=lora's, `shapes` with its
    adapters)."""
    lora = options.lora
    stages = ModelWeights(shapes, model.num_layers, model.tie_word_embeddings, muon=muon,
                          lora=lora is not None,
                          base_bf16=lora is not None and lora.base_bf16).stages(
        layout, options.pipeline_schedule in V_SHAPED)
    return [_planned_step(model, layout, options, s) for s in stages]


def memory_plan(model: ModelConfig, layout: Layout, options: EngineOptions,
                muon: MuonPlan | None = None, peft: PeftConfig | None = None,
                reference: bool = False) -> dict[str, Any]:
    """layout.json's `memory`: per pipeline stage, one rank's state, step transients and peak;
    the unsharded model for reference; under EP or ETP, a MoE layer's dispatched rows, expected
    (what the peak counts) and at most (trainer.parts.moe.dispatch_rows). peft=lora: the
    adapters train, the rest is frozen. reference: train.objective=dpo's frozen copy of the
    weights (full fine-tuning; under LoRA the reference is the base, held already)."""
    shapes, lora = parameter_shapes(model, peft), peft is not None
    half = lora and Adapters.of(peft).base_bf16
    stages = ModelWeights(shapes, model.num_layers, model.tie_word_embeddings,
                          block_buffer_bytes(model), muon, lora, reference, half).stages(
        layout, options.pipeline_schedule in V_SHAPED)
    plan = {"per_stage": [{**s.memory.as_dict(), **_planned_step(model, layout, options, s)}
                          for s in stages],
            "unsharded": unsharded_memory(shapes, muon, lora, half).as_dict()}
    dispatch = dispatch_rows(model, Tokens.of(layout), compute_bytes(options.precision),
                             options.recompute_granularity, layout.micro_batch_tokens)
    owners = [{"stage": s.memory.stage, "buffer": h.name, **owner_balance(h, muon.steps)}
              for s in stages for h in s.muon_buffers if h.matrices]
    return plan | ({"expert_dispatch": dispatch} if dispatch else {}) | (
        {"muon_owners": owners} if owners else {})
