"""What checkpoint checksums cost: two gloo ranks save model=small (85M parameters: weights and
both Adam moments, about 1 GB) with checkpoint.save (which checksums each rank's files and
records them in meta.json) and, side by side, with DCP alone into another folder; then verify
the checkpoint between them (each rank its share of the files) and load it. Figures: the
checksum rate (bytes/s, goal >= 1 GB/s on this CPU) on save and on load, and the save's time
over DCP's alone.

    python bench/checksum.py
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from memory import OPTIM  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from ranks import run_ranks  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402

ROOT = HERE.parent
WORLD = 2


def _rank(rank: int, folder: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint import dcp as checkpoint
    from trainer.checkpoint.integrity import agreed, file_checksum
    from trainer.plan.options import EngineOptions
    from trainer.train.engine import build_engine

    model = ModelConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/model/small.yaml")))
    layout = Layout(WORLD, micro_batch_size=1, seq_length=128,
                    tensor_parallel_num_weight_shards=WORLD)
    engine = build_engine(model, OPTIM, 0, layout, torch.device("cpu"), EngineOptions())
    times: dict[str, list[float]] = {"save": [], "dcp_save": [], "verify": [], "load": [],
                                     "checksum_own_files": []}
    def dcp_alone(i: int) -> Path:
        moments = engine.optimizer.gather_moments()
        tensors = checkpoint._tensors(engine, engine.optimizer.moment_views(moments))
        dcp.save({"optim_step": moments.step}, checkpoint_id=Path(folder) / f"plain{i}",
                 planner=checkpoint.ChunkSavePlanner(tensors))
        return Path(folder) / f"plain{i}"

    def ours(i: int) -> Path:
        return checkpoint.save(engine, checkpoint.TrainState(step=i), Path(folder) / "ours", {})

    for i in range(repeats):
        # Alternated: the second of two saves writes while the first one's pages are flushed.
        saved = {}
        for name, save in ((("dcp_save", dcp_alone), ("save", ours)) if i % 2 else
                           (("save", ours), ("dcp_save", dcp_alone))):
            dist.barrier()
            started = time.perf_counter()
            saved[name] = save(i)
            dist.barrier()
            times[name].append(time.perf_counter() - started)
        path = saved["save"]
        mine = sorted(p for p in path.glob(f"__{rank}_*.distcp"))
        started = time.perf_counter()
        for file in mine:
            file_checksum(file)
        times["checksum_own_files"].append(time.perf_counter() - started)
        dist.barrier()
        started = time.perf_counter()
        assert agreed(dist.group.WORLD)(path) is None
        times["verify"].append(time.perf_counter() - started)
        started = time.perf_counter()
        checkpoint.load(engine, path)
        dist.barrier()
        times["load"].append(time.perf_counter() - started)
        if rank == 0:
            shutil.rmtree(saved["dcp_save"])
    own_bytes = sum(p.stat().st_size for p in mine)
    total = sum(p.stat().st_size for p in path.iterdir())
    return {"times": times, "own_bytes": own_bytes, "checkpoint_bytes": total}


def measure(quick: bool = True) -> dict:
    repeats = 3 if quick else 5
    with tempfile.TemporaryDirectory(prefix="gtp-checksum-", dir=HERE.parent) as folder:
        results = run_ranks(WORLD, _rank, folder, repeats, timeout=1800)

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    worst = {key: median([max(r["times"][key][i] for r in results) for i in range(repeats)])
             for key in results[0]["times"]}  # a collective step lasts as long as its last rank
    own = max(r["own_bytes"] for r in results)
    total = results[0]["checkpoint_bytes"]
    return {
        "checksum_gb_per_s_on_save": round(own / worst["checksum_own_files"] / 1e9, 2),
        # verify: each rank checksums half the files, read from the page cache here
        "checksum_gb_per_s_on_load": round(total / WORLD / worst["verify"] / 1e9, 2),
        "save_over_dcp_alone": round(worst["save"] / worst["dcp_save"], 3),
        "verify_over_load": round(worst["verify"] / worst["load"], 3),
        "median_s": {key: round(value, 3) for key, value in worst.items()},
        "checkpoint_gb": round(total / 1e9, 3),
        "setup": f"{WORLD} gloo ranks, model=small, WS {WORLD}, {repeats} saves, each against "
                 f"DCP alone; the files are in the page cache (just written)",
    }


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
