"""Start a run from launch.py: check the inputs that need files (the dataset, prepared now if it
is the built-in one; the checkpoint the run starts from), lock what the run writes, write the
run directory's artifacts, and start the ranks the way this process was launched
(trainer.launch.ranks, trainer.launch.local)."""
from __future__ import annotations

import tempfile
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from trainer.checkpoint import resume
from trainer.compose.runspec import RunSpec
from trainer.config import ConfigError
from trainer.data.stream import open_streams
from trainer.launch.folder import checkpoint_lock, run_lock
from trainer.launch.local import check_local, launch_local
from trainer.launch.ranks import RankEnv, check_world, launched_rank, run_rank
from trainer.parts.assembly import parameter_shapes
from trainer.parts.matrices import muon_names
from trainer.report.console import console_log
from trainer.report.plot import write_curves
from trainer.report.record import layout_record, write_layout_json


def check_inputs(spec: RunSpec, run_dir: Path) -> resume.Decided:
    """Before any rank starts; a problem is one line naming the key or the file. The checkpoint
    the run starts from is checked from its metadata (the ranks verify its checksums); what was
    decided goes to a rank started in this process."""

    def expected() -> resume.Expected:
        # the stream's identity only: a packed stream packs when a sample is first read
        train, _ = open_streams(spec.data, spec.layout.seq_length, spec.config.data.seed,
                                with_valid=False, pack=spec.config.data.pack)
        return resume.Expected(parameter_shapes(spec.config.model, spec.config.peft),
                               train.identity, spec.plan, spec.layout, spec.config.model,
                               muon_names(spec.config.model, spec.config.optim),
                               spec.config.peft, spec.config.train.seed)

    try:
        spec.data.prepare(spec.config.train, spec.config.data.pack)
        save_dir = resume.save_folder(spec.config.checkpoint, run_dir)
        return resume.decide(spec.config.checkpoint, save_dir, expected)
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from None


def write_run_artifacts(cfg: DictConfig, spec: RunSpec, run_dir: Path) -> None:
    """The resolved config and layout.json, so a run directory explains itself."""
    write_layout_json(layout_record(spec), run_dir)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


def run(cfg: DictConfig, spec: RunSpec, run_dir: Path) -> None:
    """Lock the run folder before anything is written into it, and the checkpoint folder before
    the run reads which checkpoint to resume (trainer.launch.folder); check the inputs, write
    the artifacts, then start the ranks. Whatever started this process, these happen once, in
    this order; only rank 0 of a torchrun/submitit world writes."""
    env = launched_rank(spec.config.cluster.timeout_s)
    writer = env is None or env.rank == 0
    with run_lock(run_dir, hold=writer), checkpoint_lock(
            resume.save_folder(spec.config.checkpoint, run_dir), hold=writer):
        if env is not None:  # torchrun or submitit started this process as one rank
            check_world(env, spec)
        else:
            check_local(spec)
        decided = check_inputs(spec, run_dir)
        if writer:
            write_run_artifacts(cfg, spec, run_dir)
        with console_log(run_dir, writer=writer):
            try:
                _start_ranks(spec, run_dir, env, decided)
            finally:
                if writer:
                    write_curves(run_dir)


def _start_ranks(spec: RunSpec, run_dir: Path, env: RankEnv | None,
                 decided: resume.Decided) -> None:
    # The model config travels with every checkpoint (python -m trainer.hf export reads it), and
    # the global batch size, which a resume under another one names in its messages; the
    # tokenizer and the sequence length trained at, which python -m trainer.generate reads (a
    # blend's stream identity holds no seq_length).
    meta = {"run_dir": str(run_dir), "model": asdict(spec.config.model),
            "global_batch_size": spec.plan.global_batch_size,
            "seq_length": spec.layout.seq_length, "tokenizer": spec.data.tokenizer_file()}
    if env is not None:  # this process is one rank of a world started elsewhere
        run_rank(env, spec, run_dir, meta, decided=decided)
    elif spec.layout.world_size > 1:  # spawned: each rank decides (a restart, afresh)
        launch_local(spec, run_dir, meta)
    else:
        with tempfile.TemporaryDirectory(prefix="gtp-rendezvous-") as meeting:
            run_rank(RankEnv(0, 1, 0, f"file://{meeting}/store", "launch.py"), spec, run_dir,
                     meta, decided=decided)
