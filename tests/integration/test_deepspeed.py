"""DeepSpeed integration (DS_ACCELERATOR=cpu, gloo): a tiny LlamaForCausalLM (GQA, from a config) trained two
Adam steps through ``ctx_plugin.deepspeed.initialize`` with a "context_parallel" section, for every backend at
CP = 2 and 4 and at data parallel 2 × CP 2, ZeRO 1 and 3, against the same DeepSpeed run on one process: the
reported losses within 1e-5 relative and every parameter within 1e-5 of the largest parameter (fp32). Adam's
eps is 1e-6: with 1e-8, parameters whose gradient is ~0 take steps of ±lr decided by rounding noise (a sum
over ranks in another order), which shows up as ~1e-5 differences that say nothing about correctness."""
from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'ctx-plugin[deepspeed]'")
pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

import torch  # noqa: E402

from ctx_plugin.names import Backend  # noqa: E402
from tests.distributed.harness import run_spawned  # noqa: E402

PLAIN = [b.value for b in Backend if b != Backend.ULYSSES_RING]
# (world, backend, ulysses_size, cp size, micro batch per rank): dp = world / cp replicas of micro batches.
RUNS = ([(2, b, 1, 2, 2) for b in PLAIN] + [(4, b, 1, 4, 2) for b in PLAIN] + [(4, "ulysses_ring", 2, 4, 2)]
        + [(4, b, 1, 2, 2) for b in PLAIN])
CASES = [(*run, zero, "none") for run in RUNS for zero in (1, 3)]    # presets: test_deepspeed_presets.py
_results: dict[int, list] = {}


def results(world: int):
    if world not in _results:
        cases = ([("zigzag", 1, 1, z, mb) for z in (1, 3) for mb in (2, 4)] if world == 1
                 else [(b, u, cp, z, mb, r) for w, b, u, cp, mb, z, r in CASES if w == world])
        _results[world] = run_spawned("tests.integration.deepspeed_ranks:ds_train", world, {"cases": cases},
                                      timeout_s=900)
    return _results[world]


@pytest.mark.parametrize("world,backend,u,cp,micro,zero,recompute", CASES,
                         ids=[f"W{w}-{b}-u{u}-cp{cp}-zero{z}-{r}" for w, b, u, cp, mb, z, r in CASES])
def test_two_steps_match_one_process(world, backend, u, cp, micro, zero, recompute):
    dp = world // cp
    reference = results(1)[0][f"zigzag-u1-cp1-z{zero}-mb{micro * dp}"]
    got = results(world)
    key = f"{backend}-u{u}-cp{cp}-z{zero}-mb{micro}" + ("" if recompute == "none" else f"-{recompute}")
    for rank in range(world):
        for a, b in zip(got[rank][key]["losses"], reference["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, got[rank][key]["losses"], reference["losses"])
    have, want = torch.tensor(got[0][key]["params"]), torch.tensor(reference["params"])
    err = ((have - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"parameters differ by {err:.2e} of the largest"


def test_loader_gives_each_context_group_the_same_samples_sharded():
    res = run_spawned("tests.integration.deepspeed_ranks:loader_shards", 4)
    for rank, r in enumerate(res):
        first = (rank // 2) * 100                    # replica 0 takes samples 0, 2; replica 1 takes 1, 3
        want_ids = [list(range(first + s * 200, first + s * 200 + 8)) for s in (0, 1)]
        assert r["full"]["input_ids"] == want_ids and r["local_len"] == 4 and r["batches"] == 1
        assert r["full"]["labels"] == [ids[1:] + [-100] for ids in want_ids]
        assert r["full"]["loss_mask"] == [[i % 3 for i in ids] for ids in want_ids]
