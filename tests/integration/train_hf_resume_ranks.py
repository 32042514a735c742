"""Rank function of test_train_hf_resume.py: ``ctx_plugin.train_hf`` runs of a tiny GPT-2 with dropout (residual and
embedding; attention dropout 0, as ctx_plugin requires) on 2 gloo ranks at CP 2, uninterrupted and stopped then
resumed (the stop comes as a signal would: at the end of a chosen step on every rank)."""
from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path

MODEL = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 32,
         "attn_pdrop": 0.0, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "use_cache": False}


def _config(micro: int, accumulation: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
            "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 4}},
            "zero_optimization": {"stage": 1}, "context_parallel": {"size": 2, "kernel": "torch"}}


def runs(rank: int, world: int, payload: dict) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    import ctx_plugin.train_hf as train_hf

    root = Path(payload["dir"])
    if rank == 0:
        (root / "model").mkdir(parents=True, exist_ok=True)
        (root / "model" / "config.json").write_text(json.dumps(MODEL))
        for name, (micro, accumulation) in {"ds": (1, 2), "other": (2, 1)}.items():
            (root / f"{name}.json").write_text(json.dumps(_config(micro, accumulation)))
    import torch
    import torch.distributed as dist
    dist.barrier()
    stop_at = []

    class Stop(train_hf.StopRequest):
        def agreed(self, device):
            if stop_at and self.step == stop_at[0]:
                self.signal = signal.SIGUSR1
            return super().agreed(device)
    train_hf.StopRequest = Stop

    def main(name: str, config: str = "ds", stop: int | None = None, *extra: str) -> list | str:
        stop_at[:] = [] if stop is None else [stop]
        report = root / f"{name}.json"
        argv = ["--deepspeed_config", str(root / f"{config}.json"), "--model", str(root / "model"), "--seq-len", "16",
                "--samples", "8", "--steps", "5", "--checkpoint-dir", str(root / name.split("-")[0]), "--report",
                str(report), *extra]
        try:
            train_hf.main(argv)
        except SystemExit as e:
            return str(e)
        return json.loads(report.read_text())["losses"] if rank == 0 else []

    out = {"full": main("full")}
    main("resumed-1", "ds", 1)                                       # stops after step 1: checkpoint step2
    main("resumed-2", "ds", 2, "--resume")                           # step2 → stops after step 2: step3
    out["resumed"] = main("resumed-3", "ds", None, "--resume")
    main("cut-1", "ds", 1)
    main("cut-2", "ds", 3, "--resume")                               # checkpoint step4, then its save is cut short:
    if rank == 0:
        (root / "cut" / "step4" / "complete.json").unlink()        # DeepSpeed's latest names step4 already
    dist.barrier()
    out["cut"] = main("cut-3", "ds", None, "--resume")              # resumes from step2
    out["latest"] = (root / "cut" / "latest").read_text() if rank == 0 else ""
    main("layout-1", "ds", 1)
    out["layout"] = main("layout-2", "other", None, "--resume")      # micro batch 2 × accumulation 1
    out["seq_len"] = main("layout-3", "ds", None, "--resume", "--seq-len", "32")
    out["data"] = main("layout-4", "ds", None, "--resume", "--seed", "7")    # other synthetic samples, same shape
    out["seed"] = torch.initial_seed()          # the dropout stream this rank trained with
    return out
