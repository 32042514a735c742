"""Activation offload under context parallelism (spawned gloo ranks, float64): gradients bit-identical to the same
preset without offload, the attention's communication unchanged (offload moves tensors, it never re-runs the
ring or the all-to-alls), and each rank's host bytes exactly its region inputs plus, with ``offload_attn``, the
tensors its attention saves (measured on one attention call alone), all released after backward."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_spawned

SEQ = 48
PRESETS = [("full", "offload_attn:1"), ("sqrt", "offload:1"), ("full:block:1", "offload_attn:1")]
RUNS = {2: [("zigzag", 1, "gqa-gated"), ("ring", 1, "mha-gated"), ("ulysses", 1, "gqa-plain"),
            ("allgather", 1, "mqa-layernorm")]}     # one launch (each costs seconds)
_results: dict[int, list[dict]] = {}


def results(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = run_spawned("tests.distributed.offload_ranks:offload_vs_plain", world,
                                      {"configs": RUNS[world], "seq": SEQ, "presets": PRESETS})
    return _results[world]


CASES = [(w, b, s) for w, runs in RUNS.items() for b, _, s in runs]


@pytest.mark.parametrize("world,backend,shape", CASES, ids=[f"P{w}-{b}-{s}" for w, b, s in CASES])
def test_offload_gradients_communication_and_host_bytes(world, backend, shape):
    for rank, res in enumerate(results(world)):
        for preset, modifier in PRESETS:
            r = res[f"{backend}-{shape}-{preset}+{modifier}"]
            where = f"rank {rank} {preset}+{modifier}"
            assert r["grad_diff"] == 0.0, f"{where}: gradients differ by {r['grad_diff']:.1e}"
            assert r["comm"], f"{where}: the context-parallel attention must communicate"
            assert r["comm"] == r["plain_comm"], f"{where}: communication {r['comm']} vs {r['plain_comm']}"
            assert r["runs"][0] == r["runs"][1]
            assert r["held"] == r["want"], f"{where}: host bytes {r['held']} vs {r['want']}"
            assert r["after"] == 0, f"{where}: host memory not released after backward"
