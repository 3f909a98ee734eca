"""Property tests for parallel/layout/__init__.py against the contract in docs/layout.md.

Valid layouts are built from their factors (TP, SP, G, ns, CP, DP, PP), so every expected size,
coordinate and group below is computed here from those factors, not read back from Layout. A
brute-force oracle checks group membership pair by pair in small worlds, and a fuzz property
checks that any small (often invalid) input either raises a readable LayoutError, exactly when
the contract's rules say it must, or yields a consistent layout.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from parallel.layout import (
    AXES,
    CONFIG_KEY,
    GROUP_AXES,
    GROUP_NAMES,
    GROUP_ORDER,
    Layout,
    LayoutError,
)

# Every group kind that is a product of dense-view axes ("embedding" is not; the expert view's
# are held to their own oracle below).
AXIS_GROUPS = tuple(name for name in GROUP_AXES if GROUP_ORDER[name] == "dense")
MAX_WORLD = 600
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.filter_too_much,
                                                      HealthCheck.too_slow])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Factors(NamedTuple):
    tp: int
    sp: bool
    g: int
    ns: int
    cp: int
    dp: int
    pp: int
    micro: int
    num_micro: int | None  # None: leave global_batch_size unset
    seq_mult: int | None   # None: leave seq_length unset

    @property
    def sp_degree(self) -> int:
        return self.tp if self.sp else 1

    @property
    def nb(self) -> int:
        return self.g // self.ns

    @property
    def world(self) -> int:
        return self.tp * self.g * self.cp * self.dp * self.pp

    @property
    def sizes(self) -> dict[str, int]:
        """The contract's axis sizes, fastest first."""
        return dict(zip(AXES, (self.tp, self.ns, self.nb, self.cp, self.dp, self.pp)))

    @property
    def bps(self) -> int:
        return self.dp * self.nb

    @property
    def seq_length(self) -> int | None:
        if self.seq_mult is None:
            return None
        rcp = self.cp * self.ns
        multiple = math.lcm(2 * rcp if rcp > 1 else 1, rcp * self.sp_degree)
        return multiple * self.seq_mult

    def layout(self) -> Layout:
        gbs = None if self.num_micro is None else self.micro * self.bps * self.num_micro
        return Layout(
            world_size=self.world,
            tensor_model_parallel_size=self.tp,
            sequence_parallel=self.sp,
            tensor_parallel_num_weight_shards=self.tp * self.g,
            tensor_parallel_num_sequence_shards=self.ns * self.sp_degree,
            context_parallel_size=self.cp,
            pipeline_model_parallel_size=self.pp,
            micro_batch_size=self.micro,
            global_batch_size=gbs,
            seq_length=self.seq_length,
        )


def sp_for(draw, tp: int, ns: int) -> bool:
    # Sequence shards beyond SP with TP > 1 need sequence_parallel; otherwise it is free.
    return True if (tp > 1 and ns > 1) else draw(st.booleans())


@st.composite
def factors(draw, max_world: int = MAX_WORLD) -> Factors:
    tp = draw(st.sampled_from([1, 2, 4]))
    g = draw(st.integers(1, 8))
    ns = draw(st.sampled_from(divisors(g)))
    sp = sp_for(draw, tp, ns)
    cp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 3))
    pp = draw(st.integers(1, 3))
    assume(tp * g * cp * dp * pp <= max_world)
    micro = draw(st.integers(1, 3))
    num_micro = draw(st.none() | st.integers(1, 4))
    seq_mult = draw(st.none() | st.integers(1, 3))
    return Factors(tp, sp, g, ns, cp, dp, pp, micro, num_micro, seq_mult)


def oracle_coords(f: Factors, rank: int) -> tuple[int, ...]:
    """Mixed-radix digits of rank over the contract's axis sizes, fastest first."""
    digits = []
    for size in f.sizes.values():
        digits.append(rank % size)
        rank //= size
    assert rank == 0
    return tuple(digits)


def oracle_position(f: Factors, coords: tuple[int, ...], axes: tuple[str, ...]) -> int:
    """Mixed-radix index of the grouped axes (in AXES order, fastest first)."""
    sizes, by_axis = f.sizes, dict(zip(AXES, coords))
    index, radix = 0, 1
    for axis in AXES:
        if axis in axes:
            index += by_axis[axis] * radix
            radix *= sizes[axis]
    return index


# --------------------------------------------------------------------- sizes and coordinates


@settings(max_examples=100, **SETTINGS)
@given(factors())
def test_axis_sizes_and_derived_identities(f: Factors) -> None:
    lay = f.layout()
    assert lay.axis_sizes == f.sizes
    assert math.prod(lay.axis_sizes.values()) == lay.world_size == f.world
    d = lay.derived()
    assert list(d) == ["world_size", "sp_degree", "gtp_remat_size",
                       "gtp_remat_num_sequence_shards", "gtp_remat_num_batch_shards",
                       "data_parallel_size", "batch_parallel_size",
                       "runtime_context_parallel_size", "num_weight_replicas",
                       "num_microbatches", "global_batch_size", "expert_data_parallel_size"]
    assert d["sp_degree"] == f.sp_degree
    assert d["gtp_remat_size"] == f.g
    assert d["gtp_remat_num_sequence_shards"] == f.ns
    assert d["gtp_remat_num_batch_shards"] == f.nb
    assert d["data_parallel_size"] == f.dp
    assert d["batch_parallel_size"] == f.world // (f.tp * f.pp * f.cp * f.ns) == f.dp * f.nb
    assert (f.world % (f.tp * f.pp * f.cp * f.ns)) == 0
    assert d["runtime_context_parallel_size"] == f.cp * f.ns
    assert d["num_weight_replicas"] == f.cp * f.dp
    assert d["num_microbatches"] == (1 if f.num_micro is None else f.num_micro)
    assert d["global_batch_size"] == (
        lay.micro_batch_size * d["batch_parallel_size"] * d["num_microbatches"])
    # Group sizes of the derived values.
    r = f.world - 1
    assert len(lay.group("context", r)) == d["runtime_context_parallel_size"]
    assert len(lay.group("batch_lane", r)) == d["batch_parallel_size"]
    assert len(lay.group("token_distinct", r)) == f.world // (f.tp * f.pp)
    assert len(lay.group("weight_replica", r)) == d["num_weight_replicas"]
    assert len(lay.group("gtp_remat", r)) == d["gtp_remat_size"]
    assert len(lay.group("weight_tile", r)) == f.tp * f.g


@settings(max_examples=100, **SETTINGS)
@given(factors())
def test_coords_rank_round_trip(f: Factors) -> None:
    lay = f.layout()
    seen = set()
    for r in range(f.world):
        c = lay.coords(r)
        assert tuple(c) == oracle_coords(f, r)
        assert lay.rank(c) == r
        seen.add(tuple(c))
    assert len(seen) == f.world
    for bad in (-1, f.world):
        with pytest.raises(IndexError):
            lay.coords(bad)


# --------------------------------------------------------------------------------- groups


@settings(max_examples=60, **SETTINGS)
@given(factors())
def test_groups_partition_ordered_and_positioned(f: Factors) -> None:
    lay = f.layout()
    all_groups = lay.all_groups()
    assert set(all_groups) == set(GROUP_NAMES)
    coords = [oracle_coords(f, r) for r in range(f.world)]
    for name in AXIS_GROUPS:
        axes = GROUP_AXES[name]
        groups = lay.groups(name)
        assert all_groups[name] == groups
        size = math.prod(f.sizes[a] for a in axes)
        assert all(len(g) == size for g in groups), name
        # A partition of the world: every rank exactly once.
        assert sorted(r for g in groups for r in g) == list(range(f.world)), name
        assert len(groups) == f.world // size
        lowest = [min(g) for g in groups]
        assert lowest == sorted(lowest) and len(set(lowest)) == len(lowest), name
        owner = {r: g for g in groups for r in g}
        for r in range(f.world):
            g = lay.group(name, r)
            assert g == owner[r], (name, r)
            pos = lay.position(name, r)
            assert pos == g.index(r) == oracle_position(f, coords[r], axes), (name, r)


@settings(max_examples=60, **SETTINGS)
@given(factors(max_world=64))
def test_group_membership_brute_force_oracle(f: Factors) -> None:
    """Same group iff coords agree on every axis outside the group's axes (pairwise)."""
    lay = f.layout()
    coords = [oracle_coords(f, r) for r in range(f.world)]
    for name in AXIS_GROUPS:
        axes = GROUP_AXES[name]
        outside = [i for i, a in enumerate(AXES) if a not in axes]
        members = [set(lay.group(name, a)) for a in range(f.world)]
        for a in range(f.world):
            for b in range(f.world):
                same = all(coords[a][i] == coords[b][i] for i in outside)
                assert (b in members[a]) == same, (name, a, b)


@st.composite
def expert_views(draw) -> tuple[Layout, tuple[int, int, int, int]]:
    """A layout with expert parallel and the expert view's sizes (etp, ep, edp, pp) it must
    number: TP, PP and DP for the dense view, then an ETP and EP that divide a stage."""
    tp, pp, dp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])), \
        draw(st.sampled_from([1, 2, 3, 4, 6]))
    stage = tp * dp
    etp = draw(st.sampled_from(divisors(stage)))
    ep = draw(st.sampled_from(divisors(stage // etp)))
    lay = Layout(stage * pp, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                 expert_tensor_parallel_size=etp, expert_model_parallel_size=ep)
    return lay, (etp, ep, stage // (etp * ep), pp)


@settings(max_examples=60, **SETTINGS)
@given(expert_views())
def test_expert_view_is_megatrons_second_rank_generator(view) -> None:
    """Megatron-Core's expert generator orders the world etp-ep-edp-pp (fastest first): rank =
    etp + ETP x (ep + EP x (edp + EDP x pp)). Two ranks share a group iff they agree on every
    other axis of that view, and pipeline groups are the dense view's."""
    lay, sizes = view
    names = ("etp", "ep", "edp", "pp")
    assert tuple(lay.expert_axis_sizes.values()) == sizes
    coords = []
    for r in range(lay.world_size):
        digits, rest = [], r
        for size in sizes:
            digits.append(rest % size)
            rest //= size
        coords.append(digits)
        assert lay.expert_coords(r) == dict(zip(names, digits))
    groups = {"expert_tensor_parallel": "etp", "expert_model_parallel": "ep",
              "expert_data_parallel": "edp"}
    for name, axis in groups.items():
        i = names.index(axis)
        for a in range(lay.world_size):
            members = lay.group(name, a)
            assert lay.position(name, a) == members.index(a) == coords[a][i]
            for b in range(lay.world_size):
                same = all(coords[a][j] == coords[b][j] for j in range(4) if j != i)
                assert (b in members) == same, (name, a, b)
        assert sorted(r for g in lay.groups(name) for r in g) == list(range(lay.world_size))
    assert all(coords[r][3] == lay.coords(r).pp for r in range(lay.world_size))


@settings(max_examples=40, **SETTINGS)
@given(factors())
def test_view_invariants(f: Factors) -> None:
    lay = f.layout()
    for r in range(f.world):
        assert set(lay.group("weight_tile", r)) & set(lay.group("weight_replica", r)) == {r}
        assert set(lay.group("context", r)) & set(lay.group("batch_lane", r)) == {r}
        replica = lay.group("weight_replica", r)
        union = Counter(q for peer in replica for q in lay.group("gtp_remat", peer))
        token = lay.group("token_distinct", r)
        assert union == Counter(token) and all(n == 1 for n in union.values()), r
        shard = lay.weight_shard(r)
        assert all(lay.weight_shard(p) == shard for p in replica), r
        part = lay.batch_partition(r)
        assert all(lay.batch_partition(p) == part for p in lay.group("context", r)), r
        # The index formulas of the contract, from coordinates.
        tp, seq, batch, cp, dp, pp = oracle_coords(f, r)
        assert lay.runtime_cp_rank(r) == seq + f.ns * cp
        assert part == batch + f.nb * dp
        assert shard == seq + f.ns * batch == (r // f.tp) % f.g


@st.composite
def two_cp_choices(draw) -> tuple[Factors, Factors]:
    """Two layouts with the same world, TP, G and PP but another (CP, ns); DP absorbs CP."""
    a = draw(factors())
    cp = draw(st.integers(1, 4))
    assume((a.cp * a.dp) % cp == 0)
    ns = draw(st.sampled_from(divisors(a.g)))
    assume((cp, ns) != (a.cp, a.ns))
    sp = sp_for(draw, a.tp, ns)
    b = a._replace(cp=cp, dp=a.cp * a.dp // cp, ns=ns, sp=sp, num_micro=None, seq_mult=None)
    assert b.world == a.world
    return a, b


@settings(max_examples=60, **SETTINGS)
@given(two_cp_choices())
def test_weight_groups_do_not_depend_on_cp_or_sequence_shards(pair) -> None:
    a, b = (f.layout() for f in pair)
    for name in ("gtp_remat", "weight_replica", "model_parallel", "weight_tile", "tp", "pp"):
        assert a.groups(name) == b.groups(name), name
    # The shard each rank stores (what a checkpoint records) stays put too.
    assert [a.weight_shard(r) for r in range(a.world_size)] == [
        b.weight_shard(r) for r in range(b.world_size)]


@settings(max_examples=100, **SETTINGS)
@given(factors())
def test_embedding_groups(f: Factors) -> None:
    lay = f.layout()
    pp_groups = lay.groups("pp")
    emb = lay.groups("embedding")
    if f.pp > 1:
        assert emb == [[g[0], g[-1]] for g in pp_groups]
        assert all(g[0] < g[-1] for g in emb)
    else:
        assert emb == [[r] for r in range(f.world)]
    for g in pp_groups:
        first, last = g[0], g[-1]
        for pos, r in enumerate((first, last) if f.pp > 1 else (first,)):
            assert lay.group("embedding", r) == ([first, last] if f.pp > 1 else [r])
            assert lay.position("embedding", r) == pos


def test_contract_worked_group_example() -> None:
    """world=16, TP=2 with SP, CP=2, weight shards 8, sequence shards 4 (docs/layout.md)."""
    lay = Layout(16, 2, True, 8, 4, 2, 1)
    assert lay.groups("context") == [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14],
                                     [5, 7, 13, 15]]
    assert lay.groups("batch_lane") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13],
                                        [10, 14], [11, 15]]
    assert lay.groups("token_distinct") == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert lay.groups("gtp_remat") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14],
                                       [9, 11, 13, 15]]
    assert lay.groups("weight_replica") == [[r, r + 8] for r in range(8)]
    assert lay.groups("weight_tile") == [list(range(8)), list(range(8, 16))]


@pytest.mark.parametrize("kwargs, expect", [
    (dict(world_size=64, tensor_model_parallel_size=2, sequence_parallel=True,
          tensor_parallel_num_weight_shards=64, tensor_parallel_num_sequence_shards=16),
     dict(gtp_remat_size=32, gtp_remat_num_sequence_shards=8, gtp_remat_num_batch_shards=4)),
    (dict(world_size=128, tensor_parallel_num_weight_shards=64,
          tensor_parallel_num_sequence_shards=64, context_parallel_size=2),
     dict(gtp_remat_size=64, gtp_remat_num_sequence_shards=64, gtp_remat_num_batch_shards=1,
          data_parallel_size=1, batch_parallel_size=1, runtime_context_parallel_size=128,
          num_weight_replicas=2)),
    (dict(world_size=8, tensor_parallel_num_weight_shards=2),
     dict(gtp_remat_num_sequence_shards=1, runtime_context_parallel_size=1,
          batch_parallel_size=8, data_parallel_size=4)),
    (dict(world_size=8, tensor_parallel_num_weight_shards=2,
          tensor_parallel_num_sequence_shards=2),
     dict(gtp_remat_num_sequence_shards=2, runtime_context_parallel_size=2,
          batch_parallel_size=4, data_parallel_size=4)),
])
def test_contract_worked_derived_examples(kwargs, expect) -> None:
    d = Layout(**kwargs).derived()
    assert {k: d[k] for k in expect} == expect


def test_contract_worked_example_tiles_are_consecutive() -> None:
    lay = Layout(128, 1, False, 64, 64, 2, 1)
    assert lay.groups("weight_tile") == [list(range(64)), list(range(64, 128))]


# ------------------------------------------------------------------------ each rule, broken

RULES = ("size", "type", "sp_type", "ws_multiple", "ss_multiple", "ns_needs_sp", "g_mod_ns",
         "world", "gbs", "seq")


def valid_kwargs(f: Factors) -> dict:
    lay = f.layout()
    return dict(world_size=f.world, tensor_model_parallel_size=f.tp, sequence_parallel=f.sp,
                tensor_parallel_num_weight_shards=f.tp * f.g,
                tensor_parallel_num_sequence_shards=f.ns * f.sp_degree,
                context_parallel_size=f.cp, pipeline_model_parallel_size=f.pp,
                micro_batch_size=f.micro, global_batch_size=lay.global_batch_size,
                seq_length=lay.seq_length)


@settings(max_examples=200, **SETTINGS)
@given(factors(max_world=96), st.sampled_from(RULES), st.data())
def test_each_broken_rule_is_refused_naming_its_key(f: Factors, rule: str, data) -> None:
    """Break exactly one rule of the contract on a valid layout: a LayoutError must name the
    key that broke it and say what it must be or how to fix it."""
    x = valid_kwargs(f)
    ints = [k for k in x if k != "sequence_parallel"]
    required = ["world_size", "tensor_model_parallel_size", "context_parallel_size",
                "pipeline_model_parallel_size", "micro_batch_size"]
    tile = f.tp * f.g * f.cp * f.pp
    if rule == "size":
        key = data.draw(st.sampled_from(ints))
        x[key] = data.draw(st.sampled_from([0, -1, -3]))
    elif rule == "type":
        key = data.draw(st.sampled_from(ints))
        x[key] = data.draw(st.sampled_from([True, False, 1.0, "1"] + (
            [None] if key in required else [])))
    elif rule == "sp_type":
        key = "sequence_parallel"
        x[key] = data.draw(st.sampled_from([None, 0, 1, "true"]))
    elif rule == "ws_multiple":
        assume(f.tp > 1)
        key = "tensor_parallel_num_weight_shards"
        x[key] = data.draw(st.integers(1, f.tp - 1) | st.just(f.tp * f.g + 1))
    elif rule == "ss_multiple":
        assume(f.sp and f.tp > 1)
        key = "tensor_parallel_num_sequence_shards"
        x[key] = data.draw(st.integers(1, f.tp - 1) | st.just(f.ns * f.tp + 1))
    elif rule == "ns_needs_sp":
        assume(f.tp > 1 and f.ns > 1)
        key = "sequence_parallel"
        x[key], x["tensor_parallel_num_sequence_shards"] = False, f.ns
    elif rule == "g_mod_ns":
        ns = data.draw(st.integers(2, 16))
        assume(f.g % ns)
        key = "tensor_parallel_num_sequence_shards"
        x["sequence_parallel"] = f.tp > 1 or f.sp
        x[key] = ns * (f.tp if x["sequence_parallel"] else 1)
    elif rule == "world":
        assume(tile > 1)
        key = "world_size"
        x[key] = f.world + data.draw(st.integers(1, tile - 1))
    elif rule == "gbs":
        step = f.micro * f.bps
        assume(step > 1)
        key = "global_batch_size"
        x[key] = step * data.draw(st.integers(0, 3)) + data.draw(st.integers(1, step - 1))
    else:
        rcp = f.cp * f.ns
        multiple = math.lcm(2 * rcp if rcp > 1 else 1, rcp * f.sp_degree)
        assume(multiple > 1)
        key = "seq_length"
        x[key] = multiple * data.draw(st.integers(0, 3)) + data.draw(
            st.integers(1, multiple - 1))
    assert contract_rejects(x)
    with pytest.raises(LayoutError) as info:
        Layout(**x)
    msg = str(info.value)
    assert CONFIG_KEY[key] in msg, (rule, msg)
    assert "Fix:" in msg or "must be" in msg, msg


# ----------------------------------------------------------------------------------- fuzz

BAD = st.sampled_from([0, -1, -2, None, 1.0, 2.0, "2", True, False])


@st.composite
def raw_inputs(draw) -> dict:
    """Arbitrary small inputs. Each field is usually a plausible positive value (so the
    divisibility rules decide) and sometimes a bad one: 0, a negative, None for a required
    field, or a wrong type. Weight shards and the world lean towards multiples of what they
    must divide by, so valid layouts occur often too."""
    def field(good):
        return draw(BAD if draw(st.integers(0, 29)) == 0 else good)

    def optional(hi):
        return st.none() | st.integers(1, hi)

    x = dict(
        tensor_model_parallel_size=field(st.integers(1, 4)),
        sequence_parallel=field(st.booleans()),
        context_parallel_size=field(st.integers(1, 4)),
        pipeline_model_parallel_size=field(st.integers(1, 3)),
        micro_batch_size=field(st.integers(1, 4)),
        tensor_parallel_num_sequence_shards=field(optional(16)),
        global_batch_size=field(optional(64)),
        seq_length=field(st.none() | st.integers(1, 64) | st.sampled_from([96, 128, 192, 256])),
    )
    tp = x["tensor_model_parallel_size"]
    tp = tp if is_pos_int(tp) else 1
    x["tensor_parallel_num_weight_shards"] = field(
        optional(16) | st.integers(1, 8).map(lambda k: k * tp))
    ws, cp, pp = (x["tensor_parallel_num_weight_shards"], x["context_parallel_size"],
                  x["pipeline_model_parallel_size"])
    tile = math.prod(v for v in (ws or tp, cp, pp) if is_pos_int(v))
    x["world_size"] = field(st.integers(1, 40) | st.integers(1, 6).map(lambda k: k * tile))
    return x


def is_pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def contract_rejects(x: dict) -> bool:
    """The contract's rules, re-derived independently: True iff the inputs must be refused."""
    if not isinstance(x["sequence_parallel"], bool):
        return True
    optional = {"tensor_parallel_num_weight_shards", "tensor_parallel_num_sequence_shards",
                "global_batch_size", "seq_length"}
    for k, v in x.items():
        if k == "sequence_parallel" or (v is None and k in optional):
            continue
        if not is_pos_int(v):
            return True
    tp = x["tensor_model_parallel_size"]
    sp = tp if x["sequence_parallel"] else 1
    ws = x["tensor_parallel_num_weight_shards"] or tp
    ss = x["tensor_parallel_num_sequence_shards"] or sp
    if ws < tp or ws % tp or ss < sp or ss % sp:
        return True
    g, ns = ws // tp, ss // sp
    if ns > 1 and tp > 1 and not x["sequence_parallel"]:
        return True
    if g % ns:
        return True
    cp, pp = x["context_parallel_size"], x["pipeline_model_parallel_size"]
    if x["world_size"] % (tp * g * cp * pp):
        return True
    bps = x["world_size"] // (tp * pp * cp * ns)
    gbs = x["global_batch_size"]
    if gbs is not None and gbs % (x["micro_batch_size"] * bps):
        return True
    seq, rcp = x["seq_length"], cp * ns
    if seq is not None:
        if rcp > 1 and seq % (2 * rcp):
            return True
        if x["sequence_parallel"] and (seq % rcp or (seq // rcp) % tp):
            return True
    return False


KEY_PATTERN = re.compile("|".join(re.escape(k) for k in sorted(set(CONFIG_KEY.values()))))


@settings(max_examples=400, **SETTINGS)
@given(raw_inputs())
def test_fuzz_inputs_raise_layout_error_or_give_consistent_layout(x: dict) -> None:
    try:
        lay = Layout(**x)
    except LayoutError as err:  # anything else propagates and fails the test
        assert isinstance(err, ValueError)
        msg = str(err)
        assert "Fix:" in msg or "must be" in msg, msg
        assert KEY_PATTERN.search(msg), msg
        assert contract_rejects(x), f"refused a layout the contract allows: {x}: {msg}"
        return
    assert not contract_rejects(x), f"accepted a layout the contract refuses: {x}"
    sizes = lay.axis_sizes
    assert math.prod(sizes.values()) == lay.world_size == x["world_size"]
    assert all(is_pos_int(v) for v in sizes.values())
    d = lay.derived()
    tp, pp, cp = x["tensor_model_parallel_size"], x["pipeline_model_parallel_size"], x[
        "context_parallel_size"]
    ns = d["gtp_remat_num_sequence_shards"]
    assert d["batch_parallel_size"] == x["world_size"] // (tp * pp * cp * ns)
    assert d["batch_parallel_size"] * tp * pp * cp * ns == x["world_size"]
    assert d["runtime_context_parallel_size"] == cp * ns
    assert d["num_weight_replicas"] == cp * d["data_parallel_size"]
    assert d["gtp_remat_size"] * tp == lay.tensor_parallel_num_weight_shards
    assert d["global_batch_size"] == (
        x["micro_batch_size"] * d["batch_parallel_size"] * d["num_microbatches"])
    if x["global_batch_size"] is not None:
        assert d["global_batch_size"] == x["global_batch_size"]
    r = x["world_size"] - 1
    assert len(lay.group("context", r)) == d["runtime_context_parallel_size"]
    assert len(lay.group("batch_lane", r)) == d["batch_parallel_size"]
    assert len(lay.group("token_distinct", r)) == x["world_size"] // (tp * pp)
    assert len(lay.group("weight_replica", r)) == d["num_weight_replicas"]
