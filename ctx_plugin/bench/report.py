"""``ctx-plugin bench``: times every backend's forward and forward+backward, prints a table, writes JSON/PNG.

Simulated mode (default) runs each rank of an N-rank group in turn on one device (see
:mod:`ctx_plugin.bench.simulated`); ``--distributed --nproc N`` starts N local processes with torchrun and times
the real distributed path (NCCL on GPUs, gloo on CPU) with its communication (:mod:`ctx_plugin.bench.distributed`).
``--smoke`` is a tiny CPU case (CI runs it; its times mean nothing). ``--memory`` (simulated mode) adds what each
rank's call allocates, copies and holds at its peak (:mod:`ctx_plugin.bench.memory`, the torch profiler's memory
events) and that peak against ``(1/N) of the one-device peak + two K/V blocks``; ``--profile`` (simulated mode) where
each row's slowest rank's time goes (:mod:`ctx_plugin.bench.profile`). ``--doc-len M`` /
``--doc-lengths FILE`` pack documents into the sequence as ``ctx-plugin plan`` takes them; each row pads them to its
layout's document unit (:meth:`~ctx_plugin.bench.harness.Shape.documents_for`, columns docs/unit/pad).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from ..core.config import CPConfig
from ..core.kernels import kernel_unavailable, select_kernel
from ..core.mask import Mask
from ..core.rules import SettingNames, check_seq_len
from ..memory.flops import describe as describe_documents
from ..memory.report import need_matplotlib
from ..names import Kernel
from .harness import Shape, call_time, ideal_share, rank_times
from .memory import memory_columns, rank_bytes, single_device_bytes
from .options import configs, distributed_device, settle, shape_from_args
from .planning import format_plan_table, plan_ms, plan_rows
from .profile import format_profile_table, slowest_profile


def check(args: argparse.Namespace, argv: list[str]) -> None:
    """:func:`settle`, then ``ValueError`` naming the fix for what cannot run, before any timing or process start:
    a sequence length some backend cannot split evenly over some N (nothing is rounded), a bad shape, a ``--kernel``
    that cannot run on the device and dtype (the one ``--distributed``'s ranks will use), ``--plot`` without
    matplotlib."""
    settle(args)
    shape = shape_from_args(args, distributed_device(args, args.nproc) if args.distributed else None)
    why = kernel_unavailable(Kernel(args.kernel), shape.device, shape.dtype, shape.head_dim)
    if why is not None:
        raise ValueError(f"--kernel {args.kernel} cannot run on {shape.device.type} with --dtype {args.dtype}: {why}")
    for size in args.ranks:
        for _, config in configs(args, size):
            if not isinstance(config, str):
                check_seq_len(config, args.seq_len, size, SettingNames(seq_len="--seq-len"))
    if args.plot:
        need_matplotlib()


def row(shape: Shape, label: str, size: int, pass_: str, kernel: str, times: list[float], ideal: float,
        unit: int = 1, **extra) -> dict:
    """One table row; ``ideal``: the one-device seconds (:func:`~ctx_plugin.bench.harness.ideal_time`) for the
    documents padded to ``unit`` (the row's layout's document unit), whose FLOPs the TFLOP/s count."""
    slowest = max(times)
    documents = {}
    if shape.documents is not None:
        packing = shape.packing(unit)
        documents = {"documents": packing.documents, "doc_unit": unit, "padding": packing.padding}
    return {"backend": label, "ranks": size, "pass": pass_, "kernel": kernel, "slowest_ms": slowest * 1e3,
            "mean_ms": sum(times) / len(times) * 1e3, "ideal_ms": ideal / size * 1e3,
            "efficiency": ideal / size / slowest,
            "tflops_per_gpu": shape.flops(pass_ == "fwd+bwd", unit) / size / slowest / 1e12,
            "rank_ms": [t * 1e3 for t in times], **documents, **extra}


def run_simulated(args: argparse.Namespace, shape: Shape, rows: list[dict]) -> None:
    """Every row, appended to ``rows`` and announced on stderr as it finishes (:func:`progress`)."""
    started = time.perf_counter()
    for pass_ in args.passes:
        backward = pass_ == "fwd+bwd"
        full, kernel = call_time(shape, Kernel(args.kernel), backward, args.reps, windowed=False)   # ideal_time's
        progress(started, f"{pass_} on one device, kernel {kernel}: {full * 1e3:.3f} ms")
        single = single_device_bytes(shape, Kernel(args.kernel), backward) if args.memory else None
        for size in args.ranks:
            for label, config in configs(args, size):
                rows.append(_one_row(args, shape, label, config, size, pass_, full, kernel, single))
                progress(started, row_summary(rows[-1]))


def _one_row(args, shape: Shape, label: str, config, size: int, pass_: str, full: float, kernel: str,
             single) -> dict:
    backward = pass_ == "fwd+bwd"
    try:
        if isinstance(config, str):
            raise ValueError(config)
        times = rank_times(shape, config, size, backward, args.reps)
        unit = shape.document_unit(config, size)
    except ValueError as e:       # this backend cannot split this shape: say so, keep going
        return {"backend": label, "ranks": size, "pass": pass_, "skipped": str(e)}
    except RuntimeError as e:     # it broke (a kernel's error, out of memory): say so, run the rest
        return _failed(label, size, pass_, e, shape)
    try:
        extra = _extras(args, shape, config, size, backward, times, kernel, single)
    except RuntimeError as e:
        return _failed(label, size, pass_, e, shape)
    return row(shape, label, size, pass_, kernel, times, full * ideal_share(shape, unit), unit, **extra)


def row_summary(r: dict) -> str:
    """A row in one line: what a run cut off before its table (launch/gpu_check.sh's time limits) still shows."""
    what = f"{r['backend']} N={r['ranks']} {r['pass']}"
    if "efficiency" not in r:
        return f"{what}: {'skipped: ' + r['skipped'] if 'skipped' in r else r['failed']}"
    return (f"{what}: slowest {r['slowest_ms']:.3f} ms, ideal {r['ideal_ms']:.3f} ms, efficiency "
            f"{r['efficiency']:.3f}, {r['tflops_per_gpu']:.1f} TFLOP/s per GPU")


def progress(started: float, text: str) -> None:
    """One line on stderr, flushed, with the seconds since ``started``."""
    print(f"bench [{time.perf_counter() - started:.0f} s] {text}", file=sys.stderr, flush=True)


def _extras(args, shape: Shape, config: CPConfig, size: int, backward: bool, times: list[float], kernel: str,
            single) -> dict:
    """A row's optional columns: vs the full mask (a window), memory, plan ms (documents), the profile."""
    extra = {}
    if shape.window is not None:   # the same backend and kernel over the full mask: the speed-up
        same_kernel = replace(config, kernel=kernel)
        full = max(rank_times(replace(shape, window=None), same_kernel, size, backward, args.reps))
        extra = {"full_slowest_ms": full * 1e3, "vs_full": full / max(times)}
    if single is not None:
        extra.update(memory_columns(shape, size, single, rank_bytes(shape, config, size, backward)))
    if shape.documents is not None:   # the host work of a new batch's plans (cached afterwards)
        extra["plan_ms"] = plan_ms(shape, config, size)
    if args.profile:                  # after the timing: one more call of the slowest rank, profiled
        extra["profile"] = slowest_profile(shape, config, size, backward, times)
    return extra


def _failed(label: str, size: int, pass_: str, error: RuntimeError, shape: Shape) -> dict:
    """The row of a backend whose run raised: its error, printed in the table (the traceback on stderr) and making
    the command's exit status 1, while the other rows still run (one prepared GPU run must bring back the rest)."""
    traceback.print_exc()
    if shape.device.type == "cuda":
        torch.cuda.empty_cache()      # what the failed call held (out of memory: the next rows may fit)
    return {"backend": label, "ranks": size, "pass": pass_, "failed": f"{type(error).__name__}: {error}"}


def compare_kernels(args: argparse.Namespace, shape: Shape) -> str:
    """A table of every kernel's forward and forward+backward time on one rank's share of the sequence, with the
    shape's window applied; kernels that cannot apply it (or cannot run here) are listed with the reason. Packed
    documents need no kernel feature (the plans cut them into blocks, each a call like this one), so the block is
    one document, and the header says so."""
    block = replace(shape, seq_len=shape.seq_len // max(args.ranks), documents=None)
    features = Mask(block.causal, block.mask["window"]).within(block.seq_len).features
    auto = select_kernel(Kernel.AUTO, block.device, block.dtype, block.head_dim, features).name
    window = "" if block.window is None else f", window ({block.window}, 0)"
    packed = "" if shape.documents is None else ", one block: packed documents need no kernel feature"
    lines = [f"local kernels on {block.seq_len} tokens ({'causal' if block.causal else 'full'}{window}, "
             f"{str(block.dtype).removeprefix('torch.')}{packed}); kernel=auto picks {auto}",
             f"{'kernel':<12} {'fwd ms':>9} {'fwd+bwd ms':>11} {'TFLOP/s fwd+bwd':>16}"]
    for name in (k for k in Kernel if k != Kernel.AUTO):
        why = kernel_unavailable(name, block.device, block.dtype, block.head_dim)
        if why is not None:
            lines.append(f"{name.value:<12} unavailable: {why}")
            continue
        why = kernel_unavailable(name, block.device, block.dtype, block.head_dim, features)
        if why is not None:
            lines.append(f"{name.value:<12} skipped: {why}")
            continue
        fwd, _ = call_time(block, name, False, args.reps)
        both, _ = call_time(block, name, True, args.reps)
        lines.append(f"{name.value:<12} {fwd * 1e3:>9.3f} {both * 1e3:>11.3f} {block.flops(True) / both / 1e12:>16.1f}")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    hidden = any("hidden_comm" in r for r in rows)
    check = any("check_us" in r for r in rows)
    window = any("vs_full" in r for r in rows)
    memory = any("peak_mib" in r for r in rows)
    packed = any("doc_unit" in r for r in rows)
    head = f"{'backend':<17} {'N':>3} {'pass':<8} {'slowest ms':>10} {'mean ms':>9} {'ideal ms':>9} " \
           f"{'eff.':>5} {'TFLOP/s':>8}" + (f" {'comm ms':>8} {'hidden':>6}" if hidden else "") + \
           (f" {'check µs':>8}" if check else "") + (f" {'docs':>6} {'unit':>4} {'pad':>6} {'plan ms':>8}" if packed else "") + (f" {'full ms':>9} {'vs full':>7}" if window else "") + \
           (f" {'alloc MiB':>10} {'copied MiB':>10} {'peak MiB':>9} {'bound MiB':>9} {'peak/bound':>10}"
            if memory else "")
    lines = [head]
    for r in rows:
        if "skipped" in r or "failed" in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED: {r['failed']}"
            lines.append(f"{r['backend']:<17} {r['ranks']:>3} {r['pass']:<8} {why}")
            continue
        line = f"{r['backend']:<17} {r['ranks']:>3} {r['pass']:<8} {r['slowest_ms']:>10.3f} {r['mean_ms']:>9.3f} " \
               f"{r['ideal_ms']:>9.3f} {r['efficiency']:>5.2f} {r['tflops_per_gpu']:>8.1f}"
        if hidden:
            line += f" {r['comm_ms']:>8.3f} {r['hidden_comm']:>6.0%}"
        if check:
            line += f" {r.get('check_us', 0.0):>8.1f}"
        if packed:
            line += f" {r['documents']:>6} {r['doc_unit']:>4} {r['padding']:>6} {r['plan_ms']:>8.3f}"
        if window:
            line += f" {r['full_slowest_ms']:>9.3f} {r['vs_full']:>6.2f}×"
        if memory:
            line += f" {r['alloc_mib']:>10.3f} {r['copied_mib']:>10.3f} {r['peak_mib']:>9.3f} {r['bound_mib']:>9.3f} " \
                    f"{r['peak_vs_bound']:>10.2f}"
        lines.append(line)
    return "\n".join(lines)


def describe(shape: Shape, rows: list[dict], mode: str) -> str:
    kernels = sorted({r["kernel"] for r in rows if "kernel" in r})
    device = torch.cuda.get_device_name(shape.device) if shape.device.type == "cuda" else "cpu"
    return (f"ctx_plugin bench ({mode}): S={shape.seq_len}, batch {shape.batch}, {shape.heads} heads "
            f"({shape.kv_heads} K/V) × {shape.head_dim}, {'causal' if shape.causal else 'full'}, "
            f"{_window_text(shape, rows)}{_documents_text(shape)}"
            f"{str(shape.dtype).removeprefix('torch.')}, {device}, kernel {'/'.join(kernels) or '-'}; "
            f"efficiency = ideal (one kernel on the whole sequence ÷ N{_ideal_masked(shape)}) ÷ slowest rank"
            + ("; memory per rank and call (largest rank): allocated, copied, peak above the inputs; bound = "
               "one-device peak ÷ N + 2 K/V blocks" + ("" if shape.documents is None else
                                                      " (one-device: the whole sequence as one document)")
               if any("peak_mib" in r for r in rows) else ""))


def _ideal_masked(shape: Shape) -> str:
    what = " and ".join(name for name, given in (("window", shape.window is not None),
                                                 ("documents", shape.documents is not None)) if given)
    return "" if not what else f"; with the {what}: its full-mask time × the share of pairs the {what} keep"


def _documents_text(shape: Shape) -> str:
    if shape.documents is None:
        return ""
    return (f"{describe_documents(shape.documents)}, each padded at its end to the layout's document unit "
            f"(pad_documents; columns docs = documents in the sequence, unit, pad = padding tokens; plan ms = the "
            f"slowest rank's host time to plan a new batch of them, once per batch: later layers and the backward "
            f"reuse it), FLOPs counting only the pairs inside each document, ")

def _window_text(shape: Shape, rows: list[dict]) -> str:
    if shape.window is None:
        return ""
    compared = " (vs full: the same backend and kernel without it)" if any("vs_full" in r for r in rows) else ""
    return f"window ({shape.window}, 0){compared}, "


def write_outputs(args: argparse.Namespace, shape: Shape, rows: list[dict], mode: str) -> None:
    print(describe(shape, rows, mode))
    print(format_table(rows))
    if any("profile" in r for r in rows):
        print(format_profile_table(rows))
    if args.json:
        rates = {r["pass"]: shape.flops(r["pass"] == "fwd+bwd", r.get("doc_unit", 1))
                 / (r["ideal_ms"] * r["ranks"] / 1e3) / 1e12 for r in rows if "ideal_ms" in r}
        Path(args.json).write_text(json.dumps({
            "mode": mode, "shape": shape.describe(), "torch": torch.__version__, "setup": describe(shape, rows, mode),
            "kernel_tflops": rates,   # the one-kernel ideal's rate per pass; ctx-plugin plan --bench reads:
            "attention_tflops": rates.get("fwd+bwd", rates.get("fwd")), "rows": rows}, indent=2))
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'ctx-plugin[plot]'") from None
    done = [r for r in rows if "efficiency" in r]
    passes = sorted({r["pass"] for r in done})
    fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4), squeeze=False)
    for ax, pass_ in zip(axes[0], passes):
        for label in dict.fromkeys(r["backend"] for r in done if r["pass"] == pass_):
            pts = [(r["ranks"], r["efficiency"]) for r in done if r["pass"] == pass_ and r["backend"] == label]
            ax.plot(*zip(*pts), marker="o", label=label)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(title=pass_, xlabel="ranks N", ylabel="slowest-rank efficiency", xscale="log", ylim=(0, 1.1))
        ax.set_xticks(sorted({r["ranks"] for r in done}), labels=[str(n) for n in sorted({r["ranks"] for r in done})])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """The CLI (``args`` passed :func:`check`): simulated in this process, or, for --distributed, torchrun starting
    :mod:`ctx_plugin.bench.distributed` with the same arguments (``argv``)."""
    shape = shape_from_args(args)
    if args.distributed:
        import os

        from torch.distributed.run import main as torchrun

        from ..cliargs import without_option

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        worker = without_option([a for a in argv if a != "--distributed"], "--nproc")   # torchrun reads --nproc*
        torchrun(["--standalone", "--nproc-per-node", str(args.nproc), "-m", "ctx_plugin.bench.distributed", *worker])
        return 0
    if args.plan_only:
        rows = plan_rows(shape, list(configs(args, size) for size in args.ranks), args.ranks)
        print(f"ctx_plugin bench (plan only): S={shape.seq_len}, batch {shape.batch}, "
              f"{describe_documents(shape.documents)}; host ms the slowest rank takes to plan a new batch of them "
              f"(blocks per document, ring schedule, varlen calls), caches emptied before each rank")
        print(format_plan_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"mode": "plan only", "shape": shape.describe(), "rows": rows},
                                                  indent=2))
        return 0
    if args.compare_kernels:
        print(compare_kernels(args, shape))
    rows: list[dict] = []
    mode = ("simulated ranks, one device: each rank's compute alone, its receive buffers filled from its own send "
            "buffers; no transfer time, NCCL contention or rank-agreement check")
    try:
        run_simulated(args, shape, rows)
    except KeyboardInterrupt:       # a time limit's SIGINT (launch/gpu_check.sh): the rows measured still come out
        print(f"ctx_plugin bench: interrupted after {len(rows)} rows", file=sys.stderr)
        write_outputs(args, shape, rows, mode + "; interrupted: the rows measured before it")
        return 124
    write_outputs(args, shape, rows, mode)
    return 1 if any("failed" in r for r in rows) else 0
