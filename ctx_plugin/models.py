"""A small Llama-style decoder built on ``cp_attention``: the demo's model and the block the memory model
describes (``ctx_plugin.memory``). RMSNorm or LayerNorm, GQA attention with RoPE at the positions each rank
holds, gated (SwiGLU) or plain (GELU) MLP, pre-norm residuals.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .core.api import cp_attention
from .core.config import CPConfig
from .core.groups import CPGroups


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Shape of the decoder. Every field is checked on construction."""

    vocab: int = 128
    """Vocabulary size."""
    hidden: int = 64
    """Model width h."""
    heads: int = 4
    """Query heads a; head size is hidden / heads."""
    kv_heads: int = 2
    """K/V heads (GQA when fewer than heads); must divide heads."""
    ffn: int = 256
    """MLP inner width f."""
    gated: bool = True
    """SwiGLU MLP (gate and up projections, SiLU) when True, else a plain GELU MLP with biases."""
    layers: int = 2
    """Number of decoder blocks L."""
    norm: str = "rms"
    """``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm)."""

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "heads", "kv_heads", "ffn", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden ({self.hidden}) must split into {self.heads} heads of even size (RoPE)")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm must be 'rms' or 'layer', got {self.norm!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, S, H, D]`` at the given global ``positions`` ``[S]``."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs                   # [S, D/2]
    cos = angles.cos().to(x.dtype)[None, :, None, :]
    sin = angles.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CoreAttention(nn.Module):
    """The context-parallel attention core (no parameters); its config and groups are fixed at construction."""

    def __init__(self, cp_config: CPConfig, groups: CPGroups) -> None:
        super().__init__()
        self.cp_config, self.groups = cp_config, groups

    def forward(self, q, k, v, documents=None):
        return cp_attention(q, k, v, config=self.cp_config, groups=self.groups, causal=True, documents=documents)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm that keeps only its input and the fp32 reciprocal RMS for backward on every device (what
    fused RMSNorm kernels keep; torch's CPU path would also keep the normalized input)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        acc = torch.promote_types(x.dtype, torch.float32)      # fp32 statistics; float64 stays float64
        rstd = torch.rsqrt(x.to(acc).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.to(acc) * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype) * weight.to(rstd.dtype)
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = (grad.to(rstd.dtype) * xhat).flatten(0, -2).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x):
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def _norm(c: DecoderConfig) -> nn.Module:
    return RMSNorm(c.hidden) if c.norm == "rms" else nn.LayerNorm(c.hidden)


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig, core: CoreAttention) -> None:
        super().__init__()
        self.c = c
        self.qkv = nn.Linear(c.hidden, (c.heads + 2 * c.kv_heads) * c.head_dim, bias=False)
        self.core = core
        self.proj = nn.Linear(c.hidden, c.hidden, bias=False)

    def forward(self, x, positions, documents=None):
        b, s, _ = x.shape
        hd, h, hkv = self.c.head_dim, self.c.heads, self.c.kv_heads
        q, k, v = self.qkv(x).split([h * hd, hkv * hd, hkv * hd], -1)
        q = rope(q.view(b, s, h, hd), positions)
        k = rope(k.view(b, s, hkv, hd), positions)
        return self.proj(self.core(q, k, v.view(b, s, hkv, hd), documents).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.gated = c.gated
        self.up = nn.Linear(c.hidden, (2 if c.gated else 1) * c.ffn, bias=not c.gated)
        self.down = nn.Linear(c.ffn, c.hidden, bias=not c.gated)

    def forward(self, x):
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


class DecoderBlock(nn.Module):
    def __init__(self, c: DecoderConfig, core: CoreAttention) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = _norm(c), Attention(c, core), _norm(c), MLP(c)

    def forward(self, x, positions, documents=None):
        x = x + self.attn(self.norm1(x), positions, documents)
        return x + self.mlp(self.norm2(x))


class DecoderLM(nn.Module):
    """Embedding, ``layers`` decoder blocks, final norm and LM head."""

    def __init__(self, c: DecoderConfig, cp_config: CPConfig, groups: CPGroups) -> None:
        super().__init__()
        core = CoreAttention(cp_config, groups)
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList(DecoderBlock(c, core) for _ in range(c.layers))
        self.norm = _norm(c)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def hidden_states(self, tokens, positions, documents=None):
        """The final-norm output ``[B, S, hidden]``: what the LM head reads (``documents``: packed documents of the
        global sequence, as :func:`ctx_plugin.cp_attention` takes them)."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, documents=documents)
        return self.norm(x)

    def forward(self, tokens, positions, documents=None):
        return self.head(self.hidden_states(tokens, positions, documents))

    def loss(self, tokens, positions, labels, *, tile: bool = False, loss_tokens: int | None = None,
             ignore_index: int = -100, documents=None):
        """The token sum (at least fp32) of the cross-entropy of pre-shifted ``labels`` (``ignore_index`` targets
        count nothing); the caller divides by its token count. ``tile=True`` (``+tile_loss[:<tokens>]``): head and
        loss over chunks of ``loss_tokens`` tokens (``None``: automatic), never holding the whole logits
        (:mod:`ctx_plugin.tiled_loss`)."""
        from .tiled_loss import lm_loss_sum, upcast

        if not isinstance(tile, bool):
            raise TypeError(f"tile must be True or False, got {tile!r}")
        if loss_tokens is not None and not tile:
            raise ValueError("loss_tokens sizes the chunks of the tiled loss: give it with tile=True")
        hidden = self.hidden_states(tokens, positions, documents)
        if tile:
            return lm_loss_sum(hidden, labels, self.head, tokens=loss_tokens, ignore_index=ignore_index)
        return F.cross_entropy(upcast(self.head(hidden)).flatten(0, -2), labels.flatten(), ignore_index=ignore_index,
                               reduction="sum")
