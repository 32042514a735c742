"""Hugging Face integration: a tiny LlamaForCausalLM (GQA, from a config) with ctx_plugin's attention at
CP = 2 and 4 for every backend (hybrid: ulysses_size 2) against HF's own sdpa attention on one rank: loss,
logits (gathered with ctx_plugin.gather_sequence) and every parameter gradient within 1e-5 relative (fp32)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

import torch  # noqa: E402

from ctx_plugin.names import Backend  # noqa: E402
from tests.distributed.harness import run_spawned  # noqa: E402

SIZES = {Backend.ULYSSES_RING: [(4, 2)], **{b: [(2, 1), (4, 1)] for b in Backend if b != Backend.ULYSSES_RING}}
CASES = [(w, b.value, u) for b, sizes in SIZES.items() for w, u in sizes]
_results: dict[int, list] = {}


def results(world: int):
    if world not in _results:
        cases = [("reference", 1)] if world == 1 else [(b, u) for w, b, u in CASES if w == world]
        _results[world] = run_spawned("tests.integration.hf_ranks:llama_step", world, {"cases": cases},
                                      timeout_s=600)
    return _results[world]


@pytest.mark.parametrize("world,backend,u", CASES, ids=[f"P{w}-{b}-u{u}" for w, b, u in CASES])
def test_llama_matches_single_rank(world, backend, u):
    reference = results(1)[0]["reference"]
    got = results(world)
    for rank in range(world):
        r = got[rank][f"{backend}-u{u}"]
        assert abs(r["loss"] - reference["loss"]) <= 1e-5 * abs(reference["loss"])
        assert r["logits_err"] <= 1e-5
    grads = got[0][f"{backend}-u{u}"]["grads"]
    assert set(grads) == set(reference["grads"])
    for name, want in reference["grads"].items():
        want, have = torch.tensor(want), torch.tensor(grads[name])
        err = ((have - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def test_masks_it_cannot_honor_are_errors():
    for res in run_spawned("tests.integration.hf_ranks:rejected_masks", 2):
        assert "cannot apply a padding/custom attention_mask" in res["padding"]
        assert "use_cache=False" in res["cache"]
        assert res["default_cache_off"]
