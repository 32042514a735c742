"""ctx_plugin's calls of torch's CUDA attention ops, checked against the installed torch on the CPU: the real
``aten::_scaled_dot_product_cudnn_attention``/``_scaled_dot_product_flash_attention`` (and their backwards) and
``aten::_flash_attention_forward/_backward`` run on meta tensors (their meta kernels: shapes and dtypes, no GPU),
and the positional parameters ctx_plugin fills are pinned by name in each op's schema. ``tests/unit/
test_sdpa_layouts.py`` replaces these ops by stand-ins; this file catches a torch whose op signatures moved
(checked: torch 2.11 and 2.13 agree on every parameter used here; 2.13 adds keyword-only ``block_table`` and
``num_splits`` to ``_flash_attention_forward``, which ctx_plugin leaves at their defaults)."""
from __future__ import annotations

import pytest
import torch

from ctx_plugin.core.kernels import sdpa
from ctx_plugin.core.kernels.varlen import Varlen

# The leading positional parameters ctx_plugin passes, by name, per op (the rest by keyword: scale, windows).
POSITIONAL = {
    "_scaled_dot_product_cudnn_attention": ["query", "key", "value", "attn_bias", "compute_log_sumexp",
                                            "dropout_p", "is_causal", "return_debug_mask"],
    "_scaled_dot_product_cudnn_attention_backward": ["grad_out", "query", "key", "value", "out", "logsumexp",
                                                     "philox_seed", "philox_offset", "attn_bias", "cum_seq_q",
                                                     "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal"],
    "_scaled_dot_product_flash_attention": ["query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"],
    "_scaled_dot_product_flash_attention_backward": ["grad_out", "query", "key", "value", "out", "logsumexp",
                                                     "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                                                     "is_causal", "philox_seed", "philox_offset"],
    "_flash_attention_forward": ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                                 "is_causal", "return_debug_mask"],
    "_flash_attention_backward": ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q",
                                  "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused"],
    "_scaled_dot_product_flash_attention_for_cpu": ["query", "key", "value", "dropout_p", "is_causal"],
    "_scaled_dot_product_flash_attention_for_cpu_backward": ["grad_out", "query", "key", "value", "out",
                                                             "logsumexp", "dropout_p", "is_causal"],
}
KEYWORDS = {"_flash_attention_forward": {"scale", "window_size_left", "window_size_right"},
            "_flash_attention_backward": {"scale", "window_size_left", "window_size_right"}}


@pytest.mark.parametrize("op", sorted(POSITIONAL))
def test_schema_positions(op):
    schema = getattr(torch.ops.aten, op).default._schema
    names = [a.name for a in schema.arguments if not a.kwarg_only]
    assert names[:len(POSITIONAL[op])] == POSITIONAL[op], f"torch {torch.__version__}: {schema}"
    keywords = {a.name for a in schema.arguments if a.kwarg_only}
    assert {"scale"} | KEYWORDS.get(op, set()) <= keywords, f"torch {torch.__version__}: {schema}"


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


KERNELS = {"sdpa_cudnn": sdpa.CudnnKernel, "sdpa_flash": sdpa.FlashKernel}
# (batch, Sq, Sk, heads, K/V heads, causal): GQA, MQA, a causal block with more keys than queries (two calls).
SHAPES = [(2, 128, 128, 8, 2, True), (1, 64, 192, 8, 8, True), (2, 64, 128, 8, 4, False),
          (1, 128, 128, 4, 1, False)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_block_calls_on_meta(name, shape):
    b, sq, sk, h, hk, causal = shape
    q, k, v = _meta(b, sq, h, 64), _meta(b, sk, hk, 64), _meta(b, sk, hk, 64)
    kernel = KERNELS[name]()
    out, lse = kernel.forward(q, k, v, causal=causal, scale=0.125)
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    assert (lse.shape, lse.dtype) == ((b, h, sq), torch.float32)
    dq, dk, dv = kernel.backward(out, q, k, v, out, lse, causal=causal, scale=0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dk.dtype == dv.dtype == k.dtype


@pytest.mark.parametrize("window,causal", [((16, None), True), ((16, 8), False), ((None, 4), False)])
def test_windowed_flash_calls_on_meta(window, causal):
    q, k, v = _meta(2, 128, 8, 64), _meta(2, 128, 2, 64), _meta(2, 128, 2, 64)
    kernel = sdpa.FlashKernel()
    out, lse = kernel.forward(q, k, v, causal=causal, scale=0.125, window=window)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (2, 8, 128), torch.float32)
    dq, dk, dv = kernel.backward(out, q, k, v, out, lse, causal=causal, scale=0.125, window=window)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


VARLEN = [(((0, 40, 0, 40), (40, 100, 40, 130), (100, 128, 130, 130)), True, (None, None)),
          (((0, 1, 0, 10), (1, 2, 10, 20)), False, (8, None))]       # the second: max_q 1 (K/V expanded)


@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("seqs,causal,window", VARLEN, ids=["causal", "one-row"])
def test_varlen_flash_calls_on_meta(seqs, causal, window, kv_heads):
    batch = Varlen(seqs=seqs, causal=causal, window=window, blocks=2)
    tq, tk = seqs[-1][1], seqs[-1][3]
    q = _meta(tq, 8, 64, dtype=torch.float16)
    k, v = _meta(tk, kv_heads, 64, dtype=torch.float16), _meta(tk, kv_heads, 64, dtype=torch.float16)
    kernel = sdpa.FlashKernel()
    out, lse = kernel.forward_varlen(q, k, v, batch, scale=0.125)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (8, tq), torch.float32)
    dq, dk, dv = kernel.backward_varlen(out, q, k, v, out, lse, batch, scale=0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
