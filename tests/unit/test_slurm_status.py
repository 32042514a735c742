"""The status logic of launch/slurm_common.sh (ctx_run, ctx_status, ctx_seconds), without SLURM.

Each test writes a small bash driver that sources slurm_common.sh and runs ``ctx_run RUN_DIR`` on a tiny
``RUN_DIR/command.sh``. ``squeue`` is a fake on PATH (it prints the time left the test gives it, or nothing), so
no test depends on a cluster. Every subprocess has a timeout and runs in its own session, killed at the end.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMMON = REPO / "launch" / "slurm_common.sh"


def status_lines(run: Path) -> list[str]:
    path = run / "status"
    return path.read_text().splitlines() if path.is_file() else []


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


class Job:
    """A run directory with one attempt, fake squeue/scontrol/srun, and the driver that runs ``ctx_run`` on them.

    command.sh stands in for torchrun: it writes its pid where the batch script looks for it (``pids/``) and runs
    ``rank`` (a command: the rank, torchrun's child) in the background, waiting for it; the fake srun runs its
    command as node 0; the fake scontrol answers ``show job`` with ``show_job`` (fails when None) and records
    ``requeue``."""

    def __init__(self, tmp_path: Path, command: str, time_left: str = "", job_id: str = "4242", attempt: int = 1,
                 requeue: bool = False, show_job: str | None = None, early_warning: bool = False):
        self.tmp = tmp_path
        self.run = tmp_path / "run"
        self.attempt = self.run / f"attempt-{attempt}"
        (self.attempt / "logs").mkdir(parents=True)
        (self.attempt / "pids").mkdir()
        (self.attempt / "command.sh").write_text(
            f"#!/usr/bin/env bash\necho $$ > {self.run}/child.pid\necho $$ > {self.attempt}/pids/node-0.pid\n"
            f"{command}\n")
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        fakes = {
            "squeue": f'echo "$*" >> {tmp_path}/squeue.args\n' + (f"echo {time_left}\n" if time_left else ""),
            "scontrol": f'echo "$*" >> {tmp_path}/scontrol.args\n[ "$1" != requeue ] || exit 0\n'
                        + (f"echo '{show_job}'\n" if show_job is not None else "exit 1\n"),
            "srun": f'echo "$*" >> {tmp_path}/srun.args\nwhile [ "${{1#--}}" != "$1" ]; do shift; done\n'
                    'SLURM_NODEID=0 exec "$@"\n'}
        for name, text in fakes.items():
            (bin_dir / name).write_text("#!/usr/bin/env bash\n" + text)
            (bin_dir / name).chmod(0o755)
        self.driver = tmp_path / "driver.sh"
        early = "_ctx_early_warning=1   # what ctx_job's first trap sets\n" if early_warning else ""
        self.driver.write_text(f"set -euo pipefail\nsource {COMMON}\n{early}ctx_run {self.run} {self.attempt} "
                               f"{int(requeue)}\n")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CTX_"))}
        self.env["PATH"] = f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        self.env["CTX_PY"] = sys.executable
        if job_id:
            self.env["SLURM_JOB_ID"] = job_id
        self.proc: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        self.proc = subprocess.Popen(["bash", str(self.driver)], env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        return self.proc

    def finish(self, timeout: float = 10) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err

    def run_to_end(self, timeout: float = 10) -> tuple[int, str]:
        self.start()
        return self.finish(timeout)

    def started(self) -> int:
        """Waits until command.sh runs (ctx_run's traps are set by then); returns its pid."""
        pid_file = self.run / "child.pid"
        ranks = self.attempt / "pids" / "node-0.pid"
        wait_for(lambda: pid_file.is_file() and pid_file.read_text().strip() and ranks.is_file()
                 and ranks.read_text().strip(), 10, "command.sh to start")
        assert status_lines(self.attempt)[:1] == ["running"]
        return int(pid_file.read_text())

    def args(self, name: str) -> list[str]:
        path = self.tmp / f"{name}.args"
        return path.read_text().splitlines() if path.is_file() else []

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)     # the driver's own session: only what this test started
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=5)
        pid_file = self.run / "child.pid"
        if pid_file.is_file() and pid_file.read_text().strip():
            child = int(pid_file.read_text())
            try:
                if alive(child) and os.getpgid(child) == self.proc.pid:   # still ours: a command.sh left behind
                    os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def job(tmp_path):
    made = []

    def make(command: str, **kwargs) -> Job:
        made.append(Job(tmp_path, command, **kwargs))
        return made[-1]
    yield make
    for j in made:
        j.cleanup()


def fields(lines: list[str]) -> dict[str, str]:
    return dict(line.split("=", 1) for line in lines[1:])


RANK = """import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def stop(signum, frame):
    time.sleep(float(sys.argv[3]))        # finishing its step and saving
    out.write_text(f"signal {signum}")
    sys.exit(0)
signal.signal(getattr(signal, sys.argv[2]), stop)
Path(sys.argv[1] + ".ready").write_text("ready")
time.sleep(30)
sys.exit(5)
"""


def rank(tmp_path: Path, stop: str = "SIGUSR1", saving_s: float = 0) -> tuple[str, Path]:
    """A command.sh body running a stand-in rank 0 (on ``stop``, after ``saving_s`` seconds, writes which signal
    and exits 0; else exits 5); and where it writes."""
    (tmp_path / "rank.py").write_text(RANK)
    out = tmp_path / "rank.out"
    return f"RANK=0 {sys.executable} {tmp_path}/rank.py {out} {stop} {saving_s} &\nwait $!", out


def test_completed(job):
    j = job("exit 0")
    rc, err = j.run_to_end()
    assert rc == 0
    lines = status_lines(j.attempt)
    assert lines[0] == "completed"
    f = fields(lines)
    assert f["exit_code"] == "0" and f["job_id"] == "4242"
    assert f["started"].endswith("Z") and f["ended"].endswith("Z") and f["started"] <= f["ended"]
    assert status_lines(j.run) == lines + ["attempt=1"]
    assert not (j.attempt / "status.tmp").exists() and not (j.run / "status.tmp").exists()
    assert f"ctx_plugin: completed (exit code 0); logs in {j.attempt}" in err
    assert j.args("squeue") == ["-h -j 4242 -o %L"]


ROOT_CAUSE = """rank {rank} says: {words}
W1201 08:21:49.906000 1640 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 1 closing signal
E1201 08:21:49.913000 1640 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 3) local_rank: 1
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  time      : {time}
  host      : {host}
  rank      : {rank} (local_rank: 1)
  exitcode  : {code} (pid: 1682)
  error_file: <N/A>
============================================================
"""


def test_failed_names_the_first_failure(job):
    j = job("exit 3")
    for node, host, rank_id, code, at in ((0, "n0", 1, 7, "2026-12-01_08:21:50"), (1, "n1", 3, 3, "2026-12-01_08:21:49")):
        (j.attempt / "logs" / f"node-{node}-{host}.log").write_text(
            "\n".join(f"line {i}" for i in range(30)) + "\n"
            + ROOT_CAUSE.format(rank=rank_id, words=f"bad input on {host}", time=at, host=host, code=code))
    rc, err = j.run_to_end(timeout=30)
    assert rc == 3
    lines = status_lines(j.attempt)
    assert lines[0] == "failed" and "exit_code=3" in lines
    assert any(line.startswith("started=") for line in lines) and any(line.startswith("ended=") for line in lines)
    first = "first failure: node 1 (n1) rank 3 exit code 3 at 2026-12-01_08:21:49"
    assert f"first_failure={first}" in lines and status_lines(j.run)[0] == "failed"
    failure = (j.attempt / "failure").read_text().splitlines()
    assert failure[0] == first and failure[1] == f"log={j.attempt}/logs/node-1-n1.log"
    assert failure[-1] == "rank 3 says: bad input on n1" and failure[-2] == "line 29"   # before torchrun's report
    assert "ctx_plugin: failed (exit code 3)" in err


def test_failed_without_a_torchrun_report(job):
    j = job("exit 4")
    rc, _ = j.run_to_end(timeout=30)
    assert rc == 4
    assert "first_failure=no rank's failure found in the logs (the job step failed before or outside torchrun)" \
        in status_lines(j.attempt)


def test_running_status_while_the_command_runs(job):
    j = job("exec sleep 30")
    j.start()
    j.started()
    lines = status_lines(j.attempt)
    assert lines[0] == "running"
    assert not any(line.startswith(("ended=", "exit_code=")) for line in lines)
    assert any(line.startswith("started=") for line in lines)
    assert status_lines(j.run)[0] == "running"


def warn_and_wait_for_the_rank(j, out: Path) -> None:
    j.start()
    j.started()
    wait_for(lambda: Path(f"{out}.ready").exists(), 10, "the rank to install its handler")
    j.proc.send_signal(signal.SIGUSR1)                 # SLURM's warning (--signal=B:USR1): to the batch shell
    wait_for(lambda: out.exists(), 10, "the rank to get SIGUSR1")
    assert out.read_text() == f"signal {int(signal.SIGUSR1)}"
    wait_for(lambda: "exit_code=0" in status_lines(j.attempt), 10, "the step to end")


def test_warning_reaches_the_ranks_then_the_job_waits_for_the_limit(job, tmp_path):
    command, out = rank(tmp_path)
    j = job(command, time_left="0:30")
    warn_and_wait_for_the_rank(j, out)
    lines = status_lines(j.attempt)
    assert lines[0] == "timeout" and "exit_code=0" in lines
    assert status_lines(j.run)[0] == "timeout"
    srun = j.args("srun")
    assert len(srun) == 1 and srun[0].startswith("--overlap --export=ALL --nodes=1 --ntasks=1 --ntasks-per-node=1 bash -c")
    assert not any(a.startswith("requeue") for a in j.args("scontrol"))
    # the node's record of the rank it signalled; the rank keeps none (a program without ctx_plugin's handler)
    sent = (j.attempt / "signals" / "node-0.txt").read_text().splitlines()
    assert len(sent) == 1 and sent[0].endswith(" rank=0 signal=USR1 sent") and " node=0 " in sent[0]
    assert "signals=sent SIGUSR1 to ranks 0; no rank recorded receiving it (the program keeps no signal record; " \
           "ctx_plugin.train_hf and Megatron through ctx_plugin's entry point with --exit-signal-handler do)" in lines
    time.sleep(0.5)
    assert j.proc.poll() is None                       # waits for SLURM to end it at the limit (TIMEOUT)
    j.proc.send_signal(signal.SIGTERM)                 # the time limit
    rc, err = j.finish(timeout=10)
    assert status_lines(j.attempt)[0] == "timeout" and lines[-1].startswith("signals=sent SIGUSR1")
    assert status_lines(j.attempt)[-1] == lines[-1]    # every later status keeps it
    assert "ctx_plugin: time-limit warning: SIGUSR1 to every rank" in err


STOPPING_RANK = """import sys, time
from ctx_plugin.slurm.signals import StopRequest
stop = StopRequest()
print("ready", flush=True)
while stop.signal is None:
    time.sleep(0.05)
"""


def test_each_rank_records_its_own_signal(job, tmp_path):
    """Two ranks with ctx_plugin's handler (StopRequest, as in train_hf) under CTX_ATTEMPT_DIR, as command.sh exports
    it: the node's record has both, each rank's record its own signal, and the status says so."""
    (tmp_path / "stopping.py").write_text(STOPPING_RANK)
    ready = tmp_path / "ready"
    j = job(f"for r in 0 1; do RANK=$r CTX_ATTEMPT_DIR={tmp_path}/run/attempt-1 {sys.executable} {tmp_path}/stopping.py"
            f" >> {ready} & done\nwait", time_left="0:30")
    j.start()
    j.started()
    wait_for(lambda: ready.is_file() and ready.read_text().count("ready") == 2, 30, "the ranks' handlers")
    j.proc.send_signal(signal.SIGUSR1)
    wait_for(lambda: "exit_code=0" in status_lines(j.attempt), 30, "the step to end")
    lines = status_lines(j.attempt)
    assert "signals=sent SIGUSR1 to ranks 0 1; received: SIGUSR1 by ranks 0 1" in lines, lines
    for r in (0, 1):
        assert f" rank={r} " in (j.attempt / "signals" / f"rank-{r}.txt").read_text()
    j.proc.send_signal(signal.SIGTERM)                 # the time limit
    j.finish(timeout=10)


def test_warning_with_requeue(job, tmp_path):
    command, out = rank(tmp_path)
    j = job(command, time_left="0:30", requeue=True)
    warn_and_wait_for_the_rank(j, out)
    wait_for(lambda: any(a.startswith("requeue") for a in j.args("scontrol")), 10, "scontrol requeue")
    assert "requeue 4242" in j.args("scontrol")
    assert status_lines(j.attempt)[0] == "requeued" and status_lines(j.run)[0] == "requeued"
    j.proc.send_signal(signal.SIGTERM)                 # what the requeue does to the batch shell
    j.finish(timeout=10)
    assert status_lines(j.attempt)[0] == "requeued"


def test_warning_then_a_failing_step_is_not_requeued(job):
    j = job("sleep 0.5; exit 7", time_left="0:01", requeue=True)
    j.start()
    j.started()
    j.proc.send_signal(signal.SIGUSR1)
    failed = lambda: [x for x in status_lines(j.attempt) if x.startswith("exit_code=") and x != "exit_code=0"]  # noqa
    wait_for(failed, 10, "the step to end")     # 7, or 138 when the USR1 meets the shell forking sleep
    j.proc.send_signal(signal.SIGTERM)                 # the time limit
    j.finish(timeout=10)
    lines = status_lines(j.attempt)
    assert lines[0] == "timeout" and failed()
    assert any(line.startswith("note=the job step failed after the time-limit warning") for line in lines)
    assert not any(a.startswith("requeue") for a in j.args("scontrol"))


def test_warning_before_the_step_starts(job):
    """SLURM's warning while the job was being checked (ctx_job traps it): the step is not started; requeued."""
    j = job("exit 9", requeue=True, early_warning=True)
    rc, err = j.run_to_end()
    assert not (j.run / "child.pid").exists()
    assert status_lines(j.attempt)[0] == "requeued" and "requeue 4242" in j.args("scontrol")
    assert "the time-limit warning came before the job step started" in err


def show_job(state: str, seconds_run: int, limit: str = "00:10:00", restarts: int = 0, preempt: str = "") -> str:
    """``scontrol show job -o`` as SLURM 22.05 prints it (PreemptTime only once the job is picked for preemption)."""
    end = 1_700_000_000 + seconds_run
    stamp = lambda t: time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))   # noqa: E731
    return (f"JobId=4242 JobName=x JobState={state} Reason=None Dependency=(null) Requeue=1 Restarts={restarts} "
            f"BatchFlag=1 RunTime=00:00:01 TimeLimit={limit} StartTime={stamp(1_700_000_000)} EndTime={stamp(end)} "
            f"Deadline=N/A PreemptEligibleTime={stamp(1_700_000_000)}"
            + (f" PreemptTime={preempt}" if preempt else "") + " SuspendTime=None SecsPreSuspend=0")


def in_grace(seconds_left: int = 2) -> str:
    """Within a preemption's GraceTime: still RUNNING, PreemptTime set, EndTime moved to its end."""
    start = 1_700_000_000
    stamp = lambda t: time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))   # noqa: E731
    return show_job("RUNNING", int(time.time()) + seconds_left - start, preempt=stamp(time.time()))


@pytest.mark.parametrize("answer,time_left,word", [
    (show_job("COMPLETING", 60), "0:30", "cancelled"),      # scancel 30 s before the limit: slurmctld says cancel
    (show_job("COMPLETING", 600), "1-00:00:00", "timeout"),  # ended at the time limit
    (show_job("CANCELLED", 60), "0:30", "cancelled"),
    (show_job("TIMEOUT", 600), "", "timeout"),
    (show_job("PREEMPTED", 60), "", "preempted"),
    (show_job("COMPLETING", 700, restarts=1), "1-00:00:00", "requeued"),   # a preemption's GraceTime ended
    (None, "0:30", "timeout"),                              # slurmctld does not answer: within 90 s of the limit
    (None, "1-00:00:00", "cancelled"),
    (None, "", "cancelled"),
], ids=["scancel-near-limit", "at-limit", "cancelled", "timeout", "preempted", "requeued-by-slurm", "no-answer-near",
        "no-answer-far", "no-answer-no-limit"])
def test_sigterm_is_classified_by_slurmctld(job, answer, time_left, word):
    j = job("exec sleep 30", time_left=time_left, show_job=answer)
    j.start()
    child = j.started()
    j.proc.send_signal(signal.SIGTERM)
    rc, err = j.finish(timeout=10)
    assert status_lines(j.attempt)[0] == word and status_lines(j.run)[0] == word
    assert rc == 143 and f"ctx_plugin: {word}: stopping the job step" in err
    assert not alive(child)
    assert "show job -o 4242" in j.args("scontrol")         # asked in every case


def test_sigterm_to_this_shell_only_reaches_the_ranks(job, tmp_path):
    """`scancel --batch --signal=TERM`, `--signal=B:TERM@<s>`: the job still RUNNING, SLURM ends no step. Stopping
    srun would have it SIGKILL the ranks before they save: they get SIGTERM instead (as the warning's USR1), save
    and stop, and the step ends by itself."""
    command, out = rank(tmp_path, "SIGTERM", saving_s=0.5)
    j = job(command, show_job=show_job("RUNNING", 60))
    j.start()
    j.started()
    wait_for(lambda: Path(f"{out}.ready").exists(), 10, "the rank to install its handler")
    j.proc.send_signal(signal.SIGTERM)
    rc, err = j.finish(timeout=20)
    assert out.read_text() == f"signal {int(signal.SIGTERM)}"          # saved: not killed
    assert rc == 0 and "ctx_plugin: cancelled: SIGTERM to every rank" in err and "stopping the job step" not in err
    lines = status_lines(j.attempt)
    assert lines[0] == "cancelled" and "exit_code=0" in lines
    assert any(line.startswith("signals=sent SIGTERM to ranks 0") for line in lines)


def test_sigterm_to_this_shell_without_ranks_stops_the_step(job):
    """No rank to pass SIGTERM to (none started yet, or none left): the step is stopped as before."""
    j = job("exec sleep 30", show_job=show_job("RUNNING", 60))
    j.start()
    child = j.started()
    j.proc.send_signal(signal.SIGTERM)
    rc, err = j.finish(timeout=10)
    assert rc == 143 and "cancelled: SIGTERM to every rank" in err and "cancelled: stopping the job step" in err
    assert not alive(child) and status_lines(j.attempt)[0] == "cancelled"


def test_attempts_are_kept(job):
    j = job("exit 0", attempt=2)
    first = j.run / "attempt-1"
    (first / "logs").mkdir(parents=True)
    (first / "logs" / "node-0-vm.log").write_text("attempt 1's log\n")
    (first / "status").write_text("requeued\nexit_code=0\njob_id=4242\nstarted=A\nended=B\n")
    rc, _ = j.run_to_end()
    assert rc == 0
    run = status_lines(j.run)
    assert run[0] == "completed" and "attempt=2" in run
    assert "attempt_1=requeued exit_code=0 job_id=4242 started=A ended=B" in run
    assert (first / "status").read_text().startswith("requeued\n")
    assert (first / "logs" / "node-0-vm.log").read_text() == "attempt 1's log\n"
    assert status_lines(j.attempt)[0] == "completed"


def test_no_job_id_and_no_squeue_output(job):
    j = job("exit 0", job_id="")
    rc, _ = j.run_to_end()
    assert rc == 0
    lines = status_lines(j.attempt)
    assert lines[0] == "completed" and "job_id=" in lines
    assert j.args("squeue") == ["-h -j 0 -o %L"]


def test_failing_squeue_is_tolerated(job):
    j = job("exit 0")
    (j.tmp / "bin" / "squeue").write_text("#!/usr/bin/env bash\necho 'squeue: error: no cluster' >&2\nexit 1\n")
    rc, _ = j.run_to_end()
    assert rc == 0 and status_lines(j.attempt)[0] == "completed"


@pytest.mark.parametrize("value,seconds", [
    ("1-02:03:04", "93784"), ("02:03:04", "7384"), ("05:07", "307"), ("45", "45"), ("08:09", "489"),
    ("09", "9"), ("0:30", "30"), ("UNLIMITED", ""), ("NOT_SET", ""), ("INVALID", ""), ("", ""),
])
def test_ctx_seconds(value, seconds):
    out = subprocess.run(["bash", "-c", f'set -euo pipefail; source {COMMON}; echo "[$(ctx_seconds "$1")]"', "_",
                          value], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[{seconds}]"


def test_preempted_step_waits_for_slurm_to_end_the_job(job):
    """Preemption with a GraceTime: SLURM signals the steps (not the batch shell); the ranks save, torchrun exits 1
    after its SIGTERM. Not a failure: preempted, and the shell waits for SLURM's end of the GraceTime (a job that
    ended before it would be COMPLETED, never requeued)."""
    j = job("exit 1", time_left="9:00", show_job=in_grace())
    j.start()
    wait_for(lambda: status_lines(j.attempt)[:1] == ["preempted"], 10, "the preempted status")
    lines = status_lines(j.attempt)
    assert "exit_code=1" in lines and any(line.startswith("note=preempted (PreemptTime set)") for line in lines)
    assert not any(line.startswith("first_failure=") for line in lines)
    time.sleep(0.5)
    assert j.proc.poll() is None                       # still there when SLURM's GraceTime ends
    assert not any(a.startswith("requeue") for a in j.args("scontrol"))   # SLURM requeues it, not the script
    j.proc.send_signal(signal.SIGTERM)                 # the GraceTime's end
    rc, err = j.finish(timeout=10)
    assert rc == 1 and status_lines(j.run)[0] == "preempted"
    assert "waiting for SLURM to end the job (end of the preemption's GraceTime)" in err


def test_sigterm_within_the_grace_time_leaves_the_step_to_save(job, tmp_path):
    """Where SLURM's preemption SIGTERM reaches the batch shell too, the step is not stopped (srun would SIGKILL the
    ranks): it ends once the ranks have saved; then as above. SLURM's second SIGTERM ends the wait."""
    j = job("exec sleep 30", time_left="9:00", show_job=in_grace())
    j.start()
    child = j.started()
    j.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: status_lines(j.attempt)[:1] == ["preempted"], 10, "the preempted status")
    time.sleep(0.5)
    assert alive(child)
    assert any(line.startswith("stopping=preempted") for line in status_lines(j.attempt))
    os.kill(child, signal.SIGTERM)                     # the ranks saved and exited
    wait_for(lambda: "exit_code=143" in status_lines(j.attempt), 10, "the step to end")
    assert j.proc.poll() is None
    j.proc.send_signal(signal.SIGTERM)
    rc, _ = j.finish(timeout=10)
    assert status_lines(j.attempt)[0] == "preempted" and status_lines(j.run)[0] == "preempted"


def test_warning_at_preemption_is_not_requeued_by_the_script(job, tmp_path):
    """PreemptParameters=send_user_signal: the warning (USR1) comes at preemption; the ranks save, and the job is left
    to SLURM (which requeues it at the GraceTime's end) even with --requeue."""
    command, out = rank(tmp_path)
    j = job(command, time_left="9:00", requeue=True, show_job=in_grace())
    warn_and_wait_for_the_rank(j, out)
    assert status_lines(j.attempt)[0] == "preempted"
    # the signals' summary joins the status after it is written (the GraceTime runs)
    wait_for(lambda: status_lines(j.attempt)[-1].startswith("signals=sent SIGUSR1 to ranks 0")
             and status_lines(j.run)[-2] == status_lines(j.attempt)[-1], 20, "the summary (the run's status after)")
    assert status_lines(j.attempt)[0] == "preempted"
    time.sleep(0.5)
    assert j.proc.poll() is None and not any(a.startswith("requeue") for a in j.args("scontrol"))
    j.proc.send_signal(signal.SIGTERM)
    j.finish(timeout=10)
    assert status_lines(j.attempt)[0] == "preempted"


def test_first_failure_names_slurms_node_not_the_host(tmp_path):
    """srun's %N in the log name is the host's name, the same for nodes that share a host (or whose hostname differs
    from SLURM's node name): the record names SLURM's node from the attempt's nodes.txt, by node index."""
    from ctx_plugin.slurm.records import first_failure

    (tmp_path / "logs").mkdir()
    (tmp_path / "nodes.txt").write_text("gpu-a\ngpu-b\n")
    for node in (0, 1):
        (tmp_path / "logs" / f"node-{node}-vm.log").write_text(
            ROOT_CAUSE.format(rank=node, words="x", time=f"2026-12-01_08:21:5{1 - node}", host="vm", code=3))
    assert first_failure(tmp_path)["host"] == "gpu-b" and first_failure(tmp_path)["node"] == "1"
    (tmp_path / "nodes.txt").unlink()
    assert first_failure(tmp_path)["host"] == "vm"
