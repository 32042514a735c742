"""``+tile_loss`` on Hugging Face causal LMs (ctx_plugin.hf.loss, one process, no DeepSpeed): the final hidden
states through the model's own forward with its lm_head handing its input through, then the tiled loss, give HF's
own logits' cross-entropy and every parameter's gradient (Qwen2 float64 with biases, GQA, init 0.1, tied or own
embeddings; Llama float32); models whose logits are not just ``lm_head(hidden)`` are refused."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ctx_plugin.hf import loss as hf_loss  # noqa: E402
from ctx_plugin.tiled_loss import lm_loss_sum  # noqa: E402

SEQ, BATCH, VOCAB = 24, 2, 157


def _model(kind: str, tied: bool):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ, attention_dropout=0.0, use_cache=False,
                  tie_word_embeddings=tied, initializer_range=0.1)
    if kind == "qwen2":
        config, cls, dtype = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM, torch.float64
    else:
        config, cls, dtype = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM, torch.float32
    torch.manual_seed(11)
    model = cls._from_config(config, attn_implementation="sdpa").to(dtype).train()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=dtype))
    return model


def _data():
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[:, -4:] = -100
    return ids, labels, torch.arange(SEQ).expand(BATCH, SEQ)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind,tied,tol", [("qwen2", False, 1e-12), ("qwen2", True, 1e-12), ("llama", True, 1e-6)])
def test_tiled_loss_matches_hf_logits(kind, tied, tol):
    model = _model(kind, tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids, labels, pos = _data()
    logits = model(input_ids=ids, position_ids=pos).logits                  # HF's own forward and logits
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    want.backward()
    want_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    calls = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: calls.append(tuple(a[0].shape)))
    hidden, head = hf_loss.hidden_states(model, model, input_ids=ids, position_ids=pos)
    assert head is model.lm_head and hidden.shape == (BATCH, SEQ, 32)
    got = lm_loss_sum(hidden, labels, head, tokens=10)
    got.backward()
    hook.remove()
    assert calls[0] == (BATCH, SEQ, 32)         # the pass-through call in the model's forward
    n = BATCH * SEQ
    chunks = [(min(10, n - s), 32) for s in range(0, n, 10)]
    assert calls[1:1 + len(chunks)] == chunks and sorted(calls[1 + len(chunks):]) == sorted(chunks)
    assert abs(got.item() - want.item()) <= tol * abs(want.item())
    got_grads = _grads(model)
    assert set(got_grads) == set(want_grads)
    for name, w in want_grads.items():
        err = ((got_grads[name] - w).abs().max() / w.abs().max()).item()
        assert err <= tol * 10, (name, err)
    assert model(input_ids=ids, position_ids=pos).logits.shape == (BATCH, SEQ, VOCAB)      # the head is restored
    assert "forward" not in vars(model.lm_head)


def test_refused_models():
    import transformers

    model = _model("qwen2", False)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        hf_loss.check_model(model)

    class Custom(transformers.LlamaForCausalLM):
        pass

    with pytest.raises(ValueError, match="not Custom"):
        hf_loss.check_model(Custom(_model("llama", False).config))
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8))
    with pytest.raises(ValueError, match="not Gemma2ForCausalLM"):
        hf_loss.check_model(gemma)
    model = _model("llama", False)
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(32, VOCAB))
    with pytest.raises(ValueError, match="lm_head is Sequential"):
        hf_loss.check_model(model)
