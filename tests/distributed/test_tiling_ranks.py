"""+recompute_attn and +tile_mlp under context parallelism (spawned gloo ranks, float64).

+recompute_attn: gradients identical to no recompute, and the communication counted is the prediction: the
forward's unchanged, the total that of no recompute plus one more forward's worth for every layer inside a region
(its attention re-runs, ring / all-to-all / all-gather included, when the region is recomputed).
+tile_mlp: exact with every preset it composes with, communication unchanged (the MLP does not communicate).
Megatron's TransformerLayer ([s, b, h], MLP returning (output, bias)) tiled at CP 1 in the same launch, with
tensor parallelism 2 with and without sequence parallelism."""
from __future__ import annotations

import importlib.util

import pytest

from tests.distributed.harness import run_spawned
from tests.distributed.tiling_ranks import C

SEQ = 24
ATTN = ["full+recompute_attn", "full:block:2+recompute_attn", "sqrt+recompute_attn+tile_mlp:4"]
TILED = [f"{p}+tile_mlp:4" for p in ("none", "attn_out", "selective", "core_attn", "mlp", "full", "full:uniform:2",
                                     "full:block:2", "sqrt")]
MEGATRON = ["none+tile_mlp:5", "mlp+tile_mlp:4", "full+tile_mlp:3"]     # selective: test_megatron.py (pinned attention)
# ulysses_ring is left to the 4-rank recompute launch (tests/distributed/test_recompute_ranks.py): a second
# launch of 4 ranks here cost ~85 s on 2 busy cores
RUNS = {2: [("ring", 1, ATTN), ("zigzag", 1, ATTN + TILED), ("ulysses", 1, ATTN + TILED[2:3]),
            ("allgather", 1, ATTN)]}
REGION_LAYERS = {"full": C.layers, "full:block:2": 2, "sqrt": C.layers}      # layers inside checkpoint regions
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None
_results: dict[int, list[dict]] = {}


def results(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = run_spawned("tests.distributed.tiling_ranks:stacks", world,
                                      {"configs": RUNS[world], "seq": SEQ,
                                       "megatron": MEGATRON if world == 2 and HAS_MEGATRON else []})
    return _results[world]


CASES = [(w, b, u, p) for w, runs in RUNS.items() for b, u, presets in runs for p in presets]


@pytest.mark.parametrize("world,backend,u,preset", CASES, ids=[f"P{w}-{b}-u{u}-{p}" for w, b, u, p in CASES])
def test_gradients_and_communication(world, backend, u, preset):
    for rank, res in enumerate(results(world)):
        none, r = res[f"{backend}-u{u}-none"], res[f"{backend}-u{u}-{preset}"]
        assert none["forward"] and none["total"] != none["forward"], "the attention must communicate both ways"
        tiled = "tile_mlp" in preset
        assert r["grad_err"] <= (1e-12 if tiled else 0.0), f"rank {rank}: gradient error {r['grad_err']:.1e}"
        assert r["mode"] is None, "the pins' record/replay mode is left set"
        assert r["forward"] == none["forward"]
        if "recompute_attn" in preset:
            again = REGION_LAYERS[preset.split("+")[0]]
            want = {k: none["total"].get(k, 0) + none["forward"].get(k, 0) * again // C.layers
                    for k in {*none["total"], *none["forward"]}}
            assert r["total"] == want, f"rank {rank}: communication {r['total']}, predicted {want}"
            assert r["runs"] == C.layers + again
        elif preset.startswith("core_attn"):
            assert r["runs"] == 2 * C.layers
        else:
            assert r["total"] == none["total"], f"{preset} must not repeat communication"
            assert r["runs"] == C.layers


@pytest.mark.parametrize("parallel", ["tp1-spFalse", "tp2-spFalse", "tp2-spTrue"])
@pytest.mark.parametrize("preset", MEGATRON)
def test_megatron_transformer_layer_tiled(preset, parallel):
    """megatron-core's TransformerLayer (its own attention and MLP, biases, GQA, [s, b, h]) with +tile_mlp
    (sequence_dim=0), alone and under tensor parallelism 2 with and without sequence parallelism: gradients as
    without it (float64)."""
    if not HAS_MEGATRON:
        pytest.skip("needs megatron-core")
    for res in results(2):
        err = res["megatron"][f"{parallel}-{preset}"]
        assert err <= 1e-12, f"{parallel} {preset}: {err:.1e}"
