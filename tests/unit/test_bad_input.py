"""Bad input raises a clear ValueError/TypeError naming the fix (single process; the multi-rank cases,
which need a real group, live in tests/distributed/test_bad_input_ranks.py)."""
from __future__ import annotations

import pytest
import torch

import ctx_plugin

CFG = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")


def _call(q, k, v, cfg=CFG, groups=None, **kw):
    groups = ctx_plugin.build_cp_groups(cfg) if groups is None else groups
    return ctx_plugin.cp_attention(q, k, v, config=cfg, groups=groups, **kw)


def _qkv(h=4, hkv=2, s=8, d=16, dtype=torch.float32):
    return torch.randn(2, s, h, d, dtype=dtype), torch.randn(2, s, hkv, d, dtype=dtype), \
        torch.randn(2, s, hkv, d, dtype=dtype)


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown backend 'rng'; choose one of: ring, zigzag, striped"):
        ctx_plugin.CPConfig(backend="rng")


def test_unknown_kernel_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown kernel 'flash3'.*auto, torch"):
        ctx_plugin.CPConfig(kernel="flash3")


def test_config_is_keyword_only_frozen_and_typed():
    with pytest.raises(TypeError):
        ctx_plugin.CPConfig("zigzag")  # noqa - positional use is refused
    with pytest.raises(TypeError, match="backend must be a string"):
        ctx_plugin.CPConfig(backend=3)
    with pytest.raises(AttributeError):
        CFG.backend = "ring"  # type: ignore[misc]
    assert ctx_plugin.CPConfig(backend="ring").backend is ctx_plugin.Backend.RING


def test_ulysses_size_checks():
    with pytest.raises(ValueError, match="applies to backend='ulysses_ring' only"):
        ctx_plugin.CPConfig(backend="zigzag", ulysses_size=2)
    with pytest.raises(ValueError, match="at least 1"):
        ctx_plugin.CPConfig(backend="ulysses_ring", ulysses_size=0)
    with pytest.raises(TypeError, match="ulysses_size must be an int"):
        ctx_plugin.CPConfig(backend="ulysses_ring", ulysses_size=2.0)
    with pytest.raises(ValueError, match=r"ulysses_size 2 must divide context-parallel size 1"):
        ctx_plugin.build_cp_groups(ctx_plugin.CPConfig(backend="ulysses_ring", ulysses_size=2))


def test_groups_built_with_another_ulysses_size():
    """Single process: a group of one accepts ulysses_size 1 only, so compare two configs differing in it."""
    q, k, v = _qkv()
    groups = ctx_plugin.build_cp_groups(ctx_plugin.CPConfig(backend="ulysses_ring", ulysses_size=1))
    with pytest.raises(ValueError, match="groups were built for"):
        ctx_plugin.cp_attention(q, k, v, config=ctx_plugin.CPConfig(backend="ulysses_ring", ulysses_size=2),
                                groups=groups)


def test_not_4d():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q must be 4-D \[batch, local_seq, heads, head_dim\]"):
        _call(q[0], k, v)


def test_not_a_tensor():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        _call(q, k.tolist(), v)


def test_mismatched_dtype():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="share one dtype"):
        _call(q, k.double(), v)


def test_integer_tensors():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="floating point"):
        _call(q.long(), k.long(), v.long())


def test_mismatched_device():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="one device"):
        _call(q, k.to("meta"), v)


def test_mismatched_batch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="same batch size"):
        _call(q, k[:1], v[:1])


def test_mismatched_head_dim():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="same head_dim"):
        _call(q, k[..., :8], v[..., :8])


def test_mismatched_kv_shapes():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        _call(q, k, v[:, :4])


def test_heads_not_multiple_of_kv_heads():
    q, k, v = _qkv(h=4, hkv=3)
    with pytest.raises(ValueError, match=r"heads \(4\) must be a multiple of kv_heads \(3\)"):
        _call(q, k, v)


def test_zigzag_needs_even_local_length():
    q, k, v = _qkv(s=7)
    with pytest.raises(ValueError, match="positive multiple of 2"):
        _call(q, k, v)


def test_groups_built_for_another_config():
    q, k, v = _qkv()
    other = ctx_plugin.build_cp_groups(ctx_plugin.CPConfig(backend="ring", kernel="torch"))
    with pytest.raises(ValueError, match="groups were built for"):
        _call(q, k, v, groups=other)


def test_groups_of_the_wrong_type():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="build_cp_groups"):
        ctx_plugin.cp_attention(q, k, v, config=CFG, groups=object())


def test_bad_scale_and_causal():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="softmax_scale"):
        _call(q, k, v, softmax_scale=-1.0)
    with pytest.raises(TypeError, match="causal must be a bool"):
        _call(q, k, v, causal="yes")


def test_explicit_kernel_unavailable_says_how():
    q, k, v = _qkv()
    cfg = ctx_plugin.CPConfig(kernel="sdpa_cudnn")
    with pytest.raises(ValueError, match="kernel 'sdpa_cudnn' cannot run here: .*needs a CUDA device"):
        _call(q, k, v, cfg=cfg)
    cfg = ctx_plugin.CPConfig(kernel="flash_attn")
    with pytest.raises(ValueError, match="kernel 'flash_attn' cannot run here"):
        _call(q, k, v, cfg=cfg)


def test_shard_sequence_refuses_lengths_the_layout_cannot_split():
    cfg = ctx_plugin.CPConfig(backend="zigzag")
    groups = ctx_plugin.build_cp_groups(cfg)
    with pytest.raises(ValueError, match="positive multiple of 2"):
        ctx_plugin.shard_sequence(torch.randn(1, 7), config=cfg, groups=groups, dim=1)
    with pytest.raises(ValueError, match="out of range"):
        ctx_plugin.shard_sequence(torch.randn(1, 8), config=cfg, groups=groups, dim=2)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        ctx_plugin.sequence_positions(8.0, config=cfg, groups=groups)


def test_build_groups_needs_a_config_and_initialized_dist_for_a_group():
    with pytest.raises(TypeError, match="CPConfig"):
        ctx_plugin.build_cp_groups({"backend": "ring"})
    with pytest.raises(ValueError, match="not initialized"):
        ctx_plugin.build_cp_groups(CFG, group=object())
