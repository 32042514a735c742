"""The job scripts under a real SLURM: launch/megatron.sbatch and launch/deepspeed.sbatch as 1-node, 2-process
CPU jobs on tiny models, compared with the single-process run; plus a failing job and a timeout warning.

SLURM runs on this machine (slurm_cluster.py). Without it the tests skip, unless CTX_REQUIRE_SLURM=1 (CI sets it
after installing SLURM), when they fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .slurm_cluster import LocalSlurm, missing
from .test_megatron_entry import CHECKOUT, MODEL

ROOT = Path(__file__).resolve().parents[2]
LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "attention_dropout": 0.0,
         "use_cache": False}
TRAIN = ["--seq-len", "32", "--samples", "8", "--steps", "3"]
RTOL = 1e-5   # fp32; CP changes only the order of the attention's reductions (the demo and DeepSpeed tests hold 1e-5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()
    if why:
        if os.environ.get("CTX_REQUIRE_SLURM") == "1":
            pytest.fail(f"CTX_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)
    slurm = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield slurm
    slurm.stop()


def _ds_config(path: Path, size: int) -> Path:
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "eps": 1e-6, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "context_parallel": {"backend": "zigzag", "size": size, "kernel": "torch"}}))
    return path


def _torchrun(*args: str, env=None) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _status(run: Path) -> dict:
    lines = (run / "status").read_text().splitlines()
    return {"word": lines[0], **dict(line.split("=", 1) for line in lines[1:])}


def _submit(cluster: LocalSlurm, tmp: Path, script: str, *args: str) -> str:
    return cluster.sbatch("-N", "1", "-c", "2", "--time", "10", "-o", str(tmp / "batch-%j.out"),
                          str(ROOT / "launch" / script), *args, cwd=tmp)


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        assert abs(a - b) <= RTOL * abs(b), (got, want)


def test_training_jobs_match_one_process(cluster, tmp_path):
    """Both frameworks' scripts, 2 CPU processes with context parallelism 2, against one process."""
    site = tmp_path / "site.sh"
    site.write_text(f"export CTX_TEST_SITE=loaded\nCTX_RUNS_DIR={tmp_path}/runs\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA))
    cluster.env["CTX_SITE"] = str(site)
    try:
        megatron = _submit(cluster, tmp_path, "megatron.sbatch", "--nproc-per-node", "2", "--megatron-lm",
                           str(CHECKOUT), "--", *MODEL, "--context-parallel-size", "2", "--fake-report",
                           str(tmp_path / "megatron.json"))
        deepspeed = _submit(cluster, tmp_path, "deepspeed.sbatch", "--nproc-per-node", "2", "--ds-config",
                            str(_ds_config(tmp_path / "ds2.json", 2)), "--", "-m", "ctx_plugin.train_hf", "--model",
                            str(tmp_path / "model"), *TRAIN, "--report", str(tmp_path / "deepspeed.json"))
    finally:
        del cluster.env["CTX_SITE"]
    _torchrun("-m", "ctx_plugin.megatron.pretrain_gpt", "--megatron-lm", str(CHECKOUT), *MODEL,
              "--context-parallel-size", "1", "--fake-report", str(tmp_path / "megatron-ref.json"))
    _torchrun("-m", "ctx_plugin.train_hf", "--model", str(tmp_path / "model"), *TRAIN, "--report",
              str(tmp_path / "deepspeed-ref.json"), "--deepspeed_config", str(_ds_config(tmp_path / "ds1.json", 1)),
              env={**os.environ, "DS_ACCELERATOR": "cpu"})
    for framework, job in (("megatron", megatron), ("deepspeed", deepspeed)):
        cluster.wait(job)
        run = tmp_path / "runs" / f"{framework}-{job}"
        batch_log = (tmp_path / f"batch-{job}.out").read_text()
        status = _status(run)
        assert status["word"] == "completed" and status["exit_code"] == "0", batch_log
        assert status["job_id"] == job and status["started"] <= status["ended"]
        command = (run / "command.sh").read_text()
        assert f"source {site}" in command and "--nproc-per-node=2" in command
        logs = list((run / "logs").glob("node-0-*.log"))
        assert len(logs) == 1, list((run / "logs").iterdir())
        got = json.loads((tmp_path / f"{framework}.json").read_text())["losses"]
        _close(got, json.loads((tmp_path / f"{framework}-ref.json").read_text())["losses"])
    assert "DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}" in (tmp_path / "runs" / f"deepspeed-{deepspeed}" /
                                                          "command.sh").read_text()


def test_failed_and_timed_out_jobs_say_so(cluster, tmp_path):
    config = _ds_config(tmp_path / "ds.json", 2)
    (tmp_path / "exit3.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(300)\n")
    runs = {name: tmp_path / name for name in ("bad_layout", "exit3", "sleep")}
    bad = _submit(cluster, tmp_path, "deepspeed.sbatch", "--nproc-per-node", "3", "--run-dir",
                  str(runs["bad_layout"]), "--ds-config", str(config), "--", str(tmp_path / "exit3.py"))
    exit3 = _submit(cluster, tmp_path, "deepspeed.sbatch", "--nproc-per-node", "2", "--run-dir", str(runs["exit3"]),
                    "--ds-config", str(config), "--", str(tmp_path / "exit3.py"))
    sleep = _submit(cluster, tmp_path, "deepspeed.sbatch", "--nproc-per-node", "2", "--run-dir", str(runs["sleep"]),
                    "--ds-config", str(config), "--", str(tmp_path / "sleep.py"))
    cluster.wait(bad)
    status = _status(runs["bad_layout"])
    assert status["word"] == "failed" and "not a multiple" in status["reason"]
    cluster.wait(exit3)
    status = _status(runs["exit3"])
    assert status["word"] == "failed" and status["exit_code"] != "0"
    for _ in range(300):                         # the warning SLURM sends before the time limit (--signal=B:USR1)
        if (runs["sleep"] / "status").exists() and _status(runs["sleep"])["word"] == "running" and \
                list((runs["sleep"] / "logs").glob("*.log")):
            break
        time.sleep(0.5)
    time.sleep(3)                                # torchrun has started its worker
    subprocess.run(["scancel", "--batch", "--signal=USR1", sleep], env=cluster.env, check=True, timeout=30)
    start = time.monotonic()
    cluster.wait(sleep, timeout=120)
    assert time.monotonic() - start < 60         # the step was stopped, not left to sleep 300 s
    assert _status(runs["sleep"])["word"] == "timeout"
