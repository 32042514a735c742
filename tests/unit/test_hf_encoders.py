"""Encoders and encoder-decoders under ctx_plugin.hf: a bidirectional model is run bidirectionally (its modules'
``is_causal``) or refused, never run causally by default; positions numbered from ``padding_idx + 1`` (RoBERTa-style
learned positions), which the input check's 0-based positions would misplace, and encoder-decoders are refused at
enable. References: HF's own eager / sdpa attention, float64, one rank."""
from __future__ import annotations

import copy

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import ctx_plugin.hf as cphf  # noqa: E402
from tests.unit.test_hf_refusals import _one_rank, _quiet  # noqa: E402,F401  (_quiet: autouse fixture)

ENCODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0,
               initializer_range=0.2)


def _inputs(n=12):
    ids = torch.randint(3, 64, (2, n), generator=torch.Generator().manual_seed(3))
    return ids, torch.arange(n).expand(2, n)


def _pair(model_cls, config, implementation):
    torch.manual_seed(0)
    ref = model_cls._from_config(config, attn_implementation=implementation).double().eval()
    model = copy.deepcopy(ref)
    return ref, model


@pytest.mark.parametrize("name", ["Splinter", "AlignText"])
def test_an_encoder_that_does_not_say_it_is_bidirectional_is_refused(name):
    """Splinter's and ALIGN's text encoders pass no is_causal= and their modules have none: only the mask their
    model builds makes them bidirectional (eager, the reference, differs from the same model masked causally), and
    ctx_plugin's attention takes no mask, so the forward is refused rather than run causally."""
    config = getattr(transformers, f"{name}Config")(**ENCODER)
    ref, model = _pair(getattr(transformers, f"{name}Model"), config, "eager")
    ids, pos = _inputs()
    with torch.no_grad():
        want = ref(input_ids=ids, position_ids=pos).last_hidden_state
        causal = torch.full((12, 12), float("-inf"), dtype=torch.float64).triu(1).expand(2, 1, 12, 12)
        masked = ref.encoder(ref.embeddings(input_ids=ids, position_ids=pos), attention_mask=causal)
        assert (want - masked.last_hidden_state).abs().max() > 1e-2      # the premise: bidirectional
    cphf.enable(model, *_one_rank())
    with pytest.raises(ValueError, match=r"passes no is_causal= to the attention interface and has no is_causal "
                                         r"attribute.*ctx_plugin does not guess"):
        model(input_ids=ids, position_ids=pos)


def test_an_encoder_whose_modules_say_so_matches_hf_sdpa():
    """BERT as an encoder (is_decoder=False: its modules' is_causal is False) runs bidirectionally, as sdpa does."""
    ref, model = _pair(transformers.BertModel, transformers.BertConfig(**ENCODER), "sdpa")
    cphf.enable(model, *_one_rank())
    ids, pos = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, position_ids=pos).last_hidden_state,
                                   ref(input_ids=ids, position_ids=pos).last_hidden_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,extra", [("Roberta", {}), ("XLMRoberta", {}), ("Esm", {"pad_token_id": 1})])
def test_positions_numbered_from_the_padding_index_are_refused_at_enable(name, extra):
    """RoBERTa-style embeddings number their own positions from padding_idx + 1; the 0-based position_ids ctx_plugin
    checks select other embedding rows than the model's (the premise, against the model's own positions)."""
    config = getattr(transformers, f"{name}Config")(**ENCODER, **extra)
    ref, model = _pair(getattr(transformers, f"{name}Model"), config, "eager")
    ids, pos = _inputs()
    with torch.no_grad():
        own, zero_based = (ref(input_ids=ids, position_ids=p).last_hidden_state for p in (None, pos))
        assert (own - zero_based).abs().max() > 1e-2
    first = config.pad_token_id + 1
    with pytest.raises(ValueError, match=rf"learned position embeddings numbered from padding_idx \+ 1 = {first} "
                                         rf"\(RoBERTa-style"):
        cphf.enable(model, *_one_rank())


def test_rotary_positions_of_the_same_embeddings_are_accepted():
    """ESM with rotary positions has the same embeddings class but no learned positions: accepted, and it matches
    HF's eager attention (RoPE is relative, so its origin does not matter)."""
    config = transformers.EsmConfig(**ENCODER, pad_token_id=1, position_embedding_type="rotary")
    ref, model = _pair(transformers.EsmModel, config, "eager")
    cphf.enable(model, *_one_rank())
    ids, pos = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, position_ids=pos).last_hidden_state,
                                   ref(input_ids=ids, position_ids=pos).last_hidden_state, rtol=1e-9, atol=1e-9)


def test_encoder_decoders_are_refused_at_enable():
    """T5Gemma takes position_ids (so the check of its forward's signature passes it) but its decoder attends to the
    encoder's states: refused as an encoder-decoder, not later for its sub-configs as other modalities."""
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    config = transformers.T5GemmaConfig(encoder=small, decoder=small, vocab_size=64)   # a small decoder too (38 s)
    model = transformers.T5GemmaForConditionalGeneration(config)
    with pytest.raises(ValueError, match="is an encoder-decoder model"):
        cphf.enable(model, *_one_rank())
