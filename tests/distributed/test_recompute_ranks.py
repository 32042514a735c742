"""Recompute presets under context parallelism (spawned gloo ranks): the memory model exactly what each rank
keeps (bytes; it counts every tensor, the LSE and the norms' statistics included), the CP attention's
communication run once per step under every preset but core_attn, and the gradients equal to those without
recompute (fp32; recompute replays the same ops, so 1e-6 relative)."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_spawned
from tests.recompute_cases import LAYERS, PRESETS

SEQ = 48
RUNS = {2: [("zigzag", 1, "gqa-gated"), ("ring", 1, "mha-gated"), ("ulysses", 1, "gqa-plain"),
            ("allgather", 1, "mqa-layernorm")],
        4: [("ulysses_ring", 2, "gqa-gated"), ("ulysses", 1, "mqa-layernorm"), ("striped", 1, "gqa-plain")]}
_results: dict[int, list[dict]] = {}


def results(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = run_spawned("tests.distributed.recompute_ranks:memory_and_comm", world,
                                      {"configs": RUNS[world], "seq": SEQ})
    return _results[world]


CASES = [(w, b, u, s) for w, runs in RUNS.items() for b, u, s in runs]


@pytest.mark.parametrize("world,backend,u,shape", CASES, ids=[f"P{w}-{b}-u{u}-{s}" for w, b, u, s in CASES])
def test_memory_model_and_communication(world, backend, u, shape):
    for rank, res in enumerate(results(world)):
        none = res[f"{backend}-u{u}-{shape}-none"]
        assert none["comm"], "the context-parallel attention must communicate"
        for preset in PRESETS:
            r = res[f"{backend}-u{u}-{shape}-{preset}"]
            assert r["grad_err"] <= 1e-6, f"rank {rank} {preset}: gradient error {r['grad_err']:.1e}"
            assert r["model"] == r["measured"], \
                f"rank {rank} {preset}: model {r['model']} vs measured {r['measured']} bytes"
            if preset == "core_attn":
                assert r["attention_runs"] == 2 * LAYERS
                assert all(r["comm"][k] >= none["comm"][k] for k in none["comm"])
                assert r["comm"] != none["comm"], "core_attn re-runs the attention's communication"
            else:
                assert r["attention_runs"] == LAYERS, preset
                assert r["comm"] == none["comm"], f"{preset} must not repeat communication"
