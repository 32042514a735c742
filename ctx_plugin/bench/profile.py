"""Where the slowest rank's time goes (``ctx-plugin bench --profile``), from one more call under torch.profiler.

:func:`rank_profile` runs a rank's call once unprofiled (a warm-up, as the timed repetitions have), then once
inside a ``ctx_plugin::profiled_call`` range under ``torch.profiler`` (the device synchronised before it and at its
end): the range is the *wall* time, and :func:`breakdown` splits it into the parts of
:class:`~ctx_plugin.names.Part`, which sum to it:

- *busy intervals*. On CUDA every device activity — kernel, memcpy, memset: the profiler's CUDA events that are not
  user annotations, what torch's own tables count as device time. On the CPU every op's *self* interval (its span
  minus its child ops'); ranges, autograd's own scopes and the profiler's bookkeeping are host time, not ops.
- *an interval's part* is its op's: for a device activity, the CPU op that launched it (the profiler's correlation
  of each activity with its op). The innermost ctx_plugin range around the op (:mod:`ctx_plugin.core.profiling`: the
  kernel calls, the merges and gradient accumulation) decides; outside every range, the innermost of the op and its
  parent ops whose name :data:`PATTERNS` knows (copies, an SDPA op); else ``other``. A device activity with no op (a
  Triton kernel is launched outside aten ops) is named by its own name through the same table.
- the busy intervals' union within the wall, split evenly where they overlap (two streams), is each part's time;
  ``gaps`` is the rest: the device idle — launch and host overhead (on the CPU: host time outside every op).

The profiler's own overhead per op lands in ``gaps`` (on a GPU mostly hidden while the host runs ahead), so the wall
exceeds the timed median a little; the parts' shares are what to read.
"""
from __future__ import annotations

import re
from collections import Counter

import torch
from torch.autograd import DeviceType

from ..core.config import CPConfig
from ..core.profiling import RANGES
from ..names import Part
from .harness import Shape, attention_step
from .memory import _SCATTERS, COPY_OPS, _quiet_kineto
from .simulated import SILENT, simulated_groups

CALL = "ctx_plugin::profiled_call"
"""The range around the profiled call: its span is the wall time that the parts split."""
_COPY_NAMES = sorted({op._schema.name for op in (*COPY_OPS, *_SCATTERS)}
                     | {"aten::contiguous", "aten::to", "aten::stack", "aten::index_copy"})
PATTERNS: tuple[tuple[Part, re.Pattern], ...] = (
    (Part.KERNEL, re.compile(r"scaled_dot_product|_flash_attention|_efficient_attention|_cudnn_attention|"
                             r"flash_attn|flash|fmha|sdpa|cudnn", re.IGNORECASE)),
    (Part.MERGE, re.compile(r"_merge_kernel")),           # kernels/merge_triton.py's Triton kernel
    (Part.COPIES, re.compile("^(" + "|".join(map(re.escape, _COPY_NAMES)) + r")$|^Memcpy|^Memset|copy|CatArray|"
                             r"index|gather|scatter|FillFunctor", re.IGNORECASE)),
)
"""The one table of names: CPU ops (outside every ctx_plugin range) and device activities with no op, first match
wins: SDPA / flash-attn ops and kernels, the fused merge, and the data-movement ops that ``--memory`` counts as
copies (:data:`ctx_plugin.bench.memory.COPY_OPS` and scatters, their composite callers, CUDA memcpy/memset and copy,
cat, index and fill kernels)."""
_HOST_SCOPES = ("USER_SCOPE", "BACKWARD_FUNCTION")


def by_name(name: str, patterns=PATTERNS) -> Part | None:
    """The part ``patterns`` give ``name``, or None."""
    return next((part for part, pattern in patterns if pattern.search(name)), None)


def part_of(node, patterns=PATTERNS) -> Part:
    """An op's part: the innermost ctx_plugin range among it and its ancestors; without one, the innermost of them
    whose name ``patterns`` know; else ``other``."""
    named = None
    while node is not None:
        if node.name in RANGES:
            return RANGES[node.name]
        if named is None and _is_op(node):
            named = by_name(node.name, patterns)
        node = node.parent
    return named or Part.OTHER


def split(busy, start: int, end: int) -> tuple[dict, int]:
    """``({key: ns}, gaps ns)`` of the window ``[start, end)``: ``busy`` is ``(start, end, key)`` intervals; their
    union within the window goes to their keys (split evenly where intervals overlap), the rest is the gaps. The
    values sum to ``end − start``."""
    points = sorted((t, step, key) for s, e, key in busy
                    for t, step in ((max(s, start), 1), (min(e, end), -1)) if min(e, end) > max(s, start))
    active, share, at, count = Counter(), Counter(), start, 0
    for t, step, key in points:
        if count and t > at:
            for k, n in active.items():
                share[k] += (t - at) * n / count
        at = max(at, t)
        active[key] += step
        count += step
    return dict(share), (end - start) - sum(share.values())


def _walk(roots):
    stack = list(roots)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        yield node


def _scope(node) -> str:
    """A TorchOp's record scope (``FUNCTION``, ``USER_SCOPE`` for a range, ...); ``""`` for other events."""
    return getattr(getattr(node.extra_fields, "scope", None), "name", "")


def _is_op(node) -> bool:
    """A TorchOp whose self time is work: an operator (``namespace::name``), not a range, autograd's scopes (an
    autograd Function's Python forward is recorded under its class name), or the profiler's bookkeeping."""
    return (node.tag.name == "TorchOp" and "::" in node.name and _scope(node) not in _HOST_SCOPES
            and not node.name.startswith(("autograd::", "profiler::")))


def _self_intervals(node):
    """The op's span minus its child ops' spans."""
    at = node.start_time_ns
    for child in sorted((c for c in node.children if c.tag.name == "TorchOp"), key=lambda c: c.start_time_ns):
        if child.start_time_ns > at:
            yield at, child.start_time_ns
        at = max(at, child.end_time_ns)
    if node.end_time_ns > at:
        yield at, node.end_time_ns


def breakdown(results, cuda: bool, patterns=PATTERNS) -> dict:
    """The profile of one :data:`CALL` in a torch profiler's ``kineto_results`` (see the module docstring): wall ms,
    ms per part, and on CUDA the device time of activities no op launched, named by ``patterns`` (``by_name_ms``: the
    Triton merge) or by nothing (``unattributed_ms``, in ``other``), and outside the wall (``outside_ms``: 0)."""
    nodes = list(_walk(results.experimental_event_tree()))
    calls = [n for n in nodes if n.name == CALL]
    if len(calls) != 1:
        raise RuntimeError(f"internal: expected one {CALL} range in the profile, found {len(calls)}")
    start, end = calls[0].start_time_ns, calls[0].end_time_ns
    extra = {}
    if cuda:
        ops = {n.correlation_id: n for n in nodes if n.tag.name == "TorchOp" and n.correlation_id}   # 0: none
        ranges = {n.name for n in nodes if _scope(n) == "USER_SCOPE"}
        busy = []
        for e in results.events():   # a range's GPU annotation is not device work, flagged or not
            if e.device_type() != DeviceType.CUDA or e.is_user_annotation() or e.name() in ranges:
                continue
            op = ops.get(e.linked_correlation_id())
            named = None if op is not None else by_name(e.name(), patterns)
            how = "op" if op is not None else "name" if named is not None else "none"
            busy.append((e.start_ns(), e.end_ns(), (part_of(op, patterns) if op is not None else named or Part.OTHER,
                                                    how)))
        if not busy:
            raise RuntimeError("the profiler recorded no CUDA activity (is CUPTI available to this process?)")
        outside = sum(e - s for s, e, _ in busy) - sum(max(0, min(e, end) - max(s, start)) for s, e, _ in busy)
        extra = {"outside_ms": outside / 1e6}
    else:
        busy = [(s, e, (part_of(n, patterns), "op")) for n in nodes if _is_op(n) for s, e in _self_intervals(n)]
    share, gaps = split(busy, start, end)
    ms = {part.value: sum(v for (p, _), v in share.items() if p == part) / 1e6 for part in Part if part != Part.GAPS}
    ms[Part.GAPS.value] = gaps / 1e6
    if cuda:
        extra.update({f"{key}_ms": sum(v for (_, h), v in share.items() if h == how) / 1e6
                      for how, key in (("name", "by_name"), ("none", "unattributed"))})
    return {"wall_ms": (end - start) / 1e6, "ms": ms, **extra}


def profile_call(fn, device: torch.device, patterns=PATTERNS) -> dict:
    """Runs ``fn()`` once under torch.profiler inside :data:`CALL` and returns its :func:`breakdown`."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with _quiet_kineto(), profile(activities=activities) as prof:
        with record_function(CALL):
            fn()
            if cuda:
                torch.cuda.synchronize(device)
    return breakdown(prof.profiler.kineto_results, cuda, patterns)


def rank_profile(shape: Shape, config: CPConfig, size: int, backward: bool, rank: int, patterns=PATTERNS) -> dict:
    """Rank ``rank``'s call (the tensors and simulated group of :func:`~ctx_plugin.bench.harness.rank_times`), after
    one unprofiled warm-up call: ``{"rank": rank, **profile_call(...)}``."""
    groups = simulated_groups(config, rank, size, SILENT, shape.device.type)
    q, k, v, dout = shape.tensors(shape.seq_len // size, torch.Generator().manual_seed(rank), grad=backward)
    step = attention_step(shape, config, groups, q, k, v, dout, backward)
    step()
    return {"rank": rank, **profile_call(step, shape.device, patterns)}


def slowest_profile(shape: Shape, config: CPConfig, size: int, backward: bool, times: list[float]) -> dict:
    """:func:`rank_profile` of the slowest rank of ``times`` (each rank's timed seconds). A profile that fails (e.g.
    no CUDA activity recorded, or a profiler API this torch lacks: the CUDA path has not run on every torch) gives
    ``{"rank": rank, "error": why}`` instead, printed in its row, so that the timed rows of a run (launch/gpu_check.sh
    gets one a session) still come out."""
    rank = times.index(max(times))
    try:
        return rank_profile(shape, config, size, backward, rank)
    except Exception as e:     # noqa: BLE001 - reported in the row, never dropped
        return {"rank": rank, "error": f"{type(e).__name__}: {e}"}


def format_profile_table(rows: list[dict]) -> str:
    """The profiled rows: rank, wall ms, and each part's ms and share of the wall."""
    parts = [p.value for p in Part]
    lines = ["profile of each row's slowest rank (one more call under torch.profiler; wall = that call; kernel = "
             "the local attention kernel, merge = combining partial results and gradients, copies = data movement "
             "and casts, other = other device work, gaps = device idle: launch and host overhead)",
             f"{'backend':<17} {'N':>3} {'pass':<8} {'rank':>4} {'wall ms':>9}"
             + "".join(f" {p + ' ms':>10} {'%':>4}" for p in parts)]
    for r in rows:
        if "profile" not in r:
            continue
        prof = r["profile"]
        line = f"{r['backend']:<17} {r['ranks']:>3} {r['pass']:<8} {prof['rank']:>4}"
        if "error" in prof:
            lines.append(f"{line} profile failed: {prof['error']}")
            continue
        line += f" {prof['wall_ms']:>9.3f}"
        for p in parts:
            line += f" {prof['ms'][p]:>10.3f} {prof['ms'][p] / prof['wall_ms']:>4.0%}"
        if prof.get("unattributed_ms", 0) > 0.01 * (prof["wall_ms"] - prof["ms"][Part.GAPS.value]):
            line += f"  ({prof['unattributed_ms']:.3f} ms of device time from no op and no known name, in other)"
        if prof.get("outside_ms", 0) > 0.001 * prof["wall_ms"]:
            line += f"  (device time outside the wall: {prof['outside_ms']:.3f} ms)"
        lines.append(line)
    return "\n".join(lines)
