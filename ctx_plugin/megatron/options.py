"""megatron-core options that ctx_plugin's core attention does not implement: each is an error at model set-up.

megatron-core's ``TransformerConfig`` and Megatron-LM's parsed arguments use the same names (the arguments are
generated from the config's fields), so one table checks both: ``check_model_options(config)`` in
``CPCoreAttention.__init__`` and ``check_model_options(args)`` in ``settings_from_args``. The options that
*are* honoured, and why, are listed in README.md ("Megatron-LM / megatron-core", options table); a test
covers every row of both lists. :func:`window` maps megatron-core's ``window_size`` onto ctx_plugin's window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Refused:
    """One option ctx_plugin refuses: its field (= Megatron-LM argument without ``--``), when its value is
    refused, what it would have done and how to run without it."""

    field: str
    refused: Callable[[Any], bool]
    why: str
    fix: str

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


def _truthy(value) -> bool:
    return bool(value)


def _not_none(value) -> bool:
    return value is not None


MODEL_OPTIONS: tuple[Refused, ...] = (
    Refused("attention_dropout", lambda v: bool(v and v > 0), "ctx_plugin's attention has no dropout",
            "set it to 0"),
    Refused("qk_clip", _truthy, "QK-clip needs every core attention to report its heads' largest attention logit "
            "(current_max_attn_logits), which ctx_plugin's attention does not compute", "drop it"),
    Refused("log_max_attention_logit", _truthy, "logging the largest attention logit needs the core attention to "
            "compute it, which ctx_plugin's attention does not", "drop it"),
    Refused("experimental_attention_variant", _not_none, "experimental attention variants (gated delta net, DSA) "
            "are not softmax self-attention over the whole sequence", "drop it"),
    Refused("fp8_dot_product_attention", _truthy, "ctx_plugin's attention computes in the model's dtype, not FP8",
            "drop it (FP8 linear layers still work)"),
    Refused("fp8_multi_head_attention", _truthy, "ctx_plugin's attention computes in the model's dtype, not FP8",
            "drop it (FP8 linear layers still work)"),
    Refused("use_kitchen_attention", _truthy, "it selects another attention implementation, which ctx_plugin's "
            "core attention replaces", "drop it"),
    Refused("flash_attention_version", _not_none, "it pins the kernel of Megatron's (Transformer Engine) attention, "
            "which ctx_plugin's core attention replaces", "drop it and pick the kernel with --cp-kernel"),
    Refused("deterministic_mode", _truthy, "ctx_plugin's attention does not promise a deterministic backward (the "
            "flash-attn and cuDNN kernels accumulate gradients in a nondeterministic order; Transformer Engine's "
            "attention is made deterministic by this flag)", "drop it"),
    Refused("batch_invariant_mode", _truthy, "ctx_plugin's kernels do not promise batch-size-invariant results",
            "drop it"),
    Refused("cuda_graph_impl", lambda v: v not in (None, "none"), "a captured CUDA graph replays ctx_plugin's "
            "attention without its host-side work per call (the ranks' agreement check, the ring's plans, packed "
            "documents read from cu_seqlens on the host), so later batches would run with the captured call's "
            "documents; not checked with ctx_plugin", "drop it (--cuda-graph-impl none)"),
    Refused("enable_cuda_graph", _truthy, "it is --cuda-graph-impl local (deprecated spelling): a captured CUDA "
            "graph replays ctx_plugin's attention without its host-side work per call", "drop it"),
    Refused("external_cuda_graph", _truthy, "it captures CUDA graphs of the layers (Transformer Engine's "
            "make_graphed_callables), which replay ctx_plugin's attention without its host-side work per call",
            "drop it"),
    Refused("overlap_moe_expert_parallel_comm", _truthy, "it runs Megatron's combined 1F1B schedule, which calls the "
            "model's layers piece by piece (build_schedule_plan: attention, MLP and the experts' dispatch apart) "
            "past the model's forward, so the recompute presets ctx_plugin applies to whole layers and MLPs and the "
            "packed documents of --reset-attention-mask batches would be skipped", "drop it"),
    Refused("flash_decode", _truthy, "flash decoding is an inference path that bypasses the core attention; "
            "ctx_plugin's attention is for training", "drop it"),
    Refused("position_embedding_type", lambda v: v == "mrope", "multimodal RoPE takes its positions from "
            "position_ids and Megatron slices them zigzag-wise; ctx_plugin does not give it layout-aware positions "
            "yet", "use rope, yarn, learned_absolute or none"),
)

DATA_OPTIONS: tuple[Refused, ...] = (
    Refused("hybrid_context_parallel", _truthy, "it picks a context-parallel group per batch (PackedSeqParams."
            "cp_group / local_cp_size), while ctx_plugin's attention runs over the model's group", "drop it"),
)


def check_packed_data(args) -> None:
    """Packed batches (``--sft``, ``--dataloader-inter-document-masking``: cu_seqlens, megatron-core's THD format; and
    ``--reset-attention-mask``, whose document masks the batch sharder packs so) with RoPE/YaRN need a layout whose
    per-document shards are megatron-core's THD RoPE slices (chunks r and 2P-1-r of every document): ``zigzag`` or
    ``allgather`` (:func:`ctx_plugin.megatron.rope.check_packed_rope`, which the model also checks per batch).
    ValueError otherwise."""
    packed = [f for f in ("sft", "dataloader_inter_document_masking", "reset_attention_mask") if getattr(args, f, False)]
    if not packed or getattr(args, "position_embedding_type", None) not in ("rope", "yarn"):
        return
    if getattr(args, "context_parallel_size", 1) > 1 and args.cp_backend not in ("zigzag", "allgather"):
        flags = ", ".join("--" + f.replace("_", "-") for f in packed)
        raise ValueError(f"{flags} (packed documents, THD) with --position-embedding-type "
                         f"{args.position_embedding_type}: megatron-core's attention applies RoPE to each document's "
                         f"zigzag chunks (r and 2P-1-r of 2P), which --cp-backend {args.cp_backend} does not hold; use "
                         f"--cp-backend zigzag or allgather, or --position-embedding-type learned_absolute/none")


def check_reset_data(args) -> None:
    """``--reset-attention-mask``: ctx_plugin's batch sharder reads the documents from the dataloader's block-diagonal
    mask and packs the batch into megatron-core's THD form (:mod:`ctx_plugin.megatron.mask_documents`). ValueError for
    what that cannot give exactly. (``--reset-position-ids`` needs nothing: the position ids reach learned absolute
    embeddings sharded like the tokens, and megatron-core's GPTModel does not read them for RoPE; ``--eod-mask-loss``
    is the loss mask's.) With ``--sft``/``--dataloader-inter-document-masking`` the dataset's own ``cu_seqlens`` and no
    mask reach the sharder, as in Megatron, so this flag changes nothing there. ``--cp-pad-documents`` (the sharder
    pads those documents to the layout's unit) needs ``--reset-attention-mask`` (CUDA graphs are refused with
    ctx_plugin's attention anyway: :data:`MODEL_OPTIONS`)."""
    packed = [f"--{f.replace('_', '-')}" for f in ("sft", "dataloader_inter_document_masking") if getattr(args, f, False)]
    if getattr(args, "cp_pad_documents", False):
        if not getattr(args, "reset_attention_mask", False) or packed:
            given = f" ({', '.join(packed)} give the dataset's own cu_seqlens)" if packed else ""
            raise ValueError(f"--cp-pad-documents pads the documents ctx_plugin reads from --reset-attention-mask's "
                             f"dataloader mask{given}: drop it (packed datasets pad their own documents, as "
                             f"Megatron's SFT dataset does)")
    if not getattr(args, "reset_attention_mask", False) or packed:
        return
    problems = []
    if not getattr(args, "create_attention_mask_in_dataloader", True):
        problems.append("--no-create-attention-mask-in-dataloader: Megatron's dataloader then builds no document mask "
                        "(Megatron's own attention attends across documents) and ctx_plugin reads the documents from "
                        "that mask; drop --no-create-attention-mask-in-dataloader, or use "
                        "--dataloader-inter-document-masking (documents as cu_seqlens, no [seq, seq] mask)")
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        problems.append(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: Megatron-LM's get_batch "
                        f"gives middle pipeline stages no batch (and so no documents) without --sft/"
                        f"--dataloader-inter-document-masking, and its stages exchange [seq/CP, batch, hidden] "
                        f"activations, not a packed [batch·seq/CP, 1, hidden] sequence; use "
                        f"--dataloader-inter-document-masking or --pipeline-model-parallel-size 1")
    if getattr(args, "num_experts", None):      # the router sees the packed [batch·seq/CP, 1, hidden] sequence
        balancing = getattr(args, "moe_router_load_balancing_type", None) or []
        if "seq_aux_loss" in ([balancing] if isinstance(balancing, str) else balancing):
            problems.append("--num-experts with --moe-router-load-balancing-type seq_aux_loss: megatron-core's router "
                            "sees the packed batch as one sequence, so its per-sequence load-balancing loss would pool "
                            "the samples; use aux_loss or global_aux_loss")
        if getattr(args, "cp_pad_documents", False):
            problems.append("--num-experts with --cp-pad-documents: the padding tokens would be routed to experts and "
                            "counted by the load-balancing loss; drop --cp-pad-documents (documents a multiple of the "
                            "layout's unit, or --cp-backend ring/ulysses)")
    if getattr(args, "mtp_num_layers", None):
        problems.append("--mtp-num-layers: on a packed batch megatron-core's multi-token prediction rolls tokens "
                        "within each document, while Megatron's own --reset-attention-mask run rolls them across "
                        "the sample")
    if problems:
        raise ValueError("--reset-attention-mask (ctx_plugin packs its document masks into megatron-core's THD "
                         "format) cannot be honoured with:\n  " + "\n  ".join(problems))


def refused_options(source, table: tuple[Refused, ...] = MODEL_OPTIONS) -> list[str]:
    """One message per option of ``source`` (a TransformerConfig or Megatron-LM's args) that ``table`` refuses."""
    found = []
    for option in table:
        value = getattr(source, option.field, None)
        if option.refused(value):
            found.append(f"{option.field}={value!r} ({option.flag}): {option.why}; {option.fix}")
    return found


def _mtp_under_cp(source) -> list[str]:
    """Multi-token prediction at CP > 1: megatron-core builds its layers from its own spec (``mtp_block_spec``), so
    their core attention is not ctx_plugin's, and ``roll_tensor`` rolls their tokens and labels by zigzag chunks."""
    layers, cp = getattr(source, "mtp_num_layers", None), getattr(source, "context_parallel_size", 1) or 1
    if not layers or cp <= 1:
        return []
    return [f"mtp_num_layers={layers!r} (--mtp-num-layers) with context_parallel_size={cp}: megatron-core builds the "
            f"multi-token-prediction layers from its own layer spec, so their attention is not ctx_plugin's (Megatron's "
            f"own context-parallel attention, or an error with --transformer-impl local), and it rolls their tokens "
            f"and labels by Megatron's zigzag chunks, not by ctx_plugin's layout; drop --mtp-num-layers, or train "
            f"with --context-parallel-size 1"]


def check_model_options(source, *, where: str = "ctx_plugin's core attention") -> None:
    """Raises one ValueError naming every option of ``source`` that ctx_plugin's attention does not implement."""
    found = refused_options(source, MODEL_OPTIONS) + _mtp_under_cp(source)
    if found:
        raise ValueError(f"{where} cannot honour these settings:\n  " + "\n  ".join(found))


MASK_LIMIT = 4 * 2 ** 30
"""The largest dataloader mask (bytes per micro batch) :func:`check_dataloader_mask` lets through."""


def dataloader_mask_bytes(args) -> int:
    """The GPU memory of the attention mask Megatron-LM's dataloader builds unless
    ``--no-create-attention-mask-in-dataloader``: a ``[micro batch, 1, seq, seq]`` bool tensor that every
    tensor-parallel rank holds on its GPU through the step (megatron-core's ``get_batch_on_this_tp_rank`` moves it
    there and broadcasts it); 0 without it."""
    if not getattr(args, "create_attention_mask_in_dataloader", True):
        return 0
    return (getattr(args, "micro_batch_size", 1) or 1) * args.seq_length ** 2


def check_dataloader_mask(args) -> None:
    """A dataloader mask of :data:`MASK_LIMIT` bytes or more is an error naming the flag that drops it: ctx_plugin's
    attention applies causality itself and only checks that mask (or reads ``--reset-attention-mask``'s documents
    from it, which ``--dataloader-inter-document-masking`` gives as ``cu_seqlens`` instead), so at long sequences it is
    GPU memory spent on nothing (16 GiB at 128k tokens, 1 TiB at 1M)."""
    size = dataloader_mask_bytes(args)
    if size < MASK_LIMIT:
        return
    if getattr(args, "reset_attention_mask", False) and not getattr(args, "dataloader_inter_document_masking", False):
        fix = ("replace --reset-attention-mask with --dataloader-inter-document-masking (the documents as cu_seqlens) "
               "and add --no-create-attention-mask-in-dataloader")
    else:
        fix = "add --no-create-attention-mask-in-dataloader"
    raise ValueError(f"--seq-length {args.seq_length} with the dataloader's attention mask (Megatron's default): "
                     f"every tensor-parallel rank would hold a dense [seq, seq] mask of {size / 2 ** 30:.0f} GiB per "
                     f"micro batch on its GPU, which ctx_plugin's attention does not need (it applies causality "
                     f"itself); {fix}")


def check_data_options(args) -> None:
    """Raises one ValueError naming every data option of Megatron-LM's ``args`` that ctx_plugin cannot honour."""
    found = refused_options(args, DATA_OPTIONS)
    if found:
        raise ValueError("ctx_plugin cannot honour these data settings:\n  " + "\n  ".join(found))
    check_reset_data(args)
    check_packed_data(args)
    check_dataloader_mask(args)


def window(window_size, causal: bool) -> tuple[int | None, int | None]:
    """ctx_plugin's ``window`` for megatron-core's ``window_size=(left, right)``, read as Transformer Engine reads it
    (``check_set_window_size``; -1: unlimited): query i sees keys ``i - left <= j <= i + right``, intersected with
    causality under a causal mask. megatron-core's local ``DotProductAttention`` (``get_sliding_window_causal_mask``:
    ``triu(diagonal=-left)``, ``tril(diagonal=right)``) reads -1 literally as an offset (left -1: only keys after the
    query; right -1: only keys before it), so the two agree only for sides >= 0, and ctx_plugin follows Transformer
    Engine, the attention of GPU runs. ValueError for what Transformer Engine changes or refuses: under a causal mask
    a right side other than 0 (it sets it to 0 with a warning; the local attention's band would replace the causal
    mask), and without a mask ``(-1, 0)`` (it reads it as no window, with a warning) or one unlimited side next to a
    bounded one (it refuses that)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or any(
            isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window_size):
        raise ValueError(f"window_size={window_size!r} (--window-size) must be two integers (left, right), each >= 0 "
                         f"or -1 (unlimited)")
    left, right = window_size
    if causal and right != 0:
        raise ValueError(f"window_size={tuple(window_size)!r} (--window-size) has right={right} under a causal mask: "
                         f"Transformer Engine replaces it by 0, while megatron-core's local attention's band would "
                         f"replace the causal mask; give ({left}, 0)")
    if not causal and (left, right) == (-1, 0):
        raise ValueError("window_size=(-1, 0) (--window-size) without a causal mask means no window to Transformer "
                         "Engine, while megatron-core's local attention hides every key with it; give (-1, -1) or "
                         "drop it")
    if not causal and (left < 0) != (right < 0):
        raise ValueError(f"window_size={tuple(window_size)!r} (--window-size) without a causal mask has one unlimited "
                         f"side (-1) and one bounded: Transformer Engine refuses it (no mask takes (-1, -1) or two "
                         f"sides >= 0) and megatron-core's local attention reads -1 as an offset; give two sides >= 0 "
                         f"(a side of at least the sequence length is unlimited) or (-1, -1)")
    return (None if left < 0 else left), (None if right < 0 else right)
