"""Hugging Face integration.

Spawned gloo ranks (one launch per world size, hf_ranks.suite): a tiny LlamaForCausalLM (GQA) at CP = 2 and 4 for
every backend (hybrid: ulysses_size 2), a bidirectional Llama and a tiny Qwen2 (q/k/v biases, GQA, init std 0.1,
float64) against HF's own sdpa attention on one rank: loss, logits (gathered) and every parameter gradient; inputs
ctx_plugin cannot honour (right padding held by one rank, also given to the base model directly, caches, a cache
object, missing or packed positions, labels, logits_to_keep) raise the same error on every rank within seconds;
models with other groups in one process keep their own.

The attention variants (sliding windows, also per layer and bidirectional, Gemma-2's softcap, gpt-oss's sinks)
match HF's own attention at CP 2 and 4 with their gradients (the sinks' summed over the ranks, as every parameter's),
also under multi-layer recompute regions whose layers the model calls with different position_embeddings (Gemma-3,
MiMo-V2: REGIONS), and at CP 1 (one rank in this process: test_variant_models_match_hf_at_one_rank).

In this process (one CP rank): options a model's config or attention modules carry that ctx_plugin does not
implement are errors at enable (dropout, non-attention layers, ...); every keyword of transformers' attention
interface is honoured, harmless or refused by name (the README's table); the honoured sliding_window, softcap and
s_aux match transformers' own masks and eager attention functions, gradients included.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

import torch  # noqa: E402

import ctx_plugin  # noqa: E402
import ctx_plugin.hf as cphf  # noqa: E402
from ctx_plugin.names import Backend  # noqa: E402
from tests.distributed.harness import run_spawned  # noqa: E402

SIZES = {Backend.ULYSSES_RING: [(4, 2)], **{b: [(2, 1), (4, 1)] for b in Backend if b != Backend.ULYSSES_RING}}
PARITY = [(w, "llama", b.value, u) for b, sizes in SIZES.items() for w, u in sizes] + \
         [(2, "llama_bidir", "ring", 1), (2, "qwen2", "zigzag", 1), (2, "qwen2", "ulysses", 1),
          (2, "qwen2", "allgather", 1)]
# attention variants (hf_ranks.model): sliding windows under a rank's shard, per-layer sliding/full, softcap, sinks
PARITY += [(2, "mistral_swa", "ring", 1), (2, "mistral_swa", "zigzag", 1), (2, "mistral_bidir", "ring", 1),
           (2, "qwen2_mixed", "striped", 1), (2, "qwen2_mixed", "ulysses", 1), (2, "gemma2", "zigzag", 1),
           (2, "gemma2", "allgather", 1), (2, "gpt_oss", "ring", 1), (2, "gpt_oss", "ulysses", 1),
           (4, "mistral_swa", "ring", 1), (4, "gpt_oss", "ulysses_ring", 2), (4, "qwen2_mixed", "zigzag", 1),
           (4, "gemma2", "ring", 1)]
# values narrower than queries and keys (DeepSeek's latent attention; MiMo-V2-Flash with sinks and windows)
PARITY += [(2, "deepseek_v3", "zigzag", 1), (2, "deepseek_v3", "ulysses", 1), (2, "mimo_v2", "ring", 1),
           (4, "mimo_v2", "ulysses_ring", 2)]
# a multimodal model on text alone: its text model switched, multimodal RoPE from 3-D position_ids
PARITY += [(2, "qwen2_vl", "striped", 1), (4, "qwen2_vl", "zigzag", 1)]
# multi-layer recompute regions over layers the model calls with different arguments (Gemma-3's and MiMo-V2's
# position_embeddings per layer type) or whose hidden states differ in kind (gpt-oss's sliding and full layers)
REGIONS = [(2, "gemma3", "zigzag", 1, "full:uniform:2"), (2, "mimo_v2", "ring", 1, "sqrt"),
           (4, "gemma3", "ulysses_ring", 2, "sqrt+offload:1"), (4, "gpt_oss", "striped", 1, "full:uniform:2"),
           (2, "gemma3", "allgather", 1, "full")]
# RoPE and norms placed otherwise (partial and interleaved rotation, layers without RoPE, q/k norms, fused
# projections), each with a backend and, for some, a recompute preset
REGIONS += [(2, "cohere2", "zigzag", 1, "sqrt"), (2, "smollm3", "ring", 1, None), (2, "olmo2", "striped", 1, None),
            (2, "phi3", "ulysses", 1, "selective"), (2, "exaone4", "allgather", 1, "full:uniform:2"),
            (2, "glm4", "zigzag", 1, None), (2, "stablelm", "ring", 1, "full"), (2, "starcoder2", "zigzag", 1, None),
            (4, "cohere2", "ulysses_ring", 2, None), (4, "smollm3", "zigzag", 1, "sqrt+offload:1")]
# fp32 / float64 against sdpa / float64 against Gemma-2's eager attention, whose softmax runs in fp32 / Gemma-3's
# RMSNorm and Cohere's LayerNorm apply their weights in fp32 (the weights' gradients sum each rank's tokens in fp32:
# ~2e-7 apart; the forward exact)
TOLERANCE = {"llama": 1e-5, "llama_bidir": 1e-5, "qwen2": 1e-10, "mistral_swa": 1e-10, "mistral_bidir": 1e-10,
             "qwen2_mixed": 1e-10, "gemma2": 1e-5, "gpt_oss": 1e-10, "deepseek_v3": 1e-10, "mimo_v2": 1e-10,
             "qwen2_vl": 1e-10, "gemma3": 1e-6, "cohere2": 1e-6,
             "smollm3": 1e-10, "olmo2": 1e-10, "phi3": 1e-10, "exaone4": 1e-10, "glm4": 1e-10, "stablelm": 1e-10,
             "starcoder2": 1e-10}
# packed documents (hf_ranks._packed): kind, backend, ulysses size, document mix (fit: cu_seq_lens; padded)
PACKED = [(2, "qwen2", "zigzag", 1, "fit"), (2, "qwen2", "allgather", 1, "padded"), (2, "qwen2", "ulysses", 1, "fit"),
          (4, "qwen2", "striped", 1, "padded"), (4, "qwen2", "ring", 1, "fit"), (4, "qwen2", "ulysses_ring", 2, "padded"),
          (4, "mistral_swa", "zigzag", 1, "padded")]
REFUSED = {2: ["zigzag", "ring-nocheck"], 4: ["ring"]}     # -nocheck: CPConfig(check_ranks=False), no CPU-side group
_results: dict[int, list] = {}


def suite(world: int) -> list:
    if world not in _results:
        payload = {"parity": [[x for x in c[1:] if x is not None] for c in PARITY + REGIONS if c[0] == world],
                   "refused": REFUSED[world],
                   "packed": [c[1:] for c in PACKED if c[0] == world],
                   "two_models": world == 2}
        _results[world] = run_spawned("tests.integration.hf_ranks:suite", world, payload, timeout_s=600)
    return _results[world]


@pytest.mark.parametrize("world,kind,backend,u,preset", [(*c, None) for c in PARITY] + REGIONS,
                         ids=[f"P{w}-{k}-{b}-u{u}" for w, k, b, u in PARITY]
                         + [f"P{w}-{k}-{b}-u{u}-{p}" for w, k, b, u, p in REGIONS])
def test_matches_hf_attention_on_one_rank(world, kind, backend, u, preset):
    tol = TOLERANCE[kind]
    for rank, res in enumerate(suite(world)):
        r = res["parity"]["-".join(map(str, (kind, backend, u) + ((preset,) if preset else ())))]
        assert r["n_grads"] == r["n_ref_grads"] > 0
        assert r["loss_err"] <= tol, f"rank {rank}: loss error {r['loss_err']:.2e}"
        assert r["logits_err"] <= tol, f"rank {rank}: logits error {r['logits_err']:.2e}"
        assert r["grad_err"] <= tol, f"rank {rank}: {r['worst']} gradient error {r['grad_err']:.2e}"


@pytest.mark.parametrize("world,kind,backend,u,mix", PACKED, ids=["P{}-{}-{}-u{}-{}".format(*c) for c in PACKED])
def test_packed_documents_match_hf_per_document(world, kind, backend, u, mix):
    """A packed batch (documents from its restarting position_ids; transformers' cu_seq_lens_q/k, or padded to the
    layout's unit and passed as ctx_plugin_documents) gives the loss, logits and gradients of HF's own attention run on
    every document on its own."""
    for rank, res in enumerate(suite(world)):
        r = res["packed"][f"{kind}-{backend}-{u}-{mix}"]
        assert r["n_grads"] == r["n_ref_grads"] > 0 and r["targets"] == 2 * (sum(
            {"fit": [8, 16, 4, 12], "padded": [5, 17, 1, 9]}[mix]) - 4)
        assert r["loss_err"] <= 1e-10, f"rank {rank}: loss error {r['loss_err']:.2e}"
        assert r["logits_err"] <= 1e-10, f"rank {rank}: logits error {r['logits_err']:.2e}"
        assert r["grad_err"] <= 1e-10, f"rank {rank}: {r['worst']} gradient error {r['grad_err']:.2e}"


REFUSAL_TEXT = {"padding": "cannot apply a padding/custom attention_mask", "cache": "use_cache=False",
                "no_positions": "position_ids were not given", "packed": "position_ids restart at 0 inside the sequence",
                "labels": "labels= makes transformers shift labels",
                "logits_to_keep": "call the model with logits_to_keep=0",
                "cache_object": "a KV cache built from context-parallel shards",
                "inner_padding": "cannot apply a padding/custom attention_mask"}


@pytest.mark.parametrize("world", [2, 4])
def test_bad_inputs_raise_the_same_error_on_every_rank(world):
    got = suite(world)
    for backend in REFUSED[world]:
        per_rank = [res["refused"][backend] for res in got]
        for case, text in REFUSAL_TEXT.items():
            errors = [r[case]["error"] for r in per_rank]
            assert errors[0] is not None and text in errors[0], f"{backend}/{case}: {errors[0]}"
            assert all(e == errors[0] for e in errors), f"{backend}/{case}: ranks disagree: {errors}"
            assert max(r[case]["seconds"] for r in per_rank) < 10
        assert all(r["cache_off"] for r in per_rank)
        # right padding sits on one rank only: the last for the contiguous ring, rank 0 for zigzag
        holder = world - 1 if backend.startswith("ring") else 0
        assert f"(CP ranks [{holder}])" in per_rank[0]["padding"]["error"]
        assert f"(CP ranks [{holder}])" in per_rank[0]["inner_padding"]["error"]     # model.model(...) directly


def test_models_with_other_groups_keep_their_own():
    got = [res["two_models"] for res in suite(2)]
    for rank, two in enumerate(got):
        for key, errs in two["errors"].items():
            assert errs and max(errs) <= 1e-5, f"rank {rank}: {key} logits error {errs}"
    for two in got:
        assert len(set(two["names"].values())) == 3
        assert two["again"] == two["names"]["ring_all"]


# ---- one process, one CP rank ----------------------------------------------------------------------------------

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
REFUSED_MODELS = {
    "llama_dropout": (lambda: transformers.LlamaConfig(**COMMON, attention_dropout=0.1), "attention_dropout=0.1"),
    "jamba_mamba_layers": (lambda: transformers.JambaConfig(**{k: v for k, v in COMMON.items() if k != "head_dim"},
                                                            num_experts=1, attn_layer_period=2, attn_layer_offset=1,
                                                            use_mamba_kernels=False), "linear_attention"),
}


def _one_rank(backend: str = "zigzag"):
    cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch")
    return cfg, ctx_plugin.build_cp_groups(cfg)


@pytest.mark.parametrize("case", list(REFUSED_MODELS))
def test_options_it_does_not_implement_are_errors_at_enable(case):
    make_config, text = REFUSED_MODELS[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(), attn_implementation="eager")
    with pytest.raises(ValueError, match="does not implement these options") as e:
        cphf.enable(model, *_one_rank())
    assert text in str(e.value)
    assert model.config._attn_implementation == "eager"                 # nothing changed


@pytest.mark.parametrize("heads,kv_heads,text", [(3, 3, r"there are 3 attention heads \(num_attention_heads\); use a "
                                                          "context-parallel size that divides 3"),
                                                 (4, 3, r"needs num_key_value_heads \(3\) to divide 2")])
def test_heads_ulysses_cannot_split_are_errors_at_enable(heads, kv_heads, text):
    from ctx_plugin.bench.simulated import simulated_groups

    cfg = ctx_plugin.CPConfig(backend="ulysses", kernel="torch")
    config = transformers.LlamaConfig(**{**COMMON, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                         "hidden_size": 24 * heads, "head_dim": 24})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with pytest.raises(ValueError, match=text):
        cphf.enable(model, cfg, simulated_groups(cfg, 0, 2, None, "cpu"))
    assert model.config._attn_implementation == "eager"                 # nothing changed


@pytest.mark.parametrize("make_config", [
    lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=False),
    lambda: transformers.Gemma3TextConfig(**COMMON, sliding_window=None, layer_types=["full_attention"] * 2),
    # options ctx_plugin implements: sliding windows (per layer), soft-capping, sinks
    lambda: transformers.MistralConfig(**COMMON, sliding_window=16),
    lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=0),
    lambda: transformers.Gemma2Config(**COMMON), lambda: transformers.Gemma3TextConfig(**COMMON),
    lambda: transformers.GptOssConfig(**COMMON, num_local_experts=2, num_experts_per_tok=1)],
    ids=["mistral", "qwen2", "gemma3_full", "mistral_window", "qwen2_window", "gemma2", "gemma3", "gpt_oss"])
def test_models_with_options_it_implements_are_accepted(make_config):
    model = transformers.AutoModelForCausalLM.from_config(make_config())
    name = cphf.enable(model, *_one_rank())
    assert model.config._attn_implementation == name


def _qkv(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(2, 4, 8, 8, generator=g, dtype=dtype), torch.randn(2, 2, 8, 8, generator=g, dtype=dtype),
            torch.randn(2, 2, 8, 8, generator=g, dtype=dtype))


def _enabled_llama():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).double()
    name = cphf.enable(model, *_one_rank())
    return model, transformers.AttentionInterface()[name]


REFUSED_KWARGS = {"sinks": torch.zeros(2, 4, 8, 1), "position_bias": torch.zeros(1, 4, 8, 8),
                  "seq_idx": torch.zeros(1, 8, dtype=torch.int32), "indices": torch.zeros(1, 8, 2),
                  "block_indices": torch.zeros(1, 8, 2), "block_table": torch.zeros(1, 1),
                  "use_cache": True, "output_attentions": True, "some_new_option": 1}


@pytest.mark.parametrize("kwarg", list(REFUSED_KWARGS))
def test_attention_keywords_that_change_the_math_are_refused_by_name(kwarg):
    model, fn = _enabled_llama()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=kwarg if kwarg == "some_new_option" else re.escape(f"({kwarg}=")):
        fn(model.model.layers[0].self_attn, q, k, v, None, scaling=None, dropout=0.0, **{kwarg: REFUSED_KWARGS[kwarg]})


def test_attention_keywords_honoured_and_harmless():
    model, fn = _enabled_llama()
    module = model.model.layers[0].self_attn
    q, k, v = _qkv()
    harmless = dict(position_ids=torch.arange(8)[None], use_cache=False, output_attentions=False, softcap=None,
                    sliding_window=None, s_aux=None, output_router_logits=False, output_hidden_states=False,
                    num_items_in_batch=torch.tensor(5))
    for causal, scale in [(True, None), (False, 0.3), (None, 0.7)]:
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal is not False, scale=scale,
                                                                enable_gqa=True).transpose(1, 2)
        out, weights = fn(module, q, k, v, None, scaling=scale, dropout=0.0, is_causal=causal, **harmless)
        assert weights is None
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    module.is_causal = False                                            # no keyword: the module's own flag
    out, _ = fn(module, q, k, v, None)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
        q, k, v, enable_gqa=True).transpose(1, 2), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="has no dropout"):
        fn(module, q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match="explicit attention mask"):
        fn(module, q, k, v, torch.zeros(2, 1, 8, 8))
    with pytest.raises(ValueError, match="not passed to ctx_plugin.hf.enable"):
        fn(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).model.layers[0].self_attn, q, k, v, None)


def test_packed_document_keywords():
    """transformers' cu_seq_lens_q/k (global cumulative lengths) and ctx_plugin_documents give attention inside each
    document (HF's sdpa on each document on its own); inconsistent packing keywords are errors naming them."""
    from ctx_plugin.core.documents import Documents

    model, fn = _enabled_llama()
    module = model.model.layers[0].self_attn
    q, k, v = _qkv()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = torch.cat([sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True)
                      for a, b in ((0, 2), (2, 8))], 2).transpose(1, 2)
    cu = torch.tensor([0, 2, 8], dtype=torch.int32)
    for keywords in ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(), "max_length_q": 6, "max_length_k": 6},
                     {"ctx_plugin_documents": Documents((0, 2, 8))},
                     {"ctx_plugin_documents": Documents((0, 2, 8)), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}):
        out, _ = fn(module, q, k, v, None, **keywords)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    padded, _ = fn(module, q, k, v, None, ctx_plugin_documents=Documents((0, 2, 8), (2, 5)))
    torch.testing.assert_close(padded[:, :7], want[:, :7], rtol=1e-12, atol=1e-12)   # causal: padding is last
    assert torch.all(padded[:, 7] == 0)
    for keywords, text in (({"cu_seq_lens_q": cu}, "cu_seq_lens_q and cu_seq_lens_k together"),
                           ({"cu_seq_lens_q": cu, "cu_seq_lens_k": torch.tensor([0, 4, 8])}, "differ"),
                           ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 8}, "not this rank's shard"),
                           ({"max_length_k": 5}, "without cu_seq_lens_q"),
                           ({"cu_seq_lens_q": torch.tensor([0, 2, 6]), "cu_seq_lens_k": torch.tensor([0, 2, 6])},
                            "global sequence length 8"),
                           ({"ctx_plugin_documents": [0, 2, 8]}, "must be a ctx_plugin.Documents"),
                           ({"ctx_plugin_documents": Documents((0, 4, 8)), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu},
                            "describe different documents")):
        with pytest.raises(ValueError, match=text):
            fn(module, q, k, v, None, **keywords)


def _hf_reference(variant: str, q, k, v, window: int, sinks=None, softcap=None):
    """transformers' own code: its masks (masking_utils) with its sdpa function, Gemma-2's eager attention
    (softcap) or gpt-oss's (sinks); a stand-in module carries what they read."""
    from types import SimpleNamespace

    from transformers import masking_utils as mu
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    bidir = variant == "bidirectional"
    function = (mu.sliding_window_bidirectional_mask_function if bidir else mu.sliding_window_causal_mask_function)
    mask = mu.eager_mask(batch_size=q.shape[0], q_length=q.shape[2], kv_length=k.shape[2],
                         mask_function=function(window), dtype=q.dtype)
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False,
                             is_causal=not bidir, head_dim=q.shape[-1])
    if variant == "softcap":
        return gemma2_eager(module, q, k, v, mask, scaling=0.3, softcap=softcap)[0]
    if variant == "sinks":
        return gpt_oss_eager(module, q, k, v, mask, scaling=0.3)[0]
    return sdpa_attention_forward(module, q, k, v, mask, scaling=0.3, is_causal=False)[0]


# variant: (keywords of the attention call, tolerance); window 3 of 8 tokens, the reference in float64
VARIANTS = {"causal": ({}, 1e-12), "bidirectional": ({"is_causal": False}, 1e-12),
            "softcap": ({"softcap": 0.7}, 1e-6),               # Gemma-2's eager softmax runs in fp32
            "sinks": ({}, 1e-12)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sliding_window_softcap_and_sinks_match_transformers(variant):
    model, fn = _enabled_llama()
    module = model.model.layers[0].self_attn
    q, k, v = (t.requires_grad_() for t in _qkv())
    sinks = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    extra, tol = VARIANTS[variant]
    if variant == "sinks":
        extra = {"s_aux": sinks}
    out, _ = fn(module, q, k, v, None, scaling=0.3, sliding_window=3, **extra)
    want = _hf_reference(variant, q, k, v, 3, sinks=sinks, softcap=extra.get("softcap"))
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    inputs = (q, k, v, sinks) if variant == "sinks" else (q, k, v)
    dout = torch.randn_like(out, generator=torch.Generator().manual_seed(6))
    for have, ref in zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(want, inputs, dout)):
        torch.testing.assert_close(have, ref, rtol=tol, atol=tol)


def test_variants_it_cannot_apply_exactly_are_refused():
    model, fn = _enabled_llama()
    module = model.model.layers[0].self_attn
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="one sink logit per query head"):
        fn(module, q, k, v, None, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        fn(module, q, k, v, None, sliding_window=0)
    module.is_causal = False                    # bidirectional by the module alone (e.g. Gemma-3's option)
    with pytest.raises(ValueError, match="bidirectional attention module .* sliding_window=3"):
        fn(module, q, k, v, None, sliding_window=3)
    module.is_causal = True
    module.sliding_window = 3                   # carried by the module but not passed to the attention
    with pytest.raises(ValueError, match="sliding_window is set but the model does not pass it .* sliding_window="):
        fn(module, q, k, v, None)
    del module.sliding_window
    module.sinks = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="sinks is set but the model does not pass it .* as s_aux="):
        fn(module, q, k, v, None)


def test_names_are_per_groups_and_never_taken_over():
    cfg, groups = _one_rank("ring")
    other_cfg, other = _one_rank("ring")
    assert cphf.register(cfg, groups) == cphf.register(cfg, groups) != cphf.register(other_cfg, other)
    for taken in ["sdpa", "eager", cphf.register(other_cfg, other)]:
        with pytest.raises(ValueError, match="already taken"):
            cphf.register(cfg, groups, name=taken)
    with pytest.raises(ValueError, match="build_cp_groups"):
        cphf.register(ctx_plugin.CPConfig(backend="ulysses"), groups)


def test_readme_table_lists_every_attention_keyword():
    text = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    section = text.split("## Hugging Face models", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| (\w+)", section, re.MULTILINE))
    want = {**{k: "honoured" for k in cphf.HONOURED}, **{k: "refused" for k in cphf.MUST_BE_UNSET},
            **{k: "harmless" for k in cphf.HARMLESS}}
    assert rows == want


@pytest.mark.parametrize("kind", ["mistral_swa", "qwen2_mixed", "gemma2", "gpt_oss", "deepseek_v3", "mimo_v2"])
def test_variant_models_match_hf_at_one_rank(kind):
    """CP 1 (one rank, no process group): the whole model (sliding window under the sequence, mixed layer_types,
    Gemma-2's softcap, gpt-oss's sinks, values narrower than queries and keys; float64) gives HF's own sdpa/eager
    loss, logits and every gradient."""
    from tests.integration.hf_ranks import REFERENCE, _reference, _rel, data, model

    import torch.nn.functional as F

    want = _reference(kind)
    cfg, groups = _one_rank("ring")
    m = model(kind, None)
    assert cphf.enable(m, cfg, groups) == m.config._attn_implementation != REFERENCE[kind]
    input_ids, labels, positions = data()
    logits = m(input_ids=input_ids, position_ids=positions, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    tol = TOLERANCE[kind]
    assert abs(loss.item() - want["loss"]) <= tol * abs(want["loss"])
    assert _rel(logits.detach(), want["logits"]) <= tol
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert grads.keys() == want["grads"].keys() and len(grads) > 10
    for name, g in grads.items():
        assert _rel(g, want["grads"][name]) <= tol, f"{name}: relative error {_rel(g, want['grads'][name]):.2e}"
