"""ctx_plugin's attention as megatron-core's ``core_attention`` (imports megatron.core)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group, is_layer_window_attention,
                                             make_sharded_tensors_for_checkpoint)

from ..core.api import cp_attention
from ..core.compiler import opaque
from ..core.config import CPConfig
from ..core.documents import Documents
from ..core.groups import CPGroups, build_cp_groups
from ..core.layouts import Zigzag, shard_layout
from .options import check_model_options, window
from .rope import megatron_rope_fits

_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.no_mask)


class GroupsProvider:
    """Builds the :class:`CPGroups` of one context-parallel process group once and hands the same object to
    every layer (the hybrid's subgroups are created once per model, not per layer)."""

    def __init__(self, cp_config: CPConfig) -> None:
        self.cp_config = cp_config
        self._groups: dict[int, tuple[dist.ProcessGroup | None, CPGroups]] = {}

    def get(self, group: dist.ProcessGroup | None) -> CPGroups:
        key = id(group)
        if key not in self._groups:
            self._groups[key] = (group, build_cp_groups(self.cp_config, group=group))
        return self._groups[key][1]


def context_parallel_group(pg_collection=None) -> dist.ProcessGroup | None:
    """Megatron's context-parallel group: ``pg_collection.cp`` when given, else parallel_state's."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None and dist.is_initialized():
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    return group


class CPCoreAttention(MegatronModule):
    """Core attention running :func:`ctx_plugin.cp_attention` over Megatron's context-parallel group.

    Takes Megatron's ``[s, b, heads, dim]`` query and ``[s, b, groups, dim]`` key/value (GQA not expanded) and
    returns ``[s, b, heads·dim_v]`` (multi-latent attention's values, ``v_channels``, may be narrower than its
    queries and keys, ``k_channels``: :func:`ctx_plugin.cp_attention` takes them so). Causal and no-mask types,
    applied by the attention itself: a mask tensor is an error (:func:`ctx_plugin.megatron.spec.shard_batch` checks
    that the dataloader's mask is the causal one and drops it). Sliding windows as megatron-core decides them per
    layer (``window_size``, ``window_attn_skip_freq``; :func:`ctx_plugin.megatron.options.window`) and
    ``softmax_type`` ``off-by-one`` (a zero sink logit per head) and ``learnable`` (a ``softmax_offset`` parameter
    per head of this tensor-parallel rank, made, initialised and checkpointed like megatron-core's
    ``DotProductAttention``'s; its gradient is this rank's part, reduced over data × context ranks like every other
    parameter's). Every option it does not implement (options.py: QK-clip, FP8 attention, dropout, ...;
    padding/arbitrary masks, attention bias) is an error. Packed sequences (``PackedSeqParams``,
    ``qkv_format="thd"``, q ``[t, heads, dim]``) attend inside each document (:func:`packed_documents`), the batch
    sharded with the same documents (``shard_batch``)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 cp_comm_type: str | None = None, softmax_scale: float | None = None, k_channels: int | None = None,
                 v_channels: int | None = None, pg_collection=None, *, cp_config: CPConfig,
                 groups_provider: GroupsProvider, **kwargs) -> None:
        super().__init__(config=config)
        check_model_options(config)
        if kwargs:
            raise TypeError(f"ctx_plugin's core attention got arguments it does not implement: {sorted(kwargs)} "
                            f"(megatron-core {_megatron_version()} passes ones this ctx_plugin does not know)")
        if attention_type != "self":
            raise ValueError(f"ctx_plugin's core attention supports self-attention only, not {attention_type!r}")
        if attn_mask_type not in _MASK_TYPES:
            raise ValueError(f"ctx_plugin's core attention supports causal and no_mask attention, not "
                             f"{attn_mask_type.name}")
        if cp_comm_type not in (None, "p2p"):
            raise ValueError(f"cp_comm_type={cp_comm_type!r} (--cp-comm-type) conflicts with ctx_plugin's backend "
                             f"{cp_config.backend}, which replaces Megatron's context-parallel communication; drop it "
                             f"(for all-to-all use --cp-backend ulysses or ulysses_ring)")
        group = context_parallel_group(pg_collection)
        size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if config.context_parallel_size != size:
            raise ValueError(f"context_parallel_size={config.context_parallel_size} in the TransformerConfig but the "
                             f"context-parallel group has {size} ranks (RoPE and sequence lengths use the config's); "
                             f"make them equal")
        if config.multi_latent_attention and config.apply_rope_fusion and size > 1 \
                and not isinstance(shard_layout(cp_config), Zigzag):
            raise ValueError(f"multi-latent attention with apply_rope_fusion (--apply-rope-fusion): megatron-core's "
                             f"fused MLA RoPE picks each rank's zigzag chunks itself (cp_rank, cp_size), which "
                             f"--cp-backend {cp_config.backend} does not hold; use --no-rope-fusion, or --cp-backend "
                             f"zigzag or allgather")
        self.layer_number, self.attn_mask_type = layer_number, attn_mask_type
        self.cp_config = cp_config
        self.groups = groups_provider.get(group)
        self.softmax_scale = softmax_scale
        self.window = None                  # megatron-core's per-layer choice (its DotProductAttention's test)
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            self.window = window(config.window_size, causal=attn_mask_type == AttnMaskType.causal)
        self.tp_group = _tensor_parallel_group(pg_collection)
        self.softmax_type = config.softmax_type
        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        if self.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"softmax_type={self.softmax_type!r} is not one of megatron-core's 'vanilla', "
                             f"'off-by-one', 'learnable'")
        if config.num_attention_heads % tp_size:
            raise ValueError(f"num_attention_heads={config.num_attention_heads} is not divisible by the "
                             f"tensor-parallel size {tp_size}")
        self.model_prepared = False         # set by spec.prepare_model: RoPE follows the layout (or needs none)
        self._unprepared_fits: set[tuple[int, bool]] = set()
        self.softmax_offset = None
        if self.softmax_type == "learnable":    # as megatron-core's DotProductAttention makes and initialises it:
            # on the current CUDA device, --use-cpu-initialization or not (its initial values come from the CUDA
            # generator, so the same seed gives Megatron's); on the CPU where there is none
            device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
            self.softmax_offset = torch.nn.Parameter(torch.empty(config.num_attention_heads // tp_size,
                                                                 device=device, dtype=config.params_dtype))
            if config.perform_initialization:
                self.softmax_offset = config.init_method(self.softmax_offset)

    @opaque
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                attn_mask_type: AttnMaskType | None = None, attention_bias=None, packed_seq_params=None):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in _MASK_TYPES:
            raise ValueError(f"ctx_plugin's core attention supports causal and no_mask attention, not {mask_type.name}")
        if attention_bias is not None:
            raise ValueError("ctx_plugin's core attention does not support attention_bias")
        documents = None
        if packed_seq_params is not None:
            documents = packed_documents(packed_seq_params)
            if query.dim() == 4:            # THD arrives as [t, heads, dim]; a [t, 1, ...] batch dim is dropped
                if query.shape[1] != 1:
                    raise ValueError(f"packed sequences (qkv_format='thd') hold one packed sequence, got a batch of "
                                     f"{query.shape[1]}: flatten it first (flatten_batch_for_packed_sequences)")
                query, key, value = query[:, 0], key[:, 0], value[:, 0]
        if attention_mask is not None:
            raise ValueError(f"ctx_plugin's core attention got an attention_mask with attn_mask_type "
                             f"{mask_type.name}; it applies the causal mask itself and cannot apply others. Megatron's "
                             f"dataloader mask is checked and dropped by ctx_plugin's batch sharder (the entry point "
                             f"python -m ctx_plugin.megatron.pretrain_gpt, or ctx_plugin.megatron.spec.shard_batch); "
                             f"otherwise pass --no-create-attention-mask-in-dataloader")
        thd = query.dim() == 3
        if thd:
            if documents is None:
                raise ValueError("ctx_plugin's core attention got [t, heads, dim] tensors without packed_seq_params")
            query, key, value = query[:, None], key[:, None], value[:, None]
        s, b, heads, dim = query.shape
        if not self.model_prepared and self.groups.size > 1:
            self._check_unprepared(s * self.groups.size, packed=documents is not None)
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(dim)
        window_ = self.window
        if window_ is not None and mask_type != self.attn_mask_type:     # the window was checked for the other type
            window_ = window(self.config.window_size, causal=mask_type == AttnMaskType.causal)
        sinks = self.softmax_offset
        if self.softmax_type == "off-by-one":                           # exp(0) = 1 in every row's denominator
            sinks = torch.zeros(heads, dtype=query.dtype, device=query.device)
        out = cp_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                           config=self.cp_config, groups=self.groups, causal=mask_type == AttnMaskType.causal,
                           softmax_scale=scale, window=window_, sinks=sinks, documents=documents)
        out = out.transpose(0, 1).reshape(s, b, -1)         # heads × v's head_dim
        return out[:, 0] if thd else out

    def _check_unprepared(self, seq_len: int, packed: bool) -> None:
        """In a model :func:`~ctx_plugin.megatron.spec.prepare_model` was not called on, megatron-core's own RoPE
        slices positions zigzag-wise (its THD RoPE per document; the layout-hook patch redirects the BSHD slicing):
        an error, the same on every rank (config and lengths only), unless that gives the tokens this layout holds."""
        if (seq_len, packed) in self._unprepared_fits:
            return
        if not megatron_rope_fits(self.cp_config, seq_len, self.groups.size, packed):
            raise ValueError(f"ctx_plugin's core attention (backend {self.cp_config.backend}) runs in a model "
                             f"ctx_plugin.megatron.spec.prepare_model was not called on: megatron-core's own RoPE then "
                             f"gives each rank the positions of Megatron's zigzag chunks (r and 2P-1-r of 2P"
                             f"{', per packed document' if packed else ''}), while this backend's layout holds other "
                             f"tokens. Call prepare_model(model, settings, groups_provider) after building the model "
                             f"(it makes RoPE follow the layout; shard batches with shard_batch), run through "
                             f"python -m ctx_plugin.megatron.pretrain_gpt, or use backend zigzag or allgather")
        self._unprepared_fits.add((seq_len, packed))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The learnable ``softmax_offset`` sharded over tensor-parallel heads, as megatron-core's
        ``DotProductAttention`` saves it (so checkpoints move between the two)."""
        if self.softmax_type != "learnable":
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"softmax_offset": 0}, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


def packed_documents(packed_seq_params) -> Documents:
    """The packed documents of megatron-core's ``PackedSeqParams`` (``qkv_format="thd"``): its cumulative lengths
    are of the *global* packed sequence (before context-parallel sharding; megatron-core's THD RoPE and Transformer
    Engine's partitioning read them so). ``cu_seqlens_q_padded`` (when given) are the boundaries in the token
    layout and ``cu_seqlens_q`` the real lengths (Transformer Engine's convention): ``Documents(bounds=padded,
    valid=real)``. Megatron-LM's pretrain_gpt.py passes the padded boundaries as both; the padding at each
    document's end then belongs to the document, which a causal mask keeps from every real token."""
    fmt = getattr(packed_seq_params, "qkv_format", None)
    if fmt != "thd":
        raise ValueError(f"ctx_plugin's core attention supports packed sequences in qkv_format='thd' only, got "
                         f"{fmt!r}")
    for name in ("cp_group", "local_cp_size"):
        if getattr(packed_seq_params, name, None) is not None:
            raise ValueError(f"packed_seq_params.{name} is set (Megatron's --hybrid-context-parallel, dynamic "
                             f"context-parallel groups per batch), which ctx_plugin's attention does not support: "
                             f"it runs over the context-parallel group of the model")
    q, q_pad = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded
    kv, kv_pad = packed_seq_params.cu_seqlens_kv, packed_seq_params.cu_seqlens_kv_padded
    if q is None and q_pad is None:
        raise ValueError("packed_seq_params (qkv_format='thd') gives neither cu_seqlens_q nor cu_seqlens_q_padded")
    bounds = _ints(q_pad if q_pad is not None else q)
    real = _ints(q) if q is not None else bounds
    if (kv is not None and _ints(kv) != real) or (kv_pad is not None and _ints(kv_pad) != bounds):
        raise ValueError("packed_seq_params: cu_seqlens_kv(_padded) differ from cu_seqlens_q(_padded); ctx_plugin's "
                         "core attention is self-attention over one set of packed documents")
    if len(real) != len(bounds):
        raise ValueError(f"packed_seq_params: cu_seqlens_q has {len(real)} entries but cu_seqlens_q_padded "
                         f"{len(bounds)}; they must describe the same documents")
    valid = tuple(b - a for a, b in zip(real, real[1:]))
    return Documents(bounds, None if real == bounds else valid)


def _ints(cu) -> tuple[int, ...]:
    if isinstance(cu, torch.Tensor):
        if cu.dim() == 2 and cu.shape[0] == 1:
            cu = cu[0]
        if cu.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D (one packed sequence), got shape {tuple(cu.shape)}")
        return tuple(int(x) for x in cu.tolist())
    return tuple(int(x) for x in cu)


def _tensor_parallel_group(pg_collection=None) -> dist.ProcessGroup | None:
    """Megatron's tensor-parallel group: ``pg_collection.tp`` when given, else parallel_state's (None before
    Megatron's groups exist: one tensor-parallel rank)."""
    group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    if group is None and dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    return group


def _megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__
