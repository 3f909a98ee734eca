"""Whether a checkpoint fits the model this run builds, beyond its weights' shapes (those are
trainer.checkpoint.dcp's check_loadable): no weight it holds is dropped (an untied output head
loaded into a tied model), the routers' expert bias is there when the model has one, and the
model config its run recorded (meta.json's "model") is this run's wherever it changes the math.
A resume continues the checkpoint's optimizer state and schedule, so a difference is refused in
one line; a fine-tune (checkpoint.finetune) starts from the weights, so it is a note and the run
goes on. No torch here: the caller reads the checkpoint's tensor names.
"""
from __future__ import annotations

from dataclasses import asdict, fields, replace
from typing import Any

from trainer.config import ModelConfig, PeftConfig
from trainer.parts.assembly import BUFFER_NAMES, EMBEDDING, HEAD, buffer_shapes, parameter_shapes
from trainer.parts.families import hf_family
from trainer.parts.lora import is_adapter

HEAD_WEIGHT, EMBEDDING_WEIGHT = f"{HEAD}.weight", f"{EMBEDDING}.weight"
# Keys that change nothing a loaded model computes: init_std only draws the initial values (the
# checkpoint's replace them), both dispatchers compute the same, and the vocabulary's padding
# rows are never used (the shapes, checked first, already agree).
SAME_MATH = ("init_std", "moe_token_dispatcher_type", "make_vocab_size_divisible_by")
# Keys the tensors themselves tell (weights() checks them, old checkpoints too): a tied model has
# no head, a router with expert bias has its buffer.
HELD = ("tie_word_embeddings", "moe_router_enable_expert_bias")
TIE = "model.tie_word_embeddings"
BIAS = "model.moe_router_enable_expert_bias"


def weights(saved: set[str], model: ModelConfig, where: str, finetune: bool, fix: str,
            peft: PeftConfig | None = None) -> list[str]:
    """`saved`: the model.* tensor names the checkpoint holds, without the prefix. Refuses what
    would drop a trained weight, and on a resume what the model would miss; returns the notes of
    a fine-tune (the head starting as the embedding, the bias starting at zero)."""
    shapes, buffers, notes = parameter_shapes(model, peft), buffer_shapes(model), []
    if model.tie_word_embeddings and HEAD_WEIGHT in saved:
        raise ValueError(
            f"{where} has an output head of its own ({HEAD_WEIGHT!r}: trained with {TIE}=false), "
            f"this run ties it to the embedding ({TIE}=true), which would throw the trained "
            f"head away. Fix: set {TIE}=false.")
    if HEAD_WEIGHT in shapes and HEAD_WEIGHT not in saved and EMBEDDING_WEIGHT in saved:
        if not finetune:
            raise ValueError(
                f"{where} ties its output head to the embedding (no {HEAD_WEIGHT!r}: trained "
                f"with {TIE}=true), this run unties them ({TIE}=false), which a resume cannot "
                f"continue. Fix: set {TIE}=true, or checkpoint.finetune=true to start a "
                f"fine-tune whose head starts as a copy of the embedding.")
        notes.append(f"{TIE}=false: the output head starts as a copy of the checkpoint's "
                     f"embedding (it was trained tied)")
    dropped = sorted(saved - set(shapes) - set(buffers))
    extra_weights = [name for name in dropped if not name.endswith(BUFFER_NAMES)]
    if extra_weights:
        lora = " (with peft=lora and its adapters' settings, meta.json's peft)" if any(
            is_adapter(n) for n in extra_weights) else ""
        raise ValueError(f"{where} holds {len(extra_weights)} weight(s) this model has none of, "
                         f"e.g. {extra_weights[0]!r}: loading would drop them. Fix: {fix}{lora}.")
    if dropped and not finetune:  # the routers' bias of a run with moe_router_enable_expert_bias
        raise ValueError(
            f"{where} holds the routers' expert bias ({dropped[0]!r}), this run has none "
            f"({BIAS}=false): a resume would route without it. Fix: set {BIAS}=true, or "
            f"checkpoint.finetune=true to start a fine-tune from its weights.")
    missing = sorted(set(buffers) - saved)
    if missing and not finetune:
        raise ValueError(
            f"{where} has no expert bias {missing[0]!r} (trained with {BIAS}=false), this run "
            f"has one ({BIAS}=true), which a resume cannot continue. Fix: set {BIAS}=false, or "
            f"checkpoint.finetune=true to start a fine-tune whose bias starts at zero.")
    if missing:
        notes.append(f"{BIAS}=true: the routers' expert bias starts at zero (the checkpoint has "
                     f"none)")
    return notes


def settings(recorded: Any, model: ModelConfig, where: str, finetune: bool, fix: str
             ) -> list[str]:
    """`recorded`: meta.json's "model" (None for a checkpoint written before it was recorded:
    nothing to compare). A resume with other model settings is refused; a fine-tune's are one
    note."""
    changed = changes(recorded, model)
    if not changed:
        return []
    listed = ", ".join(f"model.{key}={_written(ours)} (the checkpoint's {_written(theirs)})"
                       for key, theirs, ours in changed)
    if finetune:
        return [f"fine-tuning from {where} with other model settings than it was trained with: "
                f"{listed}"]
    raise ValueError(
        f"{where} was trained with other model settings than this run's: {listed}; a resume "
        f"continues its optimizer state and schedule, which needs the same model. Fix: set "
        f"them back, or start a fine-tune from its weights ({fix}).")


def changes(recorded: Any, model: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(key, the recorded value, this run's) of each model key whose effective value differs;
    keys the record lacks (written by an older version) are not compared."""
    if not isinstance(recorded, dict):
        return []
    known = {f.name for f in fields(ModelConfig)}
    theirs_config = replace(model, **{k: v for k, v in recorded.items() if k in known})
    try:
        theirs = effective(theirs_config)
    except (TypeError, IndexError, KeyError, ZeroDivisionError):  # no run of ours wrote it
        return []
    ours = effective(model)
    # A key whose own value is the same differs only through another key, which is listed.
    return [(key, getattr(theirs_config, key), getattr(model, key)) for key in ours
            if key in recorded and key not in HELD and theirs[key] != ours[key]
            and getattr(theirs_config, key) != getattr(model, key)]


def effective(model: ModelConfig) -> dict[str, Any]:
    """Each model key as the model computes with it, so two spellings of one model compare
    equal (kv_channels null or hidden_size / num_heads; moe_layer_freq 1 or [1, 1]; a dense
    model's moe_* keys, which nothing reads; model.name llama with qk_layernorm or qwen3)."""
    values = asdict(model)
    # name: the family its keys make (a llama record with qk_layernorm is qwen3's model)
    values |= {"name": hf_family(model).name,
               "kv_channels": model.head_dim, "num_query_groups": model.query_groups,
               "rope_scaling_factor": model.rope_scaling_factor if model.use_rope_scaling
               else None}
    if model.num_moe_experts is None:
        values |= {key: None for key in values if key.startswith("moe_")}
    else:
        values |= {
            "moe_layer_freq": [model.is_moe_block(i) for i in range(model.num_layers)],
            "moe_ffn_hidden_size": model.expert_ffn_size,
            "moe_router_topk_scaling_factor": model.moe_router_topk_scaling_factor or 1.0,
            "moe_z_loss_coeff": model.moe_z_loss_coeff or 0.0,
            "moe_router_bias_update_rate": model.moe_router_bias_update_rate
            if model.moe_router_enable_expert_bias else None}
    for key in SAME_MATH:
        values.pop(key)
    return values


def _written(value: Any) -> str:
    """A value as the command line writes it (true, null, sigmoid, [1, 0])."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)
