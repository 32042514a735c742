"""Ranks that disagree about a call end in one clear ValueError on every rank, within seconds, naming each
differing field and each rank's value; ranks that agree get unchanged results, and the check costs one small
all-reduce per call and one per backward (none with check_ranks=False, none during a pinned recompute replay).

Spawned gloo ranks, one launch per world size (2 and 4); at world 4 only rank 2 differs (and, in one case,
ranks 1 and 3 in different fields)."""
from __future__ import annotations

import pytest

from tests.distributed.agreement_ranks import odd_rank
from tests.distributed.harness import run_spawned
from tests.recompute_cases import LAYERS

SECONDS = 10.0          # a disagreement is an error within seconds (the collective timeout is 60 s)
SCALE = repr(8 ** -0.5)
# case -> {field: (value of the ranks that agree, value of the odd rank)}
CASES = {
    "short_local_seq": {"local_seq": ("8", "4")},
    # rank 1's own check fails before it selects a kernel ("-": none)
    "invalid_local_seq": {"local_seq": ("8", "3"), "kernel": ("torch", "-"), "input_check": ("ok", None)},
    "zigzag_vs_ring": {"backend": ("zigzag", "ring")},
    "ring_vs_ulysses": {"backend": ("ring", "ulysses")},
    "dtype": {"dtype": ("torch.float32", "torch.float64")},
    "causal": {"causal": ("True", "False")},
    "scale": {"softmax_scale": (SCALE, "0.25")},
    "heads": {"heads": ("4", "2")},
    "kv_heads": {"kv_heads": ("2", "1")},
    "head_dim": {"head_dim": ("8", "4")},
    "v_head_dim": {"v_head_dim": ("8", "4")},
    "huge_scale": {"softmax_scale": ("0.25", "-"), "kernel": ("torch", "-"), "input_check": ("ok", None)},
    "huge_softcap": {"softcap": ("5.0", "-"), "kernel": ("torch", "-"), "input_check": ("ok", None)},
    "kernel": {"kernel": ("torch", "sdpa_cpu")},
    "requires_grad": {"requires_grad": ("True", "False")},
    "sinks_requires_grad": {"requires_grad": ("False", "True")},
    "gather_local_len": {"shape": ("(2, 8, 3)", "(2, 4, 3)")},
    "attention_vs_gather": {"op": ("cp_attention", "gather_sequence")},
}
AGREE_CONFIGS = {2: [("zigzag", 1), ("ulysses", 1), ("allgather", 1)], 4: [("ulysses_ring", 2), ("striped", 1)]}
PRESETS = ["none", "attn_out", "selective", "full", "sqrt", "core_attn"]
_results: dict[int, list[dict]] = {}


def results(world: int) -> list[dict]:
    if world not in _results:
        payload = {"configs": AGREE_CONFIGS[world], "presets": PRESETS if world == 2 else [], "seq": 16}
        _results[world] = run_spawned("tests.distributed.agreement_ranks:everything", world, payload, timeout_s=240)
    return _results[world]


def _ranks(ranks: list[int]) -> str:
    return {(0,): "rank 0", (1,): "rank 1", (2,): "rank 2", (3,): "rank 3", (0, 1, 3): "ranks 0-1, 3",
            (0, 2, 3): "ranks 0, 2-3", (0, 1, 2): "ranks 0-2"}[tuple(ranks)]


def _message(world: int, case: str) -> str:
    """The one message every rank raised for ``case`` (checked: a ValueError, the same text everywhere, in time,
    the group still working afterwards)."""
    per_rank = [res["disagree"][case] for res in results(world)]
    for rank, r in enumerate(per_rank):
        assert r["error"] is not None, f"rank {rank}: {case} did not raise"
        assert r["seconds"] < SECONDS, f"rank {rank}: {case} took {r['seconds']:.1f} s"
        assert r["probe"] == world, "the group must still work after the error"
    messages = {r["error"] for r in per_rank}
    assert len(messages) == 1, f"{case}: the ranks raised different errors: {messages}"
    (message,) = messages
    assert message.startswith("ValueError: "), message
    return message


def _fields(message: str) -> dict[str, str]:
    return dict(line.strip().split(": ", 1) for line in message.splitlines() if line.startswith("  "))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_disagreement_is_one_error_on_every_rank(world, case):
    message = _message(world, case)
    fields = _fields(message)
    assert set(fields) == set(CASES[case]), message
    odd = odd_rank(world)
    same_ranks = [r for r in range(world) if r != odd]
    for field, (same, other) in CASES[case].items():
        if other is None:      # a rank's own check failed: its error text is the value
            assert fields[field].startswith(f"{_ranks(same_ranks)}: {same}; {_ranks([odd])}: ValueError: "), message
            continue
        assert fields[field] == f"{_ranks(same_ranks)}: {same}; {_ranks([odd])}: {other}", message
    what = "which call to make" if case == "attention_vs_gather" else \
        "this gather_sequence call" if case.startswith("gather") else "this cp_attention call"
    assert f"the {world} ranks of the context-parallel group disagree about {what}" in message
    assert "CPConfig(check_ranks=False)" in message


@pytest.mark.parametrize("world", [2, 4])
def test_configs_building_different_groups_are_one_error_before_any_subgroup(world):
    """One rank's ulysses_size (or check_ranks) differs: that rank alone would create (or skip) subgroups and
    wait on the others; build_cp_groups compares first and raises the same error everywhere."""
    same = _ranks([r for r in range(world) if r != odd_rank(world)])
    odd = _ranks([odd_rank(world)])
    prefix = "ValueError: build_cp_groups: the ranks of the context-parallel group were given configs that build " \
             "different groups ("
    assert _message(world, "groups_ulysses_size") == \
        f"{prefix}ulysses_size: {same}: {world // 2}; {odd}: {world}); pass the same CPConfig on every rank"
    assert _message(world, "groups_check_ranks") == \
        f"{prefix}check_ranks: {same}: True; {odd}: False); pass the same CPConfig on every rank"


@pytest.mark.parametrize("world", [2, 4])
def test_a_double_backward_on_one_rank_is_an_error_on_every_rank(world):
    """create_graph=True on one rank only: every rank's backward agrees first and raises, none waits on the odd
    one's refusal in the ring's communication."""
    odd = odd_rank(world)
    for rank, res in enumerate(results(world)):
        r = res["disagree"]["double_backward"]
        assert r["error"] is not None and r["error"].startswith("RuntimeError: ring attention has no second "
                                                                "derivative"), f"rank {rank}: {r['error']}"
        assert r["seconds"] < SECONDS and r["probe"] == world
        assert ("on another rank of the context-parallel group" in r["error"]) == (rank != odd), r["error"]


@pytest.mark.parametrize("world", [2, 4])
def test_huge_numbers_are_the_odd_ranks_value_error(world):
    for case, name in (("huge_scale", "softmax_scale"), ("huge_softcap", "softcap")):
        check = _fields(_message(world, case))["input_check"]
        assert f"ValueError: {name} must be" in check and "positive finite number" in check, check


def test_invalid_shard_on_one_rank_names_its_error():
    fields = _fields(_message(2, "invalid_local_seq"))
    assert "positive multiple of 4" in fields["input_check"], fields


def test_two_ranks_differing_in_different_fields():
    fields = _fields(_message(4, "two_ranks_two_fields"))
    assert fields == {"local_seq": "ranks 0-2: 8; rank 3: 4",
                      "dtype": "ranks 0, 2-3: torch.float64; rank 1: torch.float32"}


@pytest.mark.parametrize("world", [2, 4])
def test_group_without_cpu_transport_gets_its_own_gloo_group(world):
    for rank, res in enumerate(results(world)):
        r = res["disagree"]["nccl_like"]
        assert r["own_group"] and r["backend"] == "gloo" and r["members"] == list(range(world)), r
        assert r["off"], "check_ranks=False must not create the gloo group"
        assert r["error"] is not None and "local_seq: " in r["error"], f"rank {rank}: {r['error']}"


@pytest.mark.parametrize("world,config", [(w, c) for w, cs in AGREE_CONFIGS.items() for c in cs])
def test_agreeing_ranks_pass_with_unchanged_results_and_one_check_per_call(world, config):
    backend, u = config
    for rank, res in enumerate(results(world)):
        r = res["agree"][f"{backend}-u{u}"]
        assert r["same"], f"rank {rank}: results differ with the check on and off"
        assert r["err"] < 1e-10, f"rank {rank}: relative error {r['err']:.1e} against the float64 reference"
        assert r["on_fwd"] == {"all_reduce": 1, "all_gather": 0, "counter": 1}, r["on_fwd"]
        assert r["on_bwd"] == {"all_reduce": 1, "all_gather": 0, "counter": 1}, r["on_bwd"]   # create_graph agreed
        assert r["off_fwd"] == r["off_bwd"] == {"all_reduce": 0, "all_gather": 0, "counter": 0}
        assert (r["gather_checks_on"], r["gather_checks_off"]) == (4, 0), "gather_sequence: one check per call"


def test_no_check_during_pinned_replay():
    for res in results(2):
        for preset, r in res["replay"].items():
            # one check per attention run and one per attention backward (create_graph agreed)
            if preset == "core_attn":   # re-runs the attention, and so its check, in backward on every rank
                assert r == {"agree": 3 * LAYERS, "runs": 2 * LAYERS}, preset
            else:
                assert r == {"agree": 2 * LAYERS, "runs": LAYERS}, preset
