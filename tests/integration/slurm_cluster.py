"""A one-machine SLURM cluster for tests: munged, slurmctld and slurmd started by hand, stopped by PID.

Needs Debian's ``slurmctld slurmd slurm-client munge`` and root (slurmd starts jobs as the submitting user;
munged runs as user munge). No systemd: the daemons are started directly with a minimal ``slurm.conf`` in a
temporary directory (no accounting, process tracking by /proc, one node: this host at 127.0.0.1; OverSubscribe=FORCE,
so the tests' jobs share its CPUs and run at once).
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

    def _config(self) -> str:
        host = socket.gethostname().split(".")[0]
        r = self.root
        return "\n".join([
            "ClusterName=ctxtest", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}", "AuthType=auth/munge",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool", f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid", f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "MailProg=/bin/true", "ReturnToService=2", "KillWait=5",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8", ""])

    def _munge(self) -> None:
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return                                          # a munged is already serving: use it, leave it
        run = Path("/run/munge")
        run.mkdir(parents=True, exist_ok=True)
        shutil.chown(run, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", _sbin("munged")], check=True, timeout=30)
        self.pids.append(("munged", int((run / "munged.pid").read_text())))

    def start(self) -> LocalSlurm:
        for d in ("state", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._config())
        self._munge()
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([_sbin(daemon), "-f", str(self.conf)], env=self.env, check=True, timeout=30)
            pid_file = self.root / f"{daemon}.pid"
            for _ in range(100):
                if pid_file.exists() and pid_file.read_text().strip():
                    break
                time.sleep(0.1)
            self.pids.append((daemon, int(pid_file.read_text())))
        for _ in range(150):                                # until the node takes jobs
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
            if out.stdout.strip() in ("idle", "mix", "alloc"):
                return self
            time.sleep(0.2)
        raise RuntimeError(f"the SLURM node never became idle: {out.stdout}{out.stderr}\n"
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
