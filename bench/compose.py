"""compose_vs_bare_hydra: wall time of `launch.py --cfg job --resolve` over a bare Hydra app
that composes the same config tree without our plugins (stand-in resolvers, the basic sweeper),
each a fresh process; and the time to list every group of a 16,384-rank layout."""
from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["experiment=seed_128rank_cp2"]
BARE_APP = '''
import sys
sys.path = [p for p in sys.path if p.rstrip("/") != {root!r}]  # hide our hydra_plugins
sys.path.insert(0, {pkgs!r})  # trainer/ and parallel/ only: the schemas live in trainer.config
import hydra
from omegaconf import OmegaConf
import trainer.config  # noqa: F401  (the same schemas)
OmegaConf.register_new_resolver("gtp.layout", lambda *a: OmegaConf.create({{}}))
OmegaConf.register_new_resolver("gtp.folder", lambda name: name)

@hydra.main(version_base="1.3", config_path={conf!r}, config_name="config")
def main(cfg):
    assert not [m for m in sys.modules if "gtp_trainer" in m], "our plugins were loaded"

main()
'''


def _wall(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(args, cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - started


def _bare_app(folder: Path) -> Path:
    conf = folder / "conf"
    shutil.copytree(ROOT / "conf", conf)
    config = conf / "config.yaml"  # the validating sweeper is one of our plugins
    config.write_text("".join(line for line in config.read_text().splitlines(True)
                              if "gtp_validating" not in line))
    (folder / "pkgs").mkdir()
    for package in ("trainer", "parallel"):
        (folder / "pkgs" / package).symlink_to(ROOT / package)
    app = folder / "bare_app.py"
    app.write_text(BARE_APP.format(root=str(ROOT), pkgs=str(folder / "pkgs"), conf=str(conf)))
    return app


def groups_time(world: int = 16384, repeats: int = 5) -> float:
    sys.path.insert(0, str(ROOT))
    from parallel.layout import Layout

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        Layout(world, tensor_model_parallel_size=2, sequence_parallel=True,
               tensor_parallel_num_weight_shards=64, tensor_parallel_num_sequence_shards=16,
               context_parallel_size=2, pipeline_model_parallel_size=2).all_groups()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(quick: bool = True) -> dict:
    repeats = 5 if quick else 15
    with tempfile.TemporaryDirectory(prefix="gtp-bench-") as folder:
        bare = _bare_app(Path(folder))
        ours_cmd = [sys.executable, str(ROOT / "launch.py"), *OVERRIDES, "--cfg", "job",
                    "--resolve"]
        bare_cmd = [sys.executable, str(bare), *OVERRIDES, "--cfg", "job", "--resolve"]
        _wall(ours_cmd), _wall(bare_cmd)  # warm the file cache for both
        # Once as a run, so that main() checks that none of our plugins was loaded.
        _wall([sys.executable, str(bare), *OVERRIDES, f"hydra.run.dir={folder}/run"])
        ours, plain = [], []
        for _ in range(repeats):
            ours.append(_wall(ours_cmd))
            plain.append(_wall(bare_cmd))
    ratios = [o / p for o, p in zip(ours, plain)]
    return {
        "compose_vs_bare_hydra": round(statistics.median(ours) / statistics.median(plain), 4),
        "ratio_spread": [round(min(ratios), 4), round(max(ratios), 4)],
        "compose_s_ours": round(statistics.median(ours), 4),
        "compose_s_bare": round(statistics.median(plain), 4),
        "groups_16384_ranks_s": round(groups_time(), 4),
    }
