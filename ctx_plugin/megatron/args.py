"""``--cp-*`` flags for Megatron's argument parser, and their validation against Megatron's own settings.

Pass :func:`add_arguments` as ``extra_args_provider`` to ``parse_and_validate_args`` (or call it on any
``argparse`` parser), then :func:`settings_from_args` turns the parsed namespace into ctx_plugin settings or
raises a ``ValueError`` naming the flags to change.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..core.config import CPConfig
from ..core.rules import SettingNames, check_heads, check_seq_len, check_sequence_parallel, check_ulysses_size
from ..names import Backend, Kernel, Recompute
from ..recompute import RecomputeConfig, regions, to_megatron
from .budget import budget_recompute

_USAGE = {
    Backend.RING: "contiguous shards; non-causal",
    Backend.ZIGZAG: "balanced causal ring, Megatron's own layout (default)",
    Backend.STRIPED: "balanced causal ring, token t on rank t mod P",
    Backend.ULYSSES: "all-to-all over heads; needs heads divisible by the CP size",
    Backend.ULYSSES_RING: "Ulysses inside --cp-ulysses-size ranks, zigzag ring across them",
    Backend.ALLGATHER: "all-gather K/V, one softmax per query chunk (GQA)",
}


_NAMES = SettingNames(seq_len="--seq-length", cp="--context-parallel-size", ulysses_size="--cp-ulysses-size",
                      tp="--tensor-model-parallel-size", heads="attention heads per tensor-parallel rank",
                      kv_heads="--num-query-groups per tensor-parallel rank")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ctx_plugin's flags (a Megatron ``extra_args_provider``; also registered as the entry point a fork
    patched with ``patches/`` loads, so it returns the parser unchanged when the flags are already there)."""
    if "--cp-backend" in parser._option_string_actions:
        return parser
    g = parser.add_argument_group("ctx_plugin", "context-parallel attention backends and recompute presets")
    g.add_argument("--cp-backend", default=Backend.ZIGZAG.value, choices=[b.value for b in Backend],
                   help="context-parallel attention over --context-parallel-size ranks: "
                        + "; ".join(f"{b.value}: {text}" for b, text in _USAGE.items()))
    g.add_argument("--cp-ulysses-size", type=int, default=1,
                   help="ranks per Ulysses group for --cp-backend ulysses_ring (put them inside one node)")
    g.add_argument("--cp-kernel", default=Kernel.AUTO.value, choices=[k.value for k in Kernel],
                   help="local attention kernel; auto picks the fastest for the GPU and dtype")
    g.add_argument("--cp-no-rank-check", action="store_true",
                   help="skip the check that the context-parallel ranks agree on each attention call (shapes, dtype, "
                        "settings) before communicating (CPConfig.check_ranks; on by default, one small gloo "
                        "all-reduce per call)")
    g.add_argument("--cp-recompute", default=Recompute.NONE.value,
                   help="recompute preset: none, attn_out, selective, core_attn, mlp, full, full:uniform:N, "
                        "full:block:N, sqrt or budget:<GiB>; replaces --recompute-granularity/-method/-num-layers/"
                        "-modules")
    g.add_argument("--cp-pad-documents", action="store_true",
                   help="with --reset-attention-mask: pad every document of a batch at its end (padding out of the "
                        "loss) to the multiple of tokens --cp-backend splits documents by (2x the CP size for zigzag "
                        "and allgather, the CP size for striped), wherever end-of-document tokens fall; batches then "
                        "grow by up to that multiple per document")
    return parser


@dataclass(frozen=True)
class MegatronCPSettings:
    """What the ``--cp-*`` flags ask for."""

    cp_config: CPConfig
    recompute: RecomputeConfig
    """The preset (a ``budget:`` preset is resolved against the model's memory estimate)."""
    megatron_recompute: dict | None
    """TransformerConfig recompute fields when Megatron itself can apply the preset; None when ctx_plugin
    applies it to the decoder layers (selective, full, sqrt: the attention stays pinned)."""
    document_padding: tuple[int, int] | None = None
    """``--cp-pad-documents``: the (document unit, sequence unit) the batch sharder pads ``--reset-attention-mask``
    documents to (:func:`ctx_plugin.megatron.mask_documents.document_padding`); None: no padding."""


def _value(x) -> str:
    return str(getattr(x, "name", x))


def settings_from_args(args: argparse.Namespace, *, resolve_budget: bool = True,
                       entry_point: bool = True) -> MegatronCPSettings:
    """Validates the ``--cp-*`` flags against Megatron's and returns the settings (ValueError otherwise).

    Call it once per run, on the arguments as the user gave them and Megatron completed them (after
    ``validate_args`` and ``set_global_variables``: ``budget:<GiB>`` is resolved from ``data_parallel_size`` and
    ``padded_vocab_size``), never on arguments it has already written recompute fields into. With
    ``resolve_budget=False`` a ``budget:`` preset is checked but returned unresolved (``megatron_recompute``
    None): for checks made before the vocabulary is known (``ctx-plugin launch``). ``entry_point=False``: the
    ``--spec`` layer spec alone, without ctx_plugin's entry point, where nothing writes Megatron's recompute fields,
    so Megatron's own ``--recompute-*`` flags apply as given (ctx_plugin's layer presets are refused there)."""
    for flag in ("cp_no_rank_check", "cp_pad_documents"):
        if not isinstance(getattr(args, flag, False), bool):
            raise ValueError(f"--{flag.replace('_', '-')} is a switch: True or False, got {getattr(args, flag)!r}")
    try:
        cp_config = CPConfig(backend=args.cp_backend, kernel=args.cp_kernel, ulysses_size=args.cp_ulysses_size,
                             check_ranks=not args.cp_no_rank_check)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--cp-backend/--cp-ulysses-size/--cp-kernel: {e}") from None
    cp = args.context_parallel_size
    tp = getattr(args, "tensor_model_parallel_size", 1)
    check_ulysses_size(cp_config, cp, _NAMES)
    backend = _value(getattr(args, "attention_backend", "auto"))
    if backend != "auto":
        raise ValueError(f"--attention-backend {backend} would replace ctx_plugin's core attention with Megatron's; "
                         f"drop --attention-backend (ctx_plugin picks the kernel: --cp-kernel)")
    comm = getattr(args, "cp_comm_type", None)
    comm = [comm] if isinstance(comm, str) else list(comm or [])
    if any(c != "p2p" for c in comm):
        raise ValueError(f"--cp-comm-type {' '.join(comm)} conflicts with --cp-backend {cp_config.backend}: "
                         f"ctx_plugin's backend replaces Megatron's context-parallel communication; drop "
                         f"--cp-comm-type (for all-to-all use --cp-backend ulysses or ulysses_ring)")
    if getattr(args, "hierarchical_context_parallel_sizes", None):
        raise ValueError("--hierarchical-context-parallel-sizes is Megatron's own hierarchy; with ctx_plugin use "
                         "--cp-backend ulysses_ring --cp-ulysses-size N instead")
    heads = args.num_attention_heads // tp
    kv_heads = (args.num_query_groups if getattr(args, "group_query_attention", False) and args.num_query_groups
                else args.num_attention_heads) // tp
    check_seq_len(cp_config, args.seq_length, cp, _NAMES)
    if cp > 1 and args.seq_length % (2 * cp):   # validate_args asserts it first in a job; ctx-plugin launch checks here
        raise ValueError(f"--seq-length must be a multiple of 2 × --context-parallel-size = {2 * cp}, got "
                         f"{args.seq_length}: Megatron-LM's validate_args asserts it for every backend (--cp-backend "
                         f"{cp_config.backend} alone would take it)")
    if getattr(args, "sequence_parallel", False):
        check_sequence_parallel(cp_config, args.seq_length, cp, tp, _NAMES)
    check_heads(cp_config, heads, max(kv_heads, 1), cp, _NAMES)
    if getattr(args, "attention_dropout", 0.0):
        raise ValueError(f"ctx_plugin's attention has no dropout; set --attention-dropout 0 "
                         f"(got {args.attention_dropout})")
    from .options import check_data_options, check_model_options, window     # the table of refused options

    check_model_options(args, where="ctx_plugin's attention")
    check_data_options(args)
    if getattr(args, "window_size", None) is not None:
        window(args.window_size, causal=True)           # GPT models' attention is causal
    recompute = _recompute(args, resolve_budget, entry_point)
    megatron_fields = None
    layers = recompute.for_layers
    if layers.preset != Recompute.BUDGET:       # +tile_loss is the loss's: spec.prepare_model installs it on the model
        _check_chunks(layers, args)             # full:block:N / full:uniform:N: N at most every chunk's layers
    if layers.preset in (Recompute.NONE, Recompute.ATTN_OUT, Recompute.MLP, Recompute.CORE_ATTN) \
            and not layers.has_modifiers:      # Megatron has no tiling or offload: ctx_plugin applies those
        megatron_fields = to_megatron(layers, args.num_layers, moe=bool(getattr(args, "num_experts", None)))
    elif getattr(args, "mtp_num_layers", None) and layers.preset != Recompute.BUDGET:
        raise ValueError(f"--cp-recompute {layers} with --mtp-num-layers {args.mtp_num_layers}: ctx_plugin applies "
                         "it to the decoder's layers only, so the multi-token-prediction layers would run without it "
                         "(Megatron checkpoints them only under its own full recompute); drop --mtp-num-layers, or "
                         "use --cp-recompute none, attn_out, mlp or core_attn (Megatron's own fields)")
    if layers.tile_mlp:
        _check_tiled_norms(layers, args)
    if megatron_fields is None and layers.preset != Recompute.BUDGET:       # ctx_plugin recomputes the layers
        from .moe_state import check_router_recompute

        check_router_recompute(args, layers)
    padding = None
    if getattr(args, "cp_pad_documents", False):
        from .mask_documents import document_padding

        padding = document_padding(cp_config, cp, tp=tp, sequence_parallel=bool(getattr(args, "sequence_parallel",
                                                                                         False)))
    return MegatronCPSettings(cp_config=cp_config, recompute=recompute, megatron_recompute=megatron_fields,
                              document_padding=padding)


def _check_chunks(layers: RecomputeConfig, args: argparse.Namespace) -> None:
    """The layer preset against the smallest model chunk that has layers (every rank builds its chunks with it)."""
    from .stages import chunk_layers

    chunks = {where: n for where, n in chunk_layers(args).items() if n}
    if not chunks:
        return
    smallest = min(chunks.values())
    try:
        regions(layers, smallest)
    except ValueError as e:
        pp, vp = min(where for where, n in chunks.items() if n == smallest)
        chunk = f"pipeline rank {pp}" + (f", virtual stage {vp}," if any(v for _, v in chunks) else "")
        raise ValueError(f"--cp-recompute {layers}: {e}; {chunk} builds {smallest} of the --num-layers "
                         f"{args.num_layers} (model chunks: {sorted(set(chunks.values()))} layers)") from None
    offloading = getattr(args, "cpu_offloading", False) or (getattr(args, "cpu_offloading_num_layers", 0) or 0) > 0
    if offloading and any(stop - start > 1 for n in chunks.values() for start, stop in regions(layers, n)):
        raise ValueError(f"--cp-recompute {layers} with --cpu-offloading-num-layers: Megatron enters its CPU-offload "
                         "hooks (autograd saved-tensor hooks) around each layer's call, and a multi-layer recompute "
                         "region's checkpoint spans several layers' calls, so their hooks would be left out of order; "
                         "drop --cpu-offloading-num-layers and offload with ctx_plugin's +offload:<GiB> modifier "
                         "(region inputs in host memory), or use a preset with one layer per region (full, "
                         "full:block:N)")


def _check_tiled_norms(layers: RecomputeConfig, args: argparse.Namespace) -> None:
    """+tile_mlp chunks the layers' norms (ctx_plugin.recompute.tiling): refuse the Megatron options under which a
    norm's call cannot be chunked, before anything is built."""
    if getattr(args, "fused_residual_rmsnorm", False):
        raise ValueError(f"--cp-recompute {layers} with --fused-residual-rmsnorm: +tile_mlp chunks the layers' norms "
                         "over the sequence, and Transformer Engine's fused residual RMSNorm returns the residual "
                         "next to its output, which the chunks cannot join; drop --fused-residual-rmsnorm, or "
                         "+tile_mlp")
    norms = sorted({"attn_norm", "mlp_norm"} & set(getattr(args, "offload_modules", None) or ()))
    if getattr(args, "fine_grained_activation_offloading", False) and norms:
        raise ValueError(f"--cp-recompute {layers} with --fine-grained-activation-offloading --offload-modules "
                         f"{' '.join(norms)}: Megatron frees the norm input's device memory once it has offloaded "
                         "what the norm saved, but +tile_mlp's chunked norm saves views of that input, which would "
                         f"then read freed memory; drop {' and '.join(norms)} from --offload-modules, or +tile_mlp")


def _own_equivalent(args: argparse.Namespace) -> str:
    """The --cp-recompute preset closest to Megatron's own recompute flags (for the error that refuses them)."""
    granularity = getattr(args, "recompute_granularity", None)
    if granularity == "full":
        method, layers = getattr(args, "recompute_method", None), getattr(args, "recompute_num_layers", None) or 1
        if method == "block":
            return f"full:block:{layers}"
        return "full" if layers == 1 else f"full:uniform:{layers}"
    modules = set(getattr(args, "recompute_modules", None) or ["core_attn"])
    if modules <= {"mlp", "moe"} and not getattr(args, "recompute_activations", False):
        return "mlp"
    return "selective (or core_attn, mlp)"


def _recompute(args: argparse.Namespace, resolve_budget: bool, entry_point: bool) -> RecomputeConfig:
    try:
        recompute = RecomputeConfig.parse(args.cp_recompute)
    except TypeError as e:            # a namespace built in code: the flag error all the same
        raise ValueError(f"--cp-recompute: {e}") from None
    own = [f"--{name.replace('_', '-')}" for name in ("recompute_granularity", "recompute_method",
                                                       "recompute_num_layers", "recompute_activations",
                                                       "recompute_modules", "moe_layer_recompute")
           if getattr(args, name, None)]
    if own and recompute.preset != Recompute.NONE:
        raise ValueError(f"--cp-recompute {recompute} and {', '.join(own)} both set what to recompute; keep one "
                         f"(--cp-recompute maps onto Megatron's fields where Megatron can express it)")
    if own and entry_point:  # --cp-recompute none writes Megatron's fields too: its own flags would be dropped
        raise ValueError(f"{', '.join(own)}: ctx_plugin sets Megatron's recompute fields from --cp-recompute "
                         f"(default none), so Megatron's own flags would be dropped; use --cp-recompute "
                         f"{_own_equivalent(args)} instead (its full presets keep the context-parallel attention "
                         f"pinned, so backward does not repeat its communication)")
    if recompute.preset != Recompute.BUDGET:
        return recompute
    return budget_recompute(args, recompute, resolve_budget)
