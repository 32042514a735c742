"""Packed documents through megatron-core (CPU, gloo): a tiny GPTModel (GQA, biases, init std 0.1, float64) fed a
THD packed batch (``cu_seqlens`` / ``cu_seqlens_padded``, ``PackedSeqParams(qkv_format="thd")``) at CP 2 gives the
loss and every gradient of Megatron's own model at CP 1 with the documents' block-diagonal causal mask
(tests/integration/megatron_thd_ranks.py); layouts megatron-core's THD RoPE cannot follow and documents the layout
cannot split are refused with the fix."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

from tests.distributed.harness import run_spawned  # noqa: E402

PARITY = [("zigzag", "rope", "docs"), ("zigzag", "rope", "padded"), ("allgather", "rope", "docs"),
          ("zigzag", "learned_absolute", "padded"), ("ring", "learned_absolute", "docs"),
          ("ulysses", "learned_absolute", "padded"), ("striped", "learned_absolute", "docs"),
          ("ring", "learned_absolute", "uneven")]
REFUSED = [(("striped", "rope", "docs"), "packed sequences (THD, cu_seqlens) with rotary position embeddings need "
            "--cp-backend zigzag or allgather"),
           (("ring", "rope", "docs"), "--cp-backend ring does not hold"),
           (("zigzag", "learned_absolute", "uneven"), "document 0 holds 10 tokens, not a multiple of 4")]
_results: dict = {}


def results():
    if not _results:
        cases = [c for c in PARITY] + [c for c, _ in REFUSED]
        _results.update(run_spawned("tests.integration.megatron_thd_ranks:thd_step", 2, {"cases": cases},
                                    timeout_s=300)[0])
    return _results


@pytest.mark.parametrize("backend,position,mix", PARITY, ids=["-".join(c) for c in PARITY])
def test_thd_batches_match_megatron_with_the_document_mask(backend, position, mix):
    got = results()[f"{backend}-{position}-{mix}"]
    assert "error" not in got, got.get("error")
    assert got["local_tokens"] == 16
    # megatron-core computes RoPE frequencies in float32: its THD RoPE restarts positions in each document, the
    # reference's (BSHD) counts them over the sequence, so their cos/sin round differently (same math)
    tol = 1e-6 if position == "rope" else 1e-9
    assert got["loss_err"] <= tol / 10 and got["grad_err"] <= tol, got


@pytest.mark.parametrize("case,message", REFUSED, ids=["-".join(c) for c, _ in REFUSED])
def test_thd_refusals(case, message):
    got = results()["-".join(case)]
    assert message in got.get("error", ""), got
