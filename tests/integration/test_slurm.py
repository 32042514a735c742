"""The job scripts under a real SLURM: launch/megatron.sbatch and launch/deepspeed.sbatch as 1-node, 2-process
CPU jobs on tiny models, compared with the single-process run; on two nodes (one rank each) the time-limit warning
(stop, save, requeue, resume; or a TIMEOUT), a cancel near the limit, a failing rank; a preempted job (save, SLURM's
requeue, resume); a job refused at start.

SLURM runs on this machine (slurm_cluster.py). Without it the tests skip, unless CTX_REQUIRE_SLURM=1 (CI sets it
after installing SLURM), when they fail.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .slurm_cluster import GRACE_TIME, LocalSlurm, _free_port, require
from .test_megatron_entry import CHECKOUT, MODEL

ROOT = Path(__file__).resolve().parents[2]
LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "attention_dropout": 0.0,
         "use_cache": False}
TRAIN = ["--seq-len", "32", "--samples", "8", "--steps", "3"]
RTOL = 1e-5   # fp32; CP changes only the order of the attention's reductions (the demo and DeepSpeed tests hold 1e-5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The module's cluster, stopped (its jobs cancelled, nothing of it left running) also when a test fails or the run
    is interrupted."""
    require()
    with LocalSlurm(tmp_path_factory.mktemp("slurm")).running() as slurm:
        yield slurm


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


def _submit(cluster: LocalSlurm, tmp: Path, script: str, *args: str, nodes: int = 1, sbatch: tuple = ()) -> str:
    """``sbatch -N nodes`` of a job script: 2 CPUs on one node, else 1 per node (one rank per node)."""
    return cluster.sbatch("-N", str(nodes), "-c", "2" if nodes == 1 else "1", "--time", "10", "-o",
                          str(tmp / "batch-%j.out"), *sbatch, str(ROOT / "launch" / script), *args, cwd=tmp)


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        assert abs(a - b) <= RTOL * abs(b), (got, want)


def test_training_jobs_match_one_process(cluster, tmp_path):
    """Both frameworks' scripts, 2 CPU processes with context parallelism 2, against one process. The Megatron job
    is submitted as sites that export little do (``--export=<a few variables>``): srun would pass that on to the
    tasks (SLURM_EXPORT_ENV) without the job script's own variables, unless told --export=ALL."""
    site = tmp_path / "site.sh"
    site.write_text(f"export CTX_TEST_SITE=loaded\nCTX_RUNS_DIR={tmp_path}/runs\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA))
    cluster.env["CTX_SITE"] = str(site)
    try:
        megatron = _submit(cluster, tmp_path, "megatron.sbatch", "--nproc-per-node", "2", "--megatron-lm",
                           str(CHECKOUT), "--", *MODEL, "--context-parallel-size", "2", "--fake-report",
                           str(tmp_path / "megatron.json"), sbatch=("--export=CTX_SITE,SLURM_CONF,PATH,HOME",))
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
        command = (run / "attempt-1" / "command.sh").read_text()
        assert f"source {site}" in command and "--nproc-per-node=2" in command
        logs = list((run / "attempt-1" / "logs").glob("node-0-*.log"))
        assert len(logs) == 1, list((run / "attempt-1" / "logs").iterdir())
        got = json.loads((tmp_path / f"{framework}.json").read_text())["losses"]
        _close(got, json.loads((tmp_path / f"{framework}-ref.json").read_text())["losses"])
    assert "DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}" in (tmp_path / "runs" / f"deepspeed-{deepspeed}" / "attempt-1" /
                                                          "command.sh").read_text()


def _wait_for(what: str, predicate, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _logged(run: Path, attempt: int, text: str) -> bool:
    return any(text in log.read_text(errors="replace") for log in (run / f"attempt-{attempt}" / "logs").glob("*.log"))


def _job_state(cluster: LocalSlurm, job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=cluster.env, capture_output=True, text=True)
    return next((f.split("=", 1)[1] for f in out.stdout.split() if f.startswith("JobState=")), "")


def _node_log(run: Path, attempt: int, node: int) -> str:
    logs = list((run / f"attempt-{attempt}" / "logs").glob(f"node-{node}-*.log"))
    assert len(logs) == 1, list((run / f"attempt-{attempt}" / "logs").iterdir())
    return logs[0].read_text(errors="replace")


def _show_job(cluster: LocalSlurm, job: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=cluster.env, capture_output=True, text=True)
    return next((f.split("=", 1)[1] for f in out.stdout.split() if f.startswith(field + "=")), "")


def _each_rank_recorded(attempt: Path, nodes: tuple[str, str]) -> None:
    """Node n's task (on SLURM's node n) sent SIGUSR1 to rank n, rank n's own handler recorded it (none waited for in
    vain), and the status says so."""
    for node in (0, 1):
        sent = (attempt / "signals" / f"node-{node}.txt").read_text()
        assert f" node={node} host={nodes[node]} " in sent and f" rank={node} signal=USR1 sent" in sent, sent
        got = (attempt / "signals" / f"rank-{node}.txt").read_text()
        assert f" rank={node} " in got and " signal=SIGUSR1 step=" in got and "signal=none" not in got, got
    assert _status(attempt)["signals"] == "sent SIGUSR1 to ranks 0 1 (2 of 2); received: SIGUSR1 by ranks 0 1"


def _each_rank_signalled(attempt: Path, nodes: tuple[str, str]) -> None:
    """The warning reached each rank itself, not only the step the ranks agreed on (:func:`_each_rank_recorded`), and
    both ranks stopped after the same step."""
    _each_rank_recorded(attempt, nodes)
    stops = set()
    for node in (0, 1):
        log = _node_log(attempt.parent, 1, node)
        stop = next(line for line in log.splitlines() if line.startswith(f"rank {node}: stopped by "))
        assert stop.startswith((f"rank {node}: stopped by signal 10 after step ",
                                f"rank {node}: stopped by another rank's signal (its own, signal 10, came ")), stop
        stops.add(stop.split(" after step ")[1].split(";")[0])
    assert len(stops) == 1, stops


def test_warning_preemption_requeue_resume(cluster, tmp_path):
    """Two-node jobs (one rank per node) and a preempted one, at once.

    SLURM's warning (B:USR1 to the batch shell, sent here by the test at a known step) reaches both ranks, one on
    each node, each itself: each node's record names the rank it signalled and each rank's handler recorded its own
    SIGUSR1 (though the ranks stop after the step they agree on, often before the later one's signal has come). They
    finish the step and save. With --requeue the job requeues itself and attempt 2 resumes: its losses continue
    attempt 1's and equal an uninterrupted run's, and both attempts keep their logs. Without, the job waits for its
    time limit (which the test shortens once the ranks have saved): SLURM says TIMEOUT. That job is submitted by
    ctx-plugin launch, whose --dry-run printed the command.sh the job wrote. A cancel within a minute of the limit is
    recorded as cancelled; a failing rank on the second node is named with its exit code. A job in partition ``low``
    preempted by one in ``high`` (PreemptMode=REQUEUE, GraceTime): SLURM's SIGTERM makes its ranks save (each
    records its own), it is recorded preempted, SLURM requeues it at the GraceTime's end and attempt 2 resumes with
    the uninterrupted run's losses. A two-node Megatron job (the CPU stand-in of pretrain_gpt.py through ctx_plugin's
    entry point, --exit-signal-handler --exit-signal SIGUSR1) gets the warning too: Megatron's handler stops both ranks
    and each rank records its own SIGUSR1 in front of it (cancelled once it has stopped, not left to its limit)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA))
    site = tmp_path / "site.sh"
    site.write_text(f"CTX_RUNS_DIR={tmp_path}/runs\nexport CTX_TEST_SITE=loaded\n")
    config = _ds_config(tmp_path / "ds2.json", 2)
    train = ["-m", "ctx_plugin.train_hf", "--model", str(tmp_path / "model"), "--seq-len", "32", "--samples", "8",
             "--steps", "80", "--resume"]
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(300)\n")
    (tmp_path / "exit3.py").write_text("import os, sys, time\nprint('rank', os.environ['RANK'], 'starts', "
                                       "flush=True)\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n")
    runs = {name: tmp_path / name for name in ("requeue", "timeout", "cancel", "exit3", "preempt", "megatron")}
    host, second, _ = cluster.nodes
    one_per_node = ["--nproc-per-node", "1"]
    cluster.env["CTX_SITE"] = str(site)
    try:
        # the longest first: the preempted job (GraceTime, requeue, a second attempt)
        preempt = cluster.sbatch("-p", "low", "-N", "1", "-c", "2", "--time", "10", "-o",
                                 str(tmp_path / "batch-%j.out"), str(ROOT / "launch" / "deepspeed.sbatch"),
                                 "--nproc-per-node", "2", "--run-dir", str(runs["preempt"]), "--ds-config",
                                 str(config), "--", *train, "--steps", "160", "--report", str(tmp_path / "preempt.json"),
                                 cwd=tmp_path)   # 160 steps: at 80 a fast run could end before SLURM preempts it
        # through ctx-plugin launch: the dry run, then the job. --time 10, long enough for a slow start (the test's
        # warning comes at step 3, SLURM's own never), shortened once the ranks have stopped. -c 2: the dry run,
        # outside the allocation, takes OMP_NUM_THREADS from this machine's 2 cores (it does not read -c from sbatch)
        line = ["sbatch", "--parsable", "-N", "2", "-c", "2", "--time", "10", "--signal=B:USR1@10", "-o",
                str(tmp_path / "batch-%j.out"),
                str(ROOT / "launch" / "deepspeed.sbatch"), *one_per_node, "--run-dir",
                str(runs["timeout"]), "--master-port", str(_free_port()), "--ds-config", str(config), "--",
                *train, "--steps", "100000"]
        launch = [sys.executable, "-m", "ctx_plugin.cli", "launch"]
        dry = subprocess.run([*launch, "--dry-run", *line], env=cluster.env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
        assert dry.returncode == 0, dry.stderr
        sub = subprocess.run([*launch, *line], env=cluster.env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
        assert sub.returncode == 0, sub.stderr
        timeout = sub.stdout.strip().splitlines()[-1].split(";")[0]
        requeue = _submit(cluster, tmp_path, "deepspeed.sbatch", "--requeue", *one_per_node, "--run-dir",
                          str(runs["requeue"]), "--ds-config", str(config), "--", *train, "--report",
                          str(tmp_path / "requeue.json"), nodes=2)
        cancel = cluster.sbatch("-N", "2", "-c", "1", "--time", "2", "--signal=B:USR1@10", "-o", str(tmp_path / "batch-%j.out"),
                                str(ROOT / "launch" / "deepspeed.sbatch"), *one_per_node, "--run-dir",
                                str(runs["cancel"]), "--ds-config", str(config), "--", str(tmp_path / "sleep.py"),
                                cwd=tmp_path)
        exit3 = _submit(cluster, tmp_path, "deepspeed.sbatch", *one_per_node, "--run-dir",
                        str(runs["exit3"]), "--ds-config", str(config), "--", str(tmp_path / "exit3.py"), nodes=2)
        megatron = _submit(cluster, tmp_path, "megatron.sbatch", *one_per_node, "--run-dir", str(runs["megatron"]),
                           "--megatron-lm", str(CHECKOUT), "--", *MODEL, "--context-parallel-size", "2",
                           "--cp-kernel", "torch", "--exit-signal-handler", "--exit-signal", "SIGUSR1", "--save",
                           str(tmp_path / "megatron-ckpt"), "--save-interval", "1000000", "--fake-steps", "100000",
                           nodes=2)
    finally:
        del cluster.env["CTX_SITE"]
    reference = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  "2", *train[:-1], "--report", str(tmp_path / "reference.json"), "--deepspeed_config",
                                  str(config)], env={**os.environ, "DS_ACCELERATOR": "cpu"},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    high = []       # the high-priority job that preempts `preempt`, submitted once that has trained a few steps

    def preempt_once_trained() -> None:
        if not high and _logged(runs["preempt"], 1, "step     3"):
            high.append(cluster.sbatch("-p", "high", "-N", "1", "-c", "8", "--time", "2", "-o",
                                       str(tmp_path / "high-%j.out"), "--wrap", "hostname", cwd=tmp_path))

    try:
        # scancel within 90 s of the time limit (--time 2, the warning 10 s before it, not at once: at once, before
        # waiting on the others, so the limit cannot pass first on a slow machine): cancelled, not timeout. The
        # sleeping job may start only when the preempted job's node is free, so the preemption is sent meanwhile.
        _wait_for("the sleeping job to run on both nodes", lambda: preempt_once_trained() or all(
            (runs["cancel"] / "attempt-1" / "pids" / f"node-{n}.pid").exists() for n in (0, 1)))
        subprocess.run(["scancel", cancel], env=cluster.env, check=True, timeout=30)
        # one loop, the jobs getting there in any order: the warning once a training job has trained a few steps, the
        # preemption likewise (the jobs train 80 steps in about a minute); the preempted job's status, its ranks saved
        # on SLURM's SIGTERM, seen within its GraceTime (still RUNNING: SLURM requeues it at the GraceTime's end); the
        # TIMEOUT job, stopped and saved, waits for its limit: SLURM ends it there, here at its next time-limit check
        # (every 30 s) once the limit is made the minutes it has run (SLURM's limits are whole minutes), at least 1;
        # the Megatron job, stopped, is cancelled
        waiting = {requeue: (runs["requeue"], "step     3"), timeout: (runs["timeout"], "step     3"),
                   preempt: (runs["preempt"], "step     3"), megatron: (runs["megatron"], "rank 0: iteration 3 ")}
        preempted, shortened, megatron_stopped = None, False, None
        deadline = time.monotonic() + 420
        while waiting or preempted is None or not shortened or megatron_stopped is None:
            assert time.monotonic() < deadline, (f"timed out: {sorted(waiting)} to train, {preempted=}, {shortened=}, "
                                                 f"{megatron_stopped=}")
            for job, (run, trained) in list(waiting.items()):
                if not _logged(run, 1, trained):
                    continue
                del waiting[job]
                if job == preempt:
                    preempt_once_trained()
                else:
                    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster.env, check=True,
                                   timeout=30)
            if preempt not in waiting and preempted is None:
                status = _status(runs["preempt"] / "attempt-1")
                if status["word"] == "preempted" and "exit_code" in status:
                    preempted = status
                    assert _job_state(cluster, preempt) == "RUNNING", preempted
            if timeout not in waiting and not shortened and "exit_code" in _status(runs["timeout"]):
                ran = _show_job(cluster, timeout, "RunTime").split("-")[-1]
                hours, minutes, _ = (int(x) for x in ran.split(":"))
                subprocess.run(["scontrol", "update", f"JobId={timeout}", f"TimeLimit={max(1, hours * 60 + minutes)}"],
                               env=cluster.env, check=True)
                shortened = True
            if megatron not in waiting and megatron_stopped is None and "exit_code" in _status(runs["megatron"]):
                megatron_stopped = _status(runs["megatron"] / "attempt-1")
                subprocess.run(["scancel", megatron], env=cluster.env, check=True, timeout=30)
            time.sleep(0.2)
        _wait_for("the requeue", lambda: _status(runs["requeue"])["word"] == "requeued")
        _wait_for("the job pending", lambda: _job_state(cluster, requeue) == "PENDING", 60)
        time.sleep(3)
        subprocess.run(["scontrol", "update", f"JobId={requeue}", "StartTime=now"], env=cluster.env, check=True)
        _wait_for("SLURM's requeue of the preempted job", lambda: _job_state(cluster, preempt) == "PENDING",
                  GRACE_TIME + 120)
        cluster.wait(high[0], timeout=120)
        # started within the second of its requeue, slurmd refuses the job ("Job credential revoked")
        time.sleep(3)
        subprocess.run(["scontrol", "update", f"JobId={preempt}", "StartTime=now"], env=cluster.env, check=True)
        out, _ = reference.communicate(timeout=600)
        assert reference.returncode == 0, out[-3000:]
        cluster.wait(requeue)
        cluster.wait(preempt)
        cluster.wait(exit3)
        cluster.wait(cancel)
        cluster.wait(megatron)
        cluster.wait(timeout, timeout=300)
    finally:
        if reference.poll() is None:
            reference.kill()
    want = json.loads((tmp_path / "reference.json").read_text())["losses"]
    # requeued: two attempts, each with its logs (one per node) and status; attempt 2 resumed and matches the
    # uninterrupted run
    status = _status(runs["requeue"])
    assert status["word"] == "completed" and status["attempt"] == "2", status
    assert status["attempt_1"].startswith("requeued exit_code=0 job_id=" + requeue)
    assert _status(runs["requeue"] / "attempt-1")["word"] == "requeued"
    _each_rank_signalled(runs["requeue"] / "attempt-1", (host, second))
    for node in (0, 1):
        assert f"rank {node}: resumed from {runs['requeue']}/checkpoints/step" in _node_log(runs["requeue"], 2, node)
    assert not (runs["requeue"] / "attempt-2" / "signals").exists() and "signals" not in status
    assert _show_job(cluster, requeue, "NodeList") == f"{host},{second}"
    assert "step     0 " in _node_log(runs["requeue"], 1, 0) and "step     0 " not in _node_log(runs["requeue"], 2, 0)
    got = json.loads((tmp_path / "requeue.json").read_text())["losses"]
    assert len(got) == len(want) == 80 and got == want, (got, want)
    # preempted: saved on SLURM's SIGTERM within the GraceTime, requeued by SLURM, resumed with the same losses
    assert preempted["word"] == "preempted" and preempted["note"].startswith("preempted (PreemptTime set)"), preempted
    status = _status(runs["preempt"])
    assert status["word"] == "completed" and status["attempt"] == "2", status
    assert status["attempt_1"].startswith("preempted exit_code="), status
    assert _show_job(cluster, preempt, "Restarts") == "1" and _job_state(cluster, high[0]) == "COMPLETED"
    for rank in (0, 1):   # SLURM signals the steps itself: each rank's handler recorded its SIGTERM
        assert _logged(runs["preempt"], 1, f"rank {rank}: stopped by signal 15 after step")
        assert "signal=SIGTERM " in (runs["preempt"] / "attempt-1" / "signals" / f"rank-{rank}.txt").read_text()
        assert _logged(runs["preempt"], 2, f"rank {rank}: resumed from {runs['preempt']}/checkpoints/step")
    assert _status(runs["preempt"] / "attempt-1")["signals"] == "received: SIGTERM by ranks 0 1"   # added after
    got = json.loads((tmp_path / "preempt.json").read_text())["losses"]
    assert len(got) == 160 and got[:80] == want, (got, want)      # a constant learning rate: the same first 80
    # no requeue: saved, and SLURM ended it at its time limit
    status = _status(runs["timeout"])
    assert status["word"] == "timeout" and status["exit_code"] == "0", status
    assert (runs["timeout"] / "checkpoints" / "latest").is_file()
    _each_rank_signalled(runs["timeout"] / "attempt-1", (host, second))
    assert any("stopped by signal 10 after step" in _node_log(run, 1, node) for run in (runs["requeue"], runs["timeout"])
               for node in (0, 1))
    assert _job_state(cluster, timeout) == "TIMEOUT"
    printed = dry.stdout.split("command.sh the job would write (the run directory's attempt-1/command.sh):\n", 1)[1]
    assert printed.rstrip("\n") == (runs["timeout"] / "attempt-1" / "command.sh").read_text().rstrip("\n")
    assert f"source {site}" in printed and "--nnodes=2 --nproc-per-node=1" in printed
    records = runs["timeout"] / "attempt-1"
    assert json.loads((records / "ds_config.json").read_text()) == json.loads(config.read_text())
    assert (records / "site.sh").read_text() == site.read_text()
    assert "deepspeed " in (records / "versions.txt").read_text()
    assert (records / "nodes.txt").read_text().split() == [host, second]
    assert "ctx_plugin: time-limit warning" in (records / "batch.log").read_text()
    # Megatron: its handler stopped both ranks (and saved), each rank recorded its own signal in front of it
    assert megatron_stopped["word"] == "timeout" and megatron_stopped["exit_code"] == "0", megatron_stopped
    _each_rank_recorded(runs["megatron"] / "attempt-1", (host, second))
    for node in (0, 1):
        assert f"rank {node}: exiting program after receiving SIGTERM." in _node_log(runs["megatron"], 1, node)
    assert (tmp_path / "megatron-ckpt" / "latest_checkpointed_iteration.txt").is_file()
    # cancelled near the limit; the failing rank named (rank 1, on the second node)
    assert _status(runs["cancel"])["word"] == "cancelled"
    status = _status(runs["exit3"])
    assert status["word"] == "failed" and status["first_failure"].startswith(
        f"first failure: node 1 ({second}) rank 1 exit code 3"), status
    assert "rank 1 starts" in (runs["exit3"] / "attempt-1" / "failure").read_text()


def test_bad_layout_job_says_so(cluster, tmp_path):
    config = _ds_config(tmp_path / "ds.json", 2)
    (tmp_path / "exit3.py").write_text("import sys\nsys.exit(3)\n")
    bad = _submit(cluster, tmp_path, "deepspeed.sbatch", "--nproc-per-node", "3", "--run-dir",
                  str(tmp_path / "bad"), "--ds-config", str(config), "--", str(tmp_path / "exit3.py"))
    cluster.wait(bad)
    status = _status(tmp_path / "bad")
    assert status["word"] == "failed" and \
        '"context_parallel.size" (2) must divide the ranks (nodes × processes per node) (3)' in status["reason"]


def test_warning_to_the_step_counts_as_the_warning(cluster, tmp_path):
    """SLURM's warning sent to the job step rather than the batch script (``--signal=USR1@<s>`` without ``B:``; here
    ``scancel --signal=USR1`` without ``--batch``, which signals the steps alone): the ranks save and stop and the step
    ends 0 without the script having been warned. It must not be recorded as completed: the ranks' records show the
    warning, so the job requeues itself (``--requeue``), says so in the status, and attempt 2 resumes to the end."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA))
    run = tmp_path / "direct"
    job = _submit(cluster, tmp_path, "deepspeed.sbatch", "--requeue", "--nproc-per-node", "2", "--run-dir", str(run),
                  "--ds-config", str(_ds_config(tmp_path / "ds2.json", 2)), "--", "-m", "ctx_plugin.train_hf",
                  "--model", str(tmp_path / "model"), "--seq-len", "32", "--samples", "8", "--steps", "80", "--resume",
                  "--report", str(tmp_path / "direct.json"))
    _wait_for("the job to train a few steps", lambda: _logged(run, 1, "step     3"), 420)
    subprocess.run(["scancel", "--signal=USR1", job], env=cluster.env, check=True, timeout=30)
    _wait_for("the requeue", lambda: _status(run)["word"] == "requeued")
    _wait_for("the job pending", lambda: _job_state(cluster, job) == "PENDING", 60)
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=cluster.env, check=True)
    cluster.wait(job)
    first = _status(run / "attempt-1")
    assert first["word"] == "requeued" and first["exit_code"] == "0", first
    assert first["warning"].startswith("SIGUSR1 reached the ranks from SLURM directly"), first
    assert "received: SIGUSR1 by ranks 0 1" in first["signals"], first
    assert not (run / "attempt-1" / "signals" / "node-0.txt").exists()     # the script signalled no rank
    status = _status(run)
    assert status["word"] == "completed" and status["attempt"] == "2", status
    assert _logged(run, 2, f"rank 0: resumed from {run}/checkpoints/step")
    assert len(json.loads((tmp_path / "direct.json").read_text())["losses"]) == 80
