"""ctx_plugin's attention as megatron-core's ``core_attention`` (imports megatron.core)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..api import cp_attention
from ..config import CPConfig
from ..groups import CPGroups, build_cp_groups


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
    returns ``[s, b, heads·dim]``. Causal and no-mask types; for the causal type a mask tensor, if Megatron
    passes one, is the standard causal mask the backend applies itself. Padding/arbitrary masks, attention
    bias, packed sequences and attention dropout raise (not supported yet)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 cp_comm_type=None, softmax_scale: float | None = None, pg_collection=None, *,
                 cp_config: CPConfig, groups_provider: GroupsProvider, **kwargs) -> None:
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"ctx_plugin's core attention supports self-attention only, not {attention_type!r}")
        if getattr(config, "attention_dropout", 0.0):
            raise ValueError(f"ctx_plugin's attention has no dropout; set attention_dropout=0 "
                             f"(got {config.attention_dropout})")
        self.layer_number, self.attn_mask_type = layer_number, attn_mask_type
        self.cp_config = cp_config
        self.groups = groups_provider.get(context_parallel_group(pg_collection))
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                attn_mask_type: AttnMaskType | None = None, attention_bias=None, packed_seq_params=None):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"ctx_plugin's core attention supports causal and no_mask attention, not {mask_type.name}")
        if mask_type == AttnMaskType.no_mask and attention_mask is not None:
            raise ValueError("an attention mask was given with attn_mask_type no_mask; ctx_plugin cannot apply "
                             "arbitrary masks")
        if attention_bias is not None:
            raise ValueError("ctx_plugin's core attention does not support attention_bias")
        if packed_seq_params is not None:
            raise ValueError("ctx_plugin's core attention does not support packed sequences (packed_seq_params) yet")
        s, b, heads, dim = query.shape
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(dim)
        out = cp_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                           config=self.cp_config, groups=self.groups, causal=mask_type == AttnMaskType.causal,
                           softmax_scale=scale)
        return out.transpose(0, 1).reshape(s, b, heads * dim)
