"""The status logic of launch/slurm_common.sh (ctx_run, ctx_status, ctx_seconds), without SLURM.

Each test writes a small bash driver that sources slurm_common.sh and runs ``ctx_run RUN_DIR`` on a tiny
``RUN_DIR/command.sh``. ``squeue`` is a fake on PATH (it prints the time left the test gives it, or nothing), so
no test depends on a cluster. Every subprocess has a timeout and runs in its own session, killed at the end.
"""
from __future__ import annotations

import os
import signal
import subprocess
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
    """A run directory, a fake squeue, and the driver that runs ``ctx_run`` on them."""

    def __init__(self, tmp_path: Path, command: str, time_left: str = "", job_id: str = "4242"):
        self.tmp = tmp_path
        self.run = tmp_path / "run"
        (self.run / "logs").mkdir(parents=True)
        (self.run / "command.sh").write_text(f"#!/usr/bin/env bash\necho $$ > {self.run}/child.pid\n{command}\n")
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        squeue = bin_dir / "squeue"
        squeue.write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path}/squeue.args\n'
                          + (f"echo {time_left}\n" if time_left else ""))
        squeue.chmod(0o755)
        self.driver = tmp_path / "driver.sh"
        self.driver.write_text(f"set -euo pipefail\nsource {COMMON}\nctx_run {self.run}\n")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CTX_"))}
        self.env["PATH"] = f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"
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
        wait_for(lambda: pid_file.is_file() and pid_file.read_text().strip(), 10, "command.sh to start")
        assert status_lines(self.run)[:1] == ["running"]
        return int(pid_file.read_text())

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


def test_completed(job):
    j = job("exit 0")
    rc, err = j.run_to_end()
    assert rc == 0
    lines = status_lines(j.run)
    assert lines[0] == "completed"
    f = fields(lines)
    assert f["exit_code"] == "0" and f["job_id"] == "4242"
    assert f["started"].endswith("Z") and f["ended"].endswith("Z") and f["started"] <= f["ended"]
    assert not (j.run / "status.tmp").exists()
    assert f"ctx_plugin: completed (exit code 0); logs in {j.run}/logs" in err
    assert (j.tmp / "squeue.args").read_text().split() == ["-h", "-j", "4242", "-o", "%L"]


def test_failed(job):
    j = job("exit 3")
    rc, err = j.run_to_end()
    assert rc == 3
    lines = status_lines(j.run)
    assert lines[0] == "failed"
    assert "exit_code=3" in lines and any(line.startswith("started=") for line in lines)
    assert any(line.startswith("ended=") for line in lines)
    assert "ctx_plugin: failed (exit code 3)" in err


def test_running_status_while_the_command_runs(job):
    j = job("exec sleep 30")
    j.start()
    j.started()
    lines = status_lines(j.run)
    assert lines[0] == "running"
    assert not any(line.startswith(("ended=", "exit_code=")) for line in lines)
    assert any(line.startswith("started=") for line in lines)


def test_usr1_is_a_timeout(job):
    j = job("exec sleep 30")
    j.start()
    child = j.started()
    t0 = time.monotonic()
    j.proc.send_signal(signal.SIGUSR1)
    rc, err = j.finish(timeout=10)
    assert time.monotonic() - t0 < 5
    lines = status_lines(j.run)
    assert lines[0] == "timeout"
    assert "exit_code=143" in lines and any(line.startswith("ended=") for line in lines)
    assert rc == 143
    assert "ctx_plugin: timeout: stopping the job step" in err
    assert not alive(child)


def test_sigterm_without_deadline_is_cancelled(job):
    j = job("exec sleep 30")
    j.start()
    child = j.started()
    j.proc.send_signal(signal.SIGTERM)
    rc, err = j.finish(timeout=10)
    assert status_lines(j.run)[0] == "cancelled"
    assert rc != 0 and "ctx_plugin: cancelled: stopping the job step" in err
    assert not alive(child)


def test_sigterm_near_the_deadline_is_a_timeout(job):
    j = job("exec sleep 30", time_left="0:30")          # 30 s left: within the 90 s margin
    j.start()
    child = j.started()
    j.proc.send_signal(signal.SIGTERM)
    rc, _ = j.finish(timeout=10)
    assert status_lines(j.run)[0] == "timeout"
    assert rc == 143
    assert not alive(child)


def test_sigterm_far_from_the_deadline_is_cancelled(job):
    j = job("exec sleep 30", time_left="1-00:00:00")     # a day left: scancel
    j.start()
    j.started()
    j.proc.send_signal(signal.SIGTERM)
    j.finish(timeout=10)
    assert status_lines(j.run)[0] == "cancelled"


def test_no_job_id_and_no_squeue_output(job):
    j = job("exit 0", job_id="")
    rc, _ = j.run_to_end()
    assert rc == 0
    lines = status_lines(j.run)
    assert lines[0] == "completed" and "job_id=" in lines
    assert (j.tmp / "squeue.args").read_text().split() == ["-h", "-j", "0", "-o", "%L"]


def test_failing_squeue_is_tolerated(job):
    j = job("exit 0")
    (j.tmp / "bin" / "squeue").write_text("#!/usr/bin/env bash\necho 'squeue: error: no cluster' >&2\nexit 1\n")
    rc, _ = j.run_to_end()
    assert rc == 0 and status_lines(j.run)[0] == "completed"


@pytest.mark.parametrize("value,seconds", [
    ("1-02:03:04", "93784"), ("02:03:04", "7384"), ("05:07", "307"), ("45", "45"), ("08:09", "489"),
    ("09", "9"), ("0:30", "30"), ("UNLIMITED", ""), ("NOT_SET", ""), ("INVALID", ""), ("", ""),
])
def test_ctx_seconds(value, seconds):
    out = subprocess.run(["bash", "-c", f'set -euo pipefail; source {COMMON}; echo "[$(ctx_seconds "$1")]"', "_",
                          value], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[{seconds}]"
