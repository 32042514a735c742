"""Tensor × context parallelism under Megatron (megatron-core, CPU, gloo): ctx_plugin's model at TP 2 × CP 2 (4
ranks; the Ulysses × ring hybrid at TP 2 × CP 4, 8 ranks) gives the loss and every parameter's whole gradient (TP
shards gathered, CP ranks summed) of Megatron's own model at TP 2 on the whole batch, within 1e-9, for every
backend — each TP rank attends over its 2 heads and 1 query group (Ulysses replicating that group's K/V over its
ranks), with RoPE, YaRN and learned positions, the honoured options (output gate, QK layernorm, partial interleaved
RoPE, ...), and sliding windows with learnable (TP-sharded) and off-by-one softmax offsets
(tests/integration/megatron_tp_ranks.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

import torch  # noqa: E402

from tests.distributed.harness import run_spawned  # noqa: E402
from tests.integration.megatron_tp_ranks import TP, case_key, reference_key, sp_key  # noqa: E402

# (backend, ulysses size, position embedding, variant, dataloader mask)
CASES = [(b, 1, "rope", "base", True) for b in ("ring", "zigzag", "striped", "ulysses", "allgather")]
CASES += [("striped", 1, "learned_absolute", "base", False), ("zigzag", 1, "yarn", "base", False),
          ("zigzag", 1, "rope", "knobs", True), ("ulysses", 1, "rope", "knobs", False),
          ("ulysses", 1, "rope", "window", False), ("ring", 1, "rope", "window", True),
          ("allgather", 1, "rope", "offbyone", False)]
MLA = [("zigzag", "rope"), ("ulysses", "yarn"), ("allgather", "rope")]   # (backend, MLA's rope type)
# Megatron's sequence parallelism on: (backend, ulysses size, position embedding, variant, recompute preset)
SEQUENCE_PARALLEL = [("zigzag", 1, "rope", "base", "none"), ("ring", 1, "rope", "base", "selective"),
                     ("striped", 1, "learned_absolute", "base", "mlp"), ("ulysses", 1, "rope", "window", "full"),
                     ("allgather", 1, "yarn", "base", "selective"), ("zigzag", 1, "rope", "knobs", "none"),
                     ("ulysses", 1, "rope", "moe", "none"), ("zigzag", 1, "rope", "moe", "selective"),
                     ("zigzag", 1, "rope", "base", "full+tile_mlp:3"),
                     ("ring", 1, "rope", "knobs", "full+tile_mlp+recompute_attn+offload:1"),
                     ("striped", 1, "rope", "window", "selective+tile_mlp"),
                     ("zigzag", 1, "rope", "knobs", "sqrt"), ("allgather", 1, "yarn", "base", "full:uniform:2+offload:1")]
HYBRID = [("ulysses_ring", 2, "rope", "base", True), ("ulysses_ring", 2, "rope", "window", False)]   # CP 4
_results: dict[int, list] = {}


def results(cp: int = 2) -> list:
    if cp not in _results:
        payload = {"cases": CASES, "mla": MLA, "sp": SEQUENCE_PARALLEL} if cp == 2 else {"cases": HYBRID}
        _results[cp] = run_spawned("tests.integration.megatron_tp_ranks:run", TP * cp, payload, timeout_s=600)
    return _results[cp]


@pytest.mark.parametrize("case", CASES, ids=[case_key(*c) for c in CASES])
def test_tensor_and_context_parallel_model_matches_megatron(case):
    backend, u, position, variant, mask = case
    assert any(name.endswith("softmax_offset") for name in results()[0][reference_key(position, variant)]["grads"]) \
        == (variant == "window")
    _check(reference_key(position, variant), case_key(*case))


@pytest.mark.parametrize("case", SEQUENCE_PARALLEL, ids=[sp_key(*c) for c in SEQUENCE_PARALLEL])
def test_sequence_parallelism(case):
    """Megatron's sequence parallelism at TP 2 × CP 2: between the attention and MLP blocks each TP rank holds half
    of its CP rank's tokens (its column-parallel linears gather them, its row-parallel ones reduce-scatter); the
    norms' and row-parallel biases' gradients are each TP rank's share, summed as finalize_model_grads sums them.
    Against Megatron's own TP 2 model with it, on the whole batch, with ctx_plugin's recompute presets (their
    recomputation gathers the tokens again), MoE included (its router then sees each rank's share of the tokens)."""
    backend, u, position, variant, preset = case
    _check(reference_key(position, variant, sp=True), sp_key(*case))


@pytest.mark.parametrize("position,variant", sorted({(c[2], c[3]) for c in SEQUENCE_PARALLEL if c[3] != "moe"}))
def test_sequence_parallel_reference_is_megatrons_tp_model(position, variant):
    """The references of test_sequence_parallelism (Megatron's model with sequence parallelism, its torch norms
    marked as its fused norms are) give the loss and gradients of Megatron's TP 2 model without it."""
    _check(reference_key(position, variant), reference_key(position, variant, sp=True))


@pytest.mark.parametrize("case", HYBRID, ids=[case_key(*c) for c in HYBRID])
def test_the_hybrid_under_tensor_parallelism(case):
    """Ulysses inside groups of 2, the ring across 2 of them, at TP 2 × CP 4: one head and its query group per
    Ulysses rank."""
    backend, u, position, variant, mask = case
    _check(reference_key(position, variant), case_key(*case), cp=4)


@pytest.mark.parametrize("backend,rope", MLA, ids=[f"{b}-{r}" for b, r in MLA])
def test_multi_latent_attention_under_tensor_and_context_parallelism(backend, rope):
    """MLA (tests/integration/megatron_mla_ranks.py's model: low-rank projections, queries and keys 24 wide, values
    16, its own RoPE or YaRN) at TP 2 × CP 2 against the same model at TP 2 on the whole batch, its core attention
    a float64 softmax (megatron-core 0.19's local attention takes no separate k/v widths)."""
    _check(f"mla-reference-{rope}", f"mla-{backend}-{rope}")


def _check(reference: str, key: str, cp: int = 2) -> None:
    ranks = results(cp)
    want, got = ranks[0][reference], ranks[0][key]
    assert got["weights"] == want["weights"], "the two models were not initialised alike"
    for rank in ranks:
        assert abs(rank[key]["loss"] - want["loss"]) <= 1e-10 * abs(want["loss"])
    assert set(got["grads"]) == set(want["grads"])
    floor = 1e-6 * max(max(abs(x) for x in g) for g in want["grads"].values())
    for name, w in want["grads"].items():
        w, have = torch.tensor(w, dtype=torch.float64), torch.tensor(got["grads"][name], dtype=torch.float64)
        assert have.shape == w.shape, name
        err = ((have - w).abs().max() / w.abs().max().clamp_min(floor)).item()
        assert err <= 1e-9, f"{name}: relative error {err:.2e}"
