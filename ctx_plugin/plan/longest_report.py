"""``ctx-plugin plan --max-seq-len``: the longest sequence, its fastest configuration, and what binds."""
from __future__ import annotations

import argparse

from ..memory.report import DTYPES, documents_from, framework_from
from ..memory.specs import ModelSpec
from .cluster import Cluster
from .frameworks import excluded
from .longest import Longest, binding, longest
from .prediction import Prediction
from .table import print_header, print_table


def tokens_text(n: int) -> str:
    """``4,194,304 (4M)``, ``557,056 (544k)``, or just the number when it is not a whole k."""
    if n % 2**20 == 0:
        return f"{n:,} ({n // 2**20}M)"
    return f"{n:,} ({n // 1024}k)" if n % 1024 == 0 else f"{n:,}"


def describe(p: Prediction, cluster: Cluster) -> list[str]:
    """The winner's memory, time and MFU, one line each."""
    node = p.host_bytes * cluster.gpus_per_node / 2**30
    room = cluster.host_memory_gib - cluster.host_reserve_gib
    exposed = [(name, ms) for name, ms in (("activation offload", p.offload_ms), ("optimizer offload", p.optimizer_ms),
                                           ("communication", p.exposed_ms - p.offload_ms - p.optimizer_ms)) if ms > 0]
    return [f"  memory: {p.memory_gib:.2f} GiB per GPU of {cluster.gpu_room_gib:g}; host {p.host_gib:.1f} GiB per "
            f"rank ({node:,.1f} of {room:,.1f} GiB per node)",
            f"  step: {p.step_ms:,.0f} ms = compute {p.compute_ms:,.0f} (recompute {p.recompute_ms:,.0f}) + exposed "
            f"{p.exposed_ms:,.0f}" + (f" ({', '.join(f'{n} {ms:,.0f}' for n, ms in exposed)})" if exposed else ""),
            f"  MFU {100 * p.mfu:.1f}% (model FLOPs without recompute ÷ (step time × {cluster.peak_tflops:g} TFLOP/s "
            f"peak)), {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU"]


def summary(result: Longest, cluster: Cluster) -> str:
    """What ``--max-seq-len`` prints after the header (also what the README's planner table is checked against)."""
    w = result.winner
    lines = [f"longest sequence: {tokens_text(result.seq_len)} tokens (lengths searched in multiples of "
             f"{result.unit:,}; {result.checked:,} memory footprints computed)",
             f"fastest configuration there: {w.setup}", *describe(w, cluster),
             f"one step longer, {result.next_len:,} tokens, the closest configuration ({result.closest.setup}) "
             f"does not fit: {binding(result.closest, cluster)}"]
    if result.host_bound is not None and result.host_bound is not result.closest \
            and not binding(result.closest, cluster).startswith("host"):
        lines.append(f"  and {result.host_bound.setup} fits its GPUs there but not the host: "
                     f"{binding(result.host_bound, cluster)}")
    return "\n".join(lines)


def run_longest(args: argparse.Namespace, model: ModelSpec, cluster: Cluster) -> int:
    from .report import print_documents, searched_stages, state_text
    stages = searched_stages(args)
    documents = documents_from(args)
    result = longest(model, cluster, tp_options=args.tp, zero_stages=stages, micro_batch=args.micro_batch,
                     dtype=DTYPES[args.dtype], documents=documents, **framework_from(args, stages))
    print_header(model, cluster)
    print(f"search: micro-batch {args.micro_batch}, {args.dtype}, ZeRO {'/'.join(map(str, sorted(set(stages))))}, "
          f"tp {'/'.join(map(str, args.tp))}, every backend, recompute preset, modifier and optimizer offload; "
          f"{state_text(args.framework)}")
    if (note := excluded(args.tp, stages, True, args.framework)) is not None:
        print(note)
    print_documents(documents)
    print(summary(result, cluster))
    print(f"{len(result.plans)} configurations fit at {result.seq_len:,} tokens and may be fastest; top "
          f"{min(args.top, len(result.plans))}:")
    print_table(result.plans, args.top)
    return 0
