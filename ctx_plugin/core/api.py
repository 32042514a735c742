"""The public functions: context-parallel attention and the sharding helpers that match its layout.

Every check runs before any data moves. Each rank checks its own arguments, then the ranks of the group agree
on what they are about to do and on the outcome of those checks (:mod:`ctx_plugin.core.agreement`, one small
metadata all-reduce; ``CPConfig.check_ranks``), so a bad call, or ranks that disagree, raise the same error on
every rank instead of hanging or computing garbage.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.distributed as dist

from ..recompute import pinning
from . import agreement
from .attention import run_backend
from .comm import Observers, active_observers, all_gather, reduce_scatter, restored
from .compiler import opaque
from .config import CPConfig
from .documents import Documents, check_documents
from .groups import CPGroups
from .kernels import select_kernel
from .layouts import Layout, shard_layout
from .mask import Mask, finite
from .ring import autocast_off
from .rules import SettingNames, check_documents_fit, check_heads, check_seq_len


_GLOBAL = SettingNames(seq_len="the global sequence length (the local length × ranks)")
_FULL = SettingNames(seq_len="the sequence length of x along dim")

def _check_groups(groups: CPGroups) -> None:
    if not isinstance(groups, CPGroups):
        raise TypeError(f"groups must come from ctx_plugin.build_cp_groups, got {type(groups).__name__}")


def _check_setup(config: CPConfig, groups: CPGroups) -> Layout:
    if not isinstance(config, CPConfig):
        raise TypeError(f"config must be a ctx_plugin.CPConfig, got {type(config).__name__}")
    _check_groups(groups)
    if groups.config != config:
        raise ValueError(f"groups were built for {groups.config} but this call uses {config}; "
                         f"build them with ctx_plugin.build_cp_groups(config) for the config you pass")
    return shard_layout(config)


def _check_device(t: torch.Tensor, groups: CPGroups) -> None:
    if groups.size > 1 and t.device.type not in groups.device_types:
        served = ", ".join(sorted(groups.device_types)) or "none"
        raise ValueError(f"the context-parallel group's backend ({dist.get_backend_config(groups.group)}) cannot send "
                         f"{t.device.type} tensors (it serves: {served}); move the tensors to a served device or "
                         f"build the groups over a process group for {t.device.type} (nccl for cuda, gloo for cpu)")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, local_seq, heads, head_dim], got shape {tuple(t.shape)}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q, k and v must be floating point, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3] or v.shape[3] == 0:
        raise ValueError(f"k and v must have the same shape but for their head_dim (values may be narrower or wider: "
                         f"multi-latent attention), got {tuple(k.shape)} and {tuple(v.shape)}")
    (bq, sq, h, dq), (bk, sk, hkv, dk) = q.shape, k.shape
    if bq != bk:
        raise ValueError(f"q and k/v must have the same batch size, got {bq} and {bk}")
    if dq != dk:
        raise ValueError(f"q and k/v must have the same head_dim, got {dq} and {dk}")
    if sq != sk:
        raise ValueError(f"q and k/v must hold the same local tokens (self-attention), got {sq} and {sk}")
    if sq == 0 or h == 0 or hkv == 0 or dq == 0:
        raise ValueError(f"empty attention input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if h % hkv:
        raise ValueError(f"heads ({h}) must be a multiple of kv_heads ({hkv}) for grouped-query attention")


def _one_width(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``(q, k, v, v_dim)`` with one head_dim: values of another width than queries and keys (multi-latent attention:
    DeepSeek's, MiMo-V2's) or the queries and keys are padded with zero columns, which add nothing to any score and
    give zero output columns; ``v_dim`` (the output's width to keep) is None when the widths agree."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim == qk_dim:
        return q, k, v, None
    if v_dim < qk_dim:
        return q, k, F.pad(v, (0, qk_dim - v_dim)), v_dim
    return F.pad(q, (0, v_dim - qk_dim)), F.pad(k, (0, v_dim - qk_dim)), v, v_dim


def _check_sinks(sinks, q: torch.Tensor) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks must be None or a floating-point tensor of one logit per query head, got "
                        f"{sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
    if tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(f"sinks must have shape [heads] = ({q.shape[2]},) (one logit per query head, every head "
                         f"of the model's layer, not a Ulysses rank's share), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device ({q.device}), got {sinks.device}")


@opaque
def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, config: CPConfig, groups: CPGroups,
                 causal: bool = True, softmax_scale: float | None = None, window=None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None, documents=None) -> torch.Tensor:
    """Exact softmax attention over the whole sequence, each rank holding its shard of q, k and v.

    q is ``[batch, local_seq, heads, head_dim]``, k and v ``[batch, local_seq, kv_heads, head_dim]``, sharded
    with :func:`shard_sequence` (same config). Returns this rank's output rows, q's shape and dtype (v's head_dim).
    v may be narrower or wider than q and k (multi-latent attention): the narrower side runs padded with zero
    columns (exact; memory and K/V traffic of the wider one). ``softmax_scale`` defaults to q's
    ``head_dim ** -0.5``. Differentiable in q, k, v and ``sinks``. Under autocast the inputs are cast as autocast
    casts torch's own attention's (:func:`autocast_inputs`), and the output has that dtype.

    ``window=(left, right)``: global query position i sees keys i − left .. i + right (``None`` sides unbounded;
    intersected with causality), flash-attn's sliding window. ``softcap=c``: scaled scores s become
    ``c·tanh(s/c)`` before the softmax. ``sinks``: one logit per query head (``[heads]``, floating, on q's
    device) that joins every row's softmax denominator without a value (gpt-oss, megatron-core's learnable
    softmax); its ``.grad`` on each rank is that rank's part: sum it over the context-parallel group (data
    parallelism's gradient reduction over the CP ranks does). See :mod:`ctx_plugin.core.mask` and
    :mod:`ctx_plugin.core.sinks`.

    ``documents``: the packed documents of the *global* sequence, the same on every rank — a
    :class:`ctx_plugin.core.documents.Documents` or its cumulative lengths (flash-attn's ``cu_seqlens``: a 1-D integer
    tensor or a list, from 0 to the global length). Attention then stays inside each document (and skips padding,
    ``Documents.valid``); q, k and v must be sharded with the same documents (:func:`shard_sequence`). Layouts that
    split every document need each one a multiple of :func:`ctx_plugin.core.rules.document_unit`
    (:func:`ctx_plugin.core.documents.pad_documents`). Padding rows return 0 and get no gradient.
    """
    _check_groups(groups)
    kernel = error = mask = v_dim = None
    doc_code = _document_code(None, given=documents is not None)
    q, k, v = given = autocast_inputs(q, k, v)
    try:                # this rank's own checks; the ranks then agree on their outcome before communicating
        _check_setup(config, groups)
        _check_qkv(q, k, v)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        mask = Mask(causal, window, softcap)
        _check_sinks(sinks, q)
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5
        elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
                or not finite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")
        q, k, v, v_dim = _one_width(q, k, v)
        check_seq_len(config, q.shape[1] * groups.size, groups.size, _GLOBAL)
        docs = _documents_for(documents, config, q.shape[1] * groups.size, groups.size)
        doc_code = _document_code(docs, given=documents is not None)
        mask = Mask(causal, mask.window, mask.softcap, docs).within(q.shape[1] * groups.size)
        check_heads(config, q.shape[2], k.shape[2], groups.size)
        _check_device(q, groups)
        kernel = select_kernel(config.kernel, q.device, q.dtype, q.shape[-1], mask.features)
    except (TypeError, ValueError) as e:
        error = e
    if error is not None and groups.check_group is None:
        raise error
    signature = agreement.attention_signature(*given, groups=groups, causal=causal, softmax_scale=softmax_scale,
                                              kernel=None if kernel is None else kernel.name, error=error,
                                              window=window if mask is None else mask.window, softcap=softcap,
                                              sinks=sinks, documents=doc_code)

    observers = active_observers()      # a recomputation (core_attn, +recompute_attn) reports to them too

    def compute() -> torch.Tensor:      # not run when a recomputed region replays the remembered output
        with restored(observers):
            agreement.check(groups, signature)
            if error is not None:       # the same error on every rank (they agreed on it)
                raise error
            with autocast_off(q.device):       # the kernels compute in their accumulation dtype
                return run_backend(q, k, v, config=config, groups=groups, kernel=kernel, mask=mask,
                                   scale=float(softmax_scale), sinks=sinks)

    out = pinning.run(compute)
    return out if v_dim is None else out[..., :v_dim]


def autocast_inputs(q, k, v) -> tuple:
    """q, k, v as autocast casts the inputs of torch's own attention (``scaled_dot_product_attention`` runs in its
    lower precision): under autocast on their device, floating tensors other than float64 in its dtype; else as
    given. The attention then computes as its kernels do (autocast off inside, every kernel alike)."""
    try:
        active = isinstance(q, torch.Tensor) and torch.is_autocast_enabled(q.device.type)
    except RuntimeError:            # a device autocast does not know (meta)
        active = False
    if not active:
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in (q, k, v))


def _document_code(docs: Documents | None, *, given: bool = True) -> str:
    """The documents as the ranks compare them: ``"-"`` without, their count and signature once checked, ``"given"``
    for documents that failed their checks."""
    if docs is None:
        return "given" if given else "-"
    return f"{docs.count}:{docs.signature()}"


def _documents_for(documents, config: CPConfig, seq_len: int, size: int) -> Documents | None:
    if documents is None:
        return None
    docs = check_documents(documents, seq_len)
    check_documents_fit(config, docs, size)
    return docs


def _seq_dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim!r} is out of range for a {x.dim()}-D tensor")
    return dim % x.dim()


@opaque
def sequence_positions(seq_len: int, *, config: CPConfig, groups: CPGroups,
                       device: torch.device | str | None = None, documents=None) -> torch.Tensor:
    """Position ids (int64) of the tokens this rank holds, in local order, for RoPE: their global positions, or with
    packed ``documents`` (as :func:`cp_attention` takes them) their positions inside their document (0, 1, ...
    restarting in each)."""
    layout = _check_setup(config, groups)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"seq_len must be an int, got {type(seq_len).__name__}")
    check_seq_len(config, seq_len, groups.size)
    docs = _documents_for(documents, config, seq_len, groups.size)
    index = layout.local_indices(seq_len, groups.rank, groups.size, docs)
    return (index if docs is None else docs.positions()[index]).to(device)


@opaque
def shard_sequence(x: torch.Tensor, *, config: CPConfig, groups: CPGroups, dim: int = 1,
                   documents=None) -> torch.Tensor:
    """This rank's tokens of ``x`` (the full sequence along ``dim``), in the backend's layout (with packed
    ``documents``, as :func:`cp_attention` takes them, the layout's rule applied per document). Differentiable."""
    layout = _check_setup(config, groups)
    dim = _seq_dim(x, dim)
    check_seq_len(config, x.shape[dim], groups.size, _FULL)
    docs = _documents_for(documents, config, x.shape[dim], groups.size)
    return x.index_select(dim, layout.local_indices(x.shape[dim], groups.rank, groups.size, docs).to(x.device))


class _GatherSequence(torch.autograd.Function):
    """All-gather of the shards in original token order. The backward is the gradient of the sum of every
    rank's objective (like ``torch.distributed.nn.all_gather``): :class:`_SumOwnRows`, whose own backward is this
    gather again (the two linear maps are each other's adjoints), so higher-order gradients are exact too. Both
    report to the communication observers active at the first forward (``counter``)."""

    @staticmethod
    def forward(ctx, x, layout: Layout, groups: CPGroups, dim: int, counter: Observers, documents: Documents | None):
        seq_len = x.shape[dim] * groups.size
        parts = all_gather(x.new_empty((groups.size, *x.shape)), x, groups.cp, counter, "gather_sequence")
        inverse = torch.argsort(layout.permutation(seq_len, groups.size, documents)).to(x.device)
        ctx.args = (layout, groups, dim, counter, documents)
        return parts.movedim(0, dim).flatten(dim, dim + 1).index_select(dim, inverse)

    @staticmethod
    def backward(ctx, grad):
        return _SumOwnRows.apply(grad, *ctx.args), None, None, None, None, None


class _SumOwnRows(torch.autograd.Function):
    """This rank's rows of the sum over ranks of a full-sequence tensor (the gather's gradient): one
    reduce-scatter of the rows in sharded order. The caller's tensor is never modified."""

    @staticmethod
    def forward(ctx, full, layout: Layout, groups: CPGroups, dim: int, counter: Observers,
                documents: Documents | None):
        p, seq_len = groups.size, full.shape[dim]
        ranks_rows = full.index_select(dim, layout.permutation(seq_len, p, documents).to(full.device)).movedim(dim, 0)
        parts = ranks_rows.reshape(p, seq_len // p, *ranks_rows.shape[1:]).contiguous()
        own = reduce_scatter(torch.empty(parts.shape[1:], dtype=full.dtype, device=full.device), parts, groups.cp,
                             counter, "reduce_scatter_grad")
        ctx.args = (layout, groups, dim, counter, documents)
        return own.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        return _GatherSequence.apply(grad, *ctx.args), None, None, None, None, None


@opaque
def gather_sequence(x: torch.Tensor, *, config: CPConfig, groups: CPGroups, dim: int = 1,
                    documents=None) -> torch.Tensor:
    """The full sequence on every rank, in original order, from each rank's shard ``x`` (sharded with the same packed
    ``documents``, if any). Differentiable."""
    _check_groups(groups)
    error = None
    doc_code = _document_code(None, given=documents is not None)
    try:
        layout = _check_setup(config, groups)
        dim = _seq_dim(x, dim)
        check_seq_len(config, x.shape[dim] * groups.size, groups.size, _GLOBAL)
        docs = _documents_for(documents, config, x.shape[dim] * groups.size, groups.size)
        doc_code = _document_code(docs, given=documents is not None)
        if groups.size > 1:
            _check_device(x, groups)
    except (TypeError, ValueError) as e:
        error = e
    if error is None and groups.size == 1:
        return x
    if groups.check_group is not None:
        agreement.check(groups, agreement.gather_signature(x, dim=dim, groups=groups, error=error, documents=doc_code))
    if error is not None:
        raise error
    return _GatherSequence.apply(x, layout, groups, dim, active_observers(), docs)
