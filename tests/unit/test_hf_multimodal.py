"""Multimodal models and bidirectional attention under ``ctx_plugin.hf.enable`` (one CP rank in this process; the
references are transformers' own sdpa attention, float64, logits and every gradient):

- a multimodal model (Gemma-3 with its vision tower) switches its text model only: text alone gives HF's result,
  the vision tower keeps its attention (its options are not ctx_plugin's to refuse), and inputs of another modality
  (``pixel_values``, ``token_type_ids``) are refused, also through ``model.forward`` (they were silently wrong: the
  tower ran ctx_plugin's attention over one rank's images, and image tokens lost their bidirectional blocks);
- Gemma-3's ``use_bidirectional_attention``: full layers bidirectional, sliding layers ``|i - j| < w``, as HF's mask;
- the kinds whose mask ctx_plugin cannot see (Gemma/Gemma-2 and PaliGemma: modules bidirectional next to a causal
  mask; Gemma-4's ``"all"``) are refused at enable.
"""
from __future__ import annotations

import copy

import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

import torch  # noqa: E402

import ctx_plugin.hf as cphf  # noqa: E402
from tests.unit.test_hf_refusals import _one_rank, _quiet  # noqa: E402,F401  (_quiet: autouse fixture)

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=4, pad_token_id=0,
            layer_types=["sliding_attention", "full_attention"] * 2, initializer_range=0.2)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
              patch_size=4)


def _tokens(n=16):
    return torch.randint(1, 59, (2, n), generator=torch.Generator().manual_seed(5)), torch.arange(n).expand(2, n)


def _against_sdpa(ref, **inputs):
    """(ctx_plugin's, HF sdpa's) logits and gradients of a copy of ``ref`` (float64) on ``inputs``."""
    ref = ref.double()
    ref.set_attn_implementation("sdpa")
    model = copy.deepcopy(ref)
    cphf.enable(model, *_one_rank())
    out = []
    for m in (model, ref):
        logits = m(**inputs, use_cache=False).logits
        logits.pow(2).mean().backward()
        out.append((logits.detach(), [p.grad for p in m.parameters() if p.grad is not None]))
    return out, model


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
    assert len(got[1]) == len(want[1]) > 0
    for g, w in zip(*(got[1], want[1])):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def _gemma3_vlm(**vision):
    config = transformers.Gemma3Config(text_config=TEXT, vision_config={**VISION, **vision}, mm_tokens_per_image=4,
                                       image_token_id=60, boi_token_index=61, eoi_token_index=62)
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(config)


def test_a_multimodal_model_runs_its_text_model_only():
    ids, pos = _tokens()
    (got, want), model = _against_sdpa(_gemma3_vlm(attention_dropout=0.1), input_ids=ids, position_ids=pos)
    _assert_same(got, want)
    name = model.config.text_config._attn_implementation
    assert name.startswith("ctx_plugin_") and model.config._attn_implementation == name
    assert model.config.vision_config._attn_implementation == "sdpa"
    ids[:, 4:8] = 60                                                  # an image's placeholder tokens
    images = {"pixel_values": torch.randn(2, 3, 16, 16, dtype=torch.float64), "token_type_ids": (ids == 60).long()}
    for call in (model, model.forward, model.model):
        for key, value in images.items():
            with pytest.raises(ValueError, match=r"inputs other than text \(pixel_values, token_type_ids, \.\.\.\) "
                                                 r"for a multimodal model"):
                call(input_ids=ids, position_ids=pos, **{key: value})


def test_gemma3_bidirectional_attention_matches_hf():
    """Gemma-3's use_bidirectional_attention (EmbeddingGemma): its sliding layers see |i - j| < w both ways
    (window (w - 1, w - 1)), its full layers everything; it was refused."""
    config = transformers.Gemma3TextConfig(**TEXT, use_bidirectional_attention=True)
    torch.manual_seed(0)
    ids, pos = _tokens()
    (got, want), _ = _against_sdpa(transformers.Gemma3ForCausalLM(config), input_ids=ids, position_ids=pos)
    _assert_same(got, want)


@pytest.mark.parametrize("build,value", [
    (lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**TEXT, use_bidirectional_attention=True)),
     "True"),
    (lambda: transformers.PaliGemmaForConditionalGeneration(transformers.PaliGemmaConfig(
        text_config={**TEXT, "model_type": "gemma"}, vision_config={**VISION, "model_type": "siglip_vision_model"},
        image_token_index=60)), "True"),
], ids=["gemma", "paligemma"])
def test_bidirectional_kinds_it_cannot_reproduce_are_refused(build, value):
    """Gemma's modules are is_causal=False while its mask stays causal (PaliGemma adds prefix blocks from
    token_type_ids): ctx_plugin, which takes no mask, would attend both ways over the whole sequence."""
    model = build()
    with pytest.raises(ValueError, match=rf"use_bidirectional_attention={value} \(gemma: which tokens see each other "
                                         r"both ways comes from the model's own mask code"):
        cphf.enable(model, *_one_rank())
