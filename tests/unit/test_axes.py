"""The registry of parallel axes is the one list of the layout's inputs, rank axes and groups:
the Layout, the config schema and the defaults agree with it, and its checks name the key."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from parallel.layout import GROUP_AXES, Layout, RankCoords
from parallel.layout.axes import (
    AXES,
    EXPERT_AXES,
    GROUPS,
    LAYOUT_KEYS,
    PARALLEL_KEYS,
    REGISTRY,
    LayoutError,
)
from trainer.config import ParallelConfig

from config_helpers import CONF_DIR, ROOT


def test_the_layout_takes_exactly_the_registrys_inputs_in_order():
    assert [f.name for f in dataclasses.fields(Layout)] == [k.name for k in LAYOUT_KEYS]
    assert RankCoords._fields == AXES == ("tp", "seq", "batch", "cp", "dp", "pp")
    assert EXPERT_AXES == ("etp", "ep", "edp", "pp")  # Megatron-Core's expert generator


def test_every_parallel_key_has_a_schema_field_and_a_default():
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    defaults = yaml.safe_load((CONF_DIR / "parallel" / "default.yaml").read_text())
    for key in PARALLEL_KEYS:
        assert key.name in fields and key.name in defaults, key.name


def test_each_group_belongs_to_the_axis_of_its_slowest_rank_axis():
    for axis in REGISTRY:
        for group in axis.groups:
            if group.axes is not None:
                order, own = ((AXES, axis.rank_axes) if group.order == "dense" else
                              (EXPERT_AXES, axis.expert_rank_axes))
                assert set(group.axes) <= set(order)
                assert max(group.axes, key=order.index) in own, group.name
    assert len({g.name for g in GROUPS}) == len(GROUPS)
    assert list(GROUP_AXES) == [g.name for g in GROUPS if g.axes is not None]


def test_every_rank_axis_size_is_a_layout_size():
    layout = Layout(16, tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=8,
                    sequence_parallel=True, tensor_parallel_num_sequence_shards=4)
    assert layout.axis_sizes == {"tp": 2, "seq": 2, "batch": 2, "cp": 1, "dp": 2, "pp": 1}


@pytest.mark.parametrize("name,value,said", [
    ("context_parallel_size", 0, "parallel.context_parallel_size=0 must be >= 1. Fix: set "
                                 "parallel.context_parallel_size=1 (off)."),
    ("tensor_parallel_num_weight_shards", 2.5, "parallel.tensor_parallel_num_weight_shards=2.5 "
                                               "must be an integer >= 1. Fix: set it to 1 or "
                                               "more, or parallel.tensor_parallel_num_weight_"
                                               "shards=null for its default."),
    ("sequence_parallel", 1, "parallel.sequence_parallel=1 must be true or false."),
])
def test_a_bad_input_names_its_key_and_the_fix(name, value, said):
    with pytest.raises(LayoutError) as error:
        Layout(4, **{name: value})
    assert str(error.value) == said


def test_every_registered_step_is_a_function_of_a_phase():
    """parallelize runs what the registry names: a wrong path or phase fails here, not when
    the first rank is built."""
    import importlib

    from parallel.build import PHASES

    steps = [(axis.name, phase, path) for axis in REGISTRY for phase, path in axis.steps.items()]
    assert {phase for _, phase, _ in steps} == set(PHASES)
    for name, phase, path in steps:
        module, _, function = path.partition(":")
        assert phase in PHASES, (name, phase)
        assert callable(getattr(importlib.import_module(module), function, None)), (name, path)


def test_each_axis_is_a_module_with_its_terms_of_the_plan_beside_it():
    """An axis is one module of parallel/layout/axes (its entry: keys, rank axes, groups, rules,
    steps) and one of trainer/plan/axis_costs of the same name (its rules for the model, its
    terms of the plan): what a new axis adds besides its parallel layers and its registration."""
    import importlib
    import pkgutil

    import parallel.layout.axes
    from parallel.layout.axes.axis import Axis

    homes = {}
    for info in pkgutil.iter_modules(parallel.layout.axes.__path__):
        module = importlib.import_module(f"parallel.layout.axes.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Axis):
                homes.setdefault(value.name, []).append(info.name)
    assert {axis.name for axis in REGISTRY} == set(homes)
    for axis in REGISTRY:
        (home,) = homes[axis.name]
        assert (ROOT / "trainer" / "plan" / "axis_costs" / f"{home}.py").is_file(), home
