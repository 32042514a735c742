"""Autograd edge cases inside spawned ranks: double backward, gather_sequence's backward, repeated backwards
under recompute presets (see test_autograd.py)."""
from __future__ import annotations

import warnings

import torch

import ctx_plugin
from ctx_plugin.bench.counting import CommCounter
from ctx_plugin.names import Backend
from tests.recompute_cases import BATCH, build_blocks, decoder_config

SEQ, HEADS, KV_HEADS, DIM = 12, 6, 3, 8


def _error(fn) -> str | None:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def double_backward(rank: int, world: int, payload) -> dict:
    """For every backend: what create_graph=True through the attention does, and that a plain backward after it
    still works (no request left pending, no state left behind)."""
    out = {}
    for backend in Backend:
        cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=world if backend == "ulysses_ring"
                                  else 1)
        groups = ctx_plugin.build_cp_groups(cfg)
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(2, SEQ // world, HEADS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(2, SEQ // world, KV_HEADS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
                for _ in range(2))
        attn = ctx_plugin.cp_attention(q, k, v, config=cfg, groups=groups)
        message = _error(lambda: torch.autograd.grad(attn.pow(2).sum(), (q, k, v), create_graph=True))
        again = ctx_plugin.cp_attention(q, k, v, config=cfg, groups=groups)
        dq, = torch.autograd.grad(again.pow(2).sum(), q)
        out[backend.value] = {"error": message, "first_order_finite": bool(torch.isfinite(dq).all())}
    return out


def gather_backward(rank: int, world: int, payload) -> dict:
    """gather_sequence's first and second derivatives against closed forms, and the caller's gradient untouched.

    Each rank r owns x_r and computes F_r = Σ c_r ⊙ full², full = gather(x); the backward sums over ranks, so
    dF/dx_r = 2·(C ⊙ full)[rows of r] with C = Σ_r c_r. Then G = Σ_r <dF/dx_r, w_r> gives dG/dx_r = 2·C[rows]⊙w_r."""
    out = {}
    for backend in (Backend.ZIGZAG, Backend.STRIPED, Backend.RING):
        cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch")
        groups = ctx_plugin.build_cp_groups(cfg)
        full_x = torch.randn(2, SEQ, 5, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
        cs = [torch.randn(2, SEQ, 5, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)
              for r in range(world)]
        rows = ctx_plugin.sequence_positions(SEQ, config=cfg, groups=groups)
        x = full_x[:, rows].clone().requires_grad_(True)
        with CommCounter().counting() as counter:
            full = ctx_plugin.gather_sequence(x, config=cfg, groups=groups)
            upstream = 2 * cs[rank] * full.detach()
            kept = upstream.clone()
            full.backward(upstream)
            total = sum(cs)
            first_err = (x.grad - 2 * (total * full_x)[:, rows]).abs().max().item()

            x.grad = None
            full = ctx_plugin.gather_sequence(x, config=cfg, groups=groups)
            dx, = torch.autograd.grad((cs[rank] * full.pow(2)).sum(), x, create_graph=True)
            w = torch.randn(x.shape, generator=torch.Generator().manual_seed(200 + rank), dtype=torch.float64)
            first_again = (dx.detach() - 2 * (total * full_x)[:, rows]).abs().max().item()
            (dx * w).sum().backward()
            second_err = (x.grad - 2 * total[:, rows] * w).abs().max().item()
        out[backend.value] = {"upstream_untouched": torch.equal(upstream, kept), "first_err": first_err,
                              "first_err_create_graph": first_again, "second_err": second_err,
                              "comm": dict(counter.counts)}
    return out


def repeated_backward(rank: int, world: int, payload) -> dict:
    """A stack under each preset, backward twice (retain_graph=True): the second gradient equals the first, and
    the second backward communicates exactly as much as the first (pinned attention is replayed, not re-run)."""
    cfg = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    c = decoder_config("gqa-gated")
    seq = 6 * world
    out = {}
    for preset in payload["presets"]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            blocks = build_blocks(c, cfg, groups, preset)
        full = torch.randn(BATCH, seq, c.hidden, generator=torch.Generator().manual_seed(5))
        x = ctx_plugin.shard_sequence(full, config=cfg, groups=groups).requires_grad_(True)
        pos = ctx_plugin.sequence_positions(seq, config=cfg, groups=groups)
        with CommCounter().counting() as counter:
            y = x
            for block in blocks:
                y = block(y, pos)
            loss = y.pow(2).sum()
        counter.reset()
        loss.backward(retain_graph=True)    # counted: by the counter active at the forward
        first_comm, first = dict(counter.counts), x.grad.clone()
        counter.reset()
        x.grad = None
        message = _error(lambda: loss.backward())
        second_comm = dict(counter.counts)
        out[preset] = {"error": message, "first_comm": first_comm, "second_comm": second_comm,
                       "same": message is None and torch.equal(x.grad, first)}
    return out
