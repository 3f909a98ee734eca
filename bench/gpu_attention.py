"""Context-parallel attention kernels on one device: the chunk-pair attention that every
cp_comm_type builds on (parallel/context/kernels.py: fused kernels with log-sum-exp, merged
calls, call backward) against PyTorch's own causal SDPA over the whole sequence, forward and
backward, for each rank of a runtime CP of 4, in bf16 and fp32, also over packed documents
(one SDPA call per document as the reference); and its time over SDPA's. On
CUDA this is the check of the flash (bf16) and memory-efficient (fp32) kernel calls, which a CPU
cannot make; --cpu-smoke runs the same code on the CPU flash kernel.

    python bench/gpu_attention.py [--out bench/gpu_attention.json]
    python bench/gpu_attention.py --cpu-smoke --out /tmp/attention.json
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from parallel.context.calls import plan_calls  # noqa: E402
from parallel.context.gather import ChunkPairs  # noqa: E402
from parallel.layout import Layout  # noqa: E402
from trainer.model.attention import causal_attention  # noqa: E402

CP = 4
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}  # relative, in the 2-norm


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def packed(seq: int, document: int) -> torch.Tensor:
    """[2, seq] document starts: documents of `document` tokens, the second sample's shifted by
    a third of one so they cut the chunks elsewhere."""
    positions = torch.arange(seq)
    first = positions // document * document
    shifted = ((positions + document // 3) // document * document - document // 3).clamp(min=0)
    return torch.stack((first, shifted))


def check(dtype: torch.dtype, device: torch.device, seq: int, heads: int, dim: int,
          repeats: int, groups: int | None = None, document: int | None = None) -> dict:
    """groups: K/V heads (grouped-query attention), default one per query head. document:
    packed documents of that many tokens (two samples, see packed)."""
    layout = Layout(CP, context_parallel_size=CP, seq_length=seq)
    gen = torch.Generator(device=device).manual_seed(0)
    groups = groups or heads
    documents = None if document is None else packed(seq, document)
    batch = 1 if documents is None else 2
    q, k, v, grad = (torch.randn(batch, n, seq, dim, device=device, dtype=dtype,
                                 generator=gen) for n in (heads, groups, groups, heads))
    for t in (q, k, v):
        t.requires_grad_()
    if documents is None:
        sdpa = functools.partial(F.scaled_dot_product_attention, is_causal=True,
                                 enable_gqa=groups != heads)
    else:
        sdpa = functools.partial(causal_attention, documents=documents)
    want = sdpa(q, k, v).detach()
    worst = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    chunks = tuple(range(2 * CP))
    for rank in range(CP):
        rows = torch.cat([torch.arange(r.start, r.stop) for r in layout.context_chunks(rank)])
        rows = rows.to(device)
        plan = plan_calls(layout.context_chunk_ids(rank), chunks, seq // (2 * CP), documents)
        local_q = q.index_select(2, rows)
        out = ChunkPairs.apply(local_q, k, v, plan)
        got = torch.autograd.grad(out, (q, k, v), grad.index_select(2, rows))
        # only this rank's queries: its share of dk and dv
        local = sdpa(q, k, v).index_select(2, rows)
        share = torch.autograd.grad(local, (q, k, v), grad.index_select(2, rows))
        worst["out"] = max(worst["out"], relative(out, want.index_select(2, rows)))
        for name, a, b in zip(("dq", "dk", "dv"), got, share):
            worst[name] = max(worst[name], relative(a, b))
    rank0 = torch.cat([torch.arange(r.start, r.stop) for r in layout.context_chunks(0)])
    local_q = q.detach().index_select(2, rank0.to(device))
    plan = plan_calls(layout.context_chunk_ids(0), chunks, seq // (2 * CP), documents)
    ours = timed(lambda: ChunkPairs.apply(local_q, k.detach(), v.detach(), plan), device,
                 repeats)
    theirs = timed(lambda: sdpa(q.detach(), k.detach(), v.detach()), device, repeats)
    ok = all(value <= TOLERANCE[dtype] for value in worst.values())
    return {"status": "ok" if ok else "mismatch", "max_relative": worst,
            "tolerance": TOLERANCE[dtype], "rank0_forward_s": ours,
            "full_sdpa_forward_s": theirs,
            "rank0_over_full_sdpa": ours / theirs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("gpu_attention.json")))
    parser.add_argument("--cpu-smoke", action="store_true", help="the same checks on CPU, small")
    args = parser.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --cpu-smoke", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    seq, heads, dim, repeats = (256, 4, 16, 1) if args.cpu_smoke else (16384, 16, 128, 10)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "shape": f"1 x {heads} heads x {seq} tokens x {dim}, runtime CP {CP}",
              "dtypes": {str(dtype).removeprefix("torch."): check(dtype, device, seq, heads,
                                                                  dim, repeats)
                         for dtype in (torch.bfloat16, torch.float32)},
              # grouped-query attention: K/V of a quarter of the heads
              "gqa_bfloat16": check(torch.bfloat16, device, seq, heads, dim, repeats,
                                    max(heads // 4, 1)),
              # packed documents of an eighth of the sequence (a third of a chunk off in the
              # second sample), both precisions
              "documents": {str(dtype).removeprefix("torch."): check(
                  dtype, device, seq, heads, dim, repeats, document=seq // 8)
                  for dtype in (torch.bfloat16, torch.float32)}}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    checks = [*result["dtypes"].values(), result["gqa_bfloat16"],
              *result["documents"].values()]
    return 0 if all(d["status"] == "ok" for d in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
