"""The benchmark harness: simulated groups, the silent transport, the report's arithmetic and the CLI (smoke)."""
from __future__ import annotations

import json
from dataclasses import replace
import subprocess
import sys

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench.counting import CommCounter
from ctx_plugin.bench.harness import Shape, attention_step, rank_times
from ctx_plugin.bench.report import row
from ctx_plugin.bench.simulated import SILENT, run_threaded, simulated_groups
from ctx_plugin.cli import main
from ctx_plugin.names import Backend

EXPECTED_COMM = {Backend.RING: {"ring_kv": 3}, Backend.ZIGZAG: {"ring_kv": 3}, Backend.STRIPED: {"ring_kv": 3},
                 Backend.ULYSSES: {"a2a": 4}, Backend.ULYSSES_RING: {"a2a": 4, "ring_kv": 1},
                 Backend.ALLGATHER: {"allgather_kv": 1}}


@pytest.mark.parametrize("backend", list(Backend))
def test_silent_rank_runs_the_distributed_plan(backend):
    """A simulated rank issues exactly the communication a real rank issues (P = 4), none of it moving data."""
    cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=2 if backend == Backend.ULYSSES_RING else 1)
    for rank in range(4):
        groups = simulated_groups(cfg, rank, 4, SILENT, "cpu")
        q = torch.randn(1, 8, 4, 8)
        with CommCounter().counting() as counter:
            out = ctx_plugin.cp_attention(q, torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8), config=cfg,
                                          groups=groups)
        assert out.shape == q.shape
        assert dict(counter.counts) == EXPECTED_COMM[backend]


def test_hybrid_groups_are_laid_out_like_build_cp_groups():
    cfg = ctx_plugin.CPConfig(backend="ulysses_ring", ulysses_size=2)
    g = simulated_groups(cfg, 5, 8, SILENT, "cpu")             # rank 5 of 8: Ulysses {4, 5}, ring {1, 3, 5, 7}
    assert (g.ulysses.group.members, g.ulysses.rank) == ((4, 5), 1)
    assert (g.ring.group.members, g.ring.rank) == ((1, 3, 5, 7), 2)
    with pytest.raises(ValueError, match="ulysses_size 2 must divide simulated size 3"):
        simulated_groups(cfg, 0, 3, SILENT, "cpu")


@pytest.mark.parametrize("backend", ["allgather", "ring"])          # waits in a collective / for a message
def test_a_failing_simulated_rank_does_not_hang_the_others(backend):
    """The peers give up at once, also when they reach their wait after the rank failed (not after TIMEOUT_S)."""
    import time

    from ctx_plugin.bench.simulated import TIMEOUT_S

    def work(rank, world):
        groups = simulated_groups(ctx_plugin.CPConfig(backend=backend), rank, 3, world, "cpu")
        if rank == 1:
            raise RuntimeError("rank 1 broke")
        q = torch.randn(1, 4, 2, 8)
        return ctx_plugin.cp_attention(q, q, q, config=groups.config, groups=groups)   # waits for rank 1

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        run_threaded(3, work)
    assert time.monotonic() - start < TIMEOUT_S / 4


def test_rank_times_one_per_rank():
    shape = Shape(seq_len=64, heads=4, kv_heads=2, head_dim=8, dtype=torch.float32)
    times = rank_times(shape, ctx_plugin.CPConfig(backend="zigzag"), 4, True, 1)
    assert len(times) == 4 and all(t > 0 for t in times)


def test_flops_and_efficiency_arithmetic():
    shape = Shape(seq_len=1024, heads=2, kv_heads=1, head_dim=64, batch=3)
    assert shape.flops(False) == 4 * 3 * 2 * 64 * (1024 * 1025 / 2)          # every causal pair, diagonal included
    assert shape.flops(True) == 3.5 * shape.flops(False)
    r = row(shape, "zigzag", 4, "fwd", "torch", [1.0, 2.0, 1.5, 1.5], ideal=4.0)
    assert r["efficiency"] == pytest.approx(0.5)                  # ideal 4 s / 4 ranks = 1 s, slowest 2 s
    assert r["slowest_ms"] == 2000 and r["mean_ms"] == 1500 and r["ideal_ms"] == 1000
    assert r["tflops_per_gpu"] == pytest.approx(shape.flops(False) / 4 / 2.0 / 1e12)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        Shape(seq_len=8, heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="seq_len"):
        Shape(seq_len=0)


def test_a_run_cut_off_at_a_time_limit_writes_the_rows_it_measured(tmp_path, capsys, monkeypatch):
    """launch/gpu_check.sh sends SIGINT at a step's limit: the table, JSON and plot of the rows done come out, and the
    exit status is timeout's 124."""
    from ctx_plugin.bench import report

    done = []
    measure = report._one_row

    def until_the_third(*args, **kwargs):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(measure(*args, **kwargs))
        return done[-1]
    monkeypatch.setattr(report, "_one_row", until_the_third)
    out = tmp_path / "bench.json"
    assert main(["bench", "--smoke", "--passes", "fwd", "--json", str(out)]) == 124
    captured = capsys.readouterr()
    assert "interrupted after 2 rows" in captured.err and "interrupted: the rows measured before it" in captured.out
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(done))


def test_cli_smoke_simulated(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--smoke", "--passes", "fwd", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "simulated ranks" in printed and "zigzag" in printed
    data = json.loads(out.read_text())
    # Each row is also announced on stderr as it finishes (what a run cut off at a time limit still shows).
    lines = [line for line in captured.err.splitlines() if line.startswith("bench [")]
    assert len(lines) == 1 + len(data["rows"]) and "fwd on one device, kernel " in lines[0]
    for line, r in zip(lines[1:], data["rows"]):
        what = f"{r['backend']} N={r['ranks']} fwd: "
        assert what in line and (f"efficiency {r['efficiency']:.3f}," in line if "efficiency" in r
                                 else f"skipped: {r['skipped']}" in line), (line, r)
    done = [r for r in data["rows"] if "skipped" not in r]
    assert {(r["backend"], r["ranks"]) for r in done} >= {(b.value, n) for b in Backend if b != Backend.ULYSSES_RING
                                                          for n in (2, 4)} | {("ulysses_ring(u=2)", 4)}
    assert [r for r in data["rows"] if "skipped" in r] == [
        {"backend": "ulysses_ring(u=2)", "ranks": 2, "pass": "fwd",
         "skipped": "ulysses_size 2 must divide N = 2 and be smaller"}]
    for r in done:
        assert len(r["rank_ms"]) == r["ranks"] and r["slowest_ms"] == max(r["rank_ms"])
        assert r["efficiency"] == pytest.approx(r["ideal_ms"] / r["slowest_ms"])
    assert data["attention_tflops"] == data["kernel_tflops"]["fwd"] > 0    # the rate `ctx-plugin plan --bench` reads
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "128k", "--nodes", "1", "--gpus-per-node", "8",
                 "--gpu-memory", "1000", "--bench", str(out)]) == 0


def test_cli_compare_kernels(capsys):
    assert main(["bench", "--smoke", "--compare-kernels", "--passes", "fwd", "--backends", "zigzag"]) == 0
    text = capsys.readouterr().out
    assert "local kernels on 64 tokens" in text and "kernel=auto picks sdpa_cpu" in text
    rows = {line.split()[0]: line for line in text.splitlines()}
    assert "unavailable" in rows["sdpa_cudnn"] and "unavailable" not in rows["torch"]
    assert float(rows["sdpa_cpu"].split()[1]) > 0


def test_cli_window_reports_the_speed_up_against_the_full_ring(tmp_path):
    """--window times each backend with the window and, with the same kernel, without it ('vs full')."""
    out = tmp_path / "w.json"
    assert main(["bench", "--smoke", "--passes", "fwd", "--backends", "ring", "--window", "16", "--json",
                 str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["shape"]["window"] == 16 and "window (16, 0)" in report["setup"]
    rows = [r for r in report["rows"] if "skipped" not in r]
    assert len(rows) == 2 and all(r["kernel"] == "torch" for r in rows)     # sdpa_cpu applies no window
    for r in rows:
        assert r["vs_full"] == pytest.approx(r["full_slowest_ms"] / r["slowest_ms"]) and r["vs_full"] > 0
    # one ideal for the pass: the one-device call's N-th part (the full-mask comparison once replaced it row by row)
    assert rows[0]["ideal_ms"] * rows[0]["ranks"] == pytest.approx(rows[1]["ideal_ms"] * rows[1]["ranks"])
    assert all(r["ideal_ms"] * r["ranks"] != pytest.approx(r["full_slowest_ms"]) for r in rows)
    # FLOPs count the pairs the window keeps: S·(w+1) − w·(w+1)/2 (w = 16, S = 256)
    shape = Shape(seq_len=256, heads=4, kv_heads=2, head_dim=16, window=16)
    assert shape.flops(False) == 4 * 4 * 16 * (256 * 17 - 16 * 17 / 2)
    assert Shape(seq_len=8, window=100).flops(False) == Shape(seq_len=8).flops(False) == 4 * 32 * 128 * 36  # all 36
    with pytest.raises(ValueError, match="window must be None or an int >= 0"):
        Shape(seq_len=8, window=-1)


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert main(["bench", "--smoke", "--passes", "fwd", "--backends", "zigzag", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_smoke_distributed():
    """Real processes, with packed documents (one launch: without them the path is the same, documents=None)."""
    proc = subprocess.run([sys.executable, "-m", "ctx_plugin.cli", "bench", "--smoke", "--distributed", "--nproc",
                           "2", "--passes", "fwd", "--backends", "zigzag", "ulysses", "--doc-len", "20"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 processes" in proc.stdout and "hidden" in proc.stdout and "check µs" in proc.stdout
    assert "documents of 20 tokens" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("zigzag ", "ulysses "))]
    assert len(rows) == 2 and all(float(r[-5]) > 0 for r in rows), "the rank check's time per call, in µs"
    assert [r[-4:-1] for r in rows] == [["13", "4", "0"], ["13", "1", "0"]]    # docs, unit, pad (S = 256)
    assert all(float(r[-1]) > 0 for r in rows), "plan ms: the slowest process's host time to plan the batch"


def test_no_rank_check_flag():
    """--no-rank-check is CPConfig(check_ranks=False) for every benchmarked backend; the check is on by default."""
    import argparse

    from ctx_plugin.bench.options import add_arguments, configs, settle
    for flags, want in (([], True), (["--distributed", "--no-rank-check"], False)):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(flags)
        settle(args)
        cfgs = [c for _, c in configs(args, 4)]
        assert len(cfgs) == len(Backend) and all(c.check_ranks is want for c in cfgs)


@pytest.mark.parametrize("bad", [["--smoke", "--reps", "0"], ["--smoke", "--ranks", "0"],
                                 ["--smoke", "--ulysses-size", "0"], ["--heads", "3", "--kv-heads", "2"]])
def test_cli_bad_input(bad, capsys):
    with pytest.raises(SystemExit):                   # before any timing (the last one would run S = 128k)
        main(["bench", "--device", "cpu", *bad])
    assert "error" in capsys.readouterr().err


def test_windowed_ideal_is_the_kernels_full_mask_time_scaled_by_the_kept_flops(monkeypatch):
    """The windowed ideal: the kernel that applies the window, timed over the mask without it, times the share of
    FLOPs the window keeps (timing the windowed call would make the torch kernel's full-matrix cost the ideal)."""
    from ctx_plugin.bench import harness
    from ctx_plugin.core.kernels.torch_math import TorchKernel

    seen = []

    class Recording(TorchKernel):
        def forward(self, q, k, v, *, causal, scale, window=(None, None), softcap=None):
            seen.append((causal, window))
            return super().forward(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap)

    def select(name, device, dtype, head_dim, features):
        seen.append(features)
        return Recording()

    def once(fn, device, reps, warmup=1, before=None):
        fn()
        return 2.0
    monkeypatch.setattr(harness, "select_kernel", select)
    monkeypatch.setattr(harness, "median_time", once)
    windowed = Shape(seq_len=64, heads=2, kv_heads=2, head_dim=8, window=7, dtype=torch.float32)
    seconds, name = harness.ideal_time(windowed, ctx_plugin.Kernel.AUTO, False, 1)
    share = (64 * 8 - 7 * 8 / 2) / (64 * 65 / 2)
    assert name == "torch" and seconds == pytest.approx(2.0 * share)
    assert seen == [frozenset({"window"}), (True, (None, None))]
    seen.clear()
    assert harness.ideal_time(replace(windowed, window=None), ctx_plugin.Kernel.AUTO, True, 1)[0] == 2.0
    assert harness.call_time(windowed, ctx_plugin.Kernel.AUTO, False, 1)[0] == 2.0   # compare-kernels: the window
    assert seen[-1] == (True, (7, None))


def test_cli_compare_kernels_with_a_window_skips_the_kernels_that_cannot_apply_it(capsys):
    assert main(["bench", "--smoke", "--compare-kernels", "--passes", "fwd", "--backends", "ring",
                 "--window", "16"]) == 0
    text = capsys.readouterr().out
    assert "local kernels on 64 tokens (causal, window (16, 0), float32); kernel=auto picks torch" in text
    rows = {line.split()[0]: line for line in text.splitlines()}
    assert "skipped: torch's CPU flash attention applies no sliding windows" in rows["sdpa_cpu"]
    assert "unavailable" in rows["sdpa_cudnn"] and float(rows["torch"].split()[1]) > 0


def test_a_backend_that_breaks_is_reported_and_the_others_still_run(monkeypatch, tmp_path, capsys):
    """One GPU run must bring back every row it can: a RuntimeError (a kernel's error, out of memory) in one row is
    printed as FAILED in the table, the other rows run, and the exit status is 1."""
    from ctx_plugin.bench import report as bench_report
    real = bench_report.rank_times

    def breaks(shape, config, size, backward, reps):
        if config.backend.value == "zigzag":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(shape, config, size, backward, reps)
    monkeypatch.setattr(bench_report, "rank_times", breaks)
    out = tmp_path / "b.json"
    assert main(["bench", "--smoke", "--passes", "fwd", "--backends", "ring", "zigzag", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    text = captured.out
    assert "FAILED: RuntimeError: CUDA error: an illegal memory access" in text
    assert "] zigzag N=2 fwd: RuntimeError: CUDA error: an illegal memory access" in captured.err
    rows = json.loads(out.read_text())["rows"]
    assert {r["backend"] for r in rows if "efficiency" in r} == {"ring"}
    assert sum("failed" in r for r in rows) == 2                        # zigzag at N = 2 and 4


def test_a_timed_call_writes_fresh_gradients_and_times_no_accumulation():
    """The benchmark times each rank's call several times: every call's backward must write q/k/v.grad afresh (as a
    step after zero_grad(set_to_none=True)), not add to the previous call's, which would time three extra
    elementwise passes per call (and double the gradients)."""
    shape = Shape(seq_len=64, heads=4, kv_heads=2, head_dim=8, dtype=torch.float32)
    cfg = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    groups = simulated_groups(cfg, 0, 1, SILENT, "cpu")     # one rank: no received (unset) blocks, exact grads
    q, k, v, dout = shape.tensors(64, torch.Generator().manual_seed(1), grad=True)
    step = attention_step(shape, cfg, groups, q, k, v, dout, True)
    step()
    first = [t.grad for t in (q, k, v)]
    step()
    for before, t in zip(first, (q, k, v)):
        assert t.grad is not before                       # a new tensor, written by this call's backward
        torch.testing.assert_close(t.grad, before, rtol=0, atol=0)


def test_timed_ranks_compute_on_filled_receive_buffers(monkeypatch):
    """The one-GPU benchmark's ranks receive nothing, yet their kernels must not compute on uninitialised memory
    (zeros, denormals, NaN run matrix products at other speeds on a GPU): FILLING gives every receive buffer this
    rank's own send data, and rank_times times with it."""
    from ctx_plugin.bench import harness
    from ctx_plugin.bench.simulated import FILLING

    group = type("G", (), {"rank": 1})()
    send, recv = torch.randn(2, 3), torch.full((2, 3), float("nan"))
    FILLING.exchange(group, send, recv, 0, 0, 0).wait()
    assert torch.equal(recv, send)
    parts = [torch.randn(2), torch.randn(2)]
    out = [torch.empty(2), torch.empty(2)]
    FILLING.all_to_all(group, out, parts)
    assert all(torch.equal(o, p) for o, p in zip(out, parts))
    gathered = torch.full((2, 4), float("nan"))
    FILLING.all_gather(group, gathered, parts[0].repeat(2))
    assert torch.equal(gathered, parts[0].repeat(2).expand(2, 4))
    scattered = torch.empty(3)
    FILLING.reduce_scatter(group, scattered, torch.arange(6.0).view(2, 3))
    assert scattered.tolist() == [3.0, 4.0, 5.0]                       # this rank's own share
    longer = torch.empty(5)
    FILLING.exchange(group, torch.arange(2.0), longer, 0, 0, 0)       # another size: tiled, every element set
    assert longer.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    movers = []
    original = harness.simulated_groups
    monkeypatch.setattr(harness, "simulated_groups", lambda *a: movers.append(a[3]) or original(*a))
    shape = harness.Shape(seq_len=64, heads=2, kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))
    harness.rank_times(shape, ctx_plugin.CPConfig(backend="zigzag", kernel="torch"), 2, False, 1)
    assert movers == [FILLING, FILLING]
