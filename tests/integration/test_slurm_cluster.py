"""The SLURM test cluster's teardown (slurm_cluster.LocalSlurm.stop): a job left running on nodes whose slurmd died —
its slurmstepd, batch shell, the shell's child and a step's task — is gone after stop(), with the daemons, while a
process of another cluster and a user's process that merely has this cluster's SLURM_CONF exported are not touched.

Runs its own cluster (not test_slurm.py's, which pytest stops before this module starts). Skipped without SLURM and
root, unless CTX_REQUIRE_SLURM=1."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from .slurm_cluster import LocalSlurm, _processes, require

JOB = """#!/bin/bash
sleep 300 &
child=$!
srun --overlap bash -c 'echo $$ > {root}/task.pid; exec sleep 300' &
echo "$$ $PPID $child" > {root}/batch.pids
wait
"""


def _wait_for(what: str, predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _with(marker: bytes) -> set[int]:
    """Every live process with ``marker`` in its environment (an independent scan, not the teardown's)."""
    found = set()
    for pid in _processes():
        try:
            if marker in Path("/proc", str(pid), "environ").read_bytes().split(b"\0"):
                found.add(pid)
        except OSError:
            pass
    return found


def test_stop_leaves_no_process_of_the_cluster(tmp_path):
    require()
    slurm = LocalSlurm(tmp_path / "cluster")
    bystanders = []
    try:
        slurm.start()
        root = slurm.root
        (root / "job.sh").write_text(JOB.format(root=root))
        slurm.sbatch("-N", "1", "-o", str(root / "job-%j.out"), str(root / "job.sh"), cwd=root)
        _wait_for("the job and its step to run", lambda: (root / "task.pid").is_file()
                  and (root / "batch.pids").is_file() and (root / "task.pid").read_text().strip() != ""
                  and len((root / "batch.pids").read_text().split()) == 3)
        shell, stepd, child = (int(p) for p in (root / "batch.pids").read_text().split())
        task = int((root / "task.pid").read_text())
        assert _processes()[stepd][1] == "slurmstepd"
        path = os.environ.get("PATH", "/usr/bin:/bin")
        bystanders = [subprocess.Popen(["sleep", "300"], env={"PATH": path, "SLURM_CONF": str(slurm.conf)}),
                      subprocess.Popen(["sleep", "300"], env={"PATH": path, "SLURM_CONF": "/elsewhere/slurm.conf",
                                                              "SLURM_JOB_ID": "1"})]
        for pid in slurm._alive("slurmd"):                # the daemons die; their jobs run on
            os.kill(pid, signal.SIGKILL)
        _wait_for("the slurmd to die", lambda: not slurm._alive("slurmd"), 10)
        assert {shell, stepd, child, task} <= set(_processes())
        start = time.monotonic()
        slurm.stop()
        took = time.monotonic() - start
        alive = set(_processes())
        assert not {shell, stepd, child, task} & alive, {p: _processes().get(p) for p in (shell, stepd, child, task)}
        assert _with(slurm.marker) == {bystanders[0].pid}, {p: _processes().get(p) for p in _with(slurm.marker)}
        assert all(b.poll() is None for b in bystanders)    # not the cluster's: left alone
        assert took < 20, took
        slurm.stop()                                        # again: nothing to do
    finally:
        for b in bystanders:
            b.kill()
            b.wait(timeout=10)
        slurm.stop()
