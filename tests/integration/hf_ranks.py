"""Tiny transformers models (built from configs: no download) on spawned gloo ranks (see test_hf.py).

One launch per world size runs everything (:func:`suite`): parity against HF's own attention on one rank (sdpa;
eager for Gemma-2 and gpt-oss), inputs refused on every rank together, and several models with their own groups in
one process."""
from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQ, BATCH, VOCAB = 32, 2, 128


# HF's own attention each kind is compared with: sdpa (exact in float64), or eager where transformers has no sdpa
# for the model (Gemma-2's softcap: eager's softmax runs in fp32; gpt-oss's sinks: eager in the model's dtype)
REFERENCE = {"llama": "sdpa", "llama_bidir": "sdpa", "qwen2": "sdpa", "mistral_swa": "sdpa", "mistral_bidir": "sdpa",
             "qwen2_mixed": "sdpa", "gemma2": "eager", "gpt_oss": "eager", "deepseek_v3": "sdpa", "mimo_v2": "eager",
             "qwen2_vl": "sdpa", "gemma3": "sdpa", "cohere2": "sdpa", "smollm3": "sdpa", "olmo2": "sdpa",
             "phi3": "sdpa", "exaone4": "sdpa", "glm4": "sdpa", "stablelm": "sdpa", "starcoder2": "sdpa"}


def model(kind: str, attn_implementation: str | None):
    """``llama`` (GQA, fp32), ``llama_bidir`` (config.is_causal=False) or, in float64 with initializer_range 0.1
    and GQA: ``qwen2`` (q/k/v biases), ``mistral_swa`` (sliding_window 5, under a rank's shard), ``mistral_bidir``
    (the same, config.is_causal=False), ``qwen2_mixed`` (layer_types sliding (window 6) then full), ``gemma2``
    (attn_logit_softcapping 1, sliding and full layers), ``gpt_oss`` (sinks, sliding and full layers, two
    experts), ``deepseek_v3`` (multi-head latent attention, K/V per query head as DeepSeek's: values of 16 next to
    queries and keys of 24), ``mimo_v2`` (MiMo-V2-Flash: values of 16 next to 24, sliding layers with twice the KV
    heads and sinks; both with dense layers only, as their routers run in fp32), ``gemma3`` (a sliding layer, window
    6, then a full one, each with its own RoPE base: per-layer-type position_embeddings), RoPE and norms placed
    otherwise: ``cohere2`` (a sliding layer with RoPE, a full one without), ``smollm3`` (a layer without RoPE),
    ``olmo2`` (q/k norms over the whole projections), ``phi3`` (fused qkv and gate/up projections), ``exaone4`` (q/k
    norms, sliding then full), ``glm4`` (half the head rotated, interleaved), ``stablelm`` (a quarter rotated,
    per-head q/k LayerNorms, qkv biases), ``starcoder2`` (LayerNorms with biases, window 6) and ``qwen2_vl``
    (Qwen2-VL with its vision tower, on text alone: 3-D multimodal-RoPE positions, the rows alike, as its processor
    makes them for text); the same weights for every attention implementation."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ, attention_dropout=0.0, use_cache=False)
    wide = dict(common, initializer_range=0.1)
    padded = dict(wide, pad_token_id=0)          # defaults past the tiny vocabulary otherwise
    config = {"llama": lambda: transformers.LlamaConfig(**common),
              "llama_bidir": lambda: transformers.LlamaConfig(**common, is_causal=False),
              "qwen2": lambda: transformers.Qwen2Config(**wide, use_sliding_window=False),
              "mistral_swa": lambda: transformers.MistralConfig(**wide, sliding_window=5),
              "mistral_bidir": lambda: transformers.MistralConfig(**wide, sliding_window=5, is_causal=False),
              "qwen2_mixed": lambda: transformers.Qwen2Config(**wide, use_sliding_window=True, sliding_window=6,
                                                              layer_types=["sliding_attention", "full_attention"]),
              "gemma2": lambda: transformers.Gemma2Config(**wide, head_dim=16, sliding_window=6,
                                                          attn_logit_softcapping=1.0, query_pre_attn_scalar=16),
              "gpt_oss": lambda: transformers.GptOssConfig(**wide, head_dim=16, num_local_experts=2,
                                                           num_experts_per_tok=1, sliding_window=6),
              "deepseek_v3": lambda: transformers.DeepseekV3Config(**{**wide, "num_key_value_heads": 4}, q_lora_rank=None,
                                                                   kv_lora_rank=16, qk_nope_head_dim=16,
                                                                   qk_rope_head_dim=8, v_head_dim=16,
                                                                   first_k_dense_replace=2),
              "mimo_v2": lambda: transformers.MiMoV2FlashConfig(**wide, head_dim=24, v_head_dim=16, sliding_window=6,
                                                                mlp_layer_types=["dense", "dense"]),
              "gemma3": lambda: transformers.Gemma3TextConfig(**wide, head_dim=16, sliding_window=6,
                                                              query_pre_attn_scalar=16, rope_local_base_freq=100.0,
                                                              layer_types=["sliding_attention", "full_attention"]),
              "cohere2": lambda: transformers.Cohere2Config(**padded, sliding_window=6,
                                                            layer_types=["sliding_attention", "full_attention"]),
              "smollm3": lambda: transformers.SmolLM3Config(**padded, no_rope_layers=[1, 0]),
              "olmo2": lambda: transformers.Olmo2Config(**padded),
              "phi3": lambda: transformers.Phi3Config(**padded),
              "exaone4": lambda: transformers.Exaone4Config(**padded, sliding_window=6,
                                                            layer_types=["sliding_attention", "full_attention"]),
              "glm4": lambda: transformers.Glm4Config(**padded, partial_rotary_factor=0.5),
              "stablelm": lambda: transformers.StableLmConfig(**padded, partial_rotary_factor=0.25, use_qkv_bias=True,
                                                              qk_layernorm=True),
              "starcoder2": lambda: transformers.Starcoder2Config(**padded, sliding_window=6, residual_dropout=0.0,
                                                                  embedding_dropout=0.0),
              "qwen2_vl": lambda: transformers.Qwen2VLConfig(
                  text_config={**wide, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                           "rope_theta": 10000.0}},
                  vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=4, patch_size=4),
                  image_token_id=VOCAB - 3, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 1)}[kind]()
    auto = transformers.AutoModelForImageTextToText if kind == "qwen2_vl" else transformers.AutoModelForCausalLM
    cls = auto._model_mapping[type(config)]
    extra = {"experts_implementation": "eager"} if kind == "gpt_oss" else {}     # grouped_mm has no float64
    torch.manual_seed(1234)
    m = cls(config) if attn_implementation is None and not extra else \
        cls._from_config(config, **({"attn_implementation": attn_implementation} if attn_implementation else {}), **extra)
    return m.to(torch.float32 if kind.startswith("llama") else torch.float64).train()


def data():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[:, :3] = -100                                                  # some ignored targets
    return tokens[:, :-1], labels, torch.arange(SEQ).expand(BATCH, SEQ)


def positions_of(kind: str, positions: torch.Tensor) -> torch.Tensor:
    """The ``position_ids`` a kind takes: Qwen2-VL's multimodal RoPE one row per axis (all alike for text)."""
    return positions[None].expand(3, -1, -1) if kind == "qwen2_vl" else positions


def _rel(have: torch.Tensor, want: torch.Tensor) -> float:
    return ((have - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _reference(kind: str) -> dict:
    input_ids, labels, positions = data()
    m = model(kind, REFERENCE[kind])
    logits = m(input_ids=input_ids, position_ids=positions_of(kind, positions), use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return {"loss": loss.item(), "logits": logits.detach(),         # (a vision tower unused by text: no gradients)
            "grads": {n: p.grad for n, p in m.named_parameters() if p.grad is not None}}


def _backward_errors(m, logits, local_labels, reference: dict) -> dict:
    """Backpropagates the global token-mean loss of this rank's ``logits``: the loss error and the worst gradient error
    (gradients summed over the ranks) against ``reference``, and the global target count."""
    loss = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), ignore_index=-100, reduction="sum")
    stats = torch.stack([loss.detach(), (local_labels != -100).sum().to(loss.dtype)])
    dist.all_reduce(stats)
    (loss / stats[1]).backward()
    grad_errs = {}
    for name, p in m.named_parameters():
        if p.grad is None and name not in reference["grads"]:
            continue
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        grad_errs[name] = _rel(g, reference["grads"][name])
    worst = max(grad_errs, key=grad_errs.get)
    return {"loss_err": abs((stats[0] / stats[1]).item() - reference["loss"]) / abs(reference["loss"]),
            "grad_err": grad_errs[worst], "worst": worst, "n_grads": len(grad_errs),
            "n_ref_grads": len(reference["grads"]), "targets": int(stats[1].item())}


def _parity(kind: str, backend: str, u: int, *rest) -> dict:
    """Errors of one CP forward/backward against the reference: loss, gathered logits, CP-summed gradients.
    ``rest``: a recompute preset applied to the decoder layers (optional), then the reference."""
    import ctx_plugin
    import ctx_plugin.hf
    from ctx_plugin import recompute

    *preset, reference = rest

    input_ids, labels, positions = data()
    cfg = ctx_plugin.CPConfig(backend=backend, ulysses_size=u, kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    m = model(kind, None)
    ctx_plugin.hf.enable(m, cfg, groups)
    if preset:
        recompute.apply(m.model.layers, preset[0])
    shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1)  # noqa: E731
    local_positions = ctx_plugin.shard_sequence(positions_of(kind, positions), config=cfg, groups=groups, dim=-1)
    logits = m(input_ids=shard(input_ids), position_ids=local_positions, use_cache=False).logits
    errors = _backward_errors(m, logits, shard(labels), reference)        # labels pre-shifted, then sharded
    full_logits = ctx_plugin.gather_sequence(logits.detach(), config=cfg, groups=groups, dim=1)
    return {**errors, "logits_err": _rel(full_logits, reference["logits"])}


PACKED_LENGTHS = {"fit": [8, 16, 4, 12], "padded": [5, 17, 1, 9]}
"""Documents of the packed parity runs: lengths the "fit" runs' layouts split as they are (multiples of 4: zigzag at
CP 2; ring and Ulysses take any; passed as transformers' cu_seq_lens_q/k), and lengths that need padding
(ctx_plugin.packing.pad_packed_batch)."""


def _packed_reference(kind: str, lengths: list[int]) -> dict:
    """HF's own attention on every document on its own (no packing): loss (token mean over all documents' targets),
    each document's logits, gradients."""
    m = model(kind, REFERENCE[kind])
    tokens = torch.randint(0, VOCAB, (BATCH, sum(lengths)), generator=torch.Generator().manual_seed(9))
    total, count, logits = 0.0, 0, []
    start = 0
    for n in lengths:
        doc = tokens[:, start:start + n]
        out = m(input_ids=doc, position_ids=torch.arange(n).expand(BATCH, n), use_cache=False).logits
        logits.append(out.detach())
        if n > 1:
            total = total + F.cross_entropy(out[:, :-1].flatten(0, 1), doc[:, 1:].flatten(), reduction="sum")
            count += BATCH * (n - 1)
        start += n
    (total / count).backward()
    return {"tokens": tokens, "loss": (total / count).item(), "logits": torch.cat(logits, 1),
            "grads": {n: p.grad for n, p in m.named_parameters()}}


def _packed(kind: str, backend: str, u: int, mix: str) -> dict:
    """One packed batch under CP (documents from the batch's restarting position_ids; padded when ``mix`` needs it)
    against :func:`_packed_reference`: loss, logits at the real tokens, CP-summed gradients."""
    import ctx_plugin
    import ctx_plugin.hf

    cfg = ctx_plugin.CPConfig(backend=backend, ulysses_size=u, kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    m = model(kind, None)
    ctx_plugin.hf.enable(m, cfg, groups)
    return packed_step(m, m, kind, cfg, groups, PACKED_LENGTHS[mix], padded=mix == "padded")


def packed_step(m, call, kind: str, cfg, groups, lengths: list[int], *, padded: bool) -> dict:
    """One forward/backward of the enabled model ``m`` through ``call`` (``m`` itself, or a compiled ``m``) on a
    packed batch of documents ``lengths`` (padded to the layout's units and passed as ctx_plugin_documents, or as
    they are in cu_seq_lens_q/k), against :func:`_packed_reference`: loss, logits at the real tokens, CP-summed
    gradients."""
    import ctx_plugin
    from ctx_plugin.core.rules import padding_units
    from ctx_plugin.packing import documents_of_batch, pad_packed_batch, shift_labels

    reference = _packed_reference(kind, lengths)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(BATCH, -1)
    batch = {"input_ids": reference["tokens"], "labels": reference["tokens"].clone(), "position_ids": positions}
    docs = documents_of_batch(batch)
    real = torch.arange(docs.seq_len)
    if padded:
        batch, docs = pad_packed_batch(batch, docs, *padding_units(cfg, groups.size))
        real = torch.tensor([i for i in range(docs.seq_len) if docs.is_real(i)])
        keywords = {"ctx_plugin_documents": docs}
    else:
        cu = torch.tensor(docs.bounds, dtype=torch.int32)
        keywords = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths),
                    "max_length_k": max(lengths)}
    shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1, documents=docs)  # noqa: E731
    m.zero_grad()
    logits = call(input_ids=shard(batch["input_ids"]), position_ids=shard(batch["position_ids"]), use_cache=False,
                  **keywords).logits
    errors = _backward_errors(m, logits, shard(shift_labels(batch["labels"], docs)), reference)
    full = ctx_plugin.gather_sequence(logits.detach(), config=cfg, groups=groups, dim=1, documents=docs)
    return {**errors, "logits_err": _rel(full[:, real], reference["logits"])}


def _refused_inputs(setup: str, rank: int, world: int) -> dict:
    """What each bad input does on this rank: the error text and how long it took to come."""
    import transformers

    import ctx_plugin
    import ctx_plugin.hf

    backend, _, check = setup.partition("-")   # "ring-nocheck": the decision travels on the CP group itself
    cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch", check_ranks=check != "nocheck")
    groups = ctx_plugin.build_cp_groups(cfg)
    m = model("llama", None)
    ctx_plugin.hf.enable(m, cfg, groups)
    input_ids, labels, positions = data()
    shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1)  # noqa: E731
    right_padding = torch.ones(BATCH, SEQ, dtype=torch.long)
    right_padding[0, -3:] = 0
    packed = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ // 2)]).expand(BATCH, SEQ)  # two documents
    ids, pos = shard(input_ids), shard(positions)
    cases = {"padding": dict(input_ids=ids, position_ids=pos, attention_mask=shard(right_padding)),
             "cache": dict(input_ids=ids, position_ids=pos, use_cache=True),
             "no_positions": dict(input_ids=ids),
             "packed": dict(input_ids=ids, position_ids=shard(packed)),
             "labels": dict(input_ids=ids, position_ids=pos, labels=shard(labels)),
             "logits_to_keep": dict(input_ids=ids, position_ids=pos, logits_to_keep=1),
             "cache_object": dict(input_ids=ids, position_ids=pos, use_cache=False,
                                  cache=transformers.DynamicCache(config=m.config)),
             "inner_padding": dict(input_ids=ids, position_ids=pos, attention_mask=shard(right_padding))}
    out = {}
    for name, kwargs in cases.items():
        start = time.monotonic()
        try:
            (m.model if name.startswith("inner") else m)(**kwargs)   # inner: the base model called directly
            out[name] = {"error": None}
        except ValueError as e:
            out[name] = {"error": str(e), "seconds": time.monotonic() - start}
    m(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids))   # an all-ones mask is fine
    out["cache_off"] = m.config.use_cache is False
    return out


def _two_models(rank: int, world: int) -> dict:
    """Three models in one process: ring over all ranks, ring over this rank alone (the same backend and config,
    other groups) and ulysses over all ranks, run interleaved; each logits error against HF's sdpa."""
    import ctx_plugin
    import ctx_plugin.hf

    input_ids, _, positions = data()
    want = model("llama", "sdpa")(input_ids=input_ids, position_ids=positions).logits.detach()
    alone = [dist.new_group([r]) for r in range(world)][rank]
    setups = {"ring_all": (ctx_plugin.CPConfig(backend="ring", kernel="torch"), None),
              "ring_alone": (ctx_plugin.CPConfig(backend="ring", kernel="torch"), alone),
              "ulysses_all": (ctx_plugin.CPConfig(backend="ulysses", kernel="torch"), None)}
    models, names = {}, {}
    for key, (cfg, group) in setups.items():
        groups = ctx_plugin.build_cp_groups(cfg, group=group)
        models[key] = (model("llama", None), cfg, groups)
        names[key] = ctx_plugin.hf.enable(models[key][0], cfg, groups)
    again = ctx_plugin.hf.enable(model("llama", None), *models["ring_all"][1:])   # same groups: same name
    errors: dict[str, list] = {key: [] for key in models}
    for key in ["ring_all", "ring_alone", "ulysses_all", "ring_all", "ring_alone"]:
        m, cfg, groups = models[key]
        shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1)  # noqa: E731
        logits = m(input_ids=shard(input_ids), position_ids=shard(positions)).logits.detach()
        errors[key].append(_rel(ctx_plugin.gather_sequence(logits, config=cfg, groups=groups, dim=1), want))
    return {"errors": errors, "names": names, "again": again}


def suite(rank: int, world: int, payload: dict) -> dict:
    warnings.filterwarnings("ignore")
    refs = {kind: _reference(kind) for kind in {c[0] for c in payload["parity"]}}
    out = {"parity": {"-".join(map(str, c)): _parity(*c, refs[c[0]]) for c in payload["parity"]},
           "packed": {"-".join(map(str, c)): _packed(*c) for c in payload.get("packed", [])},
           "refused": {b: _refused_inputs(b, rank, world) for b in payload["refused"]}}
    if payload["two_models"]:
        out["two_models"] = _two_models(rank, world)
    return out
