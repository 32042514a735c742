"""Multi-latent attention through megatron-core (CPU, gloo): a tiny MLA GPTModel (low-rank q/kv projections, q/kv
layernorms, queries and keys of 24 channels next to values of 16, biases, init std 0.1, float64;
tests/integration/megatron_mla_ranks.py) built through ctx_plugin's spec and prepared gives at CP 2 the loss and
every gradient of the same Megatron model on one rank whose core attention is a plain float64 softmax attention,
with MLA's own RoPE and YaRN made layout-aware in every attention, also with packed documents (THD) and under
ctx_plugin's recompute presets (the layers run again in backward); unprepared (Megatron's RoPE slicing zigzag-wise)
and with the fused MLA RoPE (which picks zigzag chunks itself) other layouts are refused, on every rank."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

import torch  # noqa: E402

from tests.distributed.harness import run_spawned  # noqa: E402

# (backend, ulysses size, rope type, prepare_model, config fields set after construction)
PARITY = [("ring", 1, "rope"), ("zigzag", 1, "yarn"), ("ulysses", 1, "rope"), ("striped", 1, "yarn"),
          ("allgather", 1, "rope")]
# ctx_plugin's recompute presets on MLA layers (prepare_model applies them; the attention stays pinned)
PRESETS = [("zigzag", 1, "rope", "selective"), ("ring", 1, "yarn", "full"), ("ulysses", 1, "rope", "sqrt")]
REFUSED = [(("ring", 1, "rope", False, {}), "(backend ring) runs in a model ctx_plugin.megatron.spec.prepare_model was "
            "not called on"),
           (("striped", 1, "yarn", True, {"apply_rope_fusion": True}), "multi-latent attention with apply_rope_fusion "
            "(--apply-rope-fusion): megatron-core's fused MLA RoPE picks each rank's zigzag chunks itself")]
# packed documents (THD; tests/integration/megatron_thd_ranks.py's mixes): (backend, rope type, mix)
THD = [("zigzag", "rope", "padded"), ("allgather", "yarn", "docs")]
THD_REFUSED = [(("ring", "rope", "docs"), "packed sequences (THD, cu_seqlens) with rotary position embeddings need "
                "--cp-backend zigzag or allgather")]
_results: dict = {}


def _key(backend, u, rope, prepare, fields) -> str:
    return "-".join(map(str, (backend, u, rope, prepare, *sorted(fields))))


def results() -> tuple[dict, list]:
    if not _results:
        _results["ref"] = run_spawned("tests.integration.megatron_mla_ranks:reference_step", 1,
                                      {"ropes": sorted({c[2] for c in PARITY}), "thd": [c[1:] for c in THD]},
                                      timeout_s=300)[0]
        cases = [(*c, True, {}) for c in PARITY] + [(*c, {}) for c in PRESETS] + [c for c, _ in REFUSED]
        _results["cp2"] = run_spawned("tests.integration.megatron_mla_ranks:mla_step", 2,
                                      {"cases": cases, "thd": THD + [c for c, _ in THD_REFUSED]}, timeout_s=300)
    return _results["ref"], _results["cp2"]


def _assert_same(got: list, key: str, want: dict, tol: float = 1e-9) -> None:
    assert got[0][key]["weights"] == want["weights"], "the two models were not initialised alike"
    for rank in range(2):
        assert abs(got[rank][key]["loss"] - want["loss"]) <= tol / 10 * abs(want["loss"])
    grads = got[0][key]["grads"]
    assert set(grads) == set(want["grads"]) and any("linear_kv_up_proj" in name for name in grads)
    for name, w in want["grads"].items():
        w, have = torch.tensor(w, dtype=torch.float64), torch.tensor(grads[name], dtype=torch.float64)
        err = ((have - w).abs().max() / w.abs().max()).item()
        assert err <= tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("backend,u,rope", PARITY, ids=["-".join(map(str, c)) for c in PARITY])
def test_mla_matches_megatrons_model(backend, u, rope):
    ref, got = results()
    key = _key(backend, u, rope, True, {})
    assert got[0][key]["rope_classes"] == ["LayoutRotaryEmbedding" if rope == "rope" else "LayoutYarnRotaryEmbedding"]
    assert got[0][key]["projection_calls"] == 1                                        # no recompute
    _assert_same(got, key, ref[rope])


@pytest.mark.parametrize("backend,u,rope,preset", PRESETS, ids=["-".join(map(str, c)) for c in PRESETS])
def test_mla_with_recompute_presets_matches_megatrons_model(backend, u, rope, preset):
    ref, got = results()
    _assert_same(got, _key(backend, u, rope, preset, {}), ref[rope])
    assert got[0][_key(backend, u, rope, preset, {})]["projection_calls"] == 2       # again in backward


@pytest.mark.parametrize("backend,rope,mix", THD, ids=["-".join(c) for c in THD])
def test_mla_packed_documents_match_megatrons_model_with_the_document_mask(backend, rope, mix):
    """THD batches (megatron-core pads MLA's values to the queries' width itself there) against the same model on
    the unpacked batch with the documents' block-diagonal causal mask. megatron-core computes RoPE/YaRN frequencies
    in float32 and its THD RoPE restarts positions in each document, the reference's counts them over the sequence:
    their cos/sin round differently (same math), hence test_megatron_thd.py's 1e-6."""
    ref, got = results()
    _assert_same(got, f"thd-{backend}-{rope}-{mix}", ref[f"{rope}-{mix}"], tol=1e-6)


@pytest.mark.parametrize("key,message", [(_key(*c), m) for c, m in REFUSED] +
                         [("thd-" + "-".join(c), m) for c, m in THD_REFUSED])
def test_mla_refuses_what_it_would_compute_wrong(key, message):
    _, got = results()
    for rank in range(2):
        assert message in got[rank][key]
