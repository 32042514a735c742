"""Runs a function on N spawned gloo processes and returns what each rank returned.

Processes start from a fork server that has imported torch once (``forkserver``, preloading torch and numpy:
about 0.1 s per launch instead of 3 s for spawned interpreters that each import torch), with the parent's current
environment; a launch still costs what its ranks import beyond that (megatron-core, DeepSpeed, transformers), so
tests run a whole matrix of cases per launch. Rendezvous goes through a file store in a fresh temporary directory
(no ports to collide), every collective has a timeout, and the parent kills the processes after a hard deadline.
"""
from __future__ import annotations

import datetime
import gc
import importlib
import json
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctx_plugin.worker import leave

COLLECTIVE_TIMEOUT_S = 60
# Imported once by the fork server (before it forks any rank): nothing here may start threads or touch a device at
# import, so the forked ranks start as clean as spawned ones.
PRELOAD = ["torch", "torch.distributed", "numpy"]


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, target: str, payload, env: dict) -> None:
    os.environ.clear()          # the parent's environment now, not the fork server's from its first launch
    os.environ.update(env)
    torch.set_num_threads(1)
    result: dict
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        module_name, fn_name = target.split(":")
        fn = getattr(importlib.import_module(module_name), fn_name)
        gc.freeze()     # what exists now is never garbage: memory measurements' collections need not scan it
        result = {"ok": True, "value": fn(rank, world_size, payload)}
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with the traceback
        result = {"ok": False, "error": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    leave(0)        # the result is on disk: no C++ static destructors, which gloo's threads may outlive


def run_spawned(target: str, world_size: int, payload=None, timeout_s: float = 300.0) -> list:
    """Calls ``module:function(rank, world_size, payload)`` on ``world_size`` gloo ranks; returns their values.

    Raises RuntimeError with every failing rank's traceback, or on timeout."""
    mp.set_forkserver_preload(PRELOAD)      # takes effect when the fork server starts (the first launch)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "store"), tmp, target, payload,
                                                dict(os.environ)),
                                 nprocs=world_size, join=False, start_method="forkserver")
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            while not ctx.join(timeout=1.0):
                if datetime.datetime.now() > deadline:
                    raise RuntimeError(f"{target} on {world_size} ranks did not finish within {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if not res["ok"]]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [res["value"] for res in results]
