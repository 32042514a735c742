"""A one-machine SLURM cluster for tests: munged, slurmctld and three slurmd started by hand, stopped by PID.

Needs Debian's ``slurmctld slurmd slurm-client munge`` and root (slurmd starts jobs as the submitting user;
munged runs as user munge). No systemd: the daemons are started directly with a minimal ``slurm.conf`` in a
temporary directory (no accounting, process tracking by /proc). Three nodes, all at 127.0.0.1, each its own
``slurmd -N`` with its own port, spool directory, log and pid file (``%n``, ``SlurmdParameters=config_overrides``).
A job's first node is its rendezvous host, so it must resolve: partition ``debug`` (the default, never preempted)
has the node named after this host and ``<host>-2`` (two-node jobs: the host's name comes first); partitions
``low`` (``PreemptMode=REQUEUE``, ``GraceTime``) and ``high`` (a higher ``PriorityTier``) share the third node,
``localhost``, where a ``high`` job that needs all its CPUs preempts the ``low`` job there (``preempt/partition_prio``).
The nodes declare more CPUs than the machine has and ``debug`` shares them (``OverSubscribe=FORCE``), so the tests'
jobs run at once.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if absent:
        return f"SLURM not installed ({', '.join(absent)} missing): apt-get install slurmctld slurmd slurm-client munge"
    if os.geteuid() != 0:
        return "starting slurmd and munged needs root"
    return None


CPUS = 8
"""CPUs each node declares (``config_overrides``: more than the machine has, shared by the tests' jobs)."""
GRACE_TIME = 40
"""Seconds a preempted job of partition ``low`` has to save before SLURM ends it (torchrun gives its ranks 30 s)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    """``start()`` writes the config and starts the daemons; ``env`` is what ``sbatch``/``squeue`` need."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.pids: list[tuple[str, int]] = []
        host = socket.gethostname().split(".")[0]
        # debug's two nodes: the host's name first (a job's first node is its rendezvous host, which must
        # resolve); the preemption partitions' node: localhost (resolves too)
        self.nodes = (host, f"{host}-2", "localhost")

    def _config(self) -> str:
        r = self.root
        nodes = [f"NodeName={name} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={CPUS} State=UNKNOWN"
                 for name in self.nodes]
        return "\n".join([
            "ClusterName=ctxtest", f"SlurmctldHost={self.nodes[0]}(127.0.0.1)", "SlurmUser=root",
            f"SlurmctldPort={_free_port()}", "AuthType=auth/munge",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool-%n", f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid", f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd-%n.log", "SlurmdParameters=config_overrides",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "MailProg=/bin/true", "ReturnToService=2", "KillWait=5", "MinJobAge=600",
            "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE", *nodes,
            f"PartitionName=debug Nodes={self.nodes[0]},{self.nodes[1]} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:8 PriorityTier=1 PreemptMode=OFF",
            f"PartitionName=low Nodes={self.nodes[2]} MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=1 "
            f"PreemptMode=REQUEUE GraceTime={GRACE_TIME}",
            f"PartitionName=high Nodes={self.nodes[2]} MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=2 "
            "PreemptMode=REQUEUE", ""])

    def _munge(self) -> None:
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return                                          # a munged is already serving: use it, leave it
        run = Path("/run/munge")
        run.mkdir(parents=True, exist_ok=True)
        shutil.chown(run, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", _sbin("munged")], check=True, timeout=30)
        self.pids.append(("munged", int((run / "munged.pid").read_text())))

    def start(self) -> LocalSlurm:
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (self.root / f"spool-{node}").mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._config())
        self._munge()
        for daemon, args, pid_file in [("slurmctld", [], self.root / "slurmctld.pid"),
                                       *(("slurmd", ["-N", node], self.root / f"slurmd-{node}.pid")
                                         for node in self.nodes)]:
            subprocess.run([_sbin(daemon), "-f", str(self.conf), *args], env=self.env, check=True, timeout=30)
            for _ in range(100):
                if pid_file.exists() and pid_file.read_text().strip():
                    break
                time.sleep(0.1)
            self.pids.append((daemon, int(pid_file.read_text())))
        for _ in range(150):                                # until every node takes jobs
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
            states = dict(line.split() for line in out.stdout.splitlines())
            if len(states) == len(self.nodes) and set(states.values()) <= {"idle", "mix", "alloc"}:
                return self
            time.sleep(0.2)
        raise RuntimeError(f"the SLURM nodes never became idle: {out.stdout}{out.stderr}\n"
                           + (self.root / "slurmctld.log").read_text()[-2000:])

    def stop(self) -> None:
        for _, pid in reversed(self.pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for _, pid in self.pids:
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        self.pids.clear()

    def sbatch(self, *args: str, cwd: Path) -> str:
        out = subprocess.run(["sbatch", "--parsable", *args], env=self.env, cwd=cwd, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().split(";")[0]

    def wait(self, job_id: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["squeue", "-h", "-j", job_id], env=self.env, capture_output=True, text=True)
            if not out.stdout.strip():
                return
            time.sleep(1)
        subprocess.run(["scancel", job_id], env=self.env)
        raise TimeoutError(f"SLURM job {job_id} still running after {timeout} s")
