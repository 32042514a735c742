"""DeepSpeed integration (DS_ACCELERATOR=cpu, gloo): a tiny Qwen2 (q/k/v biases, GQA, init std 0.1) trained two
Adam steps through ``ctx_plugin.deepspeed.initialize`` with a "context_parallel" section, for every backend at
CP = 2 and 4 (data parallel 2 × CP 2: test_deepspeed_presets.py), each backend under ZeRO 1 at one CP size and ZeRO 3
at the other (the hybrid, CP 4 only, under both), against plain PyTorch training of the same model on the same
global batch (one process, no DeepSpeed, no ctx_plugin: HF's sdpa attention,
``torch.optim.Adam``, DeepSpeed's default clipping to 1.0): every rank's losses and gradient norms within 1e-5
relative, every parameter within 1e-5 of the largest (fp32). Adam's eps is 1e-6: with 1e-8, parameters whose gradient
is ~0 take steps of ±lr decided by rounding noise (a sum over ranks in another order), ~1e-5 differences that say
nothing about correctness."""
from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'ctx-plugin[deepspeed]'")
pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

from ctx_plugin.names import Backend  # noqa: E402
from tests.distributed.harness import run_spawned  # noqa: E402
from tests.integration.deepspeed_ranks import check_against_plain, launch, plain_train  # noqa: E402

PLAIN = [b.value for b in Backend if b != Backend.ULYSSES_RING]
# (world, backend, ulysses_size, cp size, micro batch per rank): dp = world / cp replicas of micro batches.
# Data parallel 2 × CP 2 for every backend and ZeRO 0-3: the presets matrix of test_deepspeed_presets.py.
# ZeRO 1 and 3 alternate over the backends, the other way round at CP 4: every backend meets both stages once.
CASES = ([(2, b, 1, 2, 2, (1, 3)[i % 2]) for i, b in enumerate(PLAIN)]
         + [(4, b, 1, 4, 2, (3, 1)[i % 2]) for i, b in enumerate(PLAIN)]
         + [(4, "ulysses_ring", 2, 4, 2, zero) for zero in (1, 3)])    # recompute presets: test_deepspeed_presets.py


# (world, backend, cp size, ZeRO stage, torch.compile backend): DeepSpeed's engine.compile() (torch.compile of the
# module; ctx_plugin's attention runs outside the compiled graphs), micro batch 2 per rank
COMPILED = [(2, "zigzag", 2, 3, "aot_eager"), (2, "ulysses", 2, 1, "inductor")]


def payload(world: int) -> dict:
    """deepspeed_ranks.ds_train's, run in the launch shared with test_deepspeed_presets.py (deepspeed_ranks.launch)."""
    return {"cases": [(b, u, cp, z, mb) for w, b, u, cp, mb, z in CASES if w == world]
            + [(b, 1, cp, z, 2, c) for w, b, cp, z, c in COMPILED if w == world]}


def results(world: int) -> list:
    return [r["ds_train"] for r in launch(world)]


@pytest.mark.parametrize("world,backend,u,cp,micro,zero", CASES,
                         ids=[f"W{w}-{b}-u{u}-cp{cp}-zero{z}" for w, b, u, cp, mb, z in CASES])
def test_two_steps_match_plain_pytorch(world, backend, u, cp, micro, zero):
    check_against_plain(results(world), f"{backend}-u{u}-cp{cp}-z{zero}-mb{micro}", plain_train(micro * world // cp))


@pytest.mark.parametrize("world,backend,cp,zero,compiler", COMPILED,
                         ids=[f"W{w}-{b}-cp{cp}-zero{z}-{c}" for w, b, cp, z, c in COMPILED])
def test_two_compiled_steps_match_plain_pytorch(world, backend, cp, zero, compiler):
    """engine.compile() before training: the same two steps as plain PyTorch's (inductor's own float64 arithmetic
    is not in play: the model is fp32 here, as the uncompiled cases)."""
    check_against_plain(results(world), f"{backend}-u1-cp{cp}-z{zero}-mb2-{compiler}", plain_train(2 * world // cp))


@pytest.mark.parametrize("world", [2, 4])
def test_the_engines_device_is_current_before_the_groups_first_collective(world):
    """deepspeed.init_distributed binds NCCL to LOCAL_RANK's GPU without making it current; the groups' first
    all-gather ran on cuda:0 from every rank of a node (NCCL: duplicate GPU). The device DeepSpeed's engine takes is
    made current first (seen through the CPU accelerator's set_device)."""
    for rank, r in enumerate(results(world)):
        assert r["first events"] == [f"device {rank}", "groups"], (rank, r["first events"])


def test_a_batch_refused_on_one_replica_is_one_error_on_every_rank():
    """A padded sample reaches replica 1 only: its ranks used to raise alone while replica 0's went on into ZeRO-3's
    parameter gathers and waited there (NCCL: until the watchdog's timeout)."""
    results = [r["refused_batch"] for r in launch(4)]
    for rank, r in enumerate(results):
        assert r["error"] == "the batch of data-parallel replicas [1] was refused: padded batches are not supported " \
            "under context parallelism: pack or trim sequences and give padding labels -100 instead of an " \
            "attention_mask", (rank, r)
        assert r["probe"] == 4 and r["seconds"] < 30, (rank, r)


def test_loader_gives_each_context_group_the_same_samples_sharded():
    res = run_spawned("tests.integration.deepspeed_ranks:loader_shards", 4)
    for rank, r in enumerate(res):
        first = (rank // 2) * 100                    # replica 0 takes samples 0, 2; replica 1 takes 1, 3
        want_ids = [list(range(first + s * 200, first + s * 200 + 8)) for s in (0, 1)]
        assert r["full"]["input_ids"] == want_ids and r["local_len"] == 4 and r["batches"] == 1
        assert r["full"]["labels"] == [ids[1:] + [-100] for ids in want_ids]
        assert r["full"]["loss_mask"] == [[i % 3 for i in ids] for ids in want_ids]


def test_deepspeed_io_and_drop_last_give_each_context_group_the_same_samples(tmp_path):
    """CP 2, one replica, 5 samples, micro batch 2, "dataloader_drop_last": the config comes in
    args.deepspeed_config (deepspeed.initialize refuses it in both args and config=); both ranks see the same
    samples, gathered whole, in whole batches only; engine.deepspeed_io too (DeepSpeed's would give each rank of
    the group a different sample), in order on the eval route, shuffled as DeepSpeed's DistributedSampler on the
    training route."""
    import json

    import torch

    from tests.integration.deepspeed_ranks import OPTIM, spawn

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "dataloader_drop_last": True,
                                  "optimizer": {"type": "Adam", "params": {**OPTIM, "torch_adam": True}},
                                  "context_parallel": {"size": 2, "kernel": "torch"}}))
    ids = [list(range(i * 100, i * 100 + 8)) for i in range(5)]
    shuffled = torch.randperm(5, generator=torch.Generator().manual_seed(0)).tolist()   # DistributedSampler, seed 0
    for r in spawn("io_loaders", 2, {"config": str(config)}):
        assert r["args_config"] == str(config) and r["local_len"] == 4
        assert r["train"] == r["eval"] == [[ids[0], ids[1]], [ids[2], ids[3]]]          # the 5th sample dropped
        assert r["io_train"] == [[ids[i]] for i in shuffled]
        assert "engine.deepspeed_io(data_sampler=...)" in r["sampler"] and "needs a map-style dataset" in r["iterable"]
