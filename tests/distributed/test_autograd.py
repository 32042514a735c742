"""Autograd beyond one plain backward, on 3 gloo ranks: double backward through the attention is a clear error on
every rank (never silently wrong second-order gradients), gather_sequence's first and second derivatives match
closed forms and leave the caller's gradient tensor alone, and a second backward with retain_graph=True works
under every whole-layer recompute preset (same gradients, same communication) or fails clearly (selective)."""
from __future__ import annotations

import pytest

from ctx_plugin.names import Backend
from tests.distributed.harness import run_spawned

WORLD = 3
REPEATABLE = ["none", "attn_out", "core_attn", "mlp", "full", "full:uniform:2", "full:block:2", "sqrt"]
_results: dict[str, list] = {}


def results(name: str, payload=None) -> list:
    if name not in _results:
        _results[name] = run_spawned(f"tests.distributed.autograd_ranks:{name}", WORLD, payload, timeout_s=300)
    return _results[name]


@pytest.mark.parametrize("backend", [b.value for b in Backend])
def test_double_backward_through_attention_is_a_clear_error(backend):
    for rank, res in enumerate(results("double_backward")):
        r = res[backend]
        assert r["error"] is not None, f"rank {rank}: create_graph=True went through silently"
        assert "has no second derivative" in r["error"] and "create_graph=True" in r["error"], r["error"]
        assert r["first_order_finite"], "a plain backward after the error must still work"


@pytest.mark.parametrize("backend", ["zigzag", "striped", "ring"])
def test_gather_sequence_derivatives(backend):
    for rank, res in enumerate(results("gather_backward")):
        r = res[backend]
        assert r["upstream_untouched"], f"rank {rank}: backward modified the caller's gradient tensor"
        assert r["first_err"] <= 1e-12 and r["first_err_create_graph"] <= 1e-12, r
        assert r["second_err"] <= 1e-12, f"rank {rank}: second derivative off by {r['second_err']:.1e}"
        assert r["comm"]["reduce_scatter_grad"] == 3, r["comm"]   # one per backward, two in the double one


def test_second_backward_under_presets():
    res = results("repeated_backward", {"presets": REPEATABLE + ["selective"]})
    for rank, r in enumerate(res):
        for preset in REPEATABLE:
            assert r[preset]["error"] is None, f"rank {rank} {preset}: {r[preset]['error']}"
            assert r[preset]["same"], f"rank {rank} {preset}: the second backward gave other gradients"
            assert r[preset]["first_comm"], preset
            assert r[preset]["second_comm"] == r[preset]["first_comm"], (preset, r[preset])
        sel = r["selective"]
        assert sel["error"] is not None and "'selective' recompute preset" in sel["error"] \
            and "retain_graph=True" in sel["error"], sel["error"]
        assert sel["second_comm"] == {}, "the refused second backward must not start any communication"
    assert len({r["selective"]["error"] for r in res}) == 1
