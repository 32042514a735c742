"""Dense single-process attention in plain PyTorch autograd: the reference every test compares against."""
from __future__ import annotations

import torch


def dense_scores(q: torch.Tensor, k: torch.Tensor, *, causal: bool, scale: float | None = None, window=None,
                 softcap: float | None = None, q_positions: torch.Tensor | None = None) -> torch.Tensor:
    """The (capped, masked) scores ``[B, H, Sq, Sk]`` of :func:`dense_attention`; −inf where masked."""
    h, hkv = q.shape[2], k.shape[2]
    sq, sk = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hkv, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos_q = torch.arange(sq, device=q.device) + (sk - sq) if q_positions is None else q_positions.to(q.device)
    pos_k = torch.arange(sk, device=q.device)
    p, j = pos_q[:, None], pos_k[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= j <= p
    if window is not None and window[0] is not None:
        allowed &= j >= p - window[0]
    if window is not None and window[1] is not None:
        allowed &= j <= p + window[1]
    return s.masked_fill(~allowed, float("-inf"))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                    scale: float | None = None, window=None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, q_positions: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v on ``[B, S, H, D]`` tensors; GQA K/V heads via repeat_interleave.

    Written from the definitions, independent of ctx_plugin: key j sits at position j; query row i at
    ``q_positions[i]`` (default ``i + Sk − Sq``: bottom-right aligned, the usual positions when Sq == Sk). Query
    position p sees key position j iff ``j <= p`` (causal) and ``p − left <= j <= p + right`` (``window=(left,
    right)``, a None side unbounded). ``softcap=c`` caps the scaled scores to ``c·tanh(s/c)`` before the mask.
    ``sinks`` (``[H]``) adds one logit per head to the softmax as an extra column that carries no value.
    """
    h, sq, sk = q.shape[2], q.shape[1], k.shape[1]
    s = dense_scores(q, k, causal=causal, scale=scale, window=window, softcap=softcap, q_positions=q_positions)
    v = v.repeat_interleave(h // v.shape[2], dim=2)
    if sinks is not None:
        column = sinks.to(s.dtype).reshape(1, h, 1, 1).expand(s.shape[0], h, sq, 1)
        probs = torch.softmax(torch.cat((s, column), dim=-1), dim=-1)[..., :sk]
    else:
        probs = torch.softmax(s, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def dense_with_grads(q, k, v, dout, *, causal: bool, scale: float | None = None, **variants):
    """Output and (dq, dk, dv) of :func:`dense_attention` for upstream gradient ``dout`` (``variants``: its
    window/softcap/q_positions keywords; a ``sinks`` tensor's gradient is returned as a fifth element)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    sinks = variants.pop("sinks", None)
    if sinks is not None:
        sinks = sinks.detach().clone().requires_grad_(True)
        out = dense_attention(q, k, v, causal=causal, scale=scale, sinks=sinks, **variants)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad, sinks.grad
    out = dense_attention(q, k, v, causal=causal, scale=scale, **variants)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-wise relative error: max |got − want| / max |want| (computed in float64)."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def documents_with_grads(q, k, v, dout, docs, *, causal: bool, sinks=None, **variants):
    """out, dq, dk, dv (and dsinks) of packed documents (a ``ctx_plugin.Documents``: ``bounds`` and ``real(d)``):
    :func:`dense_attention` on every document's real tokens on their own, padding rows 0 (so nothing crosses a
    document or touches padding)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    s = None if sinks is None else sinks.detach().clone().requires_grad_(True)
    parts = []
    for d in range(docs.count):
        a, real = docs.bounds[d], docs.real(d)
        parts.append(dense_attention(q[:, a:a + real], k[:, a:a + real], v[:, a:a + real], causal=causal, sinks=s,
                                     **variants))
        parts.append(q.new_zeros(q.shape[0], docs.bounds[d + 1] - a - real, q.shape[2], v.shape[3]))
    out = torch.cat(parts, 1)
    out.backward(dout)
    grads = (q.grad, k.grad, v.grad)
    return (out.detach(), *grads) + ((s.grad,) if s is not None else ())


def fa2_window_reading(left: int, right: int, causal: bool, seqlen_k: int) -> tuple[int, int]:
    """The window FlashAttention-2 applies for the sides it is given, in its own convention (-1 unbounded;
    ``flash_api.cpp``: ``mha_fwd``/``mha_varlen_fwd``, seqlen_k the varlen call's ``max_seqlen_k``, then
    ``set_params_fprop``): a side >= seqlen_k is unbounded, causal sets the right side to 0, then an unbounded side
    next to a bounded one becomes seqlen_k. The stand-ins of torch's and flash-attn's FlashAttention-2 apply it."""
    left = -1 if left >= seqlen_k else left
    right = 0 if causal else -1 if right >= seqlen_k else right
    if left < 0 and right >= 0:
        left = seqlen_k
    if left >= 0 and right < 0:
        right = seqlen_k
    return left, right
