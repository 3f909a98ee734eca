"""Packed documents (data.reset_attention_mask, reset_position_ids, eod_mask_loss) and a
dataset's loss mask against an independent reference: every document of a packed batch run
alone through one plain process, no packing, no documents argument, its pieces cut here from
the document lengths and its labels masked here from the mask (not by the stream's
document_starts and loss_mask, which the layouts use); samples that count no token counted.
Losses, gradient norms and every weight after the steps match within the parity tolerances
(fp32 1e-5, fp64 1e-10): on one process, under every cp_comm_type with CP 2 and runtime CP 8,
with sequence shards, TP with SP, pipeline stages with recompute, interleaved stages, a mixture
of experts (one process and EP 2), gpt-oss's sliding windows and sinks (one process, CP 4
p2p's window exchange, runtime CP 8 all_gather, TP 2 x SP x CP 2 a2a), Qwen3-Next's hybrid (its
state and convolution restarting at each document: one process, CP 4 p2p's relay, TP 2 x SP x
CP 2 a2a, runtime CP 8 all_gather; fp64), and blocks compiled
(one graph, no break, no recompile); in bf16 within test_parity's bf16 bounds. Documents of 1
to 20 tokens and one of 45 cross the CP chunks (4 or 2 tokens) and the samples (32)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.config import CPCommType, Precision, RecomputeGranularity
from trainer.data.dataset import TokenDataset
from trainer.data.stream import SampleStream
from trainer.plan.options import EngineOptions
from trainer.train.batch import IGNORE, DocumentRules, rank_micro_batches
from trainer.train.compile import graph_breaks, graphs
from trainer.train.engine import build_engine
from trainer.train.step import train_step

from harness import run_ranks
from test_parity import (
    LAYOUTS,
    LRS,
    OPTIM,
    SEED,
    SEQ,
    TINY,
    assert_parity,
    make_layout,
    reference_model,
    reference_update,
    relative,
)

MODEL = replace(TINY, num_heads=8)  # a2a splits the heads over runtime CP 8
# A mixture of experts whose tokens are routed each on its own (dropless, no balance losses,
# which are means over a micro-batch's tokens): a document alone is routed as in the pack.
MOE = replace(MODEL, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
              moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
FOUR_LAYERS = replace(MODEL, num_layers=4)  # two chunks of one block on each of two stages
# Multi-latent attention (test_mla_parity's, 8 heads for a2a): values narrower than q and k
MLA = replace(MODEL, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32,
              qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=8, rope_type="yarn",
              original_max_position_embeddings=16, mscale_all_dim=1.0)
GPT_OSS = replace(MODEL, num_query_groups=4, window_size=5, window_attn_skip_freq=2,
                  softmax_type="learnable")
# Qwen3-Next's hybrid (dense): a gated full-attention block then a Gated DeltaNet one; the
# state and the convolution restart at every document, the relay passes them across chunks
HYBRID = replace(MODEL, name="qwen3_next", num_query_groups=4, kv_channels=8, qk_layernorm=True,
                 attention_output_gate=True, rotary_percent=0.5,
                 layernorm_zero_centered_gamma=True,
                 experimental_attention_variant="gated_delta_net", linear_attention_freq=[0, 1],
                 linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4,
                 linear_num_value_heads=8)
ALL_RULES = DocumentRules(reset_attention_mask=True, reset_position_ids=True,
                          eod_mask_loss=True)
STEPS = 2


def packed_dataset(samples: int, with_mask: bool = True) -> tuple[TokenDataset, list[int]]:
    """Random tokens in documents of 1..20 tokens (one of 45), enough for `samples` samples,
    with a loss mask (each document's first third is a prompt, no target; so is every target
    of sample 1, which counts no token); (the dataset, its document starts)."""
    rng = np.random.RandomState(SEED)
    lengths = [*rng.randint(1, 21, size=8).tolist(), 45]
    while sum(lengths) <= samples * SEQ + 1:
        lengths.append(int(rng.randint(1, 21)))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).tolist()
    total = sum(lengths)
    tokens = rng.randint(0, MODEL.vocab_size, size=total).astype(np.uint16)
    mask = np.ones(total, dtype=np.uint8)
    for begin, length in zip(starts, lengths):
        mask[begin:begin + length // 3] = 0
    mask[SEQ + 1:2 * SEQ + 1] = 0  # sample 1's targets
    meta = {"doc_starts": starts, "num_tokens": total, "fingerprint": "test:packed",
            "splits": {"train": [0, total], "valid": [total, total]}, "loss_mask": True}
    if not with_mask:
        meta.pop("loss_mask")
    return TokenDataset(Path("packed"), meta, tokens, mask if with_mask else None), starts


def stream_of(dataset: TokenDataset) -> SampleStream:
    return SampleStream(dataset, "train", SEQ, SEED, shuffle=False)


def train_packed(rank: int, layout, dataset: TokenDataset, rules: DocumentRules,
                 dtype: torch.dtype, options: EngineOptions, model=MODEL) -> dict:
    torch.set_default_dtype(dtype)
    stream = stream_of(dataset)
    engine = build_engine(model, OPTIM, SEED, layout, torch.device("cpu"), options)
    losses, norms, empty, compiled = [], [], [], []
    for step, lr in zip(range(STEPS), LRS):
        micro_batches = rank_micro_batches(stream, layout, rank, None, rules,
                                           step * layout.global_batch_size)
        result = train_step(engine.model, engine.optimizer, micro_batches, lr)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        empty.append(result.empty_samples)
        compiled.append(graphs())  # graphs so far (the same after every step: no recompile)
    params = engine.model.full_state_dict()  # collective: every rank of the stage calls it
    first_of_stage = not any(layout.coords(rank)[:-1])
    return {"losses": losses, "norms": norms, "empty": empty,
            "params": params if first_of_stage else None,
            "graphs": compiled, "breaks": dict(graph_breaks())}


def pieces(sample: int, starts: list[int], total: int) -> list[tuple[int, int, int]]:
    """(first input, end input, the document's end), sample-relative, of each document's
    piece in sample `sample`'s inputs (stream order without shuffling: tokens j*SEQ...)."""
    first, out = sample * SEQ, []
    ends = [*starts[1:], total]
    for begin, end in zip(starts, ends):
        a, e = max(begin, first), min(end, first + SEQ)
        if a < e:
            out.append((a - first, e - first, end - first))
    return out


def alone(rank: int, dataset: TokenDataset, starts: list[int], rules: DocumentRules,
          dtype: torch.dtype, global_batch: int, model_cfg=MODEL) -> dict:
    """The reference: each piece of a document through the plain model on its own (or, without
    reset_attention_mask, each sample whole), one AdamW as test_parity's reference."""
    torch.set_default_dtype(dtype)
    model, opt, initial_q = reference_model(model_cfg)
    tokens = torch.from_numpy(dataset.tokens.astype(np.int64))
    counted = torch.from_numpy(dataset.loss_mask.astype(bool))
    losses, norms, empty = [], [], []
    for step, lr in zip(range(STEPS), LRS):
        runs = []  # (inputs, RoPE positions, labels)
        empty.append(0)
        for sample in range(step * global_batch, (step + 1) * global_batch):
            window = tokens[sample * SEQ:sample * SEQ + SEQ + 1]
            labels = window[1:].masked_fill(~counted[sample * SEQ + 1:(sample + 1) * SEQ + 1],
                                            IGNORE)
            for _, e, doc_end in pieces(sample, starts, len(tokens)):
                if rules.eod_mask_loss and e == doc_end:  # the input ends its document
                    labels[e - 1] = IGNORE
            empty[-1] += int((labels != IGNORE).sum() == 0)
            if not rules.reset_attention_mask:
                runs.append((window[:-1], torch.arange(SEQ), labels))
                continue
            for a, e, _ in pieces(sample, starts, len(tokens)):
                positions = torch.arange(e - a) if rules.reset_position_ids else torch.arange(a, e)
                runs.append((window[a:e], positions, labels[a:e]))
        count = sum(int((labels != IGNORE).sum()) for _, _, labels in runs)
        opt.zero_grad()
        total = 0.0
        for x, positions, y in runs:
            loss = F.cross_entropy(model(x[None], positions[None])[0], y, reduction="sum",
                                   ignore_index=IGNORE) / count
            loss.backward()
            total += loss.item()
        norms.append(reference_update(model, opt, lr))
        losses.append(total)
    return {"losses": losses, "norms": norms, "initial_q": initial_q, "empty": empty,
            "params": {name: p.detach() for name, p in model.named_parameters()}}


FULL = replace(EngineOptions(), recompute_granularity=RecomputeGranularity.full)
COMPILED = EngineOptions(compile_blocks=True)
INTERLEAVED = EngineOptions(pipeline_schedule="interleaved_1f1b")
# name -> (world, Layout keyword arguments, engine options[, model])
CASES = {
    "one_process": (1, {}, EngineOptions()),
    **{f"cp2_{c.value}": (2, LAYOUTS["cp2"][1], EngineOptions(cp_comm_type=c))
       for c in CPCommType},
    **{f"runtime_cp8_{c.value}": (8, LAYOUTS["runtime_cp8"][1], EngineOptions(cp_comm_type=c))
       for c in CPCommType},
    "cp2_ws2_ss2": (4, LAYOUTS["cp2_ws2_ss2"][1], EngineOptions()),
    "tp2_sp_cp2_a2a": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                               context_parallel_size=2),
                       EngineOptions(cp_comm_type=CPCommType.a2a)),
    "pp2_cp2_full_recompute": (4, dict(pipeline_model_parallel_size=2, context_parallel_size=2),
                               FULL),
    # compiled blocks: one graph, no break (the documents' attention is an operator,
    # trainer/model/documents.py): the bf16 test below runs them over the hybrid (the fp32
    # case, 27 s, left CI for its time budget in issue 44; it passed when last run, at
    # 9c8c9a5)
    "one_process_compiled": (1, {}, COMPILED),
    "moe_one_process": (1, {}, EngineOptions(), MOE),
    "moe_ep2": (2, dict(expert_model_parallel_size=2), EngineOptions(), MOE),
    "mla_one_process": (1, {}, EngineOptions(), MLA),
    "mla_tp2_sp_cp2_a2a": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                   context_parallel_size=2),
                           EngineOptions(cp_comm_type=CPCommType.a2a), MLA),
    "mla_cp2_p2p": (2, LAYOUTS["cp2"][1], EngineOptions(), MLA),
    "pp2_virtual2_interleaved": (2, dict(pipeline_model_parallel_size=2,
                                         virtual_pipeline_model_parallel_size=2), INTERLEAVED,
                                 FOUR_LAYERS),
    # gpt-oss's windows (5 back, every other block) and sinks within each document
    "gpt_oss_one_process": (1, {}, EngineOptions(), GPT_OSS),
    "gpt_oss_cp4_p2p": (4, LAYOUTS["cp4"][1], EngineOptions(), GPT_OSS),
    "gpt_oss_runtime_cp8_all_gather": (8, LAYOUTS["runtime_cp8"][1],
                                       EngineOptions(cp_comm_type=CPCommType.all_gather),
                                       GPT_OSS),
    "gpt_oss_tp2_sp_cp2_a2a": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                       context_parallel_size=2),
                               EngineOptions(cp_comm_type=CPCommType.a2a), GPT_OSS),
    "hybrid_one_process": (1, {}, EngineOptions(), HYBRID),
    "hybrid_cp4_p2p": (4, LAYOUTS["cp4"][1], EngineOptions(), HYBRID),
    "hybrid_tp2_sp_cp2_a2a": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                      context_parallel_size=2),
                              EngineOptions(cp_comm_type=CPCommType.a2a), HYBRID),
    "hybrid_runtime_cp8_all_gather": (8, LAYOUTS["runtime_cp8"][1],
                                      EngineOptions(cp_comm_type=CPCommType.all_gather), HYBRID),
}
FP64 = ("one_process", "cp2_p2p", "runtime_cp8_all_gather", "pp2_cp2_full_recompute",
        "moe_one_process", "moe_ep2", "pp2_virtual2_interleaved", "mla_one_process",
        "mla_tp2_sp_cp2_a2a", "gpt_oss_one_process", "gpt_oss_cp4_p2p",
        "gpt_oss_runtime_cp8_all_gather", "gpt_oss_tp2_sp_cp2_a2a", "hybrid_one_process",
        "hybrid_cp4_p2p", "hybrid_tp2_sp_cp2_a2a", "hybrid_runtime_cp8_all_gather")
# fp64 only: in fp32 AdamW carries the rounding of nearly cancelling gradients to 1.7e-5 in a
# weight of the 4-block model (test_parity's note), past 1e-5; fp64 agrees to 3e-15.
# So do two gpt-oss layouts: 1.15e-5 in fp32 on layers.1.mlp.down.weight (losses within 2.2e-8,
# norms 1.3e-7); fp64 agrees to 2.2e-14.
FP64_ONLY = ("pp2_virtual2_interleaved", "gpt_oss_cp4_p2p", "gpt_oss_runtime_cp8_all_gather",
             "hybrid_one_process", "hybrid_cp4_p2p", "hybrid_tp2_sp_cp2_a2a",
             "hybrid_runtime_cp8_all_gather")  # the hybrid: fp64 only, for CI's time
PARAMS = [pytest.param(name, dtype, id=f"{name}-{label}") for name in CASES
          for dtype, label in ((torch.float32, "fp32"), (torch.float64, "fp64"))
          if (dtype == torch.float32 and name not in (*FP64_ONLY, "one_process_compiled")) or
          (dtype == torch.float64 and name in FP64)]


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(global_batch: int, dtype: torch.dtype, rules: DocumentRules, model=MODEL):
        key = (global_batch, dtype, rules, repr(model))
        if key not in cache:
            dataset, starts = packed_dataset(STEPS * global_batch)
            cache[key] = dataset, run_ranks(1, alone, dataset, starts, rules, dtype,
                                            global_batch, model)[0]
        return cache[key]

    return get


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """Compiled cases compile into a folder of their own (as test_compile's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


def assert_one_graph(results: list[dict], kinds: int = 1) -> None:
    """Each rank compiled one graph for each kind of block, which every block of the kind
    runs, in the first step and none after (no recompile), and broke none."""
    for result in results:
        assert set(result["graphs"]) == {kinds} and not result["breaks"], (
            result["graphs"], result["breaks"])


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_packed_documents_train_as_each_document_alone(name, dtype, references, request):
    world, kwargs, options, *model = CASES[name]
    model = model[0] if model else MODEL
    if options.compile_blocks:
        request.getfixturevalue("inductor_cache")
    layout = make_layout(world, kwargs)
    dataset, ref = references(layout.global_batch_size, dtype, ALL_RULES, model)
    results = run_ranks(world, train_packed, layout, dataset, ALL_RULES, dtype, options,
                        model, timeout=300 if options.compile_blocks else 120)
    assert_parity(results, ref, dtype, f"documents {name} (world {world})")
    assert results[0]["empty"] == ref["empty"] and ref["empty"][0] >= 1  # sample 1 at least
    if options.compile_blocks:
        assert_one_graph(results)


@pytest.mark.parametrize("name,options,model", [
    ("cp2_p2p", EngineOptions(Precision.bf16), MODEL),
    ("one_process", replace(COMPILED, precision=Precision.bf16), HYBRID),
], ids=["cp2_p2p", "hybrid_one_process_compiled"])
def test_packed_documents_in_bf16_train_close_to_fp32(name, options, model, references,
                                                      request):
    """bf16 autocast over packed documents: within test_parity's bf16 bounds of the fp32
    reference of each document alone, and not equal to it (autocast really ran). Compiled: the
    hybrid, whose full block's attention and linear blocks' rule are operators within their
    documents (trainer/model/documents.py, trainer/model/delta_rule.py): each kind of block
    one graph, unbroken, compiled once."""
    world, kwargs, _ = CASES[name]
    if options.compile_blocks:
        request.getfixturevalue("inductor_cache")
    layout = make_layout(world, kwargs)
    dataset, ref = references(layout.global_batch_size, torch.float32, ALL_RULES, model)
    got = run_ranks(world, train_packed, layout, dataset, ALL_RULES, torch.float32, options,
                    model, timeout=300)
    losses = [relative(a, b) for a, b in zip(got[0]["losses"], ref["losses"])]
    norms = [relative(a, b) for a, b in zip(got[0]["norms"], ref["norms"])]
    print(f"\nbf16 documents {name}: relative differences to fp32: loss {losses}, "
          f"grad norm {norms}")
    assert max(losses) < 1e-2 and max(norms) < 5e-2
    assert max(norms) > 1e-4  # far above fp32 rounding (1e-7): the compute was bf16
    if options.compile_blocks:
        assert_one_graph(got, kinds=2)


@pytest.mark.parametrize("rules", [
    DocumentRules(reset_attention_mask=True),  # positions run on across documents
    DocumentRules(eod_mask_loss=True),  # attention across documents, their ends not counted
], ids=["attention_only", "eod_loss_only"])
def test_each_rule_alone_matches_its_reference(rules, references):
    layout = make_layout(2, LAYOUTS["cp2"][1])
    dataset, ref = references(layout.global_batch_size, torch.float64, rules)
    results = run_ranks(2, train_packed, layout, dataset, rules, torch.float64,
                        EngineOptions(), timeout=120)
    assert_parity(results, ref, torch.float64, f"documents cp2 {rules}")


def test_the_rules_change_the_training():
    """Each rule changes what is trained (else the tests above could pass with rules
    ignored): the one-process losses of each differ from the others' (by 4e-5 or more
    relative at this random initialisation; fp64 rounding is 1e-15). Without a loss mask,
    whose prompts would hide most document ends from eod_mask_loss."""
    layout = make_layout(1, {})
    dataset, _ = packed_dataset(STEPS * layout.global_batch_size, with_mask=False)
    losses = {}
    for rules in (DocumentRules(), DocumentRules(reset_attention_mask=True), ALL_RULES,
                  DocumentRules(eod_mask_loss=True)):
        losses[rules] = run_ranks(1, train_packed, layout, dataset, rules, torch.float64,
                                  EngineOptions())[0]["losses"][0]
    values = list(losses.values())
    assert all(relative(a, b) > 1e-6 for i, a in enumerate(values) for b in values[i + 1:])
