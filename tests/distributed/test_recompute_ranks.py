"""Recompute presets under context parallelism (spawned gloo ranks): the memory model exactly what each rank
keeps (bytes; it counts every tensor, the LSE and the norms' statistics included), the CP attention's
communication run once per step under every preset but core_attn, and the gradients equal to those without
recompute (fp32; recompute replays the same ops, so 1e-6 relative). Every backend runs every preset at 2 ranks;
the 4-rank launch (costlier: 4 ranks on few cores) runs the hybrid ulysses_ring and Ulysses with its key/value head
replicated (MQA over 4 ranks) on the presets that keep different attention tensors (the region variants
full:uniform:2 and full:block:2 only regroup layers: 2 ranks)."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_spawned
from tests.recompute_cases import LAYERS, PRESETS

SEQ = 48
HYBRID = ["none", "attn_out", "selective", "core_attn", "mlp", "full", "sqrt"]
# (backend, ulysses_size, shape, presets); "none" first in each: the communication every other preset is held to.
RUNS = {2: [("zigzag", 1, "gqa-gated", PRESETS), ("ring", 1, "mha-gated", PRESETS),
            ("ulysses", 1, "gqa-plain", PRESETS), ("allgather", 1, "mqa-layernorm", PRESETS),
            ("striped", 1, "gqa-plain", PRESETS)],
        4: [("ulysses_ring", 2, "gqa-gated", HYBRID),
            ("ulysses", 1, "mqa-layernorm", ["none", "selective", "core_attn", "sqrt"])]}
_results: dict[int, list[dict]] = {}


def results(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = run_spawned("tests.distributed.recompute_ranks:memory_and_comm", world,
                                      {"configs": RUNS[world], "seq": SEQ})
    return _results[world]


CASES = [(w, b, u, s, p) for w, runs in RUNS.items() for b, u, s, p in runs]


def test_every_backend_runs_every_preset():
    from ctx_plugin.names import Backend

    assert {b for b, _, _, presets in RUNS[2] if presets == PRESETS} == set(Backend) - {Backend.ULYSSES_RING}
    assert all(presets[0] == "none" for runs in RUNS.values() for *_, presets in runs)


@pytest.mark.parametrize("world,backend,u,shape,presets", CASES,
                         ids=[f"P{w}-{b}-u{u}-{s}" for w, b, u, s, _ in CASES])
def test_memory_model_and_communication(world, backend, u, shape, presets):
    for rank, res in enumerate(results(world)):
        none = res[f"{backend}-u{u}-{shape}-none"]
        assert none["comm"], "the context-parallel attention must communicate"
        for preset in presets:
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
