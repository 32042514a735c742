"""Packed documents under DeepSpeed (CPU, gloo): a tiny Qwen2 (q/k/v biases, GQA, init std 0.1) trained two Adam
steps on packed samples (several documents per sequence, position_ids restarting in each, as Hugging Face's
DataCollatorWithFlattening packs them) through ``ctx_plugin.deepspeed.initialize``, against plain PyTorch training on
every document on its own, unpacked (HF's sdpa attention, no DeepSpeed, no ctx_plugin): losses and gradient norms
within 1e-5 relative, every parameter within 1e-5 of the largest. Documents that fit the layout go as they are; others
are padded by the loader (``"pad_documents": true``) or, for contiguous shards, cut anywhere. Runs in the DeepSpeed
launch shared with test_deepspeed.py (deepspeed_ranks.launch). With gradient accumulation and ``step_tokens``, a step is
plain PyTorch's token mean over all the step's documents (the micro batches' targets differ in number)."""
from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'ctx-plugin[deepspeed]'")
pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

from tests.integration.deepspeed_ranks import check_against_plain, launch, plain_packed_train  # noqa: E402

# (world, backend, ulysses_size, cp size, ZeRO stage, document mix, pad_documents)
CASES = [(2, "zigzag", 1, 2, 1, "fit", False), (2, "ring", 1, 2, 3, "ragged", False),
         (2, "allgather", 1, 2, 1, "ragged", True), (4, "striped", 1, 4, 1, "ragged", True),
         (4, "ulysses_ring", 2, 4, 3, "ragged", True), (4, "zigzag", 1, 2, 1, "ragged", True)]


# Gradient accumulation 2, each micro batch's loss over the whole step's tokens (step_tokens), as train_hf trains:
# (world, backend, ulysses_size, cp size, ZeRO stage, document mix, pad_documents, optimizer steps, DeepSpeed's
# managed_gradient_accumulation). The samples' target counts differ (29, 30, 28, 31 for "fit"), so the mean of the
# micro batches' token means would not match; unmanaged, an engine.step() per micro batch would update twice a step.
ACCUMULATED = [(2, "zigzag", 1, 2, 1, "fit", False, 2, True), (4, "zigzag", 1, 2, 3, "ragged", True, 1, True),
               (2, "ring", 1, 2, 2, "fit", False, 2, False)]


def payload(world: int) -> dict:
    return {"cases": [c[1:] for c in CASES if c[0] == world]}


def accumulated_payload(world: int) -> dict:
    return {"cases": [c[1:] for c in ACCUMULATED if c[0] == world]}


@pytest.mark.parametrize("world,backend,u,cp,zero,mix,pad", CASES,
                         ids=[f"W{w}-{b}-u{u}-cp{cp}-zero{z}-{m}-pad{int(p)}" for w, b, u, cp, z, m, p in CASES])
def test_packed_steps_match_plain_pytorch_per_document(world, backend, u, cp, zero, mix, pad):
    got = [r["packed_train"] for r in launch(world)]
    check_against_plain(got, f"{backend}-u{u}-cp{cp}-z{zero}-{mix}-pad{int(pad)}", plain_packed_train(mix, world // cp))


@pytest.mark.parametrize("world,backend,u,cp,zero,mix,pad,steps,managed", ACCUMULATED,
                         ids=[f"W{w}-{b}-cp{cp}-zero{z}-{m}-pad{int(p)}-managed{int(g)}"
                              for w, b, u, cp, z, m, p, _, g in ACCUMULATED])
def test_accumulated_steps_train_on_the_whole_steps_token_mean(world, backend, u, cp, zero, mix, pad, steps, managed):
    """With step_tokens, a step of 2 micro batches per replica (train_hf's train_step, with DeepSpeed's managed
    gradient accumulation or without) is plain PyTorch's step on all 2 × replicas samples' documents with one token
    mean over them."""
    got = [r["accumulated_train"] for r in launch(world)]
    check_against_plain(got, f"{backend}-u{u}-cp{cp}-z{zero}-{mix}-pad{int(pad)}-m{int(managed)}",
                        plain_packed_train(mix, 2 * world // cp, steps))
