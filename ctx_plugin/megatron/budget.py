"""``--cp-recompute budget:<GiB>`` under Megatron: the memory model's description of the GPT model Megatron-LM
builds from its flags (:func:`model_spec`), the flags that model does not describe (refused, with the fix), and the
resolution to a concrete preset with Megatron's data-parallel size, padded vocabulary, dtype and optimizer (and the
GPU memory of the dataloader's attention mask, when Megatron builds one, taken from the budget)."""
from __future__ import annotations

import argparse

import torch

from ..recompute import RecomputeConfig
from .options import dataloader_mask_bytes

# Flags that change what a layer holds beyond what the megatron block family describes (measured on megatron-core's
# local GPT layers): budget:<GiB> would under-count them. Each: (argument, its type: bool for a switch, what it adds).
UNDESCRIBED: tuple[tuple[str, type, str], ...] = (
    ("qk_layernorm", bool, "per-head norms of q and k, which keep their inputs and statistics"),
    ("qk_l2_norm", bool, "L2 norms of q and k, which keep their inputs"),
    ("attention_output_gate", bool, "a gate projection whose output is kept for the gated attention output"),
    ("fp32_residual_connection", bool, "an fp32 residual stream (the model counts it in the training dtype)"),
    ("squared_relu", bool, "squared-ReLU activations (the model describes GeLU and SwiGLU MLPs)"),
    ("quick_geglu", bool, "quick-GeGLU activations (the model describes GeLU and SwiGLU MLPs)"),
    ("openai_gelu", bool, "the tanh-approximated GeLU's eager intermediates (the model describes torch's GeLU)"),
    ("activation_func_clamp_value", float, "clamped GLU inputs, whose masks backward keeps"),
)


def _undescribed(args: argparse.Namespace) -> list[str]:
    found = []
    for name, kind, what in UNDESCRIBED:
        value = getattr(args, name, None)
        if bool(value) if kind is bool else value is not None:
            found.append(f"--{name.replace('_', '-')} ({what})")
    return found


def budget_recompute(args: argparse.Namespace, recompute: RecomputeConfig, resolve_budget: bool) -> RecomputeConfig:
    """Checks a ``budget:<GiB>`` preset against Megatron's flags and, with ``resolve_budget``, resolves it (the
    launcher checks unresolved when the vocabulary is not known yet, so it refuses what the job would)."""
    refused = []      # (the flags, why the memory model cannot resolve budget:<GiB> with them, more of the fix)
    if getattr(args, "num_experts", None):
        refused.append((f"--num-experts {args.num_experts}", "covers dense decoders only (no expert parameters, "
                        "gradients, optimizer state or routing)", ""))
    if getattr(args, "multi_latent_attention", False):
        refused.append(("--multi-latent-attention", "sizes standard attention (q/k/v projections and heads "
                        "--hidden-size wide), not latent attention's compressed projections and wider queries", ""))
    kv_channels = getattr(args, "kv_channels", None)
    if kv_channels and kv_channels * args.num_attention_heads != args.hidden_size:
        refused.append((f"--kv-channels {kv_channels}", f"sizes the attention --hidden-size wide "
                        f"({args.num_attention_heads} heads × {kv_channels} is not --hidden-size {args.hidden_size})",
                        " (`ctx-plugin memory` to choose it)"))
    undescribed = _undescribed(args)
    if undescribed:
        refused.append((", ".join(undescribed), f"does not describe {'this' if len(undescribed) == 1 else 'these'}, "
                        f"so it would under-count what each layer keeps", ""))
    if getattr(args, "mtp_num_layers", None):
        refused.append((f"--mtp-num-layers {args.mtp_num_layers}", "describes the decoder's layers only, not the "
                        "multi-token-prediction layers and their logits", ""))
    dropout = getattr(args, "hidden_dropout", 0.0) or 0.0
    if dropout > 0:
        refused.append((f"--hidden-dropout {dropout:g}", "does not count the dropout masks each layer keeps for "
                        "backward (Megatron's default is 0.1)", " (or set --hidden-dropout 0)"))
    optimizer = getattr(args, "optimizer", "adam")
    if optimizer != "adam":
        refused.append((f"--optimizer {optimizer}", "counts Adam's state (fp32 master weights and two moments)", ""))
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if pp > 1:
        refused.append((f"--pipeline-model-parallel-size {pp}", "covers one whole-model stack (every layer's "
                        "parameters, one micro batch in flight), not a pipeline stage's share under its schedule", ""))
    if refused:
        flags, why, more = refused[0]
        raise ValueError(f"--cp-recompute {recompute} with {flags}: the memory model that resolves budget:<GiB> "
                         f"{why}; give a concrete preset instead, e.g. --cp-recompute full{more}")
    if not resolve_budget:
        return recompute
    missing = [name for name in ("padded_vocab_size", "data_parallel_size") if not getattr(args, name, None)]
    if missing:
        raise ValueError(f"--cp-recompute {recompute} is resolved from Megatron's {' and '.join(missing)}, which "
                         f"Megatron sets in validate_args/set_global_variables: call settings_from_args after them")
    from ..memory import ParallelSpec, resolve
    from ..names import Framework

    dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) \
        else torch.float32
    # validate_args's verdict on the gradient buffer (fp32 for bf16 unless --grad-reduce-in-bf16 / --main-grads-dtype)
    fp32_grads = getattr(args, "accumulate_allreduce_grads_in_fp32", None)
    parallel = ParallelSpec(cp=args.context_parallel_size, backend=args.cp_backend,
                            ulysses_size=args.cp_ulysses_size, tp=getattr(args, "tensor_model_parallel_size", 1),
                            sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                            dp=args.data_parallel_size,
                            zero_stage=1 if getattr(args, "use_distributed_optimizer", False) else 0,
                            framework=Framework.MEGATRON, grad_dtype=None if fp32_grads is None else
                            torch.float32 if fp32_grads else dtype)
    return resolve(recompute, model_spec(args), parallel, seq_len=args.seq_length, micro_batch=args.micro_batch_size,
                   dtype=dtype, reserved=dataloader_mask_bytes(args))


def model_spec(args):
    """The :class:`~ctx_plugin.memory.ModelSpec` of the GPT model Megatron-LM builds from its arguments (with
    ``padded_vocab_size`` set), completed as Megatron's ``validate_args`` completes them where that has not run yet
    (the launcher's check), absent ones taken at Megatron-LM's defaults: the MLP width (``--ffn-hidden-size``, else
    4·hidden, or SwiGLU's ⌊8·hidden/3/64⌋·64), the biases ``--add-bias-linear`` (the default) and ``--add-qkv-bias``
    give the projections, and the learned position table of ``--position-embedding-type learned_absolute`` (the
    default)."""
    from ..memory import ModelSpec

    swiglu, biases = bool(getattr(args, "swiglu", False)), bool(getattr(args, "add_bias_linear", True))
    hidden = args.hidden_size
    ffn = args.ffn_hidden_size or (int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden)
    learned = getattr(args, "position_embedding_type", "learned_absolute") == "learned_absolute" and \
        not getattr(args, "use_rotary_position_embeddings", False)
    fusion = getattr(args, "bias_swiglu_fusion", True) if swiglu else getattr(args, "bias_gelu_fusion", True) and biases
    return ModelSpec(layers=args.num_layers, hidden=hidden, heads=args.num_attention_heads,
                     kv_heads=(args.num_query_groups if getattr(args, "group_query_attention", False)
                               and args.num_query_groups else args.num_attention_heads),
                     ffn=ffn, vocab=args.padded_vocab_size, gated=swiglu,
                     norm="rms" if getattr(args, "normalization", "LayerNorm") == "RMSNorm" else "layer",
                     family="megatron",     # Megatron ties the output layer to the embedding unless --untie-...
                     tied_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
                     attention_bias=biases or bool(getattr(args, "add_qkv_bias", False)), output_bias=biases,
                     mlp_bias=biases, bias_activation_fusion=bool(fusion),
                     position_embeddings=(args.max_position_embeddings or args.seq_length) if learned else 0)
