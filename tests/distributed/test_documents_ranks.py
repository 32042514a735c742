"""Packed documents on spawned gloo ranks (one launch): every backend against the per-document float64 reference,
per-document positions, and one clear error on every rank when ranks disagree about the documents or one rank's
documents do not fit the layout. The full matrix runs on simulated ranks: tests/unit/test_documents_attention.py."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_spawned

CASES = {   # name: (backend, ulysses_size, causal)
    "ring": ("ring", 1, True), "zigzag": ("zigzag", 1, True), "striped": ("striped", 1, False),
    "allgather": ("allgather", 1, True), "ulysses": ("ulysses", 1, False), "hybrid": ("ulysses_ring", 2, True),
}
WORLD = 4


@pytest.fixture(scope="module")
def results():
    return run_spawned("tests.distributed.documents_ranks:documents", WORLD, {"cases": CASES})


def test_documents_match_reference_on_gloo_ranks(results):
    for rank, res in enumerate(results):
        assert res["cases"].keys() == CASES.keys()
        for name, case in res["cases"].items():
            for what, err in case["errors"].items():
                assert err < 1e-10, f"rank {rank} {name}: {what} relative error {err:.2e}"
            assert case["positions"], f"rank {rank} {name}: positions do not restart per document"


def test_ranks_that_disagree_about_documents_raise_the_same_error(results):
    errors = [res["errors"] for res in results]
    for name in ("disagree", "bad_on_one"):
        assert errors[0][name] is not None and all(e[name] == errors[0][name] for e in errors), name
    assert "disagree" in errors[0]["disagree"] and "  documents: " in errors[0]["disagree"]
    assert "document 0 holds 9 tokens, not a multiple of 8" in errors[0]["bad_on_one"]
