"""launch/gpu_check.sh's control flow, with a stand-in interpreter (the real run needs a GPU): each step has its own
time limit, a step cut off at it leaves the later steps their turn, and the script's status says a limit was hit.
The stand-in records its arguments, so the benchmark's command (the targets' rows first) is checked too."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STUB = """#!/usr/bin/env bash
# Stand-in for python: the device line reads a script from stdin; pytest hangs; the benchmarks echo their arguments.
if [[ "$1" == "-" ]]; then cat >/dev/null; echo "device stub"; exit 0; fi
if [[ "$2" == "pytest" ]]; then echo "pytest started"; exec sleep 60; fi
echo "args: $*"
"""


def _run(tmp_path: Path, limits: str | None) -> subprocess.CompletedProcess:
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    env.pop("GPU_CHECK_LIMITS", None)
    if limits is not None:
        env["GPU_CHECK_LIMITS"] = limits
    return subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh"), str(stub)], env=env, capture_output=True,
                          text=True, timeout=60)


def test_a_step_cut_off_at_its_limit_leaves_the_others_their_turn(tmp_path):
    proc = _run(tmp_path, "1 5 5")
    out = tmp_path / "out"
    assert proc.returncode == 124, proc.stderr
    assert (out / "device.txt").read_text() == "device stub\n"
    assert (out / "pytest.txt").read_text() == "pytest started\n"
    bench = (out / "bench.txt").read_text()
    assert "--passes fwd+bwd fwd " in bench and "--seq-len 128k" in bench
    assert "--backends" not in bench.split("\n")[0]           # every backend: the bench's default, names.Backend
    assert "--doc-len 4k" in (out / "docs.txt").read_text()


@pytest.mark.parametrize("limits", ["1 2", "60 0 60", "60 x 60", "1 2 3 4"])
def test_bad_limits_are_refused_before_anything_runs(tmp_path, limits):
    proc = _run(tmp_path, limits)
    assert proc.returncode == 2
    assert "GPU_CHECK_LIMITS must be three whole seconds" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_stops_after_the_device_line(tmp_path):
    """Without CUDA the benchmark would run its 128k rows on the CPU for hours: the script stops first."""
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh"), sys.executable], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "launch/gpu_check.sh needs a GPU and a CUDA build of torch" in proc.stderr
    assert "device none" in (tmp_path / "out" / "device.txt").read_text()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["device.txt"]
