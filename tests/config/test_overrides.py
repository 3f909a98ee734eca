"""launch.py's check of the command line before Hydra composes it (trainer/compose/overrides.py):
each refusal is one line naming the override and a Fix, Hydra refuses the same overrides (so the
check never stops a valid command), and what Hydra accepts passes untouched. In process: no
launch.py subprocess, so these run in about a second.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from trainer.compose.overrides import command_line_refusal

from config_helpers import ROOT, compose_config

# (a command line Hydra refuses, what our line must name)
REFUSED = [
    (["train.seq_length=abc"], ("train.seq_length=abc", "whole number")),
    (["train.seq_length=1e3"], ("train.seq_length=1e3", "whole number")),
    (["train.precision=BF16"], ("train.precision=BF16", "fp32, bf16")),
    (["train.recompute_granularity=partial"], ("selective, full or null",)),
    (["schedule.lr=fast"], ("schedule.lr=fast", "a number")),
    (["data.blend=abc"], ("data.blend=abc", "a list")),
    (["train={seq_length:abc}"], ("train={seq_length:abc}", "train.seq_length of it")),
    (["foo=1"], ("foo=1", "no key or config group foo")),
    (["model.num_layerz=2"], ("model.num_layerz=2", "did you mean model.num_layers?")),
    (["+train.foo=1", "model.bar=2"], ("model.bar=2", "model has no key bar")),
    (["layout.world_size=3"], ("layout.world_size=3", "read-only")),
    (["schedule=cosinee"], ("schedule=cosinee", "did you mean schedule=cosine?")),
    (["+experiment=nope"], ("experiment=nope", "experiment/nope")),
    (["experiment=null"], ("experiment=null", "~experiment")),
    (["train=5"], ("train=5", "config group")),
    (["train.seed=1,2"], ("train.seed=1,2", "-m", "train.seed=[1,2]")),
    (["train.seed=range(1,3)"], ("train.seed=range(1,3)", "-m")),
    (["checkpoint.load=~/ckpt"], ("checkpoint.load=~/ckpt", "checkpoint.load=$HOME/ckpt")),
    (["train.seq_length=[1,2"], ("train.seq_length=[1,2", "cannot parse", "grammar")),
    (["dry_run"], ("dry_run", "dry_run=VALUE")),
]

# Command lines Hydra composes (settle() may refuse some later, with its own line).
ACCEPTED = [
    [], ["model=small"], ["experiment=seed_review"], ["~model"],
    ["~experiment"], ["+train.foo=1", "train.foo=2"], ["++layout.world_size=3"], ["layout=3"],
    ["hydra.run.dir=/x"], ["hydra/launcher=slurm"], ["model.num_layers=${train.seed}"],
    ["data.blend=[1,a,2,b]"], ["train.recompute_granularity=null"], ["model.num_layers=int(3)"],
    ["dry_run=yes"], ["train.precision=bf16"], ["model.hidden_size=???"], ["parallel=auto"],
    ["data.path=null"], ["checkpoint.dir='~/x'"], ["schedule.lr=1"], ["run_name=5"],
    ["train={seq_length:64}"], ["logger=wandb"], ["data.path=/a/b"],
    ["train.seq_length=${oops}"],  # an interpolation is judged once resolved
]

# Left to Hydra: flags, sweeps and other config folders (which the compose API does not take),
# and what only Hydra's defaults list can judge (experiment is in it already: Hydra refuses).
LEFT_TO_HYDRA = [
    ["+experiment=seed_review"],
    ["--help", "model=tinyy"], ["--version"], ["--cfg", "job", "--resolve"], ["--bogus"],
    ["-m", "train.seed=1,2"], ["-m", "model=tiny,small"], ["-m", "train.seed=range(1,3)"],
    ["-m", "hydra/launcher=slurm", "train.seed=1,2"], ["hydra.mode=MULTIRUN", "train.seed=1,2"],
    ["-cd", "/tmp", "model=elsewhere"], ["hydra.searchpath=[file:///x]", "experiment=elsewhere"],
]


@pytest.mark.parametrize("argv,named", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_refusal_is_one_line_with_the_fix_and_hydra_refuses_it_too(argv, named):
    message = command_line_refusal(argv)
    assert message and "\n" not in message and "Fix:" in message, message
    for part in named:
        assert part in message, f"{part!r} not in {message!r}"
    with pytest.raises((HydraException, OmegaConfBaseException, ValueError)):
        compose_config(*argv)


@pytest.mark.parametrize("argv", ACCEPTED, ids=[" ".join(a) or "default" for a in ACCEPTED])
def test_what_hydra_composes_passes(argv):
    assert command_line_refusal(argv) is None
    compose_config(*argv)


@pytest.mark.parametrize("argv", LEFT_TO_HYDRA, ids=[" ".join(a) for a in LEFT_TO_HYDRA])
def test_flags_sweeps_and_other_config_folders_are_left_to_hydra(argv):
    assert command_line_refusal(argv) is None


@pytest.mark.parametrize("argv,named", [
    (["-m", "model.num_layers=1,abc"], "model.num_layers=abc (a point of the sweep "
                                       "model.num_layers=1,abc)"),
    (["-m", "model=tiny,tinyy"], "model=tinyy (a point of the sweep model=tiny,tinyy)"),
    (["-m", "train.seed=choice(1,x)"], "train.seed=x (a point of the sweep"),
])
def test_each_choice_of_a_sweep_is_checked(argv, named):
    message = command_line_refusal(argv)
    assert message and named in message and "Fix:" in message, message


def test_the_checks_import_no_torch():
    code = ("import sys\n"
            "import trainer.compose.overrides, trainer.compose.callbacks, trainer.compose.sweeps\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
