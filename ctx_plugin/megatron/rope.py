"""Rotary embeddings that give each rank the positions of the tokens ctx_plugin's layout holds (megatron-core's own
slice zigzag-wise), and when megatron-core's own slicing already does (imports megatron)."""
from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

from ..core.api import sequence_positions
from ..core.config import CPConfig
from ..core.groups import CPGroups
from ..core.layouts import Zigzag, shard_layout


def _layout_hook_installed() -> bool:
    """True when this megatron-core carries patches/megatron-core-0.19-cp-layout-hook.patch (batch sharding and
    RoPE slicing both ask the hook) and the hook it finds is ctx_plugin's."""
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.utils as core_utils

    from .hooks import local_positions

    find = getattr(core_utils, "get_cp_layout_hook", None)
    return find is not None and getattr(rope_utils, "get_cp_layout_hook", None) is find and find() is local_positions


def megatron_rope_fits(cp_config: CPConfig, seq_len: int, cp: int, packed: bool) -> bool:
    """Whether megatron-core's own RoPE (in a model :func:`~ctx_plugin.megatron.spec.prepare_model` was not called
    on) gives every rank the positions of the tokens ``cp_config``'s layout holds: Megatron's zigzag chunks (packed:
    per document, which the layout-hook patch does not reach), or, for unpacked sequences, the positions of the
    layout-hook patch's hook."""
    if packed:
        return isinstance(shard_layout(cp_config), Zigzag)
    if _is_megatron_zigzag(cp_config, seq_len, cp):
        return True
    if not _layout_hook_installed():
        return False
    import megatron.core.utils as core_utils

    hook = core_utils.get_cp_layout_hook()
    return _every_rank_holds(cp_config, seq_len, cp, lambda rank: hook(seq_len, cp, rank))


def _is_megatron_zigzag(cp_config: CPConfig, seq_len: int, cp: int) -> bool:
    """Whether every rank holds the tokens Megatron's zigzag gives it: chunks r and 2cp-1-r of 2cp (ctx_plugin's
    :class:`~ctx_plugin.core.layouts.Zigzag`)."""
    return seq_len % (2 * cp) == 0 and _every_rank_holds(cp_config, seq_len, cp,
                                                         lambda rank: Zigzag().local_indices(seq_len, rank, cp))


def _every_rank_holds(cp_config: CPConfig, seq_len: int, cp: int, positions) -> bool:
    """Whether ``positions(rank)`` (None: unknown) are the tokens ``cp_config``'s layout gives each rank: every
    rank's compared, so that every rank decides alike."""
    layout = shard_layout(cp_config)
    for rank in range(cp):
        want = positions(rank)
        if want is None or not torch.equal(want.cpu(), layout.local_indices(seq_len, rank, cp)):
            return False
    return True


class LayoutRotaryEmbedding(RotaryEmbedding):
    """Megatron's RotaryEmbedding returning the frequencies of the global positions this rank holds in the
    backend's layout (Megatron's own slices zigzag-wise): the rows of Megatron's own full-sequence frequencies
    (``get_freqs_non_repeated``: base, rotary percent, Llama-3 scaling, interpolation factor, offset), laid
    out as its ``get_emb`` does (interleaved or not). Install with :func:`use_layout_rope`."""

    ctx_plugin_config: CPConfig
    ctx_plugin_groups: CPGroups

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        positions = _layout_positions(self, max_seq_len, packed_seq)
        if self.inv_freq.device.type == "cpu" and torch.cuda.is_available():
            self.inv_freq = self.inv_freq.to(torch.cuda.current_device())      # as RotaryEmbedding.get_emb does
        freqs = self.get_freqs_non_repeated(max_seq_len, offset).index_select(0, positions.to(self.inv_freq.device))
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


class LayoutYarnRotaryEmbedding(YarnRotaryEmbedding):
    """Megatron's YarnRotaryEmbedding returning ``(frequencies, mscale)`` like the original, with the rows of its
    own full-sequence embedding (``get_emb``) at the global positions this rank holds. The YaRN attention
    factor (mscale) is applied by Megatron's attention from the config, as without ctx_plugin (GPTModel drops the
    returned one); packed sequences (THD) keep Megatron's per-document YaRN (:func:`check_packed_yarn`)."""

    ctx_plugin_config: CPConfig
    ctx_plugin_groups: CPGroups
    ctx_plugin_model_config: object

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        emb, mscale = self.get_emb(max_seq_len, offset)
        if packed_seq:
            check_packed_yarn(self.ctx_plugin_model_config, mscale)
        positions = _layout_positions(self, max_seq_len, packed_seq)
        return emb.index_select(0, positions.to(emb.device)), mscale


_LAYOUT_ROPE = {RotaryEmbedding: LayoutRotaryEmbedding, YarnRotaryEmbedding: LayoutYarnRotaryEmbedding}


def _layout_positions(rope, max_seq_len: int, packed_seq: bool) -> torch.Tensor:
    if packed_seq:          # megatron-core's THD RoPE slices each document itself, zigzag-wise (2P chunks)
        check_packed_rope(rope.ctx_plugin_config, rope.ctx_plugin_groups.size)
        return torch.arange(max_seq_len)
    return sequence_positions(max_seq_len, config=rope.ctx_plugin_config, groups=rope.ctx_plugin_groups)


def check_packed_rope(cp_config: CPConfig, cp: int) -> None:
    """With packed sequences (THD), megatron-core's attention applies RoPE to each document's two zigzag chunks
    (``_apply_rotary_pos_emb_thd``: chunks r and 2P-1-r, positions restarting in each document), the documents'
    layout of ctx_plugin's ``zigzag`` and ``allgather``. Other layouts hold other tokens: ValueError."""
    if cp > 1 and not isinstance(shard_layout(cp_config), Zigzag):
        raise ValueError(f"packed sequences (THD, cu_seqlens) with rotary position embeddings need --cp-backend "
                         f"zigzag or allgather: megatron-core's attention applies RoPE to each document's zigzag "
                         f"chunks (r and 2P-1-r of 2P), which --cp-backend {cp_config.backend} does not hold; use one "
                         f"of those, or --position-embedding-type learned_absolute/none")


def check_packed_yarn(model_config, mscale: float) -> None:
    """With packed sequences (THD) megatron-core applies YaRN's attention factor (mscale) in its unfused THD RoPE
    (``_apply_rotary_pos_emb_thd``), but its fused one (``apply_rope_fusion``: Transformer Engine's
    ``fused_apply_rotary_pos_emb_thd``) takes no mscale and drops it, while the BSHD path falls back to the unfused
    RoPE for it: a ``--reset-attention-mask`` batch (which ctx_plugin packs into THD) or a packed dataset would train
    a model without the factor. ValueError then, the same on every rank (config only), before the attention runs."""
    if mscale != 1.0 and getattr(model_config, "apply_rope_fusion", False):
        raise ValueError(f"YaRN (--position-embedding-type yarn, attention factor {mscale:.6g}) with packed sequences "
                         f"(THD, cu_seqlens; also --reset-attention-mask batches, which ctx_plugin packs so) and "
                         f"apply_rope_fusion: megatron-core's fused THD RoPE (Transformer Engine) drops YaRN's "
                         f"attention factor, which its unfused RoPE applies; set apply_rope_fusion=False "
                         f"(Megatron-LM's arguments turn it off for yarn)")


def use_layout_rope(model, cp_config: CPConfig, groups: CPGroups) -> None:
    """Makes the rotary embeddings of ``model`` layout-aware: GPTModel's (``model.rotary_pos_emb``, RoPE or YaRN) and
    each multi-latent attention's own (MLA applies RoPE itself, to its positional part of q and k); no-op for a
    model without any. Any other rotary embedding (multimodal RoPE, a subclass of Megatron's) is an error:
    ctx_plugin cannot know which positions it would compute."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    owners = [model, *(m for m in model.modules() if isinstance(m, MultiLatentAttention))]
    for rope in (getattr(owner, "rotary_pos_emb", None) for owner in owners):
        if rope is None:
            continue
        layout_class = _LAYOUT_ROPE.get(type(rope)) or (type(rope) if type(rope) in _LAYOUT_ROPE.values() else None)
        if layout_class is None:
            raise ValueError(f"rotary embedding {type(rope).__module__}.{type(rope).__name__} is not supported by "
                             f"ctx_plugin: it gives layout-aware positions to megatron-core's RotaryEmbedding "
                             f"(position_embedding_type rope) and YarnRotaryEmbedding (yarn) only; use one of those, "
                             f"learned_absolute or none")
        rope.__class__ = layout_class                   # keeps inv_freq and every setting of the original
        rope.ctx_plugin_config, rope.ctx_plugin_groups = cp_config, groups
        rope.ctx_plugin_model_config = getattr(model, "config", None)       # read per call: check_packed_yarn
