"""``+tile_loss`` with DeepSpeed (DS_ACCELERATOR=cpu, gloo; tests/integration/tiled_loss_deepspeed_ranks.py): the tiny
Qwen2 (q/k/v biases, GQA, init std 0.1) trained two Adam steps with ``ctx_plugin.deepspeed.lm_loss`` and a section
``"recompute": "<preset>+tile_loss[:<tokens>]"`` — at CP 2 (ZeRO 1 and 3) and CP 1 × DP 2 — matches plain PyTorch
training on the whole logits (deepspeed_ranks.plain_train: losses, gradient norms, parameters within 1e-5, fp32);
the lm_head runs on the predicted chunks; the whole-logits loss and unsupported models are refused."""
from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'ctx-plugin[deepspeed]'")
pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

from tests.integration.deepspeed_ranks import SEQ, TILED, check_against_plain, launch, plain_train  # noqa: E402

WORLD = 2
# ZeRO-3 partitions the head (deepspeed_ranks._config): the automatic chunk size reads the whole weight's shape
CASES = [(2, 1, "full+tile_loss:5", 2), (2, 3, "none+tile_loss:3", 2), (1, 2, "sqrt+tile_loss", 1),
         (2, 3, "full+tile_loss", 2)]


def payload() -> dict:
    """tiled_loss_deepspeed_ranks.train's, run in the 2-rank launch of the DeepSpeed tests (deepspeed_ranks.launch)."""
    return {"cases": [list(c) for c in CASES]}


def results() -> list:
    return [r[TILED] for r in launch(WORLD)]


@pytest.mark.parametrize("size,zero,preset,micro", CASES, ids=[f"cp{s}-zero{z}-{p}" for s, z, p, _ in CASES])
def test_two_steps_match_plain_pytorch(size, zero, preset, micro):
    key = f"cp{size}-z{zero}-{preset}-mb{micro}"
    got = results()
    check_against_plain(got, key, plain_train(micro * WORLD // size))
    tokens = micro * SEQ // size                       # this rank's tokens per micro batch
    size_ = int(preset.split(":")[1]) if ":" in preset else tokens        # automatic: one chunk here
    chunks = [min(size_, tokens - s) for s in range(0, tokens, size_)]
    per_step = [micro] + chunks + chunks        # the pass-through call (hidden [b, s, h]), forward, backward
    for rank in range(WORLD):
        calls = got[rank][key]["calls"]
        assert len(calls) == 2 * len(per_step)
        for step in range(2):
            one = calls[step * len(per_step):(step + 1) * len(per_step)]
            assert one[:1 + len(chunks)] == per_step[:1 + len(chunks)]
            assert sorted(one[1 + len(chunks):]) == sorted(chunks)


def test_refusals():
    for rank in range(WORLD):
        r = results()[rank]
        assert "ctx_plugin.deepspeed.lm_loss(engine, batch)" in r["causal_lm_loss"]
        assert "config.logit_scale=0.5" in r["initialize"]
