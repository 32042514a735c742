"""megatron-core GPT layers (local spec with ctx_plugin's core attention, as ctx_plugin's Megatron integration
builds them) measured against the memory model's ``megatron`` family, on one spawned gloo rank (megatron-core's
parallel state needs torch.distributed): bytes the layers keep for backward and a step's activation peak
(layers, final norm, output layer, fp32 cross-entropy, backward). One launch measures every case; the fused
SwiGLU (``bias_swiglu_impl``, torch.compile) compiles once."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, BATCH, SEQ = 64, 160, 3, 4, 2, 2, 64
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def spec(vocab: int, norm: str, fusion: bool, gated: bool = True, layers: int = LAYERS):
    from ctx_plugin.memory import ModelSpec

    return ModelSpec(layers=layers, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, vocab=vocab,
                     family="megatron", norm=norm, gated=gated, bias_activation_fusion=fusion, attention_bias=True)


def _model(preset: str, dtype: torch.dtype, vocab: int, norm: str, fusion: bool, gated: bool, layers: int = LAYERS):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    import ctx_plugin
    from ctx_plugin.megatron.args import MegatronCPSettings
    from ctx_plugin.megatron.core_attention import GroupsProvider
    from ctx_plugin.megatron.spec import gpt_layer_spec, prepare_model
    from ctx_plugin.recompute import RecomputeConfig

    normalization = "RMSNorm" if norm == "rms" else "LayerNorm"
    config = TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
        ffn_hidden_size=FFN, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
        add_bias_linear=not gated, add_qkv_bias=True, init_method_std=0.1, normalization=normalization,
        gated_linear_unit=gated, activation_func=F.silu if gated else F.gelu, bias_activation_fusion=fusion,
        bias_dropout_fusion=fusion, bf16=dtype == torch.bfloat16, params_dtype=dtype)
    cp_config = ctx_plugin.CPConfig(kernel="sdpa_cpu")         # a flash-style kernel: no score matrices
    provider = GroupsProvider(cp_config)
    layer_spec = gpt_layer_spec(cp_config, base=get_gpt_layer_local_spec(normalization=normalization),
                                groups_provider=provider)
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=vocab, max_sequence_length=SEQ,
                     position_embedding_type="rope").to(dtype)
    settings = MegatronCPSettings(cp_config=cp_config, recompute=RecomputeConfig.parse(preset),
                                  megatron_recompute=None)        # ctx_plugin applies the preset, as for regions
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepare_model(model, settings, provider)
    return model


def _measure(preset: str, dtype: torch.dtype, vocab: int, norm: str, fusion: bool, gated: bool,
             step: bool = True, layers: int = LAYERS) -> dict:
    from ctx_plugin.memory import ParallelSpec, estimate, layer_activations, saved_bytes
    from ctx_plugin.memory.measure import step_bytes

    model = _model(preset, dtype, vocab, norm, fusion, gated, layers)
    rope = model.rotary_pos_emb(SEQ)
    x0 = torch.randn(SEQ, BATCH, HIDDEN, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (SEQ * BATCH,))
    fixed = [*model.parameters(), *model.buffers(), x0, rope]

    def only_layers():
        x = x0 * 1.0
        for layer in model.decoder.layers:
            x = layer(x, attention_mask=None, rotary_pos_emb=rope)[0]
        return x

    out, kept = saved_bytes(only_layers, exclude=fixed)
    m = spec(vocab, norm, fusion, gated, layers)
    kw = dict(seq_len=SEQ, micro_batch=BATCH, dtype=dtype, device="cpu")
    layers_model = sum(layer_activations(m, ParallelSpec(), preset, **kw))
    if not step:      # (a fused activation's backward would compile with torch.compile: seconds)
        return {"layers": kept, "layers_model": layers_model}
    out.float().sum().backward()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step():
        hidden = model.decoder(hidden_states=x0 * 1.0, attention_mask=None, rotary_pos_emb=rope)
        logits, _ = model.output_layer(hidden)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels)

    _, peak = step_bytes(step, exclude=[*fixed, *(p.grad for p in model.parameters())])
    est = estimate(m, ParallelSpec(), preset, **kw)
    return {"layers": kept, "layers_model": layers_model, "peak": peak,
            "peak_model": est.activations + est.transient}


def measure_cases(rank: int, world: int, payload: dict) -> dict:
    """``payload["cases"]``: (preset, dtype name, vocab, norm, fused activation, gated) tuples measured with a step,
    ``payload["kept_only"]``: the same, measuring only what the layers keep."""
    from megatron.core import parallel_state

    warnings.filterwarnings("ignore")
    parallel_state.initialize_model_parallel()
    try:
        return {"|".join(map(str, case)): _measure(case[0], DTYPES[case[1]], *case[2:], step=step)
                for step, key in ((True, "cases"), (False, "kept_only")) for case in payload.get(key, [])}
    finally:
        parallel_state.destroy_model_parallel()


PARAM_BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
              "--max-position-embeddings", "64", "--micro-batch-size", "1", "--attention-dropout", "0",
              "--use-cpu-initialization", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion"]


def param_counts(rank: int, world: int, payload: list[list[str]]) -> dict:
    """For each list of Megatron-LM flags: Megatron's real parser and ``validate_args``, its GPT model built from
    ``core_transformer_config_from_args`` (local spec), and the memory model's count of the ModelSpec that
    ``ctx_plugin.megatron.budget.model_spec`` describes it with: ``{flags: (counted, the model's parameters, the
    ModelSpec's fields)}``."""
    import dataclasses
    import sys

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    from ctx_plugin.megatron.args import add_arguments
    from ctx_plugin.megatron.budget import model_spec
    from ctx_plugin.memory import param_count

    warnings.filterwarnings("ignore")
    parallel_state.initialize_model_parallel()
    counts, argv = {}, sys.argv
    try:
        for flags in payload:
            sys.argv = ["pretrain_gpt.py", *PARAM_BASE, *flags]
            args = parse_args(extra_args_provider=add_arguments)
            args.padded_vocab_size = 96
            validate_args(args, {})
            model = GPTModel(config=core_transformer_config_from_args(args),
                             transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
                             vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                             share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                             position_embedding_type=args.position_embedding_type)     # as pretrain_gpt.py passes it
            spec = model_spec(args)
            counts[" ".join(flags)] = (param_count(spec), sum(p.numel() for p in model.parameters()),
                                       dataclasses.asdict(spec))
    finally:
        sys.argv = argv
        parallel_state.destroy_model_parallel()
    return counts
