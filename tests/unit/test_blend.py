"""data.blend: datasets mixed by weight (Megatron's --data-path form), our folders and Megatron
prefixes alike; proportions within one sample per period, a pure function of the sample index
(any order, any layout), checked at compose time, trained from launch.py and resumed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.compose.runspec import settle
from trainer.config import ConfigError
from trainer.data.blend import PERIOD, blend_pattern, samples_per_part
from trainer.data.dataset import TokenDataset, prepare
from trainer.data.stream import open_streams

from config_helpers import ROOT, compose_config
from test_megatron_data import write_indexed


@pytest.mark.parametrize("weights", [(0.3, 0.7), (1, 1, 1), (0.5, 0.25, 0.125, 0.125), (9, 1)])
def test_every_period_holds_each_part_in_proportion(weights):
    part, rank, per_period = blend_pattern(weights)
    share = np.asarray(weights) / sum(weights)
    assert per_period.sum() == PERIOD
    assert (np.abs(per_period - share * PERIOD) <= 1).all()
    for d in range(len(weights)):  # positions of a part count 0, 1, 2, ... in order
        assert rank[part == d].tolist() == list(range(per_period[d]))
    # and every prefix stays within a sample or two of its share
    prefix = np.stack([np.cumsum(part == d) for d in range(len(weights))], axis=1)
    ideal = np.outer(np.arange(1, PERIOD + 1), share)
    assert np.abs(prefix - ideal).max() < 2
    assert samples_per_part(weights, 3 * PERIOD + 10) == [
        int(3 * per_period[d] + (part[:10] == d).sum()) for d in range(len(weights))]


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> tuple[Path, Path]:
    """One of our dataset folders ("a" text) and a Megatron prefix (ids 200-249)."""
    src = tmp_path_factory.mktemp("text")
    for i in range(6):
        (src / f"{i}.txt").write_text("a" * 3000 + "\n")
    ours = prepare(src, tmp_path_factory.mktemp("ours") / "ds", valid_fraction=0.2)
    gen = np.random.default_rng(0)
    prefix = tmp_path_factory.mktemp("megatron") / "text_document"
    write_indexed(prefix, [[gen.integers(200, 250, 300).tolist()] for _ in range(60)])
    return ours, prefix


def spec_for(parts, *extra: str):
    ours, prefix = parts
    return settle(compose_config("model=tiny", "train.seq_length=16", "data.valid_fraction=null",
                                 f"data.blend=[0.25,{ours},0.75,{prefix}]", *extra))


def test_the_mixture_draws_each_part_by_weight_in_any_order(parts):
    spec = spec_for(parts, "train.eval_interval=null")
    train, _ = open_streams(spec.data, spec.layout.seq_length, spec.config.data.seed, False)
    batch = train.get(range(4 * PERIOD))
    from_megatron = (batch[:, 0] >= 200).mean()  # our part is "a" (97) and newlines
    assert abs(from_megatron - 0.75) < 1e-3
    assert ((batch < 200).all(axis=1) | (batch >= 200).all(axis=1)).all()  # samples unmixed
    scattered = [5000, 3, 12000, 7, 4096]  # any rank fetches any index in any order
    assert train.get(scattered).tolist() == [batch[i].tolist() for i in scattered]
    assert train.identity["blend"][0][0] == 0.25 and train.identity["period"] == PERIOD


def test_blend_mistakes_are_one_line_at_compose_time(parts, tmp_path):
    ours, prefix = parts
    cases = {
        f"data.blend=[0.5,{ours},{prefix}]": "is not weight, path pairs",
        f"data.blend=[0,{ours},1,{prefix}]": "weight '0' of",
        f"data.blend=[1,{ours},1,{tmp_path / 'nothing'}]": "does not exist",
        f"data.path={ours} data.blend=[1,{ours},1,{prefix}]": "are both set",
        f"data.blend=[1,{ours},1,{prefix}] train.eval_samples=64": "would repeat samples",
    }
    for overrides, named in cases.items():
        with pytest.raises(ConfigError) as error:
            settle(compose_config("model=tiny", "train.seq_length=16", *overrides.split()))
        message = str(error.value)
        assert "\n" not in message and named in message and "Fix:" in message, message


def test_a_blend_of_datasets_made_with_different_tokenizers_is_refused(parts, tmp_path):
    ours, _ = parts
    bpe = []
    for i, text in enumerate(("the quick brown fox jumps over the lazy dog. ",
                              "pack my box with five dozen liquor jugs! ")):
        docs = tmp_path / f"docs{i}"
        docs.mkdir()
        for j in range(6):
            (docs / f"{j}.txt").write_text(f"{j} {text}" * 80)
        bpe.append(prepare(docs, tmp_path / f"bpe{i}", 0.2, train_vocab_size=280))
    assert [TokenDataset.open(b).vocab_size for b in bpe] == [280, 280]  # names and sizes alike
    alike = prepare(tmp_path / "docs1", tmp_path / "alike", 0.2,
                    tokenizer=bpe[0] / "tokenizer.json")
    base = ("model=tiny", "model.vocab_size=512", "train.seq_length=16",
            "train.eval_interval=null")
    for mixed, named in (((ours, bpe[0]), "byte (vocabulary 256)"),
                         ((bpe[0], bpe[1]), "tokenizer.json (vocabulary 280)")):
        with pytest.raises(ConfigError) as error:
            settle(compose_config(*base, f"data.blend=[1,{mixed[0]},1,{mixed[1]}]"))
        message = str(error.value)
        assert message.startswith("data.blend mixes tokenizers: ") and named in message
        assert "\n" not in message and "Fix:" in message, message
    settle(compose_config(*base, f"data.blend=[1,{bpe[0]},1,{alike}]"))  # one tokenizer file


def test_launch_trains_on_a_blend_and_resumes_its_stream(parts, tmp_path):
    ours, prefix = parts
    run = [sys.executable, "launch.py", "model=tiny", "train.seq_length=16",
           f"data.blend=[0.25,{ours},0.75,{prefix}]", "train.eval_interval=2",
           "train.eval_samples=8", f"hydra.run.dir={tmp_path / 'run'}"]
    first = subprocess.run([*run, "train.train_samples=16"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    again = subprocess.run([*run, "train.train_samples=32"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "from step 2" in again.stdout and "step      4/4" in again.stdout
    assert TokenDataset.open(ours).num_tokens  # the parts were read in place, not copied
