"""ctx_plugin under ``torch.compile`` (spawned gloo ranks, CP 2; tests/distributed/compile_ranks.py).

Dynamo used to trace into the attention's host-side planning (document tables built with NumPy) and fail there on
some ranks while the others waited in a collective: a hang, or with every rank failing, no training. The public
functions, Hugging Face's attention function and input check, and Megatron's core attention are now opaque to the
compiler (``torch.compiler.disable``): the model around them compiles, the attention runs eagerly, and what changes
from call to call (packed documents, windows) is read anew on every call. Checked against the float64 reference and
HF's own attention on every document on its own: a compiled function around ``cp_attention`` (every backend,
documents and windows changing), a whole compiled HF model with recompute presets on batches whose documents
change, the real compiler (inductor; its own float64 arithmetic on CPU differs from eager's by ~3e-7 relative,
with or without ctx_plugin), and ranks that disagree under compile (one error on every rank)."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_spawned

ATTENTION = [(b, "aot_eager") for b in ("ring", "zigzag", "striped", "ulysses", "allgather")] + [("zigzag", "inductor")]
HF = [("zigzag", "none", "aot_eager"), ("ring", "selective", "aot_eager"), ("allgather", "sqrt", "aot_eager"),
      ("ulysses", "full+offload:1", "aot_eager"), ("striped", "mlp+tile_mlp:3", "aot_eager"),
      ("zigzag", "full", "inductor")]
_results: list = []


def results() -> list:
    if not _results:
        pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")
        _results.extend(run_spawned("tests.distributed.compile_ranks:run", 2, {"attention": ATTENTION, "hf": HF},
                                    timeout_s=600))
    return _results


def _tolerance(compiler: str) -> float:
    return 1e-12 if compiler == "aot_eager" else 1e-5


@pytest.mark.parametrize("backend,compiler", ATTENTION, ids=[f"{b}-{c}" for b, c in ATTENTION])
def test_compiled_function_around_cp_attention(backend, compiler):
    for rank in results():
        errors = rank["attention"][f"{backend}-{compiler}"]
        assert len(errors) == 5 and max(errors) <= _tolerance(compiler), errors


@pytest.mark.parametrize("backend,preset,compiler", HF, ids=[f"{b}-{p}-{c}" for b, p, c in HF])
def test_compiled_hf_model_with_changing_documents(backend, preset, compiler):
    for rank in results():
        errors = rank["hf"][f"{backend}-{preset}-{compiler}"]
        assert len(errors) == 3 and max(errors) <= _tolerance(compiler), errors


def test_ranks_that_disagree_under_compile_raise_the_same_error():
    errors = [rank["disagreement"] for rank in results()]
    assert errors[0] is not None and "disagree" in errors[0] and "  window: " in errors[0], errors
    assert errors[0] == errors[1]


def test_fullgraph_names_the_attention():
    """One graph cannot hold the attention: torch refuses fullgraph=True, naming cp_attention (compile without it)."""
    for rank in results():
        assert rank["fullgraph"] is not None and rank["fullgraph"].startswith("Unsupported: ") \
            and "marked as skipped" in rank["fullgraph"] and "cp_attention" in rank["fullgraph"], rank["fullgraph"]
