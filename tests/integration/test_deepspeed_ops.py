"""launch/deepspeed_ops.py, the install step for the comm op DeepSpeed JIT-compiles at its first start on CPU, on
separate ``TORCH_EXTENSIONS_DIR``s (the shared cache is only read): a lock left by a killed build (torch's
``FileBaton``: created, then the builder SIGKILLed) is removed and the op loads; a lock a live builder holds is
waited for a bounded time, then named with its process, and left alone; a cold cache's build that runs out of time (a
compiler that never finishes, through torch's ``CXX``) is stopped, compiler included, and leaves no lock behind. A
real cold build (1-5 min on 2 cores) is what ``launch/env.sh`` and the DeepSpeed tests' first run do."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'ctx-plugin[deepspeed]'")

from tests.integration.deepspeed_ranks import OP_TIMEOUT_S, ROOT  # noqa: E402

SCRIPT = os.path.join(ROOT, "launch", "deepspeed_ops.py")
BATON = ("import os, signal, sys, time\n"
         "from torch.utils.file_baton import FileBaton\n"
         "assert FileBaton(sys.argv[1]).try_acquire()\n"      # what cpp_extension.load does before it builds
         "print('held', flush=True)\n"
         "if sys.argv[2] == 'killed':\n"
         "    os.kill(os.getpid(), signal.SIGKILL)\n"
         "time.sleep(300)\n")


SLOW_CXX = """#!/bin/sh
case " $* " in *" -c "*) echo $$ >> "$(dirname "$0")/compiling"; sleep 300;; esac
exec c++ "$@"
"""


def _ops(ext_dir, timeout: float, limit_s: float, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), **env) if ext_dir else None
    return subprocess.run([sys.executable, SCRIPT, "--timeout", str(timeout)], env=env, capture_output=True,
                          text=True, timeout=limit_s)


def _baton(lock: str, mode: str) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", BATON, lock, mode], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A copy of the built op (built here first if the cache is cold) in a fresh TORCH_EXTENSIONS_DIR."""
    assert _ops(None, OP_TIMEOUT_S, OP_TIMEOUT_S + 120).returncode == 0
    source = subprocess.run([sys.executable, SCRIPT, "--print-dir"], capture_output=True, text=True,
                            check=True).stdout.strip()
    ext = tmp_path_factory.mktemp("extensions")
    shutil.copytree(source, ext / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock", "*.flock"))
    return ext


def test_a_lock_left_by_a_killed_build_is_removed_and_the_op_loads(built):
    lock = str(built / "deepspeed_shm_comm" / "lock")
    _baton(lock, "killed").wait()
    assert os.path.exists(lock)
    run = _ops(built, 120, 240)
    assert run.returncode == 0, run.stderr
    assert f"removed a stale lock left by a killed DeepSpeed op build: {lock}" in run.stderr
    assert not os.path.exists(lock)


def test_a_live_builder_is_waited_for_a_bounded_time_then_named(built):
    lock = str(built / "deepspeed_shm_comm" / "lock")
    holder = _baton(lock, "alive")
    try:
        run = _ops(built, 2, 120)
        assert run.returncode == 1
        assert f"{lock} is still held after 2 s (pid {holder.pid} (" in run.stderr, run.stderr
        assert os.path.exists(lock), "a lock a live process holds must be left alone"
    finally:
        holder.kill()
        holder.wait()
        os.remove(lock)


def test_a_cold_build_out_of_time_is_stopped_and_leaves_no_lock(tmp_path):
    cxx = tmp_path / "bin" / "c++"
    cxx.parent.mkdir()
    cxx.write_text(SLOW_CXX)
    cxx.chmod(0o755)
    ext, started = tmp_path / "extensions", time.monotonic()
    run = _ops(ext, 25, 240, CXX=str(cxx))   # its compiler starts after ~10 s on 2 loaded cores (imports, ninja)
    assert run.returncode == 1
    assert "building DeepSpeed's deepspeed_shm_comm op once, into" in run.stderr
    assert "did not finish within 25 s" in run.stderr, run.stderr
    compilers = [int(p) for p in (cxx.parent / "compiling").read_text().split()]   # the build had started
    assert not (ext / "deepspeed_shm_comm" / "lock").exists()
    assert time.monotonic() - started < 120
    for pid in compilers:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2], \
            f"compiler {pid} still running"
