"""The quick-start job itself: `ctx-plugin demo` under torchrun, every ring backend, parity with 1 process."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ctx_plugin.names import Backend


# (ranks, extra flags) per backend; the hybrid needs 4 ranks to have both axes.
RUNS = {b.value: (2, []) for b in Backend} | {Backend.ULYSSES_RING.value: (4, ["--ulysses-size", "2"])}


@pytest.mark.parametrize("backend", [b.value for b in Backend])
def test_demo_matches_single_process(tmp_path, backend):
    report = tmp_path / "demo.json"
    nproc, extra = RUNS[backend]
    proc = subprocess.run(
        [sys.executable, "-m", "ctx_plugin.cli", "demo", "--nproc", str(nproc), "--backend", backend, *extra,
         "--device", "cpu", "--steps", "3", "--seq-len", "64", "--json", str(report)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: loss matches the single-process run" in proc.stdout
    data = json.loads(report.read_text())
    assert data["ok"] and data["world_size"] == nproc and data["device"] == "cpu"
    assert len(data["cp_losses"]) == 3 and data["worst_rel_diff"] <= 1e-5
    assert data["tokens_per_s"] > 0 and all(m > 0 for m in data["peak_memory_mib"])


def test_demo_with_memory_modifiers(tmp_path):
    """``--recompute full+tile_loss:48+offload_attn:1`` in one run: the context-parallel run's head and loss over
    chunks of 48 of each rank's 128 tokens (the last chunk shorter), region inputs and pinned attention tensors
    through host memory, trains like the untiled single-process run without recompute (the demo's own reference:
    losses within 1e-5). Offload's bit-identity with the same preset without it:
    tests/distributed/test_offload_ranks.py."""
    report = tmp_path / "demo.json"
    recompute = "full+tile_loss:48+offload_attn:1"
    proc = subprocess.run(
        [sys.executable, "-m", "ctx_plugin.cli", "demo", "--nproc", "2", "--backend", "zigzag", "--device", "cpu",
         "--steps", "3", "--seq-len", "64", "--recompute", recompute, "--json", str(report)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["ok"] and data["worst_rel_diff"] <= 1e-5 and data["args"]["recompute"] == recompute
    assert len(data["cp_losses"]) == 3


def test_demo_with_packed_documents(tmp_path):
    """``--documents 4`` under ``--recompute sqrt`` (documents through a multi-layer recompute region): packed
    sequences train like the one-process run with the same documents, and differently from unpacked sequences (the
    documents reach the attention)."""
    losses = {}
    for extra in (["--documents", "4"], []):
        report = tmp_path / f"demo{len(extra)}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "ctx_plugin.cli", "demo", "--nproc", "2", "--backend", "zigzag", "--device", "cpu",
             "--steps", "3", "--seq-len", "64", "--recompute", "sqrt", *extra, "--json", str(report)],
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        data = json.loads(report.read_text())
        assert data["ok"] and data["worst_rel_diff"] <= 1e-5
        losses[len(extra)] = data["cp_losses"]
    assert all(abs(a - b) > 1e-4 for a, b in zip(losses[2], losses[0])), losses
