"""``ctx-plugin memory``: the memory table for every recompute preset, and a plot against sequence length."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from ..cliargs import output_file, positive_float, positive_int, read_json_object, tokens
from ..core.rules import SettingNames, check_sequence_parallel
from ..names import Backend, Framework, Recompute
from ..recompute.presets import RecomputeConfig
from .flops import describe as describe_documents
from .model import GiB, MemoryEstimate, check_layout, estimate, resolve
from .specs import FAMILIES, MODEL_PRESETS, ModelSpec, ParallelSpec, ZeroSettings, check_parallel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_NAMES = SettingNames(seq_len="--seq-len", cp="--cp", tp="--tp", ulysses_size="--ulysses-size", heads="query heads",
                      kv_heads="K/V heads", backend="--backend", sequence_parallel="--sequence-parallel")


def table_presets(layers: int) -> list[RecomputeConfig]:
    names = ["none", "attn_out", "selective", "core_attn", "mlp"]
    if layers > 2:
        names.append(f"full:block:{layers // 2}")
    return [RecomputeConfig.parse(p) for p in (*names, "full", "sqrt")]


parse_tokens = tokens      # ``--seq-len``: 131072, 128k or 1m; a fraction or a non-number is an error


def model_arg(text: str) -> ModelSpec:
    """``--model``: a preset name or the path of a Hugging Face ``config.json`` (argparse ``type=``)."""
    if text in MODEL_PRESETS:
        return ModelSpec.preset(text)
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a model preset ({', '.join(MODEL_PRESETS)}) nor an "
                                         f"existing config.json; pick a preset or give the config's path")
    try:
        return ModelSpec.from_hf_config(read_json_object(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e}") from None


def doc_lengths_file(text: str) -> tuple[int, ...]:
    """``--doc-lengths FILE``: document lengths (tokens, whole numbers ≥ 1) as a JSON list (``[4096, 812, ...]``)
    or as text, whitespace- or newline-separated (``#`` starts a comment); argparse ``type=``."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file of document lengths")
    try:
        raw = path.read_text()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text} ({e.strerror})") from None
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{text} is not text: give a JSON list or whitespace-separated lengths") \
            from None
    if raw.lstrip().startswith("["):
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{text} is not a JSON list of lengths ({e})") from None
        if not isinstance(values, list):
            raise argparse.ArgumentTypeError(f"{text} holds a JSON {type(values).__name__}, not a list of lengths")
        words = [(v, json.dumps(v)) for v in values]
    else:
        words = [(w, w) for line in raw.splitlines() for w in line.split("#", 1)[0].split()]
    if not words:
        raise argparse.ArgumentTypeError(f"{text} holds no document length; give at least one")
    lengths = []
    for i, (value, shown) in enumerate(words):
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise argparse.ArgumentTypeError(f"{text}: length {i + 1} is {shown}, not a whole number of tokens ≥ 1")
        lengths.append(value)
    return tuple(lengths)


def add_document_arguments(p: argparse.ArgumentParser) -> None:
    """``--doc-len MEAN`` / ``--doc-lengths FILE``: the packed documents of each sequence (one of them)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--doc-len", type=parse_tokens, default=None,
                       help="packed documents: each sequence is filled with documents of this many tokens (a mean "
                            "length, equal documents assumed; e.g. 4096 or 4k); attention FLOPs count the pairs "
                            "inside each document")
    group.add_argument("--doc-lengths", type=doc_lengths_file, default=None, metavar="FILE",
                       help="packed documents: a file of document lengths (a JSON list, or whitespace-separated "
                            "numbers), taken in order and repeated until each sequence is full")


def documents_from(args: argparse.Namespace):
    """The ``documents`` of :func:`ctx_plugin.memory.estimate` / :func:`ctx_plugin.plan.predict`: None, a mean
    length or a tuple of lengths."""
    return args.doc_len if args.doc_lengths is None else args.doc_lengths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=model_arg,
                   help=f"a model preset ({', '.join(MODEL_PRESETS)}) or the path of a Hugging Face config.json")
    p.add_argument("--seq-len", type=parse_tokens, required=True, help="tokens per sequence, e.g. 131072 or 128k")
    p.add_argument("--micro-batch", type=positive_int, default=1)
    p.add_argument("--cp", type=positive_int, default=1, help="context-parallel size")
    p.add_argument("--backend", default=Backend.ZIGZAG.value, choices=[b.value for b in Backend])
    p.add_argument("--ulysses-size", type=positive_int, default=1, help="Ulysses group size for --backend ulysses_ring")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (tp > 1)")
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel size")
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage (distributed optimizer = 1)")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    add_framework_arguments(p, "whose model state to count (default: deepspeed for --zero 2/3, else megatron)")
    p.add_argument("--grad-dtype", default=None, choices=list(DTYPES),
                   help="the gradient buffer's dtype (default: the framework's: Megatron fp32 for bf16 training, "
                        "e.g. bf16 for --grad-reduce-in-bf16; DeepSpeed the training dtype)")
    p.add_argument("--budget", type=positive_float, default=None,
                   help="GiB per GPU: also report the preset budget:<GiB> picks (for the peak above, which counts no "
                        "CUDA context, NCCL buffers or fragmentation: give the card's memory less a few GiB, as "
                        "ctx-plugin plan's --gpu-reserve)")
    p.add_argument("--recompute", type=recompute_arg, default=None,
                   help="one recompute preset with modifiers to report instead of the preset table, e.g. "
                        "full+tile_mlp+tile_loss+offload_attn:96 (its tile_loss/tile_mlp also apply to --budget)")
    p.add_argument("--family", default=None, choices=list(FAMILIES),
                   help="block implementation the model runs as (default: ctx_plugin for a preset, hf for a "
                        "config.json)")
    p.add_argument("--plot", type=output_file, default=None,
                   help="write a PNG of peak memory vs. sequence length per preset (the one --recompute gives, if any)")
    add_document_arguments(p)


def add_framework_arguments(p: argparse.ArgumentParser, framework_help: str) -> None:
    """``--framework`` and ``--deepspeed-config`` (``ctx-plugin memory`` and ``plan``): :func:`framework_from`."""
    p.add_argument("--framework", default=None, choices=[f.value for f in Framework], help=framework_help)
    p.add_argument("--deepspeed-config", type=read_json_object, default=None,
                   help="a DeepSpeed config JSON whose zero_optimization bucket sizes size DeepSpeed's buffers "
                        "(default: DeepSpeed's defaults)")


def framework_from(args: argparse.Namespace, stages) -> dict:
    """``framework`` and ``zero_settings`` (ParallelSpec's, the planner's) from :func:`add_framework_arguments`, for
    an estimate or search at the ZeRO ``stages``."""
    zero = ZeroSettings() if args.deepspeed_config is None else _deepspeed_zero(args.deepspeed_config, stages)
    return {"framework": None if args.framework is None else Framework(args.framework), "zero_settings": zero}


def _deepspeed_zero(config: dict, stages) -> ZeroSettings:
    """``--deepspeed-config``'s bucket sizes (read by DeepSpeed's parser: :mod:`ctx_plugin.memory.zero_config`);
    ValueError for a stage other than the estimate's and for offload, which the memory model does not count (the
    planner's ``--modifiers`` searches optimizer offload)."""
    from .zero_config import zero_config

    parsed = zero_config(config)
    if "stage" in config.get("zero_optimization", {}) and set(stages) != {int(parsed.stage)}:
        raise ValueError(f"--deepspeed-config sets ZeRO stage {int(parsed.stage)}, but the estimate is for "
                         f"--zero {' '.join(map(str, sorted(set(stages))))}: give --zero {int(parsed.stage)}")
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(getattr(parsed, key), "device", "none")
        device = str(getattr(device, "value", device))
        if device != "none":
            raise ValueError(f"--deepspeed-config offloads ({key}.device {device!r}), which the memory model does not "
                             f"count: drop {key} from the copy given here (the planner's --modifiers searches "
                             f"optimizer offload)")
    return ZeroSettings.from_parsed(parsed)


def recompute_arg(text: str) -> RecomputeConfig:
    """``--recompute``: a concrete preset, with any modifiers (argparse ``type=``)."""
    try:
        config = RecomputeConfig.parse(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if config.preset == Recompute.BUDGET:
        raise argparse.ArgumentTypeError("give --budget <GiB> for budget:<GiB>; --recompute takes a concrete preset")
    return config


def model_from(text: str | ModelSpec, family: str | None = None) -> ModelSpec:
    """The model of ``--model`` (a preset name, a config.json path, or a ModelSpec), run as ``family``'s blocks when
    given: a preset is built for that family (the Hugging Face Qwen2 has q/k/v biases), anything else keeps its
    shape and biases."""
    if isinstance(text, ModelSpec):
        model = text
    elif text in MODEL_PRESETS:
        return ModelSpec.preset(text) if family is None else ModelSpec.preset(text, family)
    else:
        model = ModelSpec.from_hf_config(Path(text))
    return model if family is None or family == model.family else replace(model, family=family)


def need_matplotlib() -> None:
    """``ValueError`` naming the install when ``--plot`` is given without matplotlib (checked before any work)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'ctx-plugin[plot]'") from None


def _row(name: str, est: MemoryEstimate, width: int = 16) -> str:
    static = (est.params + est.grads + est.optimizer + est.framework_buffers) / GiB
    return (f"{name:<{width}} {est.activations / GiB:>11.1f} {est.recompute_peak / GiB:>10.1f} "
            f"{round(est.attention_peak / GiB, 1) + 0.0:>8.1f} {est.cp_buffers / GiB:>8.2f} {est.logits_peak / GiB:>8.1f} "
            f"{static:>14.1f} {est.peak / GiB:>9.1f} "
            f"{100 * est.recompute_fraction:>9.1f}% {est.host / GiB:>8.1f}")


_FAMILY_TEXT = {"ctx_plugin": "ctx_plugin's own block (ctx_plugin.models)",
                "hf": "Hugging Face Llama/Mistral/Qwen2-style layers",
                "megatron": "megatron-core GPT layers, local spec"}


def run(args: argparse.Namespace) -> int:
    model = model_from(args.model, getattr(args, "family", None))
    check_parallel(Backend(args.backend), args.ulysses_size, args.cp, args.tp, args.sequence_parallel, _NAMES)
    parallel = ParallelSpec(cp=args.cp, backend=args.backend, ulysses_size=args.ulysses_size, tp=args.tp,
                            sequence_parallel=args.sequence_parallel, dp=args.dp, zero_stage=args.zero,
                            **framework_from(args, [args.zero]),
                            grad_dtype=None if args.grad_dtype is None else DTYPES[args.grad_dtype])
    if args.deepspeed_config is not None and parallel.runs_on != Framework.DEEPSPEED:
        raise ValueError(f"--deepspeed-config sizes DeepSpeed's buffers, but this estimate counts the model state as "
                         f"Megatron holds it (ZeRO {parallel.zero_stage}): give --framework deepspeed or --zero 2/3, "
                         f"or drop --deepspeed-config")
    check_layout(model, parallel, args.seq_len, _NAMES)
    if parallel.sequence_parallel:
        check_sequence_parallel(parallel.cp_config, args.seq_len, parallel.cp, parallel.tp, _NAMES)
    dtype = DTYPES[args.dtype]
    documents = documents_from(args)
    kw = dict(seq_len=args.seq_len, micro_batch=args.micro_batch, dtype=dtype, documents=documents)
    if args.plot:
        need_matplotlib()
    chosen_one = getattr(args, "recompute", None)
    presets = table_presets(model.layers) if chosen_one is None else [chosen_one]
    width = max(16, *(len(str(p)) + 1 for p in presets))
    estimates = [estimate(model, parallel, preset, **kw) for preset in presets]
    rows = [_row(str(preset), est, width) for preset, est in zip(presets, estimates)]
    budget = None
    if args.budget is not None:
        tiles = "" if chosen_one is None else "".join(
            f"+{name}" + ("" if tokens is None else f":{tokens}") for name, on, tokens in
            (("tile_loss", chosen_one.tile_loss, chosen_one.loss_tokens),
             ("tile_mlp", chosen_one.tile_mlp, chosen_one.mlp_tokens)) if on)
        budget = f"budget:{args.budget:g}{tiles}"
    chosen = None if budget is None else resolve(budget, model, parallel, **kw)
    gpus = parallel.cp * parallel.tp * parallel.dp
    print(f"{model.name}: {model.layers} layers, hidden {model.hidden}, {model.heads} heads ({model.kv_heads} K/V), "
          f"ffn {model.ffn}, vocab {model.vocab}; {args.seq_len:,} tokens × {args.micro_batch}, {args.dtype}")
    qk = ", with per-head q/k norms (Qwen3)" if model.qk_norm else ""
    print(f"blocks: {model.family} ({_FAMILY_TEXT[model.family]}{qk})")
    print(f"parallel: cp={parallel.cp} ({parallel.backend}), tp={parallel.tp}, dp={parallel.dp} = {gpus} GPUs, "
          f"ZeRO-{parallel.zero_stage}, model state as {parallel.runs_on.value} holds it; GiB per GPU")
    if documents is not None:
        print(f"documents: {describe_documents(documents)}; memory as for one document (every saved tensor is per "
              f"token), extra FLOPs against the attention of the pairs inside each document")
    print(f"{'preset':<{width}} {'activations':>11} {'recompute':>10} {'attn bwd':>8} {'cp bufs':>8} {'logits':>8} "
          f"{'model state':>14} {'peak':>9} {'extra FLOPs':>10} {'host':>8}")
    print("\n".join(rows))
    first = estimates[0]
    print(f"model state: parameters {first.params / GiB:.1f}, gradients {first.grads / GiB:.1f}, optimizer "
          f"{first.optimizer / GiB:.1f}, {first.framework.value}'s buffers {first.framework_buffers / GiB:.1f}; at the "
          f"optimizer step {first.step_peak / GiB:.1f} (the peak when it is larger)")
    if chosen is not None:
        print(f"{budget} → {chosen} (fewest extra FLOPs among the presets that fit)")
    if args.plot:
        plot(model, parallel, args, dtype, Path(args.plot), presets)
        print(f"wrote {args.plot}")
    return 0


def plot_series(model: ModelSpec, parallel: ParallelSpec, args: argparse.Namespace, dtype: torch.dtype,
                presets) -> tuple[list[int], dict[str, list[float]]]:
    """The plot's sequence lengths (``--seq-len`` / 64 to × 4, each a multiple of the layout's unit) and, per preset
    of the table (or the one ``--recompute``), its peak in GiB at each."""
    unit = 2 * parallel.cp * parallel.ulysses
    lens = sorted({max(unit, int(args.seq_len * 2.0 ** k) // unit * unit) for k in range(-6, 3)})
    return lens, {str(preset): [estimate(model, parallel, preset, seq_len=s, micro_batch=args.micro_batch,
                                         dtype=dtype).peak / GiB for s in lens] for preset in presets}


def plot(model: ModelSpec, parallel: ParallelSpec, args: argparse.Namespace, dtype: torch.dtype, path: Path,
         presets) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'ctx-plugin[plot]'") from None
    lens, series = plot_series(model, parallel, args, dtype, presets)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, peaks in series.items():
        ax.plot(lens, peaks, marker="o", label=label)
    if args.budget is not None:
        ax.axhline(args.budget, color="k", linestyle="--", label=f"budget {args.budget:g} GiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_title(f"{model.name}, cp={parallel.cp} {parallel.backend}, tp={parallel.tp}, ZeRO-{parallel.zero_stage}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
