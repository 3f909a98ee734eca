#!/usr/bin/env bash
# The trainer on a GPU machine, one process (NCCL, world 1): fp32 with a mid-run checkpoint,
# a resume from it, bf16, and a larger model's throughput; then the bf16 MFU script.
# Usage (from the repository root): OUT=/some/folder bench/gpu_check.sh
# A machine without hydra/omegaconf needs their pure-Python copies on PYTHONPATH (build/pydeps).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/build/pydeps:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
common=(data.cache_dir="$OUT/cache" logger.log_interval=64 train.eval_interval=256)
run() {  # name, overrides...
  local name=$1; shift
  local started=$SECONDS
  python launch.py hydra.run.dir="$OUT/$name" "${common[@]}" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - started)) s"
  grep -E "^step|^eval|rank\(s\)|saved|Error|error" "$OUT/$name.log" | tail -n 6
}
run fp32 train.train_samples=4096 checkpoint.save_interval=256
run resume train.train_samples=4096 checkpoint.load="$OUT/fp32/checkpoints/step_00000256"
run bf16 train.train_samples=4096 train.precision=bf16
run small_bf16 model=small train.seq_length=1024 train.micro_batch_size=16 \
  train.train_samples=1600 train.precision=bf16 logger.log_interval=20 train.eval_interval=null
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def steps(name):
    return {r["step"]: r for r in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
a, b = steps("fp32"), steps("resume")
common = sorted(set(a) & set(b))
diff = max(abs(a[s]["loss"] - b[s]["loss"]) / a[s]["loss"] for s in common)
print(f"resume vs uninterrupted on GPU: steps {common[0]}..{common[-1]}, max relative loss difference {diff:.2e}")
for name in ("fp32", "bf16", "small_bf16"):
    s = steps(name); last = s[max(s)]
    print(f"{name}: loss {s[min(s)]['loss']:.3f} -> {last['loss']:.3f}, {last['tokens_per_s']:,.0f} tok/s at the last logged step")
PY
python bench/gpu_mfu.py --out "$OUT/gpu_results.json" --variants plain,te_bf16 2>&1 | tail -n 4
