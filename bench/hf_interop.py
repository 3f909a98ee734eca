"""hf_import_s / hf_export_s: `python -m trainer.hf import` and `export` of a random
LlamaForCausalLM of model=small's shapes (fp32 safetensors, ~0.34 GB), side by side with
transformers' own from_pretrained + save_pretrained of the same folder; and each command's peak
resident memory over the weights' bytes, measured in a fresh process against one that only
imports the same modules (the streaming claim: about one tensor beyond the baseline, not the
model).

    python bench/hf_interop.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=256, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=12, head_dim=64, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             tie_word_embeddings=False, attention_bias=False, mlp_bias=False)


def _child(code: str) -> tuple[float, int]:
    """(wall seconds, peak RSS in bytes) of `python -c code` in a fresh process."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                             env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise RuntimeError(f"benchmark child failed ({child.returncode}): {code[:200]}")
    return time.perf_counter() - started, usage.ru_maxrss * 1024


def measure(quick: bool = True) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="hf-bench-"))
    hf, ours, back = folder / "hf", folder / "ours", folder / "back"
    _child(f"""
import torch, transformers
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{SMALL!r}))
model.save_pretrained({str(hf)!r})
""")
    weight_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    setup = "import trainer.checkpoint.hf, trainer.hf, transformers, torch"
    _, baseline = _child(setup)
    import_s, import_rss = _child(
        f"{setup}; trainer.hf.main(['import', {str(hf)!r}, {str(ours)!r}])")
    export_s, export_rss = _child(
        f"{setup}; trainer.hf.main(['export', {str(ours)!r}, {str(back)!r}])")
    transformers_s, _ = _child(f"""{setup}
model = transformers.LlamaForCausalLM.from_pretrained({str(hf)!r})
model.save_pretrained({str(folder / 'hf_again')!r})
""")
    shutil.rmtree(folder)
    return {
        "hf_import_s": round(import_s, 2), "hf_export_s": round(export_s, 2),
        "transformers_load_and_save_s": round(transformers_s, 2),
        "import_and_export_over_transformers": round((import_s + export_s) / transformers_s, 2),
        "weights_gb": round(weight_bytes / 1e9, 3),
        # beyond the peak of a process that only imports the same modules
        "import_peak_rss_over_weights": round((import_rss - baseline) / weight_bytes, 3),
        "export_peak_rss_over_weights": round((export_rss - baseline) / weight_bytes, 3),
        "peak_rss_mb": {"imports_only": baseline >> 20, "import": import_rss >> 20,
                        "export": export_rss >> 20},
        "setup": "model=small shapes (85M parameters, fp32), each command in a fresh process "
                 "(interpreter and imports included in the times)",
    }


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
