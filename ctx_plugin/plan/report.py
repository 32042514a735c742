"""``ctx-plugin plan``: rank every parallel layout × recompute preset for a model on a cluster."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..cliargs import output_file, positive_float, positive_int, read_json_object, tokens
from ..memory.report import DTYPES, model_arg, model_from, need_matplotlib
from ..memory.specs import MODEL_PRESETS, ModelSpec
from .predict import Cluster, Prediction
from .search import best_per_layout, enumerate_plans, explain

_DEFAULTS = Cluster(nodes=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=model_arg,
                   help=f"a model preset ({', '.join(MODEL_PRESETS)}) or the path of a Hugging Face config.json")
    p.add_argument("--seq-len", type=tokens, required=True, help="tokens per sequence, e.g. 131072 or 128k")
    p.add_argument("--nodes", type=positive_int, required=True, help="number of nodes")
    p.add_argument("--gpus-per-node", type=positive_int, default=_DEFAULTS.gpus_per_node)
    p.add_argument("--gpu-memory", type=positive_float, default=_DEFAULTS.gpu_memory_gib, help="GiB per GPU the plan must fit")
    p.add_argument("--intra-bw", type=positive_float, default=_DEFAULTS.intra_bw_gbs,
                   help="intra-node GB/s per GPU and direction (NVLink)")
    p.add_argument("--inter-bw", type=positive_float, default=_DEFAULTS.inter_bw_gbs,
                   help="inter-node GB/s per GPU and direction (InfiniBand: 400 Gb/s = 50)")
    p.add_argument("--attention-tflops", type=positive_float, default=None,
                   help=f"attention kernel TFLOP/s per GPU (default {_DEFAULTS.attention_tflops:g}, bf16 on H200)")
    p.add_argument("--matmul-tflops", type=positive_float, default=_DEFAULTS.matmul_tflops, help="dense matmul TFLOP/s per GPU")
    p.add_argument("--bench", type=read_json_object, default=None,
                   help="a JSON file from `ctx-plugin bench`: its attention_tflops replaces --attention-tflops")
    p.add_argument("--tp", type=positive_int, nargs="+", default=[1], help="tensor-parallel sizes to try, e.g. --tp 1 2 4")
    p.add_argument("--micro-batch", type=positive_int, default=1)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage (distributed optimizer = 1)")
    p.add_argument("--top", type=positive_int, default=15, help="rows of the table (default 15)")
    p.add_argument("--all-presets", action="store_true",
                   help="one row per layout × preset (default: each layout's best preset only)")
    p.add_argument("--plot", type=output_file, default=None, help="write a PNG of step time against memory for every configuration")


def _attention_tflops(args: argparse.Namespace) -> float:
    if args.bench is None:
        return _DEFAULTS.attention_tflops if args.attention_tflops is None else args.attention_tflops
    if args.attention_tflops is not None:
        raise ValueError("give --attention-tflops or --bench, not both")
    data = args.bench                  # the JSON object (read_json_object)
    if "attention_tflops" not in data:
        raise ValueError("the --bench file has no 'attention_tflops' key; write it with `ctx-plugin bench` or give "
                         "--attention-tflops")
    rate = data["attention_tflops"]
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"the --bench file's attention_tflops is {rate!r}, not a positive number; rerun "
                         f"`ctx-plugin bench --json` or give --attention-tflops")
    return float(rate)


def _model(text: str | ModelSpec) -> ModelSpec:
    try:
        return model_from(text)
    except OSError as e:
        raise ValueError(f"--model {text!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a readable "
                         f"config.json ({e.strerror})") from None


def _row(rank: int, p: Prediction) -> str:
    axes = "-" if p.backend.value == "allgather" or p.cp == 1 else f"{p.ulysses_size}×{p.ring_size}"
    hidden = "-" if p.ring_hidden is None else ("yes" if p.ring_hidden else "no")
    return (f"{rank:>4} {p.backend.value if p.cp > 1 else '-':<13} {p.cp:>3} {axes:>5} {p.tp:>3} {p.dp:>3} "
            f"{str(p.recompute):<14} {p.memory_gib:>8.1f} {'yes' if p.fits else 'no':>4} {p.step_ms:>10,.1f} "
            f"{p.compute_ms:>10,.1f} {p.exposed_ms:>9,.1f} {hidden:>6} {p.tokens_per_s_per_gpu:>9,.0f}")


def run(args: argparse.Namespace) -> int:
    model = _model(args.model)
    if args.top < 1:
        raise ValueError(f"--top must be at least 1, got {args.top}")
    if args.plot:
        need_matplotlib()
    cluster = Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory,
                      intra_bw_gbs=args.intra_bw, inter_bw_gbs=args.inter_bw, attention_tflops=_attention_tflops(args),
                      matmul_tflops=args.matmul_tflops)
    plans = enumerate_plans(model, args.seq_len, cluster, micro_batch=args.micro_batch, dtype=DTYPES[args.dtype],
                            tp_options=args.tp, zero_stage=args.zero)
    c = cluster
    print(f"{model.name}: {model.layers} layers, hidden {model.hidden}, {model.heads} heads ({model.kv_heads} K/V), "
          f"ffn {model.ffn}, vocab {model.vocab}")
    print(f"sequence: {args.seq_len:,} tokens × micro-batch {args.micro_batch}, {args.dtype}, ZeRO-{args.zero}")
    print(f"cluster: {c.nodes} × {c.gpus_per_node} = {c.gpus} GPUs, {c.gpu_memory_gib:g} GiB each; "
          f"{c.intra_bw_gbs:g} GB/s in a node, {c.inter_bw_gbs:g} GB/s across; attention {c.attention_tflops:g}, "
          f"matmul {c.matmul_tflops:g} TFLOP/s")
    rows = plans if args.all_presets else best_per_layout(plans)
    what = "every layout × preset" if args.all_presets else "each layout's best recompute preset"
    print(f"{len(plans)} configurations, {sum(p.fits for p in plans)} fit; top {min(args.top, len(rows))} "
          f"({what}); times per micro-batch step")
    print(f"{'rank':>4} {'backend':<13} {'cp':>3} {'u×r':>5} {'tp':>3} {'dp':>3} {'recompute':<14} {'mem GiB':>8} "
          f"{'fits':>4} {'step ms':>10} {'compute ms':>10} {'comm ms':>9} {'hidden':>6} {'tok/s/GPU':>9}")
    for i, p in enumerate(rows[:args.top], 1):
        print(_row(i, p))
    print(explain(plans[0], plans))
    if args.plot:
        title = f"{model.name}, {args.seq_len:,} tokens, {c.nodes}×{c.gpus_per_node} GPUs"
        plot(plans, cluster, Path(args.plot), title=title)
        print(f"wrote {args.plot}")
    return 0 if plans[0].fits else 1


def plot(plans: list[Prediction], cluster: Cluster, path: Path, *, title: str = "") -> None:
    """Time per sequence against memory per GPU for every configuration, the memory limit, the winner."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'ctx-plugin[plot]'") from None
    fig, ax = plt.subplots(figsize=(9, 5.5))
    def label(p: Prediction) -> str:
        return p.backend.value if p.cp > 1 else "no CP"

    for name in dict.fromkeys(map(label, plans)):
        group = [p for p in plans if label(p) == name]
        ax.scatter([p.memory_gib for p in group], [p.step_ms / p.dp for p in group], s=12, alpha=0.6, label=name)
    ax.axvline(cluster.gpu_memory_gib, color="k", linestyle="--", label=f"{cluster.gpu_memory_gib:g} GiB per GPU")
    best = plans[0]
    if best.fits:
        ax.scatter([best.memory_gib], [best.step_ms / best.dp], s=160, marker="*", color="red", zorder=3,
                   label=f"winner: {best.layout}, {best.recompute}")
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("step time ÷ dp (ms; lower is faster)")
    if max(p.step_ms / p.dp for p in plans) > 20 * min(p.step_ms / p.dp for p in plans):
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
