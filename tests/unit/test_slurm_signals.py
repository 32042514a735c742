"""The stop-signal records (ctx_plugin.slurm.signals): a rank's handler recording its own signal, the bounded wait for
it after an agreed stop, the record put in front of a framework's own handler (OwnSignalRecord), the per-node record of
launch/slurm_common.sh's ctx_signal_node, and the status summary."""
from __future__ import annotations

import atexit
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ctx_plugin.slurm import signals
from ctx_plugin.slurm.signals import OwnSignalRecord, StopRequest, summary

COMMON = Path(__file__).resolve().parents[2] / "launch" / "slurm_common.sh"


@pytest.fixture
def handlers():
    """Restores SIGUSR1's and SIGTERM's handlers after the test."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def others(monkeypatch, signalled: bool) -> None:
    """StopRequest.agreed's all-reduce as if other ranks took part: one of them signalled, or none."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda flag, op=None: flag.fill_(1) if signalled else flag)


def rank_env(attempt: Path, rank: int = 3) -> dict[str, str]:
    return {"CTX_ATTEMPT_DIR": str(attempt), "RANK": str(rank), "SLURMD_NODENAME": "gpu-b"}


def test_handler_records_its_own_signal(tmp_path, handlers, monkeypatch):
    stop = StopRequest(env=rank_env(tmp_path))
    stop.step = 12
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signal == signal.SIGUSR1                      # the first one
    others(monkeypatch, signalled=False)
    assert stop.agreed("cpu") and stop.describe() == f"signal {int(signal.SIGUSR1)}"
    lines = (tmp_path / "signals" / "rank-3.txt").read_text().splitlines()
    assert len(lines) == 2 and lines[0].endswith(f" rank=3 pid={os.getpid()} host=gpu-b signal=SIGUSR1 step=12")
    assert lines[1].endswith("signal=SIGTERM step=12") and lines[0][:4].isdigit() and lines[0].split()[0][-1] == "Z"
    assert stop.await_own(timeout=5) is True                  # had come: no wait


def test_outside_the_job_scripts_nothing_is_recorded_and_nothing_waits(tmp_path, handlers, monkeypatch):
    stop = StopRequest(env={"RANK": "0"})
    others(monkeypatch, signalled=False)
    assert stop.record is None and not stop.agreed("cpu")
    others(monkeypatch, signalled=True)
    assert stop.agreed("cpu")
    start = time.monotonic()
    assert stop.await_own(timeout=5) is True and time.monotonic() - start < 1
    assert stop.describe() == "another rank's signal"


def test_a_rank_stopped_by_another_waits_for_its_own(tmp_path, handlers, monkeypatch):
    stop = StopRequest(env=rank_env(tmp_path))
    others(monkeypatch, signalled=True)
    assert stop.agreed("cpu") and stop.signal is None
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    start = time.monotonic()
    assert stop.await_own(timeout=10) is True
    assert 0.2 < time.monotonic() - start < 5
    assert stop.describe().startswith(f"another rank's signal (its own, signal {int(signal.SIGUSR1)}, came 0.")
    assert "signal=SIGUSR1" in (tmp_path / "signals" / "rank-3.txt").read_text()


def test_a_signal_that_never_comes_is_recorded(tmp_path, handlers, monkeypatch):
    stop = StopRequest(env=rank_env(tmp_path))
    others(monkeypatch, signalled=True)
    assert stop.agreed("cpu")
    assert stop.await_own(timeout=0.3) is False
    line = (tmp_path / "signals" / "rank-3.txt").read_text().splitlines()[-1]
    assert " rank=3 " in line and "signal=none waited=0.3" in line
    assert stop.describe() == f"another rank's signal (none of its own came within {signals.OWN_SIGNAL_WAIT:.0f} s)"
    assert summary(tmp_path) == f"no signal of its own reached ranks 3 within {signals.OWN_SIGNAL_WAIT:.0f} s"


class Framework:
    """A framework's own handler (as Megatron's DistributedSignalHandler's: sets a flag, calls nothing before it)."""

    def __init__(self, sig=signal.SIGUSR1):
        self.got = []
        signal.signal(sig, lambda signum, frame: self.got.append(signum))


def test_own_record_in_front_of_the_frameworks_handler(tmp_path, handlers):
    record = OwnSignalRecord(env=rank_env(tmp_path), step=lambda: 41)
    framework = Framework()
    record.chain(signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert framework.got == [signal.SIGUSR1] and record.came == [signal.SIGUSR1]     # both ran
    line = (tmp_path / "signals" / "rank-3.txt").read_text()
    assert line.endswith(f" rank=3 pid={os.getpid()} host=gpu-b signal=SIGUSR1 step=41\n") and line.count("\n") == 1
    again = Framework()                                       # the framework installs its handler again: chained again
    record.chain(signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert again.got == [signal.SIGUSR1] and len(record.came) == 2
    assert summary(tmp_path) == "received: SIGUSR1 by ranks 3"
    signal.signal(signal.SIGTERM, signal.SIG_DFL)             # no framework handler there: nothing put in front
    record.chain(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_own_record_only_in_the_job_scripts_and_the_rank(tmp_path, handlers):
    """Outside the job scripts the framework's handler stays as it is; a forked process (a data-loader worker that
    inherits the handler or chains its own) records nothing."""
    outside = OwnSignalRecord(env={"RANK": "0"})
    framework = Framework()
    handler = signal.getsignal(signal.SIGUSR1)
    outside.chain(signal.SIGUSR1)
    assert signal.getsignal(signal.SIGUSR1) is handler
    record = OwnSignalRecord(env=rank_env(tmp_path))
    record.chain(signal.SIGUSR1)
    child = os.fork()
    if child == 0:                                            # the worker: inherited handler, then its own chained
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            Framework()
            record.chain(signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)
            os._exit(0 if len(framework.got) == 1 and not record.came else 1)
        finally:
            os._exit(2)
    assert os.waitpid(child, 0)[1] == 0
    assert not (tmp_path / "signals").exists()


def test_own_record_waits_at_exit_when_stopped_by_another(tmp_path, handlers, monkeypatch):
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    record = OwnSignalRecord(env=rank_env(tmp_path))
    Framework()
    record.chain(signal.SIGUSR1)
    record.stopping(False)                                    # no rank got one: nothing to wait for
    assert registered == []
    record.stopping(True)                                     # another rank's signal: wait for its own at exit, once
    record.stopping(True)
    assert registered == [record.await_own]
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    start = time.monotonic()
    assert registered[0]() is True and 0.2 < time.monotonic() - start < 5
    assert "signal=SIGUSR1" in (tmp_path / "signals" / "rank-3.txt").read_text()
    own = OwnSignalRecord(env=rank_env(tmp_path, rank=4))    # its own came first: no wait registered
    own.chain(signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    own.stopping(True)
    assert registered == [record.await_own]
    late = OwnSignalRecord(env=rank_env(tmp_path, rank=5))
    assert late.await_own(timeout=0.3) is False
    assert "signal=none waited=0.3" in (tmp_path / "signals" / "rank-5.txt").read_text()


def node_line(node: int, rank: str, result: str = "sent") -> str:
    return f"2026-12-01T08:00:00.000Z node={node} host=n{node} pid=10{rank} rank={rank} signal=USR1 {result}\n"


def rank_line(rank: int, sig: str = "SIGUSR1") -> str:
    return f"2026-12-01T08:00:00.100Z rank={rank} pid=10{rank} host=n{rank // 2} signal={sig} step=5\n"


def test_summary(tmp_path):
    assert summary(tmp_path) is None                          # no signals/: not stopped by a signal
    where = tmp_path / "signals"
    where.mkdir()
    (tmp_path / "job.txt").write_text("job_id=7\nranks=4\nnodes=n0,n1\n")
    (where / "node-0.txt").write_text(node_line(0, "0") + node_line(0, "1"))
    (where / "node-1.txt").write_text(node_line(1, "2") + node_line(1, "3"))
    for rank in range(4):
        (where / f"rank-{rank}.txt").write_text(rank_line(rank))
    assert summary(tmp_path) == "sent SIGUSR1 to ranks 0 1 2 3 (4 of 4); received: SIGUSR1 by ranks 0 1 2 3"
    # node 1 signalled nothing; rank 1's handler never ran, rank 0 also got SLURM's SIGTERM
    (where / "node-1.txt").write_text("2026-12-01T08:00:00.000Z node=1 host=n1 torchrun=99 signal=USR1 none\n")
    (where / "rank-1.txt").unlink()
    (where / "rank-0.txt").write_text(rank_line(0) + rank_line(0, "SIGTERM"))
    assert summary(tmp_path) == ("sent SIGUSR1 to ranks 0 1 (2 of 4); no rank running on node 1; received: SIGTERM "
                                 "by ranks 0, SIGUSR1 by ranks 0 2 3; no record from ranks 1")
    # a program that keeps no record (Megatron's own handler); a rank that had exited
    for rank in (0, 2, 3):
        (where / f"rank-{rank}.txt").unlink()
    (where / "node-1.txt").write_text(node_line(1, "2", "gone") + node_line(1, "3"))
    assert summary(tmp_path) == ("sent SIGUSR1 to ranks 0 1 3 (3 of 4); ranks 2 had exited; no rank recorded "
                                 "receiving it (the program keeps no signal record; ctx_plugin.train_hf and Megatron "
                                 "through ctx_plugin's entry point with --exit-signal-handler do)")


RANK = """import os, signal, sys, time
from pathlib import Path
def stop(signum, frame):
    Path(sys.argv[1]).write_text(os.environ.get("RANK", "") + " got " + str(signum))
    sys.exit(0)
signal.signal(signal.SIGUSR1, stop)
Path(sys.argv[1] + ".ready").write_text("ready")
time.sleep(30)
sys.exit(5)
"""


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def node_started(tmp_path, pid: int, node: int, ranks) -> None:
    """Writes the node's pid file (what the job script's task writes) once the ranks are up."""
    (tmp_path / "pids" / f"node-{node}.pid").write_text(f"{pid}\n")
    wait_for(lambda: all(Path(f"{tmp_path}/r{r}.ready").exists() for r in ranks), 20, "the ranks to start")


def signal_node(tmp_path, node: int, host: str) -> subprocess.CompletedProcess:
    """``ctx_signal_node <attempt dir> USR1`` as the srun task on node ``node`` runs it."""
    env = {**os.environ, "SLURM_NODEID": str(node), "SLURMD_NODENAME": host}
    return subprocess.run(["bash", "-c", f'source "{COMMON}" && ctx_signal_node "$1" USR1', "_", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=30)


def test_ctx_signal_node_finds_the_ranks_below_a_container_runtime_that_forks(tmp_path):
    """CTX_EXEC_PREFIX (apptainer exec) may keep a parent process and run torchrun as its child: the pid file then
    holds the runtime's pid, whose children are torchrun, not the ranks (SIGUSR1 went to torchrun, which ignores it,
    and no rank saved). The ranks are found below it; a rank's own child (a data-loader worker, with RANK inherited)
    is not signalled."""
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "pids").mkdir()
    py, rank = shlex.quote(sys.executable), shlex.quote(str(tmp_path / "rank.py"))
    (tmp_path / "rank6.sh").write_text(f"{py} -c 'import time; time.sleep(30)' &\nexec {py} {rank} {tmp_path}/r6\n")
    (tmp_path / "torchrun.sh").write_text(f"RANK=6 bash {tmp_path}/rank6.sh &\n"
                                          f"RANK=7 {py} {rank} {tmp_path}/r7 &\nwait\n")
    runtime = subprocess.Popen(["bash", "-c", f"bash {tmp_path}/torchrun.sh & wait"], start_new_session=True)
    try:
        node_started(tmp_path, runtime.pid, 0, (6, 7))
        out = signal_node(tmp_path, 0, "gpu-a")
        assert out.returncode == 0, out.stderr
        lines = (tmp_path / "signals" / "node-0.txt").read_text().splitlines()
        assert sorted(line.split(" rank=")[1] for line in lines) == ["6 signal=USR1 sent", "7 signal=USR1 sent"]
        wait_for(lambda: all((tmp_path / f"r{r}").exists() for r in (6, 7)), 20, "the ranks to stop")
        assert {(tmp_path / f"r{r}").read_text() for r in (6, 7)} == {f"{r} got {int(signal.SIGUSR1)}" for r in (6, 7)}
    finally:
        os.killpg(runtime.pid, signal.SIGKILL)
        runtime.wait(timeout=5)


def test_ctx_signal_node_signals_and_records_each_rank(tmp_path):
    """On one node: SIGUSR1 to each child of torchrun (here a bash standing in for it), a line per rank naming its
    RANK; a node without ranks says so and fails."""
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "pids").mkdir()
    torchrun = subprocess.Popen(["bash", "-c", f"RANK=4 {sys.executable} {tmp_path}/rank.py {tmp_path}/r4 & "
                                               f"RANK=5 {sys.executable} {tmp_path}/rank.py {tmp_path}/r5 & wait"],
                                start_new_session=True)
    try:
        node_started(tmp_path, torchrun.pid, 2, (4, 5))
        out = signal_node(tmp_path, 2, "gpu-c")
        assert out.returncode == 0, out.stderr
        assert torchrun.wait(timeout=20) == 0
        assert {(tmp_path / f"r{r}").read_text() for r in (4, 5)} == {f"{r} got {int(signal.SIGUSR1)}" for r in (4, 5)}
        lines = (tmp_path / "signals" / "node-2.txt").read_text().splitlines()
        assert sorted(line.split(" ", 1)[1].split(" pid=")[0] for line in lines) == ["node=2 host=gpu-c"] * 2
        assert sorted(line.split(" rank=")[1] for line in lines) == ["4 signal=USR1 sent", "5 signal=USR1 sent"]
        # the ranks have exited: nothing to signal
        assert signal_node(tmp_path, 2, "gpu-c").returncode == 1
        last = (tmp_path / "signals" / "node-2.txt").read_text().splitlines()[-1]
        assert last.endswith(f" node=2 host=gpu-c torchrun={torchrun.pid} signal=USR1 none")
    finally:
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.wait(timeout=5)
