"""Layer specs whose core attention is ctx_plugin's, model preparation and batch sharding (imports megatron); the
rotary embeddings' positions are :mod:`ctx_plugin.megatron.rope`'s."""
from __future__ import annotations

import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .. import recompute as recompute_presets
from ..core.api import shard_sequence
from ..core.config import CPConfig
from ..core.documents import Documents
from ..core.groups import CPGroups
from ..names import Recompute
from .args import MegatronCPSettings
from .core_attention import CPCoreAttention, GroupsProvider, context_parallel_group
from .mask_documents import (METADATA_KEYS, block_causal, check_mask_documents_fit, check_mask_format,
                             documents_of_mask)
from .rope import _is_megatron_zigzag, _layout_hook_installed, use_layout_rope


def gpt_layer_spec(cp_config: CPConfig, *, base: ModuleSpec | None = None,
                   groups_provider: GroupsProvider | None = None) -> ModuleSpec:
    """``base`` (default: Megatron's local GPT layer spec; a per-layer ``TransformerBlockSubmodules`` too)
    with only its core attention replaced."""
    spec = copy.deepcopy(base if base is not None else get_gpt_layer_local_spec())
    provider = groups_provider if groups_provider is not None else GroupsProvider(cp_config)
    core = ModuleSpec(module=CPCoreAttention, params={"cp_config": cp_config, "groups_provider": provider})
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
        if attention is None or not hasattr(attention.submodules, "core_attention"):
            raise ValueError("this layer spec has no self_attention.submodules.core_attention to replace; "
                             "ctx_plugin supports GPT layer specs with self-attention")
        attention.submodules.core_attention = core
    _note_attention(cp_config)
    return spec


def _note_attention(cp_config: CPConfig) -> None:
    """Records on Megatron's args that this process builds ctx_plugin's core attention (read by the layout hook,
    :func:`ctx_plugin.megatron.hooks.local_positions`, which shards by ``--cp-backend`` only for it)."""
    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except (ImportError, AssertionError):      # Megatron-LM's training package absent or its args not set
        return
    args.ctx_plugin_attention = cp_config.backend.value


def layer_spec(model_config=None, vp_stage=None) -> ModuleSpec:
    """For ``--spec ctx_plugin.megatron.spec layer_spec``: the layer spec Megatron would build, with ctx_plugin's core
    attention configured by the ``--cp-*`` flags. Called with megatron-core's ``GPTModelConfig`` (its
    ``GPTModelBuilder``), that is Megatron's own ``default_layer_spec``; without it, Megatron's local or
    Transformer-Engine layer (by ``--transformer-impl``), and flags that layer would drop (``--qk-l2-norm``,
    ``--num-experts``, ``--multi-latent-attention``, heterogeneous layers) are a ValueError."""
    from megatron.training import get_args

    from .args import settings_from_args

    args = get_args()
    run = _entry_point_run()
    if run is None and not hasattr(args, "cp_backend"):
        raise ValueError("--spec ctx_plugin.megatron.spec layer_spec: Megatron's arguments have no --cp-* flags (its "
                         "parser never got ctx_plugin's); run through python -m ctx_plugin.megatron.pretrain_gpt, apply "
                         "patches/megatron-core-0.19-extra-args-entry-points.patch, or pass "
                         "extra_args_provider=ctx_plugin.megatron.args.add_arguments to Megatron's pretrain")
    # the entry point's, computed once; without it Megatron applies its own --recompute-* flags
    settings = run.settings if run is not None else settings_from_args(args, entry_point=False)
    _check_seams(args, settings)
    if getattr(model_config, "transformer", None) is not None:
        # megatron.training.models.gpt's GPTModelConfig: the spec Megatron itself would build for it (MoE blocks,
        # qk_l2_norm, heterogeneous layers, the TE op fuser), its core attention then replaced.
        from megatron.training.models.gpt import default_layer_spec

        return gpt_layer_spec(settings.cp_config, base=default_layer_spec(model_config, vp_stage))
    omitted = [flag for flag, field in (("--qk-l2-norm", "qk_l2_norm"), ("--num-experts", "num_experts"),
                                        ("--multi-latent-attention", "multi_latent_attention"),
                                        ("--heterogeneous-layers-config-path", "heterogeneous_layers_config_path"),
                                        ("--heterogeneous-layers-config-encoded-json",
                                         "heterogeneous_layers_config_encoded_json"))
               if getattr(args, field, None)]
    if omitted:
        raise ValueError(f"--spec ctx_plugin.megatron.spec layer_spec was called without Megatron's model config, so "
                         f"it builds the plain local or Transformer Engine GPT layer, which would drop "
                         f"{', '.join(omitted)}; run through ctx_plugin's entry point (python -m "
                         f"ctx_plugin.megatron.pretrain_gpt, no --spec) or drop {', '.join(omitted)}")
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        base = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        base = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    return gpt_layer_spec(settings.cp_config, base=base)


def _check_seams(args, settings: MegatronCPSettings) -> None:
    """``--spec`` alone changes only the layer spec: Megatron still shards batches and slices RoPE zigzag-wise
    and never applies ``--cp-recompute``. Refuse what that would silently get wrong."""
    if _entry_point_running():
        return
    cp, problems = args.context_parallel_size, []
    if cp > 1 and not _layout_hook_installed() and not _is_megatron_zigzag(settings.cp_config, args.seq_length, cp):
        problems.append(f"--cp-backend {settings.cp_config.backend} holds other tokens on each rank than the zigzag "
                        f"chunks this Megatron shards batches into (get_batch_on_this_cp_rank) and slices RoPE by; "
                        f"run through the entry point, apply patches/megatron-core-0.19-cp-layout-hook.patch, or use "
                        f"--cp-backend zigzag or allgather (Megatron's zigzag layout)")
    sft, inter_document = getattr(args, "sft", False), getattr(args, "dataloader_inter_document_masking", False)
    if cp > 1 and inter_document and not sft:
        problems.append("--dataloader-inter-document-masking without --sft: Megatron-LM's get_batch shards its batches "
                        "zigzag over the whole sequence (use_per_sequence_balancing), while their PackedSeqParams "
                        "describe documents, which ctx_plugin's attention and Megatron's THD RoPE read per document; "
                        "run through the entry point (its batch sharder shards per document)")
    elif cp > 1 and sft and not _is_megatron_zigzag(settings.cp_config, args.seq_length, cp):
        problems.append(f"--sft: Megatron shards packed batches zigzag per document (Transformer Engine's "
                        f"thd_get_partitioned_indices, which the layout-hook patch does not reach), while --cp-backend "
                        f"{settings.cp_config.backend} holds other tokens of each document; run through the entry "
                        f"point, or use --cp-backend zigzag or allgather")
    if getattr(args, "create_attention_mask_in_dataloader", False):
        problems.append("Megatron's dataloader builds an attention mask that only ctx_plugin's batch sharder checks "
                        "and drops (its core attention refuses mask tensors); run through the entry point, or pass "
                        "--no-create-attention-mask-in-dataloader")
    if settings.recompute.preset not in (Recompute.NONE, Recompute.ATTN_OUT) or settings.recompute.has_modifiers:
        problems.append(f"--cp-recompute {settings.recompute} is applied by ctx_plugin's entry point, not by --spec; "
                        f"run through the entry point, or drop --cp-recompute and use Megatron's --recompute-* flags")
    if problems:
        raise ValueError("--spec ctx_plugin.megatron.spec layer_spec without ctx_plugin's entry point "
                         "(python -m ctx_plugin.megatron.pretrain_gpt --megatron-lm PATH ...):\n  "
                         + "\n  ".join(problems))


def _entry_point_run():
    """The entry point's :class:`~ctx_plugin.megatron.pretrain_gpt.RunSettings` when it runs this process."""
    import megatron.core.utils as core_utils

    return getattr(core_utils.get_batch_on_this_cp_rank, "ctx_plugin_run", None)


def _entry_point_running() -> bool:
    """True when python -m ctx_plugin.megatron.pretrain_gpt installed its seams in this process."""
    import megatron.core.utils as core_utils

    return bool(getattr(core_utils.get_batch_on_this_cp_rank, "ctx_plugin_seam", False))


def batch_documents(batch: dict) -> Documents | None:
    """The packed documents of a Megatron batch: ``cu_seqlens`` (and ``cu_seqlens_padded``), ``[1, n]`` after
    ``flatten_batch_for_packed_sequences``, global boundaries of the packed sequence; padded boundaries with the
    real lengths as ``valid`` when both are given. None without them."""
    from .core_attention import _ints

    cu, padded = batch.get("cu_seqlens"), batch.get("cu_seqlens_padded")
    if cu is None:
        return None
    for key in ("local_cp_size", "hybrid_cp_group"):
        if batch.get(key) is not None:
            raise ValueError(f"the batch carries {key} (Megatron's --hybrid-context-parallel), which ctx_plugin "
                             f"does not support: drop --hybrid-context-parallel")
    real = _ints(cu)
    bounds = _ints(padded) if padded is not None else real
    if len(real) != len(bounds):
        raise ValueError(f"cu_seqlens has {len(real)} entries but cu_seqlens_padded {len(bounds)}")
    valid = tuple(b - a for a, b in zip(real, real[1:]))
    return Documents(bounds, None if real == bounds else valid)


def shard_batch(batch: dict, *, config: CPConfig, groups: CPGroups, pad_documents: tuple[int, int] | None = None) -> dict:
    """This rank's part of a Megatron batch (tokens, labels, loss_mask, position_ids, ...) in the backend's layout:
    the replacement for ``get_batch_on_this_cp_rank``. Labels must be pre-shifted. The ``attention_mask`` (Megatron's
    dataloader builds one unless ``--no-create-attention-mask-in-dataloader``) is checked on the full batch, which
    every context-parallel rank holds, so every rank decides alike, and comes back as None: the standard causal mask
    ctx_plugin's attention applies itself; the block-diagonal causal mask of ``--reset-attention-mask`` becomes
    packed documents (:mod:`ctx_plugin.megatron.mask_documents`: the batch comes back as one packed sequence
    ``[1, b·s]`` with ``cu_seqlens`` and ``max_seqlen``, from which Megatron-LM's ``forward_step`` builds THD
    ``PackedSeqParams``; ``pad_documents``: :func:`ctx_plugin.megatron.mask_documents.document_padding`, pads each of
    those documents to the layout's unit). Any other mask is an error.

    Packed batches (``cu_seqlens``, ``cu_seqlens_padded``: megatron-core's THD format, one packed sequence) are
    sharded per document (:func:`batch_documents`; zigzag: chunks r and 2P-1-r of every document, as
    Transformer Engine's ``thd_get_partitioned_indices``); the metadata keys come back unchanged, as Megatron's own
    sharder leaves them (the attention reads the global boundaries from ``PackedSeqParams``)."""
    packed = documents_of_mask(batch, pad_documents)
    if packed is not None:
        batch = packed
        if pad_documents is None:
            check_mask_documents_fit(config, batch_documents(batch), groups.size, seq_len=_seq_len(batch))
    elif batch.get("cu_seqlens") is not None:          # the dataset's own documents (THD)
        check_mask_documents_fit(config, batch_documents(batch), groups.size, seq_len=_seq_len(batch), dataset=True)
    docs = batch_documents(batch)
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_causal_mask(mask, docs)
    return {key: value if key in METADATA_KEYS else None if value is None or key == "attention_mask" else
            shard_sequence(value, config=config, groups=groups, dim=1, documents=docs)
            for key, value in batch.items()}


def _seq_len(batch: dict) -> int:
    return next(v.shape[1] for k, v in batch.items() if k not in METADATA_KEYS and isinstance(v, torch.Tensor))


def _check_causal_mask(mask, documents: Documents | None = None) -> None:
    """Next to packed ``documents`` (``cu_seqlens``): the causal mask, or the causal mask inside each document."""
    check_mask_format(mask)
    causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).triu_(1)
    if documents is not None and documents.seq_len == mask.shape[-1]:
        causal = block_causal(documents.bounds, mask.device)
    if not torch.equal(mask, causal.expand_as(mask)):
        raise ValueError("attention_mask is neither the standard causal mask nor the causal mask of the batch's packed "
                         "documents (cu_seqlens); ctx_plugin's attention applies only causal masks inside documents: "
                         "drop the extra masking")


def prepare_model(model, settings: MegatronCPSettings, groups_provider: GroupsProvider, pg_collection=None):
    """After building a GPTModel with :func:`gpt_layer_spec`: layout-aware RoPE, the recompute preset's layer part
    (``for_layers``) when ctx_plugin (not Megatron) applies it, and ``+tile_loss``'s tiled output layer and loss
    (:mod:`ctx_plugin.megatron.loss`). Returns the model's :class:`CPGroups`. Without it the core attention runs
    only where megatron-core's own RoPE slicing gives the layout's positions
    (:func:`~ctx_plugin.megatron.rope.megatron_rope_fits`), else its first forward is an error naming this
    function."""
    groups = groups_provider.get(context_parallel_group(pg_collection))
    use_layout_rope(model, settings.cp_config, groups)
    for module in model.modules():
        if isinstance(module, CPCoreAttention):
            module.model_prepared = True
    if settings.megatron_recompute is None:
        from .moe_state import keep_router_state

        recompute_presets.apply(model.decoder.layers, settings.recompute.for_layers, sequence_dim=0,  # [s, b, h]
                                final_norm=getattr(model.decoder, "final_layernorm", None))   # None: not this stage
        keep_router_state(model.decoder.layers)           # MoE routers recomputed with autograd on
    if settings.recompute.tile_loss:
        from .loss import use_tiled_loss

        use_tiled_loss(model, settings.recompute.loss_tokens)
    return groups
