"""Every check of a config value that needs no process, no torch and reads no data (a folder
the run must write is tried): one place, so a new key gets its check here. Each failure is one
ValueError line naming the key, the value and the fix; settle() turns it into the run's one-line
error. The layout's rules relating degrees live with their axes (parallel.layout.axes), and so do an
axis's rules for the model's shapes (trainer.plan.axis_costs); the sample accounting is
plan.accounting's, the schedule plan.lr_schedule's, the data's data.source's.
"""
from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

from parallel.layout import Layout
from parallel.layout.axes import BATCH, PARALLEL_KEYS
from trainer.config import (
    CheckpointConfig,
    ClusterConfig,
    Config,
    LoggerConfig,
    LoggerName,
    ModelConfig,
    OptimConfig,
    Precision,
)
from trainer.parts import model_parts, mtp
from trainer.parts.assembly import parameter_shapes
from trainer.parts.families import FAMILIES
from trainer.parts.gdn import GATED_DELTA_NET, check_hybrid
from trainer.parts.matrices import unmatched_patterns
from trainer.parts.moe import MOE, check_moe
from trainer.values import finite, one_of, positive_int

# What optim.name selects; the implementation lives in train/ (which imports torch). A model
# family (model.name) is a description in trainer.parts.families.
OPTIMIZERS = ("adamw", "muon")
# Megatron's muon_scale_mode values (emerging_optimizers' get_muon_scale_factor: the factor the
# orthogonalised update of a rows x cols matrix is multiplied by; trainer.plan.muon), and where
# the Newton-Schulz iteration runs: master, the master weights' dtype (fp32, or fp64 in the exact
# tests), or bf16, its input rounded first as torch.optim.Muon does.
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
NS_DTYPES = ("master", "bf16")
MUON_KEYS = ("muon_momentum", "muon_nesterov", "muon_num_ns_steps", "muon_scale_mode",
             "muon_extra_scale_factor", "muon_split_qkv", "muon_ns_dtype", "adamw_params")


def check_model(model: ModelConfig) -> None:
    """The model's own rules (the Transformer calls this too): its family's (model.name), the
    shapes every block has, and each of its parts' (trainer.parts)."""
    family = FAMILIES.get(model.name)
    one_of("model.name", model.name, tuple(FAMILIES), "model family")
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size"):
        positive_int(f"model.{key}", getattr(model, key))
    positive_int("model.make_vocab_size_divisible_by", model.make_vocab_size_divisible_by,
                 "use 128 (Megatron's default), or 1 for no padding")
    finite("model.init_std", model.init_std, 0, False, fix="use e.g. 0.02")
    check_moe(model)  # the MoE part's keys: refused on a dense model, checked on a MoE one
    check_hybrid(model)  # Gated DeltaNet's likewise: refused without the variant
    for part in model_parts(model):
        if part not in (MOE, GATED_DELTA_NET):
            part.rules(model)
    mtp.rules(model)
    family.rules(model)


def check_optim(optim: OptimConfig) -> None:
    one_of("optim.name", optim.name, OPTIMIZERS, "optimizer")
    finite("optim.weight_decay", optim.weight_decay, 0, True, fix="use e.g. 0.1, or 0 for none")
    for key in ("beta1", "beta2"):
        finite(f"optim.{key}", getattr(optim, key), 0, True, 1, False, fix="use e.g. 0.9")
    finite("optim.eps", optim.eps, 0, False, fix="use e.g. 1e-8")
    if optim.clip_grad is not None:
        finite("optim.clip_grad", optim.clip_grad, 0, False,
               fix="use e.g. 1.0, or null for no clipping")
    if optim.qk_clip_threshold is not None:
        finite("optim.qk_clip_threshold", optim.qk_clip_threshold, 0, False,
               fix="use e.g. 100 (Kimi K2's), or null for no QK-clip")
    finite("optim.qk_clip_alpha", optim.qk_clip_alpha, 0, True, 1, True,
           fix="use 0.5: q and k take half the scaling each")
    if optim.name != "muon":
        unused = [f"optim.{k}={getattr(optim, k)!r}" for k in MUON_KEYS
                  if getattr(optim, k) != getattr(OptimConfig, k, [])]
        if unused:
            raise ValueError(f"{unused[0]} applies to Muon only, but optim.name={optim.name!r}. "
                             f"Fix: select optim=muon, or drop the override.")
        return
    finite("optim.muon_momentum", optim.muon_momentum, 0, True, 1, False, fix="use e.g. 0.95")
    positive_int("optim.muon_num_ns_steps", optim.muon_num_ns_steps, "use e.g. 5")
    one_of("optim.muon_scale_mode", optim.muon_scale_mode, SCALE_MODES, "Muon scale mode")
    finite("optim.muon_extra_scale_factor", optim.muon_extra_scale_factor, 0, False,
           fix="use 0.2 with spectral (AdamW's update RMS), or 1.0")
    one_of("optim.muon_ns_dtype", optim.muon_ns_dtype, NS_DTYPES, "Newton-Schulz dtype")


def check_qk_clip(cfg: Config) -> None:
    """QK-clip scales q and k through their projections: a norm after them would undo it."""
    threshold = cfg.optim.qk_clip_threshold
    if threshold is None:
        return
    if cfg.model.qk_layernorm:
        raise ValueError(f"optim.qk_clip_threshold={threshold} with model.qk_layernorm=true: "
                         f"the q and k norms would undo the clip's scaling of their "
                         f"projections. Fix: optim.qk_clip_threshold=null, or a model without "
                         f"qk_layernorm.")
    if cfg.train.compile:
        raise ValueError(f"optim.qk_clip_threshold={threshold} with train.compile="
                         f"{cfg.train.compile}: recording each head's largest logit is not "
                         f"compiled. Fix: train.compile=false, or optim.qk_clip_threshold=null.")


def check_muon_params(model: ModelConfig, optim: OptimConfig) -> None:
    """optim.adamw_params: each pattern names a parameter of the model."""
    if optim.name != "muon":
        return
    shapes = parameter_shapes(model)
    missing = unmatched_patterns(shapes, list(optim.adamw_params))
    if missing:
        raise ValueError(f"optim.adamw_params has {missing[0]!r}, which matches no parameter of "
                         f"model={model.name}. Fix: use a name pattern such as "
                         f"'layers.*.attn.o.weight' (docs/optimizers.md lists the names), or "
                         f"remove it.")


def check_cluster(cluster: ClusterConfig) -> None:
    positive_int("cluster.num_nodes", cluster.num_nodes)
    positive_int("cluster.procs_per_node", cluster.procs_per_node)
    positive_int("cluster.gpus_per_nvlink_domain", cluster.gpus_per_nvlink_domain,
                 "set it to the GPUs one NVLink domain connects (8 on a DGX H100)")
    positive_int("cluster.timeout_s", cluster.timeout_s,
                 "set it to the seconds a collective may wait (default 300)")
    if not isinstance(cluster.max_restarts, int) or cluster.max_restarts < 0:
        raise ValueError(f"cluster.max_restarts={cluster.max_restarts} must be a count >= 0. "
                         f"Fix: 0 ends the run at the first failed rank; N restarts it from "
                         f"the latest checkpoint up to N times.")
    for key in ("device_memory_gib", "peak_bf16_tflops", "peak_fp32_tflops",
                "nvlink_bandwidth_gbs", "network_bandwidth_gbs"):
        finite(f"cluster.{key}", getattr(cluster, key), 0, False,
               fix="set it from the device's datasheet (conf/cluster/dgx_h100.yaml cites "
                   "its sources)")
    finite("cluster.link_latency_us", cluster.link_latency_us, 0, True, fix="use e.g. 5")
    finite("cluster.compute_efficiency", cluster.compute_efficiency, 0, False, 1, True,
           fix="use the share of peak FLOP/s a training step reaches, e.g. 0.45")
    finite("cluster.memory_margin", cluster.memory_margin, 0, True, 1, False,
           fix="use e.g. 0.1 (a tenth of the device kept free)")
    if cluster.cpu_cores_per_node is not None:
        positive_int("cluster.cpu_cores_per_node", cluster.cpu_cores_per_node,
                     "set it to the node's CPU cores, or null where each rank has a GPU")


def check_layout_inputs(parallel: Any, cluster: Any, train: Any) -> None:
    """The counts a Layout is built from (parallel.layout.axes: every axis's keys and the batch's),
    each checked before the Layout relates them. DictConfig nodes or dataclasses."""
    check_cluster(cluster)
    sections = {"parallel": parallel, "train": train}
    for key in (*PARALLEL_KEYS, *BATCH):
        key.check(getattr(sections[key.section], key.name))


def check_writable(key: str, value: Any, folder: Path, what: str) -> None:
    """folder, or the nearest existing folder above it, must take a new entry. Tried, not asked
    of os.access, which says yes to root even where nothing can be made (/proc)."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(existing)
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError:
        raise ValueError(f"{key}={value}: {what} in {folder}, but {existing} is not a folder "
                         f"this user can write. Fix: point {key} at a folder you can write."
                         ) from None


def check_restarts(cfg: Config) -> None:
    """A restart resumes from the run's latest checkpoint, as a relaunch does."""
    if cfg.cluster.max_restarts and not cfg.checkpoint.resume:
        raise ValueError(f"cluster.max_restarts={cfg.cluster.max_restarts} with "
                         f"checkpoint.resume=false: a restarted run would start over and "
                         f"overwrite the checkpoints of the failed one. Fix: set "
                         f"checkpoint.resume=true, or cluster.max_restarts=0.")


def check_checkpoint(checkpoint: CheckpointConfig) -> None:
    """What can be known before start: the folder to load exists (whether it holds checkpoints
    is asked at start, of the checkpoint module), the folder to save into can be written."""
    if checkpoint.load is not None and not Path(checkpoint.load).exists():
        raise ValueError(f"checkpoint.load={checkpoint.load} does not exist. Fix: point it at a "
                         f"checkpoint folder or a folder of them, or set checkpoint.load=null.")
    if checkpoint.finetune and checkpoint.load is None:
        raise ValueError("checkpoint.finetune=true takes its weights from checkpoint.load, which "
                         "is null. Fix: set checkpoint.load to the checkpoint to fine-tune, or "
                         "checkpoint.finetune=false.")
    if (checkpoint.finetune and checkpoint.dir is not None
            and Path(checkpoint.dir).resolve() == Path(checkpoint.load).resolve()):
        raise ValueError(f"checkpoint.finetune=true with checkpoint.dir=checkpoint.load="
                         f"{checkpoint.load}: a relaunch would resume the checkpoint being "
                         f"fine-tuned as if it were this run's. Fix: save the fine-tuned run "
                         f"elsewhere (checkpoint.dir=null saves into the run folder).")
    if checkpoint.dir is not None:
        check_writable("checkpoint.dir", checkpoint.dir, Path(checkpoint.dir),
                       "checkpoints are saved")


def check_logger(logger: LoggerConfig) -> None:
    positive_int("logger.log_interval", logger.log_interval, "set it to a number of steps")
    positive_int("logger.sample_max_new_tokens", logger.sample_max_new_tokens,
                 "set it to a number of tokens")
    if logger.name is not LoggerName.wandb and logger.project is not None:
        raise ValueError(f"logger.project={logger.project!r} is ignored by "
                         f"logger={logger.name.value}. Fix: use logger=wandb, or remove the "
                         f"override.")
    if logger.name is LoggerName.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("logger=tensorboard needs the tensorboard package, which is not "
                         "installed. Fix: pip install -e '.[tensorboard]', or use logger=console.")


def check_sample_prompts(cfg: Config) -> None:
    """Greedy continuations at each evaluation, generated on rank 0 from the whole model."""
    prompts = cfg.logger.sample_prompts
    if prompts is None:
        return
    value = f"logger.sample_prompts={list(prompts)}"
    if cfg.train.eval_interval is None:
        raise ValueError(f"{value} is ignored without evaluations (they are sampled at each). "
                         f"Fix: set train.eval_interval, or logger.sample_prompts=null.")
    if cfg.parallel.pipeline_model_parallel_size > 1:
        raise ValueError(f"{value} with parallel.pipeline_model_parallel_size="
                         f"{cfg.parallel.pipeline_model_parallel_size}: samples are generated "
                         f"from one rank's whole model, which pipeline stages split. Fix: set "
                         f"logger.sample_prompts=null (python -m trainer.generate reads any "
                         f"checkpoint).")
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"{value}: expected a list of non-empty prompts. Fix: e.g. "
                         f"'logger.sample_prompts=[\"def main(\"]'.")


def check_seeds(cfg: Config) -> None:
    for key, value in (("train.seed", cfg.train.seed), ("data.seed", cfg.data.seed)):
        if not 0 <= value < 2**32:
            raise ValueError(f"{key}={value} must be in [0, 2**32). Fix: choose such a seed.")


def check_memory_options(cfg: Config, layout: Layout) -> None:
    """Activation recompute and communication dtype: keys that only act in some combinations
    are refused where they would be silently ignored."""
    train, num_layers = cfg.train, cfg.model.num_layers
    if train.recompute_num_layers is not None:
        if train.recompute_granularity is None:
            raise ValueError(
                f"train.recompute_num_layers={train.recompute_num_layers} is ignored without "
                f"recompute. Fix: set train.recompute_granularity=full (or selective), or "
                f"train.recompute_num_layers=null.")
        if not 1 <= train.recompute_num_layers <= num_layers:
            raise ValueError(
                f"train.recompute_num_layers={train.recompute_num_layers} must be in [1, "
                f"model.num_layers={num_layers}]. Fix: choose such a number of blocks, or null "
                f"for all of them.")
    if cfg.parallel.grad_reduce_in_bf16 and train.precision is not Precision.bf16:
        raise ValueError(
            f"parallel.grad_reduce_in_bf16=true is ignored with train.precision="
            f"{train.precision.value} (gradients are fp32). Fix: set train.precision=bf16, or "
            f"parallel.grad_reduce_in_bf16=false.")
    rank = cfg.dry_run_rank
    if rank is not None:
        if not cfg.dry_run:
            raise ValueError(f"dry_run_rank={rank} is ignored without dry_run=true. Fix: add "
                             f"dry_run=true, or remove dry_run_rank.")
        if cfg.optim.name == "muon":
            raise ValueError(f"dry_run_rank={rank} with optim=muon: a simulated rank has no "
                             f"peers to exchange Muon's matrices with. Fix: measure with "
                             f"optim=adamw (the plan states Muon's terms), or drop "
                             f"dry_run_rank.")
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"dry_run_rank={rank} is not a rank of world_size="
                             f"{layout.world_size}. Fix: choose a rank in [0, "
                             f"{layout.world_size - 1}].")


COMPILE_MODES = (False, "blocks")  # train.compile


def check_compile(cfg: Config) -> None:
    train, experts = cfg.train, cfg.model.num_moe_experts
    if train.compile not in COMPILE_MODES:
        raise ValueError(f"train.compile={train.compile!r} is not a compile mode. Fix: "
                         f"train.compile=blocks (torch.compile each transformer block) or "
                         f"train.compile=false.")
    if train.compile == "blocks" and experts and train.precision is Precision.fp32:
        # torch's meta kernel of aten._grouped_mm, which compiling traces, takes bf16 only.
        raise ValueError(f"train.compile=blocks with a mixture of experts (model.num_moe_experts="
                         f"{experts}) in train.precision=fp32: torch cannot compile the experts' "
                         f"grouped GEMM in fp32. Fix: train.precision=bf16, or "
                         f"train.compile=false.")


OBJECTIVES = ("lm", "dpo")
DPO_LOSSES = ("sigmoid", "ipo")


def check_objective(cfg: Config) -> None:
    """train.objective and dpo.*: DPO reads whole pairs, each document apart."""
    one_of("train.objective", cfg.train.objective, OBJECTIVES, "objective")
    if cfg.train.objective != "dpo":
        return
    dpo, data = cfg.dpo, cfg.data
    finite("dpo.beta", dpo.beta, 0, False, fix="use e.g. 0.1 (TRL's default)")
    one_of("dpo.loss_type", dpo.loss_type, DPO_LOSSES, "DPO loss")
    finite("dpo.label_smoothing", dpo.label_smoothing, 0, True, 0.5, False,
           fix="use e.g. 0.1, or 0 for plain DPO")
    if dpo.label_smoothing and dpo.loss_type != "sigmoid":
        raise ValueError(f"dpo.label_smoothing={dpo.label_smoothing} with dpo.loss_type="
                         f"{dpo.loss_type}: smoothing is the sigmoid loss's (conservative DPO). "
                         f"Fix: dpo.label_smoothing=0, or dpo.loss_type=sigmoid.")
    unset = [key for key in ("pack", "reset_attention_mask", "reset_position_ids")
             if not getattr(data, key)]
    if unset:
        raise ValueError(f"train.objective=dpo with data.{unset[0]}=false: DPO takes each pair "
                         f"whole, its two documents apart, as separate sequences. Fix: "
                         + " ".join(f"data.{k}=true" for k in unset) + ".")
    if cfg.model.mtp_num_layers:
        raise ValueError(f"train.objective=dpo with model.mtp_num_layers="
                         f"{cfg.model.mtp_num_layers}: multi-token prediction's losses are not "
                         f"part of the preference loss. Fix: model.mtp_num_layers=null for DPO.")


def check_values(cfg: Config, layout: Layout) -> None:
    """Everything above, in the order a reader meets the config."""
    check_layout_inputs(cfg.parallel, cfg.cluster, cfg.train)
    check_model(cfg.model)
    mtp.check_sequence(cfg.model, cfg.train.seq_length)
    check_memory_options(cfg, layout)
    check_compile(cfg)
    check_seeds(cfg)
    check_optim(cfg.optim)
    check_objective(cfg)
    check_muon_params(cfg.model, cfg.optim)
    check_qk_clip(cfg)
    check_logger(cfg.logger)
    check_sample_prompts(cfg)
    check_checkpoint(cfg.checkpoint)
    check_restarts(cfg)
