"""peft=lora and train.objective=dpo against full fine-tuning and the next-token loss, as ratios
of engines run side by side in one process (their steps alternate, which goes first alternates
too, so load from anything else on the machine falls on all alike; the first step of each is a
warm-up, the figure is the median step).

1. LoRA's step over full fine-tuning's: model=small (conf/model/small.yaml, 12 layers of width
   768), rank 16 on q, k, v, o, gate, up and down (conf/peft/lora.yaml), one process, 2
   micro-batches of 2 x 128 tokens, fp32. Where the time goes: LoRA skips the frozen weights'
   weight-gradient GEMMs (a third of a step's matmul FLOPs) and their optimizer update, and adds
   its rank-16 matmuls (2 x 16 x (in + out) a token per adapter: under 5% of the projections');
   its forward and its input-gradient GEMMs are full fine-tuning's. The time of each part
   (forward and backward together, update) is reported beside the ratio. Goal <= 0.8.
2. A rank's state (weights, gradients, optimizer state) under LoRA over full fine-tuning, as the
   memory plan has it and as the engines allocate it (trainer.train.throughput.state_bytes),
   the same model and layout. Goal: planned = measured.
3. DPO's step over two next-token steps on the same tokens (preference pairs of ~40 tokens,
   prepared by trainer.prepare --preference and packed whole into samples of 128), LoRA on
   both: a DPO step runs the reference's forward (adapters off, no gradients) and the policy's
   forward and backward, where TRL-style DPO without a precomputed reference runs each pair as
   two sequences; the reference forward costs about a third of a step. Goal <= 1.0.

    python bench/finetune.py          # quick: 3 timed steps
    python bench/finetune.py --full   # 6 timed steps
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from ranks import run_ranks  # noqa: E402
from table import met  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import DpoConfig, ModelConfig, OptimConfig, PeftConfig  # noqa: E402
from trainer.parts.assembly import parameter_shapes  # noqa: E402
from trainer.plan.memory import memory_per_stage  # noqa: E402

MICRO, SEQ, MICRO_BATCHES = 2, 128, 2
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
PEFT = PeftConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/peft/lora.yaml")))
DPO = DpoConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/dpo/default.yaml")))


def small() -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/model/small.yaml")))


def layout() -> Layout:
    """One process, 2 micro-batches of MICRO samples a step."""
    return Layout(1, micro_batch_size=MICRO, seq_length=SEQ,
                  global_batch_size=MICRO * MICRO_BATCHES)


def pairs(folder: Path) -> Path:
    """Arithmetic pairs through trainer.prepare --preference (the byte tokenizer)."""
    from trainer.data.dataset import prepare

    gen = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(400):
        a, b, off = (int(v) for v in torch.randint(1, 90, (3,), generator=gen))
        lines.append(json.dumps({"prompt": f"Q: what is {a} + {b}? A: ",
                                 "chosen": f"it is {a + b}.", "rejected": f"{a + b + off}?"}))
    (folder / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return prepare(folder / "pairs.jsonl", folder / "pairs", 0.0, preference=True)


def _rank(rank: int, steps: int, data: str) -> dict:
    from trainer.data.dataset import TokenDataset
    from trainer.data.stream import SampleStream
    from trainer.model.lora import adapters_off
    from trainer.train.batch import DocumentRules, rank_micro_batches
    from trainer.train.dpo import Dpo
    from trainer.train.engine import build_engine
    from trainer.train.step import train_step
    from trainer.train.throughput import state_bytes

    model, lay = small(), layout()
    engines = {"full": build_engine(model, OPTIM, 0, lay, torch.device("cpu")),
               "lora": build_engine(model, OPTIM, 0, lay, torch.device("cpu"), peft=PEFT),
               "lora_dpo": build_engine(model, OPTIM, 0, lay, torch.device("cpu"), peft=PEFT)}
    dpo = Dpo(DPO, None, functools.partial(adapters_off, engines["lora_dpo"].model.module))
    stream = SampleStream(TokenDataset.open(data), "train", SEQ, 0, shuffle=False, pack=True)
    rules = DocumentRules(reset_attention_mask=True, reset_position_ids=True)
    update_s = {name: [] for name in engines}
    for name, engine in engines.items():  # the update's own time, inside the real step
        def timed(*args, _inner=engine.optimizer.update, _name=name, **kwargs):
            start = time.perf_counter()
            _inner(*args, **kwargs)
            update_s[_name].append(time.perf_counter() - start)
        engine.optimizer.update = timed
    step_s = {name: [] for name in engines}
    order = list(engines)
    for step in range(steps + 1):
        batches = rank_micro_batches(stream, lay, rank, rules=rules,
                                     offset=step * lay.global_batch_size)
        for name in (order if step % 2 == 0 else list(reversed(order))):
            dist.barrier()
            start = time.perf_counter()
            train_step(engines[name].model, engines[name].optimizer, batches, 1e-4,
                       dpo=dpo if name == "lora_dpo" else None)
            step_s[name].append(time.perf_counter() - start)
    return {"step_s": step_s, "update_s": update_s,
            "state": {name: state_bytes(engines[name]) for name in ("full", "lora")}}


def measure(quick: bool = True) -> dict:
    steps = 3 if quick else 6
    with tempfile.TemporaryDirectory() as tmp:
        data = pairs(Path(tmp))
        (found,) = run_ranks(1, _rank, steps, str(data), timeout=3600)
    median = {name: statistics.median(times[1:]) for name, times in found["step_s"].items()}
    update = {name: statistics.median(times[1:]) for name, times in found["update_s"].items()}
    model = small()
    plan = {name: memory_per_stage(parameter_shapes(model, peft), model.num_layers,
                                   layout(),
                                   model.tie_word_embeddings, lora=peft is not None)[0].total_bytes
            for name, peft in (("full", None), ("lora", PEFT))}
    lora_over_full = median["lora"] / median["full"]
    dpo_over_two = median["lora_dpo"] / (2 * median["lora"])
    planned = plan["lora"] / plan["full"]
    measured = found["state"]["lora"] / found["state"]["full"]
    return {
        "lora_step_over_full": {"value": round(lora_over_full, 3), "goal": "<= 0.8",
                                "met": met(round(lora_over_full, 3), "<= 0.8")},
        "step_s": {k: round(v, 3) for k, v in median.items()},
        "update_s": {k: round(v, 4) for k, v in update.items()},
        "forward_backward_s": {k: round(median[k] - update[k], 3) for k in median},
        "state_lora_over_full": {"planned": round(planned, 4), "measured": round(measured, 4),
                                 "bytes": {"planned": plan, "measured": found["state"]},
                                 "met": plan == {k: found["state"][k] for k in plan}},
        "dpo_step_over_two_lm_steps": {"value": round(dpo_over_two, 3), "goal": "<= 1.0",
                                       "met": met(round(dpo_over_two, 3), "<= 1.0")},
        "timed_steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    print(json.dumps(measure(not parser.parse_args().full), indent=1))


if __name__ == "__main__":
    main()
