"""Builds, once and in bounded time, the op DeepSpeed's CPU accelerator compiles at its first ``init_distributed``.

DeepSpeed 0.19 (``deepspeed.comm.torch.TorchBackend``) JIT-compiles its shared-memory comm op
(``ShareMemCommBuilder``, ``deepspeed_shm_comm``) into ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions/<python>_<accelerator>/``) the first time a process starts DeepSpeed on CPU: 1-5 minutes
on 2 cores, under torch's ``FileBaton``, an empty ``lock`` file created with ``O_CREAT | O_EXCL`` and removed when the
build ends. A build killed mid-way leaves that file behind and every later DeepSpeed start waits on it forever.

This script is the visible install step (``launch/env.sh`` runs it; the DeepSpeed tests run it before they start
ranks): it removes a stale lock (one no process holds open: the builder is gone), waits a bounded time for a live
builder, then runs DeepSpeed's own ``build_shm_op()`` in a child process under the same time limit, killing the child
(with ninja and its compilers) and removing the lock it leaves if the limit passes. Concurrent runs of this script
take turns (``fcntl.flock``, released by the kernel if a run dies). Exit status 0: the op is built (or DeepSpeed does
not need it); 1: a one-line reason and what to do, on stderr. ``DS_ACCELERATOR`` defaults to ``cpu``, the accelerator
the CPU tests use.

Usage: python launch/deepspeed_ops.py [--timeout SECONDS] [--print-dir]
"""
from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time

NAME = "deepspeed_shm_comm"
BUILD = ("import warnings; warnings.filterwarnings('ignore')\n"
         "from deepspeed.comm.torch import build_shm_op\n"
         "print('ctx_plugin: op', 'built' if build_shm_op() is not None else 'not needed')\n")


def build_dir() -> str:
    """The folder torch's ``cpp_extension.load`` builds the op in (it honours ``TORCH_EXTENSIONS_DIR``)."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)   # "No CUDA runtime is found" on CPU
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(NAME, verbose=False)


def holders(path: str) -> list[int] | None:
    """Processes that have ``path`` open (the builder holds torch's lock open until it removes it); None when /proc
    cannot say (not Linux)."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target, found = os.path.realpath(path), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:                         # gone, or another user's process (the cache is per user)
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    found.append(int(pid))
                    break
            except OSError:
                continue
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


class Failure(Exception):
    pass


def _clear_lock(lock: str, deadline: float, timeout: float) -> None:
    """Remove a stale lock; wait (until ``deadline``) for a live builder to finish."""
    while os.path.exists(lock):
        pids = holders(lock)
        if pids == []:
            try:
                os.remove(lock)
                print(f"[ctx_plugin] removed a stale lock left by a killed DeepSpeed op build: {lock}", file=sys.stderr)
            except FileNotFoundError:
                pass
            return
        if time.monotonic() > deadline:
            who = ("no /proc to tell which process holds it" if pids is None else
                   ", ".join(f"pid {p} ({_command(p)})" for p in pids))
            raise Failure(f"{lock} is still held after {timeout:g} s ({who}): wait for that build to finish, or end "
                          f"it and rerun; if no build is running, delete the file")
        time.sleep(0.5)


def _kill_session(sid: int) -> None:
    """SIGKILL every live process of session ``sid`` (the build child started one; ninja puts each compiler in a
    process group of its own, but they stay in the session)."""
    if not os.path.isdir("/proc"):
        os.killpg(sid, signal.SIGKILL)
        return
    for _ in range(50):
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state, _ppid, _pgrp, session = f.read().rsplit(")", 1)[1].split()[:4]
            except (OSError, ValueError):
                continue
            if int(session) == sid and state != "Z":
                alive.append(int(pid))
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _build(directory: str, deadline: float, timeout: float) -> str:
    child = subprocess.Popen([sys.executable, "-c", BUILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)      # its own session: ninja and the compilers too
    try:
        out, _ = child.communicate(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        _kill_session(child.pid)
        child.communicate()
        lock = os.path.join(directory, "lock")
        if os.path.exists(lock) and holders(lock) == []:
            os.remove(lock)                     # the lock the killed build left
        raise Failure(f"building DeepSpeed's {NAME} op in {directory} did not finish within {timeout:g} s (1-5 min "
                      f"on 2 cores; the partial build was stopped and its lock removed): rerun with a larger "
                      f"--timeout (launch/env.sh: CTX_DS_BUILD_TIMEOUT)") from None
    if child.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-15:])
        raise Failure(f"building DeepSpeed's {NAME} op in {directory} failed (exit {child.returncode}); its last "
                      f"lines:\n{tail}")
    return out.strip().splitlines()[-1] if out.strip() else ""


def prepare(timeout: float) -> str:
    """Makes the op ready within ``timeout`` seconds; returns DeepSpeed's last line, raises Failure."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deadline = time.monotonic() + timeout
    directory = build_dir()
    with open(os.path.join(directory, "ctx_plugin-prepare.flock"), "w") as turn:
        while True:
            try:
                fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Failure(f"another launch/deepspeed_ops.py has been preparing {directory} for more than "
                                  f"{timeout:g} s: wait for it, or rerun with a larger --timeout") from None
                time.sleep(0.5)
        _clear_lock(os.path.join(directory, "lock"), deadline, timeout)
        if not os.path.exists(os.path.join(directory, f"{NAME}.so")):
            print(f"[ctx_plugin] building DeepSpeed's {NAME} op once, into {directory} (1-5 min on 2 cores, at most "
                  f"{timeout:g} s)", file=sys.stderr)
        return _build(directory, deadline, timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for everything (default 900)")
    parser.add_argument("--print-dir", action="store_true", help="print the build folder and exit")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.print_dir:
        print(build_dir())
        return 0
    try:
        prepare(args.timeout)
    except Failure as e:
        print(f"[ctx_plugin] error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
