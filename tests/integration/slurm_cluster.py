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

``stop()`` leaves nothing of the cluster running, also after a failed or interrupted test (``running()`` calls it in a
``finally`` and turns a SIGTERM into KeyboardInterrupt; ``start()`` registers it with ``atexit`` too, and stops what
it started when it fails): it cancels the cluster's jobs while slurmctld runs (``scancel``, then waits for their
processes while a slurmd is up to end them), stops the daemons it started (by pid, checked to still be that daemon
with this config), then kills what is left of the cluster: the processes with its ``SLURM_CONF`` in their
environment (every slurmd passes its own on to the ``slurmstepd`` it starts, ``sbatch`` the submitter's on to the
job) that are a SLURM daemon, a ``slurmstepd`` or a job's process (``SLURM_JOB_ID`` set), and all their descendants.
A ``slurmstepd`` is not a child of its slurmd (it is reparented to init), so a slurmd that died leaves its jobs
running: only this sweep ends them. Processes of another cluster (another ``SLURM_CONF``), or a user's that merely
have this one exported, are never touched.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if absent:
        return f"SLURM not installed ({', '.join(absent)} missing): apt-get install slurmctld slurmd slurm-client munge"
    if os.geteuid() != 0:
        return "starting slurmd and munged needs root"
    return None


def require() -> None:
    """Skips the test without SLURM (or root); fails it instead when CTX_REQUIRE_SLURM=1 (CI, which installs it)."""
    why = missing()
    if why:
        if os.environ.get("CTX_REQUIRE_SLURM") == "1":
            pytest.fail(f"CTX_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)


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


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


SLURM_PROCESSES = ("slurmctld", "slurmd", "slurmstepd", "slurmscriptd")
"""Names (``/proc/<pid>/comm``) of SLURM's daemons: those started here and those they start."""


def _processes() -> dict[int, tuple[int, str]]:
    """Every live process, zombies left out: pid -> (parent pid, name)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path("/proc", entry.name, "stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            found[int(entry.name)] = (int(fields[1]), name)
    return found


def _environ(pid: int) -> list[bytes]:
    try:
        return Path("/proc", str(pid), "environ").read_bytes().split(b"\0")
    except OSError:
        return []


def _runs(pid: int, name: str, marker: bytes | None) -> bool:
    """Whether ``pid`` is a live process named ``name`` (with ``marker`` in its environment, when given)."""
    try:
        stat = Path("/proc", str(pid), "stat").read_text()
    except OSError:
        return False
    if stat[stat.index("(") + 1:stat.rindex(")")] != name or stat[stat.rindex(")") + 2:].startswith("Z"):
        return False
    return marker is None or marker in _environ(pid)


def _kill(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:                          # ended meanwhile
            pass


def _leftovers(marker: bytes, daemons: bool = True) -> set[int]:
    """The processes of one cluster, by ``marker`` (its ``SLURM_CONF=...``) in their environment: SLURM's daemons
    (slurmctld and slurmd only if ``daemons``), every ``slurmstepd``, jobs' processes (``SLURM_JOB_ID`` set), and all
    their descendants, whatever their environment. Never this process or one of its ancestors."""
    procs = _processes()
    roots = []
    for pid, (_, name) in procs.items():
        env = _environ(pid)
        if marker in env and (name == "slurmstepd" or any(e.startswith(b"SLURM_JOB_ID=") for e in env)
                              or (daemons and name in SLURM_PROCESSES)):
            roots.append(pid)
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in procs.items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    while roots:
        pid = roots.pop()
        if pid not in found:
            found.add(pid)
            roots.extend(children.get(pid, ()))
    pid = os.getpid()
    while pid in procs:                                     # this process and its ancestors stay
        found.discard(pid)
        pid = procs[pid][0]
    return found


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
            "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
            # the main and backfill scheduling loops every 2 s (defaults 60 and 30): a high-priority job preempts
            # within seconds, not after a fast preempted job has finished its training
            "SchedulerParameters=sched_interval=2,bf_interval=2", *nodes,
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
        """Writes the config and starts the daemons; when that fails, stops what it started and raises."""
        atexit.register(self.stop)                          # a run that ends without the fixture's teardown
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    @contextlib.contextmanager
    def running(self):
        """``start()`` ... ``stop()``, stopped also when the body fails or is interrupted: a SIGTERM meanwhile (a test
        run killed by a time limit) raises KeyboardInterrupt, so pytest's teardown (and this ``finally``) runs."""
        interrupt = threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        if interrupt:
            signal.signal(signal.SIGTERM, _interrupted)
        try:
            yield self.start()
        finally:
            try:
                self.stop()
            finally:
                if interrupt:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _start(self) -> LocalSlurm:
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

    @property
    def marker(self) -> bytes:
        """``SLURM_CONF=<this config>``: in the environment of every process of this cluster (see the module doc)."""
        return b"SLURM_CONF=" + str(self.conf).encode()

    def _alive(self, daemon: str) -> list[int]:
        """The pids of the ``daemon`` processes this cluster started that still run (checked by name, and for SLURM's
        by this config in their environment: a pid since reused by another process is not one)."""
        marker = None if daemon == "munged" else self.marker
        return [pid for name, pid in self.pids if name == daemon and _runs(pid, daemon, marker)]

    def stop(self, timeout: float = 15) -> None:
        """Cancels the jobs, stops the daemons, kills what is left of the cluster (see the module docstring); raises
        when a process of it survives that. Safe to call again, and on a cluster that did not fully start."""
        atexit.unregister(self.stop)
        if self._alive("slurmctld"):
            try:
                jobs = subprocess.run(["squeue", "-h", "-o", "%A"], env=self.env, capture_output=True, text=True,
                                      timeout=30).stdout.split()
                if jobs:
                    subprocess.run(["scancel", *jobs], env=self.env, capture_output=True, timeout=30)
            except subprocess.TimeoutExpired:
                jobs = []                                   # a hung slurmctld: the sweep below ends the jobs
            deadline = time.monotonic() + timeout           # KillWait=5: SIGTERM, SIGKILL 5 s later, by slurmstepd
            while jobs and self._alive("slurmd") and _leftovers(self.marker, daemons=False) \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
        daemons = ("slurmd", "slurmctld", "munged")
        for daemon in daemons:
            _kill(self._alive(daemon), signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(self._alive(d) for d in daemons) and time.monotonic() < deadline:
            time.sleep(0.1)
        _kill(self._alive("munged"), signal.SIGKILL)      # SLURM's own daemons: swept below
        self.pids.clear()
        for _ in range(5):                                  # what the daemons left: jobs, steps, a daemon hung
            left = _leftovers(self.marker)
            if not left:
                return
            _kill(left, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while _leftovers(self.marker) and time.monotonic() < deadline:
                time.sleep(0.1)
        if left := _leftovers(self.marker):
            raise RuntimeError(f"processes of the SLURM test cluster {self.root} survive SIGKILL: {sorted(left)}")

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
