"""ctx_plugin: context-parallel attention and selective-recompute granularity for Megatron/DeepSpeed/HF.

Public API::

    cfg    = ctx_plugin.CPConfig(backend="zigzag")
    groups = ctx_plugin.build_cp_groups(cfg, group=None)
    q_loc  = ctx_plugin.shard_sequence(q, config=cfg, groups=groups, dim=1)
    out    = ctx_plugin.cp_attention(q_loc, k_loc, v_loc, config=cfg, groups=groups, causal=True)
    full   = ctx_plugin.gather_sequence(out, config=cfg, groups=groups, dim=1)
    pos    = ctx_plugin.sequence_positions(seq_len, config=cfg, groups=groups)

Packed documents: pass ``documents=`` (a ``ctx_plugin.Documents`` or the global ``cu_seqlens``) to every one of these;
``ctx_plugin.pad_documents`` pads them to the units ``ctx_plugin.padding_units(cfg, cp)`` gives.
"""
from .core.api import cp_attention, gather_sequence, sequence_positions, shard_sequence
from .core.config import CPConfig
from .core.documents import Documents, pad_documents, pad_tokens
from .core.groups import CPGroups, build_cp_groups
from .core.rules import padding_units
from .names import Backend, Kernel

__all__ = ["Backend", "CPConfig", "CPGroups", "Documents", "Kernel", "build_cp_groups", "cp_attention",
           "gather_sequence", "pad_documents", "pad_tokens", "padding_units", "sequence_positions", "shard_sequence"]
__version__ = "0.1.0"
