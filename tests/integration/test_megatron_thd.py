"""Packed documents through megatron-core (CPU, gloo): a tiny GPTModel (GQA, biases, init std 0.1, float64) fed a
THD packed batch (``cu_seqlens`` / ``cu_seqlens_padded``, ``PackedSeqParams(qkv_format="thd")``) at CP 2 and 4 gives
the loss and every gradient of Megatron's own model at CP 1 with the documents' block-diagonal causal mask
(tests/integration/megatron_thd_ranks.py), with RoPE, YaRN (its attention factor applied per document by
megatron-core's THD RoPE) and learned positions; layouts megatron-core's THD RoPE cannot follow, documents the layout
cannot split and YaRN with the fused THD RoPE (which drops YaRN's attention factor) are refused with the fix, the same
on every rank. The CP 2 cases have a launch of their own; the CP 4 ones run in test_megatron.py's 4-rank launch (in a
launch of their own when that one did not run)."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

from tests.distributed.harness import run_spawned  # noqa: E402
from tests.integration.megatron_thd_ranks import CP4_CASES  # noqa: E402

# (CP size, backend, position embedding, mix)
PARITY = [(2, "zigzag", "rope", "docs"), (2, "zigzag", "rope", "padded"), (2, "allgather", "rope", "docs"),
          (2, "zigzag", "learned_absolute", "padded"), (2, "ring", "learned_absolute", "docs"),
          (2, "ulysses", "learned_absolute", "padded"), (2, "striped", "learned_absolute", "docs"),
          (2, "ring", "learned_absolute", "uneven"), (2, "zigzag", "yarn", "docs"), (2, "allgather", "yarn", "padded"),
          (4, "zigzag", "rope", "padded8"), (4, "allgather", "yarn", "docs8"),
          (4, "ulysses", "learned_absolute", "uneven"), (4, "striped", "learned_absolute", "docs")]
REFUSED = [((2, "striped", "rope", "docs"), "packed sequences (THD, cu_seqlens) with rotary position embeddings need "
            "--cp-backend zigzag or allgather"),
           ((2, "ring", "rope", "docs"), "--cp-backend ring does not hold"),
           ((2, "ring", "yarn", "docs"), "--cp-backend ring does not hold"),
           ((2, "zigzag", "learned_absolute", "uneven"), "--dataloader-inter-document-masking/--sft: the dataset's "
            "document at token 0 of sample 0 holds 10 tokens, not a multiple of 4"),
           ((4, "zigzag", "rope", "docs"), "the dataset's document at token 0 of sample 0 holds 12 tokens, not a "
            "multiple of 8")]
# run with apply_rope_fusion (megatron-core's fused THD RoPE takes no mscale); YARN's attention factor is 1.06482
FUSED = [("zigzag", "yarn", "docs")]
_results: dict = {}


def results(world: int) -> list:
    """Every rank's results at CP ``world``: the CP 4 cases from test_megatron.py's 4-rank launch when it ran (as in
    the whole suite), else from a launch of their own."""
    if world not in _results:
        cases = [c[1:] for c in PARITY + [c for c, _ in REFUSED] if c[0] == world]
        shared = None
        if world == 4:
            from tests.integration import test_megatron

            assert set(cases) == set(CP4_CASES), "test_megatron.py's 4-rank launch runs CP4_CASES"
            shared = test_megatron.results(4, launch=False)
        _results[world] = [rank["thd"] for rank in shared] if shared else run_spawned(
            "tests.integration.megatron_thd_ranks:thd_step", world,
            {"cases": cases, "fused": FUSED if world == 2 else []}, timeout_s=300)
    return _results[world]


def _key(case) -> str:
    return "-".join(case[1:])


@pytest.mark.parametrize("world,backend,position,mix", PARITY, ids=[f"P{c[0]}-{_key(c)}" for c in PARITY])
def test_thd_batches_match_megatron_with_the_document_mask(world, backend, position, mix):
    got = results(world)[0][f"{backend}-{position}-{mix}"]
    assert "error" not in got, got.get("error")
    assert got["local_tokens"] == 32 // world
    # megatron-core computes RoPE/YaRN frequencies in float32: its THD RoPE restarts positions in each document, the
    # reference's (BSHD) counts them over the sequence, so their cos/sin round differently (same math)
    tol = 1e-6 if position in ("rope", "yarn") else 1e-9
    assert got["loss_err"] <= tol / 10 and got["grad_err"] <= tol, got


@pytest.mark.parametrize("case,message", REFUSED, ids=[f"P{c[0]}-{_key(c)}" for c, _ in REFUSED])
def test_thd_refusals(case, message):
    errors = [rank[_key(case)].get("error", "") for rank in results(case[0])]
    assert message in errors[0], errors[0]
    assert len(set(errors)) == 1, errors                    # the same on every rank


@pytest.mark.parametrize("case", FUSED, ids=["-".join(c) for c in FUSED])
def test_yarn_with_fused_thd_rope_is_refused_on_every_rank(case):
    errors = [rank["fused-" + "-".join(case)].get("error", "") for rank in results(2)]
    assert "YaRN (--position-embedding-type yarn, attention factor 1.06482) with packed sequences" in errors[0], \
        errors[0]
    assert "set apply_rope_fusion=False" in errors[0]
    assert len(set(errors)) == 1, errors


def test_fused_thd_rope_is_refused_only_with_a_yarn_attention_factor():
    from types import SimpleNamespace

    from ctx_plugin.megatron.rope import check_packed_yarn

    check_packed_yarn(SimpleNamespace(apply_rope_fusion=True), 1.0)       # YaRN with mscale == mscale_all_dim
    check_packed_yarn(SimpleNamespace(apply_rope_fusion=False), 1.06)
    with pytest.raises(ValueError, match="drops YaRN's attention factor"):
        check_packed_yarn(SimpleNamespace(apply_rope_fusion=True), 1.06)
