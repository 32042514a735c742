"""launch/env.sh's disk-space check: a venv that still has to install torch (~5.1 GB) is refused at once when its
disk lacks room, with the numbers and the fix, before pip starts (a CI clone once failed half way through pip with
"No space left on device"); a venv whose torch is installed is never refused. ``df`` is a stand-in on PATH that
reports the free space the test wants, so nothing real is created or installed."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _source_env(tmp_path: Path, free_kib: int) -> subprocess.CompletedProcess:
    stub = tmp_path / "stub-bin"
    stub.mkdir(exist_ok=True)
    df = stub / "df"
    df.write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                  f"echo '/dev/stub 999999999 1 {free_kib} 1% /'\n")
    df.chmod(0o755)
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", CTX_VENV=str(tmp_path / "venv"))
    script = f'source "{REPO}/launch/env.sh" test && echo "CTX_PY=$CTX_PY"'
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)


def _installed_venv(tmp_path: Path) -> None:
    """A venv as launch/env.sh leaves it after a complete install with the ``test`` extra."""
    venv = tmp_path / "venv"
    (venv / "lib" / "python3.12" / "site-packages" / "torch-2.13.0.dist-info").mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".ctx_plugin-installed-test").touch()


@pytest.mark.parametrize("free_gib", [0, 6])
def test_new_venv_refused_without_room(tmp_path, free_gib):
    proc = _source_env(tmp_path, free_gib * 1024 * 1024 + 1000)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "needs about 7 GiB free" in proc.stderr and f"has {free_gib * 1024} MiB" in proc.stderr
    assert "set CTX_VENV to a path on a larger disk" in proc.stderr
    assert not (tmp_path / "venv").exists(), "refused before the venv was created"


def test_venv_without_torch_refused_without_room(tmp_path):
    """A venv created before an install that failed (bin/python there, torch not): refused like a new one."""
    _installed_venv(tmp_path)
    (tmp_path / "venv" / "lib" / "python3.12" / "site-packages" / "torch-2.13.0.dist-info").rmdir()
    (tmp_path / "venv" / ".ctx_plugin-installed-test").unlink()
    proc = _source_env(tmp_path, 1024)
    assert proc.returncode == 1 and "needs about 7 GiB free" in proc.stderr, proc.stdout + proc.stderr


def test_installed_venv_not_refused_when_disk_is_full(tmp_path):
    _installed_venv(tmp_path)
    proc = _source_env(tmp_path, 1024)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"CTX_PY={tmp_path / 'venv' / 'bin' / 'python'}" in proc.stdout and "GiB" not in proc.stderr


def _sourced_in_plain_shell(tmp_path: Path, free_kib: int) -> subprocess.CompletedProcess:
    """An interactive-like shell (no errexit, no pipefail) that sources env.sh, then goes on."""
    stub = tmp_path / "stub-bin"
    stub.mkdir(exist_ok=True)
    (stub / "df").write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                             f"echo '/dev/stub 999999999 1 {free_kib} 1% /'\n")
    (stub / "df").chmod(0o755)
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", CTX_VENV=str(tmp_path / "venv"))
    script = (f'set +euo pipefail; source "{REPO}/launch/env.sh" test; echo "rc=$?"; echo "flags=$-"; '
              'set -o | grep -E "^(pipefail|nounset|errexit) " | tr -s " \\t" " "; false | true; echo "went on"')
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("installed", [True, False], ids=["installed", "refused"])
def test_sourcing_keeps_the_callers_shell_options(tmp_path, installed):
    """`source launch/env.sh` in a shell of one's own: its strict options stay inside it, and a refusal returns its
    status instead of ending the shell."""
    if installed:
        _installed_venv(tmp_path)
    proc = _sourced_in_plain_shell(tmp_path, 1024)
    out = proc.stdout
    assert proc.returncode == 0 and "went on" in out, proc.stdout + proc.stderr
    assert f"rc={0 if installed else 1}" in out
    assert "errexit off" in out and "nounset off" in out and "pipefail off" in out
    assert ("needs about 7 GiB free" in proc.stderr) is not installed
