"""CPGroups is the group topology only: communication is counted by context-scoped observers (a backward by the
counter of its forward, on whatever thread it runs), and the recompute pins' state belongs to the context, not
to the groups or the model."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench.counting import CommCounter
from ctx_plugin.bench.simulated import SimulatedGroup, run_threaded, simulated_groups
from ctx_plugin.core.groups import CPGroups, RankGroup
from ctx_plugin.names import Backend
from ctx_plugin.recompute import pinning
from tests.recompute_cases import BATCH, build_blocks, counting_attention, decoder_config


def test_groups_hold_the_topology_only():
    groups = ctx_plugin.build_cp_groups(ctx_plugin.CPConfig())
    names = ["config", "cp", "ulysses", "ring", "device_types", "check_group"]
    assert [f.name for f in dataclasses.fields(CPGroups)] == names
    assert sorted(vars(groups)) == sorted(names)              # nothing attached beside the fields
    assert [f.name for f in dataclasses.fields(RankGroup)] == ["group", "rank", "size"]
    assert sorted(vars(groups.cp)) == ["group", "rank", "size"]
    sim = simulated_groups(ctx_plugin.CPConfig(), 1, 2, None, "cpu")
    assert type(sim.cp) is RankGroup and isinstance(sim.cp.group, SimulatedGroup)     # the group moves the data
    assert (sim.cp.group.rank, sim.cp.group.members) == (1, (0, 1))


def test_the_core_does_not_import_the_benchmark():
    code = ("import sys, ctx_plugin, ctx_plugin.recompute; "
            "print(sorted(m for m in sys.modules if m.startswith('ctx_plugin.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# P = 4 (hybrid: 2 × 2): the forward's operations, then the backward's.
EXPECTED = {Backend.ZIGZAG: ({"ring_kv": 3}, {"ring_kv": 3, "ring_dkv": 4}),
            Backend.ULYSSES: ({"a2a": 4}, {"a2a": 4}),
            Backend.ULYSSES_RING: ({"a2a": 4, "ring_kv": 1}, {"a2a": 4, "ring_kv": 1, "ring_dkv": 2}),
            Backend.ALLGATHER: ({"allgather_kv": 1}, {"allgather_kv": 1, "reduce_scatter_dkv": 1})}


@pytest.mark.parametrize("backend", list(EXPECTED))
def test_a_backward_on_another_thread_is_counted_by_its_forwards_counter(backend):
    """The backward runs in a fresh thread (as autograd's CUDA worker threads do: the forward's context is not
    set there), with another counter active: the forward's counter counts it, the other counts nothing."""
    cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=2 if backend == Backend.ULYSSES_RING else 1)

    def rank_work(rank: int, world) -> tuple[dict, dict, dict]:
        groups = simulated_groups(cfg, rank, 4, world, "cpu")
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(1, 4, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(1, 4, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
        counter, bystander, failed = CommCounter(), CommCounter(), []
        with counter.counting():
            out = ctx_plugin.cp_attention(q, k, v, config=cfg, groups=groups)
        forward = dict(counter.counts)
        counter.reset()

        def backward():
            try:
                with bystander.counting():
                    out.pow(2).sum().backward()
            except BaseException as e:          # noqa: BLE001 - re-raised on the rank's thread
                failed.append(e)

        thread = threading.Thread(target=backward)
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        assert q.grad is not None and k.grad is not None
        return forward, dict(counter.counts), dict(bystander.counts)

    for forward, backward, bystander in run_threaded(4, rank_work):
        assert (forward, backward) == EXPECTED[backend]
        assert bystander == {}


def _run(blocks, x, pos):
    y = x
    for block in blocks:
        y = block(y, pos)
    return y.pow(2).sum()


def test_two_models_regions_do_not_see_each_others_pins_state():
    """Two models on one CPGroups, under 'full' and 'selective': both forwards, then B's backward on another
    thread and A's after it. Each attention runs once (every replay hands out its own region's output) and the
    gradients equal those of the same models without a preset; no state is left set."""
    cfg = ctx_plugin.CPConfig(kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    c = decoder_config("gqa-plain")
    seq = 8
    pos = ctx_plugin.sequence_positions(seq, config=cfg, groups=groups)
    inputs = [torch.randn(BATCH, seq, c.hidden, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
              for s in (1, 2)]
    grads = {}
    for kind, presets in (("preset", ("full", "selective")), ("plain", ("none", "none"))):
        models = [build_blocks(c, cfg, groups, p, seed=i).double() for i, p in enumerate(presets)]
        xs = [x.clone().requires_grad_(True) for x in inputs]
        with counting_attention() as calls:
            losses = [_run(m, x, pos) for m, x in zip(models, xs)]
            assert pinning.state() == pinning.PinState()
            thread = threading.Thread(target=losses[1].backward)
            thread.start()
            thread.join()
            losses[0].backward()
        assert calls["n"] == 2 * c.layers, kind           # replayed, never re-run
        assert pinning.state() == pinning.PinState()
        grads[kind] = [x.grad for x in xs] + [p.grad for m in models for p in m.parameters()]
        assert all(g is not None for g in grads[kind])
    for got, want in zip(grads["preset"], grads["plain"]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
