"""Every recompute preset × ZeRO 0-3 through ``ctx_plugin.deepspeed.initialize`` (DS_ACCELERATOR=cpu, gloo) on a
tiny Qwen2 (q/k/v biases, GQA, init std 0.1, 3 layers so ``sqrt`` and ``full:uniform:2`` make a two-layer region),
against plain PyTorch: one process, no DeepSpeed, no ctx_plugin, HF's sdpa attention, ``torch.optim.Adam`` and
gradient clipping as the DeepSpeed config has them (DeepSpeed clips to 1.0 by default). Two steps: losses and
DeepSpeed's gradient norms within 1e-5 relative, parameters within 1e-5 of the largest.

At data parallel 2 × CP 2 (world 4, where a saved ZeRO-3 parameter gather gave NaN gradients), giving the natural
``train_batch_size`` (CP ranks not counted), every preset runs once, at the ZeRO stage of ``ZERO_AT_DP2`` (each stage
at least twice; ZeRO-3 for ``selective`` and the multi-layer regions ``full:uniform:2`` and ``sqrt``), with four
``+tile_mlp`` cases (its chunk checkpoints under ZeRO-2/3's hooks, with full, selective and +recompute_attn); at CP 2
alone (world 2) every preset runs under ZeRO-3 and ``selective`` under ZeRO 0-2, ``+offload``/``+offload_attn``
under ZeRO-3, ``selective`` under ZeRO-3 limits that make the recomputation gather parameters more often than
the forward (``TIGHT_ZERO3``), plus a model that is not a Hugging Face model, wired through ``attention=`` (and one whose callback
wires nothing: its first forward is an error)."""
from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'ctx-plugin[deepspeed]'")
pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

from ctx_plugin.names import Backend, Recompute  # noqa: E402
from ctx_plugin.recompute import RecomputeConfig  # noqa: E402
from tests.integration.deepspeed_ranks import check_against_plain, launch, plain_train  # noqa: E402

PRESETS = ["none", "attn_out", "selective", "core_attn", "mlp", "full", "full:uniform:2", "full:block:1", "sqrt"]
BACKENDS = [b.value for b in Backend if b != Backend.ULYSSES_RING]
MICRO = 2
# The ZeRO stage of each preset at DP 2 × CP 2: a rotation, not the product (every stage, presets paired with the
# backends as in _cases); the +tile_mlp cases below add two ZeRO-3 and one ZeRO-2.
ZERO_AT_DP2 = {"none": 0, "attn_out": 1, "selective": 3, "core_attn": 2, "mlp": 0, "full": 1, "full:uniform:2": 3,
               "full:block:1": 2, "sqrt": 3}


TIGHT_ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 1000,
               "stage3_max_reuse_distance": 0}
"""ZeRO-3 limits under which the recomputation gathers parameters more often than the forward did (selective
checkpointing's cached mode refused the extra gathers: ctx_plugin/recompute/sac.py)."""


def _cases(world: int) -> list:
    """(model, backend, zero, preset, extra config); backends rotate over the presets."""
    if world == 4:
        return ([("hf", BACKENDS[i % len(BACKENDS)], ZERO_AT_DP2[preset], preset, {"train_batch_size": MICRO * 2})
                 for i, preset in enumerate(PRESETS)]
                + [("hf", backend, zero, preset, {"train_batch_size": MICRO * 2}) for backend, zero, preset in (
                    ("zigzag", 3, "full+tile_mlp:3"), ("ulysses", 3, "selective+tile_mlp:3"),   # ZeRO-3 at DP 2
                    ("ring", 2, "none+tile_mlp:3"), ("allgather", 3, "sqrt+tile_mlp+recompute_attn"))])
    return ([("hf", BACKENDS[i % len(BACKENDS)], 3, preset, {}) for i, preset in enumerate(PRESETS)]
            + [("hf", "zigzag", zero, "selective", {}) for zero in (0, 1, 2)]
            + [("hf", "zigzag", 3, "selective", {"zero_optimization": TIGHT_ZERO3})]
            + [("hf", "zigzag", 3, "full+offload_attn:1", {}), ("hf", "ulysses", 3, "sqrt+offload:1", {})]
            + [("wrapped", "ulysses", 3, "sqrt", {}), ("unwired", "zigzag", 1, "none", {})])


CASES = [(world, *case) for world in (4, 2) for case in _cases(world)]


def payload(world: int) -> dict:
    """deepspeed_ranks.presets_train's, run in the launch shared with test_deepspeed.py (deepspeed_ranks.launch)."""
    return {"micro": MICRO, "cases": [list(c) for c in _cases(world)]}


def test_the_matrix_names_every_preset():
    assert {RecomputeConfig.parse(p).preset for p in PRESETS} == set(Recompute) - {Recompute.BUDGET}
    assert set(ZERO_AT_DP2) == set(PRESETS) and set(ZERO_AT_DP2.values()) == {0, 1, 2, 3}


def _run(world: int) -> list:
    return [r["presets_train"] for r in launch(world)]


@pytest.mark.parametrize("world,kind,backend,zero,preset,extra", [c for c in CASES if c[1] != "unwired"],
                         ids=[f"W{c[0]}-{c[1]}-{c[2]}-zero{c[3]}-{c[4]}" for c in CASES if c[1] != "unwired"])
def test_two_steps_match_plain_pytorch(world, kind, backend, zero, preset, extra):
    check_against_plain(_run(world), f"{kind}-{backend}-z{zero}-{preset}", plain_train(MICRO * world // 2))


def test_attention_callback_that_wires_nothing_fails_on_the_first_forward():
    for rank, result in enumerate(_run(2)):
        assert "did not call ctx_plugin.cp_attention with the engine's groups" in \
            result["unwired-zigzag-z1-none"]["error"], rank
