"""``ctx-plugin plan``: rank every parallel layout × recompute preset for a model on a cluster."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..cliargs import nonnegative_float, output_file, positive_float, positive_int, read_json_object, tokens
from ..memory.flops import describe as describe_documents
from ..memory.report import (DTYPES, add_document_arguments, add_framework_arguments, documents_from, framework_from,
                             model_arg, model_from, need_matplotlib)
from ..memory.specs import MODEL_PRESETS, ModelSpec
from ..names import Framework
from .cluster import Cluster
from .prediction import Prediction
from .longest_report import run_longest
from .frameworks import deepspeed_counted, excluded
from .search import best_per_layout, enumerate_plans, explain, untried
from .table import print_header, print_table

_DEFAULTS = Cluster(nodes=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=model_arg,
                   help=f"a model preset ({', '.join(MODEL_PRESETS)}) or the path of a Hugging Face config.json")
    p.add_argument("--seq-len", type=tokens, default=None, help="tokens per sequence, e.g. 131072 or 128k")
    p.add_argument("--max-seq-len", action="store_true",
                   help="instead of --seq-len: find the longest sequence that fits (GPU and host memory), the fastest "
                        "configuration at that length and what binds one step longer")
    p.add_argument("--modifiers", action="store_true",
                   help="with --seq-len: also try the memory modifiers (+tile_loss, +tile_mlp, +recompute_attn, "
                        "+offload, +offload_attn) and optimizer offload on the presets that need them to fit "
                        "(--max-seq-len always does)")
    p.add_argument("--nodes", type=positive_int, required=True, help="number of nodes")
    p.add_argument("--gpus-per-node", type=positive_int, default=_DEFAULTS.gpus_per_node)
    p.add_argument("--gpu-memory", type=positive_float, default=_DEFAULTS.gpu_memory_gib,
                   help=f"GiB per GPU, the card's size (default {_DEFAULTS.gpu_memory_gib:g}); the plan fits under it "
                        f"less --gpu-reserve")
    p.add_argument("--gpu-reserve", type=nonnegative_float, default=_DEFAULTS.gpu_reserve_gib,
                   help=f"GiB per GPU the memory model does not count and the plan leaves free: the driver's "
                        f"share, the CUDA context, NCCL's buffers, workspaces, allocator fragmentation (default "
                        f"{_DEFAULTS.gpu_reserve_gib:g})")
    p.add_argument("--intra-bw", type=positive_float, default=_DEFAULTS.intra_bw_gbs,
                   help="intra-node GB/s per GPU and direction (NVLink)")
    p.add_argument("--inter-bw", type=positive_float, default=_DEFAULTS.inter_bw_gbs,
                   help="inter-node GB/s per GPU and direction (InfiniBand: 400 Gb/s = 50)")
    p.add_argument("--attention-tflops", type=positive_float, default=None,
                   help=f"attention kernel TFLOP/s per GPU (default {_DEFAULTS.attention_tflops:g}, bf16 on H200)")
    p.add_argument("--matmul-tflops", type=positive_float, default=_DEFAULTS.matmul_tflops, help="dense matmul TFLOP/s per GPU")
    p.add_argument("--peak-tflops", type=positive_float, default=_DEFAULTS.peak_tflops,
                   help=f"the GPU's peak bf16 TFLOP/s, MFU's denominator (default {_DEFAULTS.peak_tflops:g}: H100/H200)")
    p.add_argument("--host-memory", type=positive_float, default=None,
                   help=f"host memory per node in GiB for offload (default {_DEFAULTS.host_memory_gib:g})")
    p.add_argument("--host-reserve", type=nonnegative_float, default=None,
                   help=f"host GiB per node kept free for the OS, frameworks and loaders (default "
                        f"{_DEFAULTS.host_reserve_gib:g})")
    p.add_argument("--host-bw", type=positive_float, default=None,
                   help=f"host↔device GB/s per PCIe link and direction (default {_DEFAULTS.host_bw_gbs:g}: PCIe 5 ×16)")
    p.add_argument("--gpus-per-host-link", type=positive_int, default=None,
                   help=f"GPUs sharing one PCIe uplink to the CPUs (default {_DEFAULTS.gpus_per_host_link}: HGX H100/H200)")
    p.add_argument("--host-adam", type=positive_float, default=None,
                   help=f"billions of parameters per second a node's CPUs update with DeepSpeed's CPU Adam (default "
                        f"{_DEFAULTS.host_adam_gparams_s:g})")
    p.add_argument("--bench", type=read_json_object, default=None,
                   help="a JSON file from `ctx-plugin bench`: its attention_tflops replaces --attention-tflops")
    p.add_argument("--tp", type=positive_int, nargs="+", default=[1], help="tensor-parallel sizes to try, e.g. --tp 1 2 4")
    p.add_argument("--micro-batch", type=positive_int, default=1)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--zero", type=int, nargs="+", default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stages to try (distributed optimizer = 1; default 1, and 0 1 2 3 with --max-seq-len)")
    add_framework_arguments(p, "search only what this framework runs, with its model state (default: both; "
                               "Megatron's state for ZeRO 0/1 without optimizer offload, DeepSpeed's otherwise)")
    p.add_argument("--top", type=positive_int, default=15, help="rows of the table (default 15)")
    p.add_argument("--all-presets", action="store_true",
                   help="one row per layout × preset (default: each layout's best preset only)")
    p.add_argument("--plot", type=output_file, default=None, help="write a PNG of step time against memory for every configuration")
    add_document_arguments(p)


def state_text(framework: str | None) -> str:
    """How the search counts model state (``ctx_plugin.memory.state``), for the header."""
    if framework is not None:
        return f"{framework} only, with its model state"
    return "model state as Megatron holds it at ZeRO 0/1, as DeepSpeed does at 2/3 and with optimizer offload"


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


def _check_mode(args: argparse.Namespace) -> None:
    """The options of one mode given in the other are errors, not ignored."""
    if args.max_seq_len:
        given = [flag for flag, on in (("--seq-len", args.seq_len is not None), ("--modifiers", args.modifiers),
                                       ("--all-presets", args.all_presets), ("--plot", args.plot is not None)) if on]
        if given:
            raise ValueError(f"--max-seq-len searches the length and every modifier itself: drop {', '.join(given)}")
    elif args.seq_len is None:
        raise ValueError("give --seq-len <tokens> (plan one length) or --max-seq-len (find the longest)")


def print_documents(documents) -> None:
    """The line that says how packed documents fill each sequence (nothing without ``--doc-len``/``--doc-lengths``)."""
    if documents is not None:
        print(f"documents: {describe_documents(documents)}, each padded to its layout's document unit; attention "
              f"FLOPs, step time and MFU count only the pairs inside each document")


_HOST_OPTIONS = {"host_memory": "host_memory_gib", "host_reserve": "host_reserve_gib", "host_bw": "host_bw_gbs",
                 "gpus_per_host_link": "gpus_per_host_link", "host_adam": "host_adam_gparams_s"}
"""The host options (for offload; default None: the Cluster's defaults) → their Cluster fields."""


def _host_given(args: argparse.Namespace) -> dict[str, object]:
    """The host options given, by argument name."""
    return {name: getattr(args, name) for name in _HOST_OPTIONS if getattr(args, name) is not None}


def cluster_from(args: argparse.Namespace) -> Cluster:
    host = {_HOST_OPTIONS[name]: value for name, value in _host_given(args).items()}
    return Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory,
                   gpu_reserve_gib=args.gpu_reserve, intra_bw_gbs=args.intra_bw, inter_bw_gbs=args.inter_bw,
                   attention_tflops=_attention_tflops(args),
                   matmul_tflops=args.matmul_tflops, peak_tflops=args.peak_tflops, **host)


def searched_stages(args: argparse.Namespace) -> list[int]:
    """``--zero``, else the default: 1 for one length, every stage the framework runs for ``--max-seq-len``."""
    if args.zero:
        return args.zero
    if not args.max_seq_len:
        return [1]
    return [0, 1] if args.framework == Framework.MEGATRON else [0, 1, 2, 3]


def _check_unused(args: argparse.Namespace) -> None:
    """Options the chosen search would not read are errors, not ignored."""
    offload = args.max_seq_len or args.modifiers
    if args.deepspeed_config is not None and not deepspeed_counted(searched_stages(args), offload, args.framework):
        raise ValueError("--deepspeed-config sizes DeepSpeed's buffers, but this search counts every configuration's "
                         "model state as Megatron holds it (ZeRO 0/1 without optimizer offload): give --framework "
                         "deepspeed, --zero 2 or 3, or --modifiers (optimizer offload), or drop --deepspeed-config")
    host = ["--" + name.replace("_", "-") for name in _host_given(args)]
    if host and not offload:
        many = len(host) > 1
        raise ValueError(f"{', '.join(host)} describe{'' if many else 's'} the host for offload, which --seq-len "
                         f"searches only with --modifiers: add --modifiers, or drop {'them' if many else 'it'}")


def run(args: argparse.Namespace) -> int:
    model = _model(args.model)
    _check_mode(args)
    _check_unused(args)
    if args.top < 1:
        raise ValueError(f"--top must be at least 1, got {args.top}")
    if args.plot:
        need_matplotlib()
    cluster = cluster_from(args)
    if args.max_seq_len:
        return run_longest(args, model, cluster)
    stages = searched_stages(args)
    documents = documents_from(args)
    plans = enumerate_plans(model, args.seq_len, cluster, micro_batch=args.micro_batch, dtype=DTYPES[args.dtype],
                            tp_options=args.tp, zero_stage=stages, modifiers=args.modifiers, documents=documents,
                            **framework_from(args, stages))
    c = cluster
    print_header(model, c)
    print(f"sequence: {args.seq_len:,} tokens × micro-batch {args.micro_batch}, {args.dtype}, ZeRO "
          f"{'/'.join(map(str, sorted(set(stages))))}" + (", with memory modifiers and offload" if args.modifiers else "")
          + f"; {state_text(args.framework)}")
    if (note := excluded(args.tp, stages, args.modifiers, args.framework)) is not None:
        print(note)
    print_documents(documents)
    rows = plans if args.all_presets else best_per_layout(plans)
    what = "every layout × preset" if args.all_presets else "each layout's best recompute preset"
    print(f"{len(plans)} configurations, {sum(p.fits for p in plans)} fit; top {min(args.top, len(rows))} "
          f"({what}); times per micro-batch step")
    print_table(rows, args.top)
    print(explain(plans[0], plans, untried=untried(model, cluster, args.tp, stages, args.modifiers)))
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
    ax.axvline(cluster.gpu_room_gib, color="k", linestyle="--",
               label=f"{cluster.gpu_room_gib:g} GiB per GPU ({cluster.gpu_memory_gib:g} less "
                     f"{cluster.gpu_reserve_gib:g} reserved)")
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
