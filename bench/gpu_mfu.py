"""Single-GPU bf16 training speed and MFU of a ~1B Transformer (trainer.model.transformer): plain
PyTorch against the same model with transformer-engine layers. A benchmark that prints a table and
writes JSON, not a test; it downloads nothing (synthetic tokens, default initialisers).

    python bench/gpu_mfu.py [--out bench/gpu_results.json] [--peak-tflops 989]
    python bench/gpu_mfu.py --cpu-smoke --out /tmp/smoke.json   # the same code path on CPU
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import stamp  # noqa: E402  (bench/, beside this file)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from trainer.config import ModelConfig  # noqa: E402
from trainer.model.norm import RMSNorm  # noqa: E402
from trainer.model.transformer import Transformer  # noqa: E402

# Llama-style widths (TinyLlama's hidden and ffn, full multi-head attention) at 18 layers:
# 1,055,991,808 parameters, printed and checked at run time.
ONE_B = ModelConfig(name="llama", vocab_size=32000, hidden_size=2048, num_layers=18,
                    num_heads=16, ffn_hidden_size=5632, rope_theta=10000.0, norm_eps=1e-5,
                    init_std=0.02)
TINY = ModelConfig(name="llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                   ffn_hidden_size=176, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02)

# Dense (not 2:4 sparse) bf16 tensor-core peak from the datasheets; the first substring of the
# device name that matches wins, so "H100 PCIe" is looked at before "H100".
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H200", 989e12), ("H100", 989e12), ("A100", 312e12))

FLOPS_FORMULA = ("flops_per_token = 6 * non_embedding_params + 12 * num_layers * hidden_size * "
                 "seq_length (PaLM appendix B / Megatron accounting: forward + backward; "
                 "attention scores counted in full, not halved for the causal mask; "
                 "non_embedding_params = every parameter except the input embedding table: "
                 "the output head is a matmul and counts)")
VARIANTS = ("plain", "te_bf16", "te_fp8")
NO_CUDA = ("no CUDA device: bench/gpu_mfu.py measures GPU training. Run it on a GPU machine, "
           "or pass --cpu-smoke to check the code path on CPU.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/gpu_results.json", help="JSON results path")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny model on CPU, 2 timed steps, MFU null, transformer-engine skipped")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak of the GPU in TFLOP/s (overrides the name table)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default 8 (smoke: 2)")
    p.add_argument("--seq-length", type=int, default=None, help="default 2048 (smoke: 128)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps, default 3 (smoke: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps, default 10 (smoke: 2)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {VARIANTS}")
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    for key, full, tiny in (("micro_batch_size", 8, 2), ("seq_length", 2048, 128),
                            ("warmup", 3, 1), ("steps", 10, 2)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if smoke else full)
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := sorted(set(args.variants) - set(VARIANTS)):
        p.error(f"--variants has {unknown}; choose from {VARIANTS}")
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    return args


def count_params(model: nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    embedding = model.embed.weight.numel()  # a lookup, no matmul: outside the 6N term
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding}


def flops_per_token(cfg: ModelConfig, seq_length: int, non_embedding_params: int) -> int:
    return 6 * non_embedding_params + 12 * cfg.num_layers * cfg.hidden_size * seq_length


def peak_flops(device_name: str | None, override_tflops: float | None) -> tuple[float | None, str]:
    if override_tflops is not None:
        return override_tflops * 1e12, "--peak-tflops"
    for key, flops in PEAK_BF16_FLOPS:
        if device_name and key in device_name:
            return flops, f"table entry {key!r} (dense bf16 datasheet peak)"
    return None, f"unknown device {device_name!r}: pass --peak-tflops for an MFU"


def load_te(smoke: bool):
    """transformer_engine.pytorch, or None and why. Without CUDA it raises RuntimeError or
    OSError as often as ImportError (a CUDA library it cannot load), so all three are caught."""
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
    except (ImportError, RuntimeError, OSError) as err:
        return None, f"transformer_engine does not import: {type(err).__name__}: {err}"
    if smoke:
        return None, "--cpu-smoke: transformer-engine kernels need CUDA"
    return te, f"transformer_engine {getattr(transformer_engine, '__version__', '?')}"


def fp8_support(te) -> tuple[bool, str]:
    try:  # TE 1.x and 2.x both have this; it checks the GPU architecture and CUDA version
        from transformer_engine.pytorch.fp8 import check_fp8_support
        return check_fp8_support()
    except (ImportError, AttributeError):
        ok = torch.cuda.get_device_capability() >= (8, 9)
        return ok, "" if ok else "fp8 needs compute capability >= 8.9 (Ada or Hopper)"


def to_te(model: nn.Module, te) -> None:
    """Swap every nn.Linear for te.Linear and every RMSNorm for te.RMSNorm, copying weights.
    Parameters stay fp32 (master weights), as in the plain variant; TE casts under autocast."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                new = te.Linear(child.in_features, child.out_features, bias=False,
                                params_dtype=torch.float32, device="cuda")
            elif isinstance(child, RMSNorm):
                new = te.RMSNorm(child.weight.numel(), eps=child.eps,
                                 params_dtype=torch.float32, device="cuda")
            else:
                continue
            with torch.no_grad():
                new.weight.copy_(child.weight)
            setattr(parent, name, new)


def te_context(te, fp8: bool):
    """A fresh TE autocast context per step. fp8_autocast(enabled=False) runs TE's bf16 kernels;
    newer TE renames it autocast(recipe=...), so take whichever this version has."""
    recipe = None
    if fp8:  # E4M3 forward, E5M2 gradients; scales from a short amax history
        from transformer_engine.common.recipe import DelayedScaling, Format
        recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                                amax_compute_algo="max")
    if hasattr(te, "fp8_autocast"):
        return lambda: te.fp8_autocast(enabled=fp8, fp8_recipe=recipe)
    return lambda: te.autocast(enabled=fp8, recipe=recipe)


def time_steps(step, n: int, device: torch.device) -> list[float]:
    """Seconds per step. On CUDA, events around each step and one synchronize at the end, so
    the host never waits inside the loop and a host that falls behind shows as GPU idle time."""
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def run_variant(variant: str, cfg: ModelConfig, args, device: torch.device, te,
                flops_tok: int, peak: float | None) -> dict:
    """Build a fresh model, train warmup + timed steps on synthetic tokens, report figures."""
    torch.manual_seed(0)
    with torch.device(device):  # built in place on the GPU: no 4 GB host-to-device copy
        model = Transformer(cfg)
    if variant != "plain":
        to_te(model, te)
    plain = variant == "plain"
    extra = contextlib.nullcontext if plain else te_context(te, fp8=variant == "te_fp8")
    # The usual mixed-precision recipe: fp32 master weights, grads and Adam moments; bf16
    # matmuls and attention under autocast; one fused AdamW kernel over all parameters.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    b, s = args.micro_batch_size, args.seq_length
    data = torch.randint(0, cfg.vocab_size, (b, s + 1), device=device)
    tokens, labels = data[:, :-1], data[:, 1:]
    losses = []

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16), extra():
            logits = model(tokens)
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1))
        loss.backward()  # outside TE's autocast, as TE asks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as the trainer clips
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # no .item(): a host sync per step would skew timing

    time_steps(step, args.warmup, device)  # kernels chosen, allocator warmed, Adam state made
    t0 = time.perf_counter()
    times = time_steps(step, args.steps, device)
    wall = time.perf_counter() - t0
    med = statistics.median(times)
    tokens_per_s = b * s / med
    achieved = flops_tok * tokens_per_s
    peak_mem = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {
        "status": "ok",
        "step_time_s": {"median": med, "min": min(times), "max": max(times),
                        "spread_pct": 100 * (max(times) - min(times)) / med, "all": times},
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_wall": b * s * args.steps / wall,
        "achieved_tflops": achieved / 1e12,
        "mfu": achieved / peak if peak else None,
        "peak_memory_gib": peak_mem / 2**30 if peak_mem is not None else None,
        "loss_first": losses[0].item(), "loss_last": losses[-1].item(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit(f"error: {NO_CUDA}")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    cfg = TINY if args.cpu_smoke else ONE_B
    name = None if args.cpu_smoke else torch.cuda.get_device_name()
    peak, peak_source = (None, "--cpu-smoke: no MFU on CPU") if args.cpu_smoke else \
        peak_flops(name, args.peak_tflops)
    with torch.device("meta"):  # shapes only: count parameters without allocating them
        params = count_params(Transformer(cfg))
    flops_tok = flops_per_token(cfg, args.seq_length, params["non_embedding"])
    result = {
        # its own file: a GPU's figures, stamped, never part of bench/run.py's results.json
        "measured": stamp.now(), "commit": stamp.commit(), "machine": stamp.machine(),
        "device": name or "cpu", "torch": torch.__version__, "cpu_smoke": args.cpu_smoke,
        "model": {**vars(cfg), "params": params},
        "micro_batch_size": args.micro_batch_size, "seq_length": args.seq_length,
        "tokens_per_step": args.micro_batch_size * args.seq_length,
        "warmup_steps": args.warmup, "timed_steps": args.steps,
        "recipe": "fp32 master weights, bf16 autocast, fused AdamW, grad clip 1.0",
        "flops_per_token": flops_tok, "flops_formula": FLOPS_FORMULA,
        "peak_flops": peak, "peak_source": peak_source, "variants": {},
    }
    print(f"device {result['device']}, torch {torch.__version__}; model {cfg.name}: "
          f"{params['total']:,} params ({params['non_embedding']:,} non-embedding); "
          f"{flops_tok / 1e9:.3f} GFLOP/token; peak {peak_source}", flush=True)
    te, te_note = load_te(args.cpu_smoke) if set(args.variants) - {"plain"} else (None, "")
    result["transformer_engine"] = te_note
    fp8_ok, fp8_reason = fp8_support(te) if te is not None else (False, te_note)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:
        if variant != "plain" and te is None:
            entry = {"status": "skipped", "reason": te_note}
        elif variant == "te_fp8" and not fp8_ok:
            entry = {"status": "skipped", "reason": f"fp8 unsupported: {fp8_reason}"}
        else:
            print(f"[{variant}] {args.warmup} warm-up + {args.steps} timed steps ...", flush=True)
            if device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                entry = run_variant(variant, cfg, args, device, te, flops_tok, peak)
            except Exception as err:  # e.g. out of memory: keep the other variants' figures
                entry = {"status": "failed", "reason": f"{type(err).__name__}: {err}"}
        if variant == "te_fp8":
            entry["note"] = ("fp8 GEMMs (DelayedScaling, HYBRID): a precision change, not only "
                             "kernels; MFU is still against the dense bf16 peak")
        result["variants"][variant] = entry
        out.write_text(json.dumps(result, indent=2))  # after each variant: partial runs count
        print(f"[{variant}] {summary(entry)}", flush=True)
    print(f"flops accounting: {FLOPS_FORMULA}\nwrote {out}")
    return 0 if result["variants"].get("plain", {}).get("status", "ok") == "ok" else 1


def summary(entry: dict) -> str:
    if entry["status"] != "ok":
        return f"{entry['status']}: {entry['reason']}"
    t, mfu, mem = entry["step_time_s"], entry["mfu"], entry["peak_memory_gib"]
    return (f"step {t['median'] * 1e3:.1f} ms median ({t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f}, "
            f"spread {t['spread_pct']:.1f}%), {entry['tokens_per_s']:,.0f} tokens/s, "
            f"{entry['achieved_tflops']:.1f} TFLOP/s, MFU "
            f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, peak memory "
            f"{'n/a' if mem is None else f'{mem:.1f} GiB'}, loss {entry['loss_first']:.3f} -> "
            f"{entry['loss_last']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
