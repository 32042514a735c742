"""Hugging Face models whose result under context parallelism would depend on what one rank sees are refused with a
ValueError naming the setting (one CP rank in this process; the references are transformers' own code):

- length-dependent RoPE (``dynamic``, ``longrope``; also per layer type and as the legacy ``rope_scaling``) and
  Llama-4's ``attn_temperature_tuning`` with NoPE layers, at enable — HF's own rotary embedding on a shard differs
  from the one on the whole sequence for exactly those types;
- a sliding-window layer whose model does not pass ``sliding_window=`` (PhiMoE), at its forward, while the models
  that pass it (or have no window) give HF's sdpa logits in float64;
- the input check also on the inner model (``model.model(...)``, ``model.forward(...)``), once per forward;
- a cache passed as ``cache=`` (transformers 5.24's name) or ``past_key_values=``, and a nonzero ``logits_to_keep``.
"""
from __future__ import annotations

import copy
import functools
import inspect
import warnings
from types import SimpleNamespace

import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

import torch  # noqa: E402

import ctx_plugin  # noqa: E402
import ctx_plugin.hf as cphf  # noqa: E402
import ctx_plugin.hf.inputs as hf_inputs  # noqa: E402
from ctx_plugin.hf.checks import config_problems  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _one_rank():
    cfg = ctx_plugin.CPConfig(backend="ring", kernel="torch")
    return cfg, ctx_plugin.build_cp_groups(cfg)


def _dynamic(**extra):
    return {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4, **extra}


def _longrope():
    return {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
            "original_max_position_embeddings": 16}


ROPE_REFUSED = {
    "phi3_longrope": (lambda: transformers.Phi3Config(**COMMON, original_max_position_embeddings=16, pad_token_id=0,
                                                      rope_parameters=_longrope()), "'longrope'"),
    "llama_dynamic": (lambda: transformers.LlamaConfig(**COMMON, rope_parameters=_dynamic()), "'dynamic'"),
    "llama_legacy_rope_scaling": (lambda: transformers.LlamaConfig(**COMMON, rope_scaling={
        "type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "'dynamic'"),
    "gemma3_per_layer_type": (lambda: transformers.Gemma3TextConfig(**COMMON, rope_parameters={
        "full_attention": _dynamic(), "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        "rope_parameters['full_attention']['rope_type']='dynamic'"),
}


@pytest.mark.parametrize("case", list(ROPE_REFUSED))
def test_length_dependent_rope_is_refused_at_enable(case):
    make_config, text = ROPE_REFUSED[case]
    model = transformers.AutoModelForCausalLM.from_config(make_config(), attn_implementation="eager")
    with pytest.raises(ValueError, match="does not implement these options") as e:
        cphf.enable(model, *_one_rank())
    assert text in str(e.value) and "rope_type does not depend on the length" in str(e.value)
    assert model.config._attn_implementation == "eager"                 # nothing changed


def test_legacy_rope_scaling_attribute_is_read():
    """A config (remote code) carrying only the legacy ``rope_scaling`` attribute."""
    assert [o for o, _ in config_problems(SimpleNamespace(rope_scaling={"type": "longrope"}))] == ["rope_type"]
    assert config_problems(SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0})) == []


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 1e4},
                                  {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                  {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                                   "original_max_position_embeddings": 32}], ids=["default", "linear", "yarn"])
def test_length_independent_rope_is_accepted(rope):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, rope_parameters=rope))
    assert cphf.enable(model, *_one_rank()) == model.config._attn_implementation


@pytest.mark.parametrize("rope,differs", [(_longrope(), True), (_dynamic(), True),
                                          ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, False)],
                         ids=["longrope", "dynamic", "linear"])
def test_hf_rotary_on_a_shard_differs_exactly_for_the_refused_types(rope, differs):
    """Why: transformers' own rotary embedding of rank 0's shard (positions 0..15 of 32, a fresh module as on that
    rank) against the whole sequence's, for the same positions."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 16}, rope_parameters=rope)
    x, pos = torch.zeros(1, 32, 8, dtype=torch.float64), torch.arange(32)[None]
    full = LlamaRotaryEmbedding(config)(x, pos)[0]
    shard = LlamaRotaryEmbedding(config)(x[:, :16], pos[:, :16])[0]
    assert ((shard - full[:, :16]).abs().max().item() > 1e-3) is differs
    assert bool(config_problems(config)) is differs


def _llama4(**extra):
    return transformers.Llama4TextConfig(**{**COMMON, "num_hidden_layers": 4}, intermediate_size_mlp=64,
                                         num_local_experts=2, attention_chunk_size=None, floor_scale=2,
                                         attn_scale=0.5, **extra)


def test_llama4_temperature_tuning_with_nope_layers_is_refused_at_enable():
    config = _llama4()
    assert config.attn_temperature_tuning and 0 in config.no_rope_layers     # transformers' defaults
    model = transformers.Llama4ForCausalLM(config)
    with pytest.raises(ValueError, match="set attn_temperature_tuning=False"):
        cphf.enable(model, *_one_rank())
    for ok in (_llama4(attn_temperature_tuning=False), _llama4(no_rope_layers=[1, 1, 1, 1])):
        model = transformers.Llama4ForCausalLM(ok)
        assert cphf.enable(model, *_one_rank()) == model.config._attn_implementation


def test_a_model_split_by_transformers_tensor_parallelism_is_refused_at_enable(monkeypatch):
    """A model loaded with tp_plan (its tp_size set by transformers) is refused before anything changes."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    monkeypatch.setattr(model, "_tp_size", 2)
    assert model.tp_size == 2
    with pytest.raises(ValueError, match=r"LlamaForCausalLM is split by transformers' tensor parallelism \(tp_size=2\)"
                                         r".*load the model without tp_plan"):
        cphf.enable(model, *_one_rank())
    assert model.config._attn_implementation != "ctx_plugin"
    monkeypatch.setattr(model, "_tp_size", None)
    assert cphf.enable(model, *_one_rank()) == model.config._attn_implementation


# ---- sliding windows the model does not pass -----------------------------------------------------------------

def _phimoe(window):
    return transformers.PhimoeConfig(**{k: v for k, v in COMMON.items() if k != "head_dim"}, num_local_experts=2,
                                     num_experts_per_tok=1, sliding_window=window)


WINDOWED = {
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "mistral_window": lambda: transformers.MistralConfig(**COMMON, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=False),
    "qwen2_window": lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5,
                                                     max_window_layers=0),
    "gemma3": lambda: transformers.Gemma3TextConfig(**COMMON, sliding_window=5),
    "phimoe_no_window": lambda: _phimoe(None),
}


def _pair(config):
    """The same weights under HF's sdpa (the reference) and under ctx_plugin, float64."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                                        experts_implementation="eager")   # grouped_mm: no float64
    ref = ref.double().eval()
    model = copy.deepcopy(ref)
    cphf.enable(model, *_one_rank())
    return ref, model


def _tokens(n=16):
    return torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(5)), torch.arange(n).expand(2, n)


def test_a_window_the_model_does_not_pass_is_refused():
    """PhiMoE masks with config.sliding_window but passes no sliding_window= (and its module has no attribute):
    HF's sdpa and ctx_plugin's attention would differ, so its forward is an error naming the setting."""
    ref, model = _pair(_phimoe(4))
    ids, pos = _tokens()
    whole = copy.deepcopy(ref)
    whole.config.sliding_window = None                                   # the premise: the window matters here
    want, without = (m(input_ids=ids, position_ids=pos).logits for m in (ref, whole))
    assert (want - without).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"sliding-window layer \(config.sliding_window=4 and no layer_types"):
        model(input_ids=ids, position_ids=pos)


def test_a_window_declared_by_layer_types_is_refused_without_the_keyword():
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, use_sliding_window=False)).double()
    name = cphf.enable(model, *_one_rank())
    fn = transformers.AttentionInterface()[name]
    module = model.model.layers[1].self_attn
    module.config.layer_types = ["full_attention", "sliding_attention"]
    module.config.sliding_window = 4
    q = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    k = v = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"config.layer_types\[1\] is 'sliding_attention'"):
        fn(module, q, k, v, None)
    fn(model.model.layers[0].self_attn, q, k, v, None)                   # a full layer needs no keyword
    fn(module, q, k, v, None, sliding_window=4)                          # passed: applied


@pytest.mark.parametrize("kind", list(WINDOWED))
def test_models_that_pass_their_window_match_hf_sdpa(kind):
    ref, model = _pair(WINDOWED[kind]())
    ids, pos = _tokens()
    want = ref(input_ids=ids, position_ids=pos).logits
    have = model(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(have, want, rtol=1e-10, atol=1e-10)


# ---- the input check: inner model, caches, logits_to_keep ------------------------------------------------------

def _llama():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    cphf.enable(model, *_one_rank())
    return model


def test_the_inner_model_is_checked_once_per_forward(monkeypatch):
    model = _llama()
    ids, pos = _tokens(8)
    pad = torch.ones_like(ids)
    pad[0, -3:] = 0
    calls = []
    original = hf_inputs.InputCheck._flags
    monkeypatch.setattr(hf_inputs.InputCheck, "_flags", lambda self, m, *a: calls.append(type(m).__name__) or
                        original(self, m, *a))
    for call in (model.model, model.get_decoder(), model.forward):       # PEFT's tuner calls model.forward
        with pytest.raises(ValueError, match="cannot apply a padding/custom attention_mask"):
            call(input_ids=ids, position_ids=pos, attention_mask=pad)
        with pytest.raises(ValueError, match="position_ids were not given"):
            call(input_ids=ids)
    assert calls == ["LlamaModel"] * 4 + ["LlamaForCausalLM"] * 2       # model.forward: the model's own check
    calls.clear()
    model(input_ids=ids, position_ids=pos)
    model.model(input_ids=ids, position_ids=pos)
    model.forward(input_ids=ids, position_ids=pos)
    assert calls == ["LlamaForCausalLM", "LlamaModel", "LlamaForCausalLM"]  # one check per forward, not two
    calls.clear()
    with pytest.raises(RuntimeError):                                    # checked, then fails inside the model
        model(inputs_embeds=torch.randn(1, 8, 31), position_ids=pos)
    with pytest.raises(ValueError, match="cannot apply a padding"):      # a failed forward leaves nothing behind
        model.model(input_ids=ids, position_ids=pos, attention_mask=pad)
    assert calls == ["LlamaForCausalLM", "LlamaModel"]


@pytest.mark.parametrize("token", [64, -1])
def test_token_ids_outside_the_vocabulary_are_refused_before_the_embedding(token):
    model = _llama()
    ids, pos = _tokens(8)
    ids[0, 5] = token
    for call in (model, model.model):
        with pytest.raises(ValueError, match=r"input_ids outside the model's vocabulary .* \(CP ranks \[0\]\)"):
            call(input_ids=ids, position_ids=pos)
    ids[0, 5] = 63
    assert model(input_ids=ids, position_ids=pos).logits.shape == (*ids.shape, 64)


def test_enable_again_keeps_one_check_per_module():
    model = _llama()
    cphf.enable(model, *_one_rank())
    assert len(model._forward_pre_hooks) == len(model.model._forward_pre_hooks) == 1
    assert len(model._forward_hooks) == len(model.model._forward_hooks) == 1


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_a_cache_object_is_refused_under_either_name(keyword):
    from transformers import DynamicCache

    model = _llama()
    ids, pos = _tokens(8)
    cache = DynamicCache(config=model.config)
    for call in (model, model.model):
        with pytest.raises(ValueError, match="a KV cache built from context-parallel shards"):
            call(input_ids=ids, position_ids=pos, use_cache=False, **{keyword: cache})
    assert cache.get_seq_length() == 0                                   # nothing was written into it


@pytest.mark.parametrize("keep", [1, torch.tensor([3, 7])], ids=["last", "indices"])
def test_a_nonzero_logits_to_keep_is_refused(keep):
    model = _llama()
    ids, pos = _tokens(8)
    for call in (model, model.forward):         # PEFT's tuner calls model.forward, which runs no hooks of the model
        with pytest.raises(ValueError, match="logits_to_keep=0"):
            call(input_ids=ids, position_ids=pos, logits_to_keep=keep)
        assert call(input_ids=ids, position_ids=pos, logits_to_keep=0).logits.shape[1] == 8


def test_model_forward_keeps_its_signature_and_a_wrapper_put_on_it():
    """The instance forward that checks direct calls keeps the signature transformers' Trainer and PEFT read; a
    wrapper put on model.forward after enable (Accelerate's autocast) and an enable again keep one check per call."""
    model = _llama()
    assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    outer = model.forward
    seen = []
    model.forward = functools.wraps(outer)(lambda *a, **kw: seen.append(1) or outer(*a, **kw))   # as Accelerate's
    cphf.enable(model, *_one_rank())
    ids, pos = _tokens(8)
    for call in (model, model.forward):
        with pytest.raises(ValueError, match="logits_to_keep=0"):
            call(input_ids=ids, position_ids=pos, logits_to_keep=2)
        assert call(input_ids=ids, position_ids=pos).logits.shape[1] == 8
    assert seen == [1] * 3               # the refused call through model(...) never reached forward


def test_position_ids_off_by_one_are_refused():
    """Positions one step off the rank's share (all of them, or from some token on) are refused, not tolerated."""
    model = _llama()
    ids, pos = _tokens(8)
    shifted = pos.clone()
    shifted[:, 4:] += 1
    for wrong in (pos + 1, shifted):
        with pytest.raises(ValueError, match="position_ids are not this rank's share"):
            model(input_ids=ids, position_ids=wrong)


def test_a_whole_sequence_where_a_shard_belongs_is_named():
    """At CP 1 a whole sequence is the shard: positions 0..n-1 run. Shifted ones are not a whole sequence's."""
    model = _llama()
    ids, pos = _tokens(8)
    assert model(input_ids=ids, position_ids=pos).logits.shape == (2, 8, 64)
    with pytest.raises(ValueError, match="position_ids are not this rank's share") as e:
        model(input_ids=ids, position_ids=pos + 2)
    assert "whole sequence" not in str(e.value)


def test_restarting_position_ids_without_documents_name_the_documents():
    """position_ids restarting at 0 (DataCollatorWithFlattening's packing) without cu_seq_lens_q/k or
    ctx_plugin_documents: the attention would cross the documents; the error says how to pass them (and not that
    the positions are off). With the documents given, the same positions run."""
    model = _llama()
    ids, _ = _tokens(8)
    packed = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]).expand(2, 8)
    with pytest.raises(ValueError, match=r"position_ids restart at 0 inside the sequence .* cu_seq_lens_q") as e:
        model(input_ids=ids, position_ids=packed)
    assert "not this rank's share" not in str(e.value)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert model(input_ids=ids, position_ids=packed, cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits.shape == (2, 8, 64)


def test_generate_is_refused_before_any_forward():
    """generate() would run the model on a growing sequence with a KV cache: refused at the call, with its own
    message (not the cache's or logits_to_keep's, which the forwards it makes would otherwise raise)."""
    model = _llama()
    ids, _ = _tokens(8)
    forwards = []
    model.register_forward_pre_hook(lambda *a: forwards.append(1))
    for kwargs in ({}, {"use_cache": False}):
        with pytest.raises(ValueError, match=r"LlamaForCausalLM\.generate\(\) is not supported under context "
                                             r"parallelism"):
            model.generate(ids, max_new_tokens=2, **kwargs)
    assert forwards == []


def test_labels_through_a_call_that_skips_the_check_are_refused_at_the_loss():
    """model.forward(..., labels=) (PEFT's tuner) skips the model's hooks: the instance forward checks it; the class's
    forward called on the model skips both, and the loss transformers would then compute shifts labels inside the
    shard: the model's loss function refuses."""
    model = _llama()
    ids, pos = _tokens(8)
    with pytest.raises(ValueError, match="labels= makes transformers shift labels inside this rank's shard"):
        model(input_ids=ids, position_ids=pos, labels=ids)                  # the input check
    with pytest.raises(ValueError, match="labels= makes transformers shift labels inside this rank's shard"):
        model.forward(input_ids=ids, position_ids=pos, labels=ids)          # PEFT's call: the instance forward
    forward = type(model).forward
    with pytest.raises(ValueError, match="reached the model's loss function through a call that skipped its input "
                                         "check"):
        forward(model, input_ids=ids, position_ids=pos, labels=ids)
    assert forward(model, input_ids=ids, position_ids=pos).loss is None    # without labels: no loss, no error


# ---- packed documents reach every attention call; hidden states under multi-layer regions ----------------------

@pytest.mark.parametrize("model_type", ["llama", "stablelm", "nemotron"])
def test_packed_documents_reach_layers_that_drop_the_forwards_keywords(model_type):
    """StableLM and Nemotron decoder layers call their attention without the forward's keywords, so the documents
    the input check read (from cu_seq_lens_q/k) must reach the attention another way: the packed logits equal HF's
    own sdpa on each document alone (float64)."""
    config = transformers.AutoConfig.for_model(model_type, **COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().eval()
    model = copy.deepcopy(ref)
    cphf.enable(model, *_one_rank())
    cu = [0, 5, 8, 16]
    ids = torch.randint(3, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]
    bounds = torch.tensor(cu, dtype=torch.int32)
    with torch.no_grad():
        alone = torch.cat([ref(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(cu, cu[1:])], 1)
        got = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=8,
                    max_length_k=8).logits
        # the next forward, without documents, attends over the whole sequence (not the last forward's documents)
        whole = model(input_ids=ids, position_ids=torch.arange(16)[None]).logits
        want = ref(input_ids=ids, position_ids=torch.arange(16)[None], use_cache=False).logits
    assert (got - alone).abs().max() < 1e-12
    assert (whole - want).abs().max() < 1e-12


@pytest.mark.parametrize("mode", ["full", "core_attn", "hf_checkpointing", "full+recompute_attn"])
def test_packed_documents_of_layers_that_drop_keywords_under_recomputation(mode):
    """StableLM's layers do not pass the documents on, so an attention run again in backward (HF's gradient
    checkpointing, +recompute_attn) would attend across documents: refused; presets that keep the attention (full,
    core_attn) give HF's own sdpa gradients on each document alone (float64)."""
    from ctx_plugin import recompute

    config = transformers.AutoConfig.for_model("stablelm", **COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().train()
    model = copy.deepcopy(ref)
    if mode == "hf_checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cphf.enable(model, *_one_rank())
    if mode != "hf_checkpointing":
        recompute.apply(model.model.layers, mode)
    cu = [0, 5, 8, 16]
    ids = torch.randint(3, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]
    bounds = torch.tensor(cu, dtype=torch.int32)
    alone = torch.cat([ref(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(cu, cu[1:])], 1)
    weights = torch.randn(alone.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (alone * weights).sum().backward()
    got = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=8,
                max_length_k=8).logits
    if mode in ("hf_checkpointing", "full+recompute_attn"):
        with pytest.raises(ValueError, match="runs its attention again outside the model's forward .* its layer does "
                                             "not pass the packed documents on"):
            (got * weights).sum().backward()
        return
    (got * weights).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("model_type,first", [("stablelm", "packed"), ("llama", "packed"), ("llama", "unpacked")])
def test_two_forwards_then_one_backward_recompute_the_right_documents(model_type, first):
    """A packed and an unpacked micro batch forward before one backward (pipeline schedules) under
    full+recompute_attn: a layer that drops the documents (StableLM) cannot tell whose it recomputes, whichever
    forward came last: refused; Llama passes them on, so both recompute their own and the gradients are HF's sdpa's
    on each document alone and on the unpacked sequence (float64)."""
    from ctx_plugin import recompute

    extra = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2} if model_type == "stablelm" else {}
    config = transformers.AutoConfig.for_model(model_type, **COMMON, **extra)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().train()
    model = copy.deepcopy(ref)
    cphf.enable(model, *_one_rank())
    recompute.apply(model.model.layers, "full+recompute_attn")
    cu = [0, 5, 8, 16]
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]
    bounds = torch.tensor(cu, dtype=torch.int32)
    weights = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    packed = dict(input_ids=ids[:1], position_ids=pos, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=8,
                  max_length_k=8)
    whole = dict(input_ids=ids[1:], position_ids=torch.arange(16)[None])
    order = [(packed, weights[:1]), (whole, weights[1:])]
    loss = sum((model(**call).logits * w).sum() for call, w in (order if first == "packed" else order[::-1]))
    if model_type == "stablelm":
        with pytest.raises(ValueError, match="its layer does not pass the packed documents on"):
            loss.backward()
        return
    loss.backward()
    alone = torch.cat([ref(input_ids=ids[:1, a:b], use_cache=False).logits for a, b in zip(cu, cu[1:])], 1)
    ((alone * weights[:1]).sum() + (ref(input_ids=ids[1:], use_cache=False).logits * weights[1:]).sum()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


def test_autocast_casts_the_attention_inputs_as_for_sdpa():
    """Under bf16 autocast with fp32 weights (HF Trainer's bf16=True) Llama's q and k leave RoPE in fp32 next to a
    bf16 v; the attention takes them in autocast's dtype, as sdpa does: logits as HF's sdpa's under the same
    autocast, to bf16 rounding."""
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, attn_implementation="sdpa"))
    model = copy.deepcopy(ref)
    cphf.enable(model, *_one_rank())
    ids, pos = _tokens(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
        got = model(input_ids=ids, position_ids=pos).logits.float()
    assert (got - want).abs().max() / want.abs().max() < 2e-2


def _stack_llama(preset):
    from ctx_plugin import recompute

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 4}))
    model.double()
    cphf.enable(model, *_one_rank())
    if preset is not None:
        recompute.apply(model.model.layers, preset)
    return model


def test_hidden_states_are_exact_under_every_region_shape():
    """Each layer of a recompute region returns its own output, also inside a multi-layer region (one checkpoint
    spanning its layers' calls), so transformers records every layer's hidden state exactly (keyword or config)."""
    ids, pos = _tokens(8)
    torch.manual_seed(0)
    want = _stack_llama(None)
    state = want.state_dict()
    ref = want(input_ids=ids, position_ids=pos, output_hidden_states=True).hidden_states
    for preset in ("full", "full:uniform:2", "sqrt", "full:uniform:4+offload:1"):
        model = _stack_llama(preset)
        model.load_state_dict(state)
        got = model(input_ids=ids, position_ids=pos, output_hidden_states=True).hidden_states
        assert len(got) == len(ref) == 5 and all(torch.equal(g, r) for g, r in zip(got, ref)), preset
        model.config.output_hidden_states = True
        got = model(input_ids=ids, position_ids=pos).hidden_states
        assert all(torch.equal(g, r) for g, r in zip(got, ref)), preset


@pytest.mark.parametrize("preset", ["full", "full:uniform:2", "sqrt", "full:uniform:4+offload_attn:1"])
def test_regions_run_each_layer_with_its_own_arguments(preset):
    """Gemma-3 gives its sliding-window and full-attention layers different position_embeddings: a multi-layer
    region runs (and in backward replays) each layer with its own, and matches the model without a preset
    (float64, loss and gradients bit for bit)."""
    from ctx_plugin import recompute

    config = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4}, sliding_window=6,
                                           layer_types=["sliding_attention", "full_attention"] * 2,
                                           rope_local_base_freq=100.0, attention_dropout=0.0, use_cache=False)
    ids, pos = _tokens(16)

    def run(preset):
        torch.manual_seed(0)
        model = transformers.Gemma3ForCausalLM(copy.deepcopy(config)).double()
        cphf.enable(model, *_one_rank())
        if preset is not None:
            recompute.apply(model.model.layers, preset)
        loss = model(input_ids=ids, position_ids=pos).logits.pow(2).mean()
        loss.backward()
        return loss, [p.grad for p in model.parameters()]

    want_loss, want_grads = run(None)
    loss, grads = run(preset)
    assert loss == want_loss and all(torch.equal(g, w) for g, w in zip(grads, want_grads))


def test_a_model_whose_attention_never_reaches_ctx_plugin_is_refused_at_its_forward():
    """GIT's text layers hard-code an eager attention (transformers' check that the model supports attention
    implementations passes on its vision tower's), so under context parallelism each rank would attend within its
    shard alone: a checked forward that made no call into ctx_plugin's attention is an error."""
    config = transformers.GitConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64,
                                    vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                                   "num_attention_heads": 4, "image_size": 16, "patch_size": 8})
    model = transformers.GitForCausalLM(config)
    cphf.enable(model, *_one_rank())
    ids, pos = _tokens(8)
    with pytest.raises(ValueError, match="GitForCausalLM's forward ran none of its attention through ctx_plugin's "
                                         "attention function"):
        model(input_ids=ids, position_ids=pos)
    llama = _llama()
    assert llama(input_ids=ids, position_ids=pos).logits.shape == (2, 8, 64)       # a model that calls it: fine


@pytest.mark.parametrize("model_type", ["bert", "electra"])
def test_bert_style_decoders_pass_no_encoder_states_and_match_hf_sdpa(model_type):
    """BERT-style causal LMs (is_decoder=True) hand encoder_hidden_states=None to the attention interface: not
    cross-attention, accepted; the logits are HF's sdpa's (float64, one rank)."""
    config = transformers.AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                               is_decoder=True, attention_probs_dropout_prob=0.0,
                                               hidden_dropout_prob=0.0, pad_token_id=0)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().eval()
    model = copy.deepcopy(ref)
    cphf.enable(model, *_one_rank())
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        want = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
        got = model(input_ids=ids, position_ids=pos).logits
    assert (got - want).abs().max() < 1e-12


def test_prefix_lm_token_type_ids_are_refused():
    """HRM-Text's prefix_lm builds a bidirectional prefix from token_type_ids in its mask, which ctx_plugin's
    attention does not take: an error, not a causal prefix; without them the model matches sdpa."""
    config = transformers.HrmTextConfig(**{**COMMON, "num_hidden_layers": 1}, H_cycles=1, L_cycles=1, L_bp_cycles=[1])
    ref, model = _pair(config)
    ids, pos = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, position_ids=pos).logits,
                                   ref(input_ids=ids, position_ids=pos, use_cache=False).logits, rtol=1e-12, atol=1e-12)
        prefix = torch.zeros_like(ids)
        prefix[:, :6] = 1
        with pytest.raises(ValueError, match="token_type_ids with config.prefix_lm=True"):
            model(input_ids=ids, position_ids=pos, token_type_ids=prefix)
    model.config.prefix_lm = False       # transformers then ignores them
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, token_type_ids=prefix)


def test_cross_attention_decoders_are_refused():
    """A BERT-style decoder passes the encoder's states to the attention as keys (not as a keyword ctx_plugin could
    see), and transformers drops the encoder's padding mask for a registered attention: refused at enable."""
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, is_decoder=True, add_cross_attention=True)
    model = transformers.BertLMHeadModel(config)
    with pytest.raises(ValueError, match="add_cross_attention=True"):
        cphf.enable(model, *_one_rank())
    assert hf_inputs.InputCheck.PROBLEMS["encoder"].startswith("encoder_hidden_states / encoder_attention_mask")


def test_gemma3_bidirectional_ignores_is_causal_as_its_mask_does():
    """Gemma-3 with use_bidirectional_attention: its own mask (full, and |i - j| < w on sliding layers) decides,
    whatever is_causal the caller passes; ctx_plugin matches sdpa with and without it."""
    config = transformers.Gemma3TextConfig(**COMMON, sliding_window=6, layer_types=["sliding_attention",
                                                                                    "full_attention"],
                                           use_bidirectional_attention=True)
    ref, model = _pair(config)
    ids, pos = _tokens()
    for given in ({}, {"is_causal": True}, {"is_causal": False}):
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids, position_ids=pos, **given).logits,
                                       ref(input_ids=ids, position_ids=pos, use_cache=False, **given).logits,
                                       rtol=1e-12, atol=1e-12, msg=str(given))


def test_per_layer_head_counts_are_checked_layer_by_layer():
    """A heterogeneous config (transformers' per_layer_config: Gemma-4 with attention_k_eq_v, dots3) refuses a global
    read of num_key_value_heads: each layer's heads are checked (transformers' AmbiguousGlobalPerLayerAttributeError
    before). The config alone: Llama's modules do not build from one."""
    from ctx_plugin.hf.model import _check_heads

    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 48, "num_attention_heads": 12,
                                         "num_key_value_heads": 12}, per_layer_config={1: {"num_key_value_heads": 4}})
    model = SimpleNamespace(config=config)
    _check_heads(model, ctx_plugin.CPConfig(backend="ulysses", kernel="torch"), 4)     # 12/12 and 12/4 split over 4
    with pytest.raises(ValueError, match=r"4 K/V heads|num_key_value_heads"):    # layer 1's 4 K/V heads over 6
        _check_heads(model, ctx_plugin.CPConfig(backend="ulysses", kernel="torch"), 6)
