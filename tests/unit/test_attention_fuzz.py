"""Random combinations of everything ``cp_attention`` takes, against the float64 reference (tests/reference.py).

The other matrices vary a few settings at a time; here every case draws all of them at once, from a seeded
generator (the same cases every run): backend and CP size (1-8; the hybrid with Ulysses groups of 2 or 3), heads and
query groups (MHA, GQA, MQA, counts not powers of two), head sizes (odd ones; values wider or narrower than queries
and keys, as multi-latent attention has), causal or not, sliding windows (one-sided, two-sided, zero-wide), softcap,
sinks, softmax scale, packed documents (padded or fitting), batch, kernel (``torch``, ``sdpa_cpu``, ``auto``),
float64/float32, and how q, k and v lie in memory (separate tensors, views into one fused QKV projection, or
Megatron's ``[seq, batch, ...]`` transposed to ``[batch, seq, ...]``). Each case runs on simulated ranks (threads
exchanging real tensors) and compares the gathered output and every gradient (the sinks' summed over the ranks).
A setting the kernel cannot apply must be the kernel's clear refusal, nothing else.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench.simulated import run_threaded, simulated_groups
from ctx_plugin.core.documents import Documents, pad_documents
from ctx_plugin.core.rules import check_heads, padding_units, sequence_unit
from ctx_plugin.names import Backend

from ..reference import dense_with_grads, documents_with_grads

CASES = 240


def draw(seed: int) -> dict:
    rng = random.Random(seed)
    backend = rng.choice(list(Backend))
    u = rng.choice([2, 3]) if backend == Backend.ULYSSES_RING else 1
    size = u * rng.choice([1, 2, 3]) if backend == Backend.ULYSSES_RING else rng.choice([1, 2, 3, 4, 5, 6, 8])
    kv_heads = rng.choice([1, 2, 3, 4])
    dim = rng.choice([4, 5, 8, 12])
    causal = rng.random() < 0.6
    window = None
    if rng.random() < 0.4:
        window = (rng.choice([None, 0, 1, 2, 3, 5, 8, 13, 40]),
                  rng.choice([0, None, 3]) if causal else rng.choice([None, 0, 1, 4, 9]))
    return {"backend": backend, "u": u, "size": size, "heads": kv_heads * rng.choice([1, 2, 3]),
            "kv_heads": kv_heads, "dim": dim, "v_dim": rng.choice([dim, dim, rng.choice([3, 6, 16])]),
            "causal": causal, "window": window, "softcap": rng.choice([None, None, 0.7, 2.5]),
            "sinks": rng.random() < 0.3, "scale": rng.choice([None, None, 0.05, 0.9]),
            "documents": rng.choice([None, "fit", "padded"]), "batch": rng.choice([1, 2]),
            "kernel": rng.choice(["torch", "torch", "sdpa_cpu", "auto"]),
            "dtype": rng.choice([torch.float64, torch.float64, torch.float32]),
            "memory": rng.choice(["separate", "fused", "sbhd"]), "lengths": [rng.randint(1, 20)
                                                                            for _ in range(rng.choice([1, 2, 5, 8]))],
            "repeat": rng.choice([1, 2, 3]), "seed": rng.randrange(1 << 30)}


def _documents(config, case) -> Documents | None:
    unit, total = padding_units(config, case["size"])
    if case["documents"] == "padded":
        return pad_documents(case["lengths"], unit, total_unit=total)[0]
    if case["documents"] == "fit":             # every document a multiple of the layout's unit, no padding
        lengths = [max(unit, n // unit * unit) for n in case["lengths"]]
        lengths[-1] += -sum(lengths) % total
        return Documents((0, *itertools.accumulate(lengths)))
    return None


def _local_inputs(shard, q, k, v, case):
    """This rank's q, k and v laid out as ``case["memory"]`` says, and the tensors whose gradients are compared."""
    q, k, v = (shard(t).to(case["dtype"]) for t in (q, k, v))
    if case["memory"] == "fused" and q.shape[-1] == v.shape[-1]:      # views into one [b, s, h + 2·kv, d] tensor
        fused = torch.cat((q, k, v), dim=2).requires_grad_(True)
        h, kv = q.shape[2], k.shape[2]
        views = fused[:, :, :h], fused[:, :, h:h + kv], fused[:, :, h + kv:]
    elif case["memory"] == "sbhd":                                      # [s, b, ...] storage seen as [b, s, ...]
        views = tuple(t.transpose(0, 1).contiguous().requires_grad_(True).transpose(0, 1) for t in (q, k, v))
    else:
        return [t.requires_grad_(True) for t in (q, k, v)]
    for t in views:
        t.retain_grad()
    return list(views)


def run_case(case: dict):
    """``(got, want)``: out, dq, dk, dv (and dsinks) gathered from the simulated ranks and from the reference;
    None when the heads cannot be split over the ranks (a refusal tested elsewhere)."""
    config = ctx_plugin.CPConfig(backend=case["backend"], ulysses_size=case["u"], kernel=case["kernel"])
    size = case["size"]
    try:
        check_heads(config, case["heads"], case["kv_heads"], size)
    except ValueError:
        return None
    docs = _documents(config, case)
    seq = docs.seq_len if docs is not None else sequence_unit(config, size) * case["repeat"]
    g = torch.Generator().manual_seed(case["seed"])
    b, h, kv, d, dv = case["batch"], case["heads"], case["kv_heads"], case["dim"], case["v_dim"]
    q, k = torch.randn(b, seq, h, d, generator=g, dtype=torch.float64), torch.randn(b, seq, kv, d, generator=g,
                                                                                     dtype=torch.float64)
    v = torch.randn(b, seq, kv, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(b, seq, h, dv, generator=g, dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64) if case["sinks"] else None
    variants = {"window": case["window"], "softcap": case["softcap"]}

    def rank_work(rank: int, world):
        groups = simulated_groups(config, rank, size, world, "cpu")
        shard = lambda t: ctx_plugin.shard_sequence(t, config=config, groups=groups, dim=1,  # noqa: E731
                                                    documents=docs)
        local = _local_inputs(shard, q, k, v, case)
        own = None if sinks is None else sinks.to(case["dtype"]).detach().clone().requires_grad_(True)
        out = ctx_plugin.cp_attention(*local, config=config, groups=groups, causal=case["causal"], sinks=own,
                                      softmax_scale=case["scale"], documents=docs, **variants)
        assert out.dtype == case["dtype"] and out.shape == (*local[0].shape[:3], dv)
        out.backward(shard(dout).to(case["dtype"]))
        gather = lambda t: ctx_plugin.gather_sequence(t, config=config, groups=groups, dim=1,  # noqa: E731
                                                      documents=docs)
        with torch.no_grad():
            return [gather(t).double() for t in (out, *(x.grad for x in local))], own

    results = run_threaded(size, rank_work)
    got = results[0][0] + ([sum(r[1].grad.double() for r in results)] if sinks is not None else [])
    if docs is not None:
        want = documents_with_grads(q, k, v, dout, docs, causal=case["causal"], scale=case["scale"], sinks=sinks,
                                    **variants)
    else:
        want = dense_with_grads(q, k, v, dout, causal=case["causal"], scale=case["scale"], sinks=sinks, **variants)
    return got, want


@pytest.mark.parametrize("seed", range(CASES))
def test_random_combinations_match_the_reference(seed):
    case = draw(seed)
    try:
        result = run_case(case)
    except ValueError as e:         # only the CPU kernel's refusal of what it cannot apply
        assert case["kernel"] == "sdpa_cpu" and (case["softcap"] or case["window"]), (case, e)
        assert "kernel 'sdpa_cpu' cannot apply" in str(e) and "kernel='torch'" in str(e)
        return
    if result is None:
        return
    got, want = result
    # relative to the largest of out and the gradients (a zero-wide window makes dq and dk exactly 0 in exact
    # arithmetic); float32 against that largest value as a whole
    top = max(w.abs().max().item() for w in want[:4])
    floor, tol = (1e-4 * top, 1e-9) if case["dtype"] == torch.float64 else (top, 2e-5)
    names = ("out", "dq", "dk", "dv", "dsinks")[:len(want)]
    for name, a, w in zip(names, got, want, strict=True):
        assert a.shape == w.shape, (name, case)
        err = ((a - w).abs().max() / max(w.abs().max().item(), floor)).item()
        assert err <= tol, f"{name}: relative error {err:.2e} in {case}"
