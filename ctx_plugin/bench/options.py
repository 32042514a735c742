"""``ctx-plugin bench``'s options: the parser, their defaults (or ``--smoke``'s), the combinations refused before
anything runs, and what they describe (the benchmarked :class:`~ctx_plugin.bench.harness.Shape`, each backend's
:class:`~ctx_plugin.core.config.CPConfig`)."""
from __future__ import annotations

import argparse

import torch

from ..cliargs import non_negative_tokens, output_file, positive_int, tokens
from ..core.config import CPConfig
from ..memory.report import doc_lengths_file
from ..names import Backend, Kernel
from .harness import PASSES, Shape

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
DEFAULTS = dict(seq_len=131072, heads=32, kv_heads=None, head_dim=128, dtype="bf16", device="auto", reps=5, ranks=[8])
"""The shape options' defaults (``None`` in the parser, so that :func:`settle` sees which ones were given)."""
SMOKE = dict(seq_len=256, heads=4, kv_heads=2, head_dim=16, dtype="fp32", device="cpu", reps=1, ranks=[2, 4])
"""What ``--smoke`` sets (none of these options may be given with it)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", nargs="+", default=[b.value for b in Backend], choices=[b.value for b in Backend])
    p.add_argument("--ranks", nargs="+", type=positive_int, default=None, help="group sizes N (default 8)")
    p.add_argument("--ulysses-size", type=positive_int, default=None,
                   help="Ulysses group size of ulysses_ring (default 2)")
    p.add_argument("--seq-len", type=tokens, default=None,
                   help="global sequence length, e.g. 128k (default); must split evenly over every N")
    p.add_argument("--heads", type=positive_int, default=None, help="default 32")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=positive_int, default=None, help="default 128")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None, help="default auto")
    p.add_argument("--kernel", choices=[k.value for k in Kernel], default=Kernel.AUTO.value)
    p.add_argument("--no-causal", action="store_true", help="full (bidirectional) attention")
    p.add_argument("--window", type=non_negative_tokens, default=None,
                   help="sliding window: each query sees itself and this many tokens before it (window=(w, 0)); "
                        "simulated mode also times the same backends without it (column 'vs full')")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--doc-len", type=tokens, default=None, metavar="MEAN",
                      help="packed documents, as ctx-plugin plan takes them: documents of this many tokens fill the "
                           "sequence one after another, the last one cut (e.g. 512 or 4k); each row pads every "
                           "document at its end to its layout's document unit (pad_documents; columns docs, unit, "
                           "pad); FLOPs and the ideal count only the pairs inside each document")
    docs.add_argument("--doc-lengths", type=doc_lengths_file, default=None, metavar="FILE",
                      help="packed documents: a file of document lengths (a JSON list, or whitespace-separated "
                           "numbers), taken in order and repeated until the sequence is full, padded like --doc-len")
    p.add_argument("--passes", nargs="+", choices=PASSES, default=None, help="default: all")
    p.add_argument("--reps", type=positive_int, default=None,
                   help="timed repetitions per measurement (median; default 5)")
    p.add_argument("--json", type=output_file, default=None, help="write the rows and the setup here")
    p.add_argument("--plot", type=output_file, default=None, help="PNG: slowest-rank efficiency per backend and N")
    p.add_argument("--distributed", action="store_true", help="real processes under torchrun (--nproc of them)")
    p.add_argument("--nproc", type=positive_int, default=None, help="processes for --distributed (default 2)")
    p.add_argument("--no-rank-check", action="store_true",
                   help="CPConfig(check_ranks=False): no agreement check among the ranks before each call "
                        "(--distributed; simulated ranks never check). With the check on, --distributed reports "
                        "its time per call")
    p.add_argument("--memory", action="store_true",
                   help="also measure, per rank and call, the bytes allocated and copied and the peak (torch profiler "
                        "memory events; one more call per rank) against (1/N) of the one-device peak + two K/V "
                        "blocks (columns alloc/copied/peak/bound MiB, peak/bound; simulated mode)")
    p.add_argument("--profile", action="store_true",
                   help="also split each row's slowest rank's time (one more call under torch.profiler) into kernel, "
                        "merge, copies, other device work and gaps (device idle: launch/host overhead); a second "
                        "table and the rows' 'profile' in --json (simulated mode)")
    p.add_argument("--compare-kernels", action="store_true",
                   help="first time every local kernel that can run here on one rank's share (S / max N) and say "
                        "which one kernel=auto picks (it should be the fastest)")
    p.add_argument("--smoke", action="store_true", help="a tiny CPU case in fp32 (for CI): S=256, 4 heads × 16, "
                                                        "N = 2 and 4, one repetition")
    p.add_argument("--plan-only", action="store_true",
                   help="with --doc-len/--doc-lengths: only the host time each backend takes to plan a new batch "
                        "of those documents (column plan ms, the slowest rank, every rank timed; no attention runs, "
                        "so any sequence length works on any machine; --kernel torch on a CPU includes the varlen "
                        "calls' planning, as the GPU kernels have it)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def settle(args: argparse.Namespace) -> None:
    """Fills in the defaults (or ``--smoke``'s values) once; ``ValueError`` for an option that would be ignored."""
    given = [name for name in SMOKE if getattr(args, name) is not None]
    if args.smoke and given:
        raise ValueError(f"--smoke sets {', '.join(map(_flag, given))} itself: drop {'them' if len(given) > 1 else 'it'}"
                         f" or --smoke")
    if args.plan_only:
        if args.doc_len is None and args.doc_lengths is None:
            raise ValueError("--plan-only times the planning of packed documents: add --doc-len or --doc-lengths")
        for name in ("distributed", "memory", "profile", "compare_kernels", "plot", "passes", "reps"):
            if getattr(args, name, None) not in (None, False):
                raise ValueError(f"{_flag(name)} does not apply to --plan-only (no attention runs): drop it")
    if args.ulysses_size is not None and Backend.ULYSSES_RING.value not in args.backends:
        raise ValueError("--ulysses-size sizes the ulysses_ring backend's Ulysses groups, which --backends leaves "
                         "out: drop it or add ulysses_ring")
    if args.distributed:
        for name, what in (("ranks", "the group size is --nproc"), ("compare_kernels", "it runs in simulated mode"),
                           ("memory", "it measures simulated ranks"), ("profile", "it profiles simulated ranks")):
            if getattr(args, name):
                raise ValueError(f"{_flag(name)} does not apply to --distributed ({what}): drop it")
    else:
        for name, what in (("nproc", "the number of processes"), ("no_rank_check", "simulated ranks never check")):
            if getattr(args, name):
                raise ValueError(f"{_flag(name)} applies to --distributed only ({what}): drop it or add --distributed")
    for name, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.nproc = 2 if args.nproc is None else args.nproc
    args.ulysses_size = 2 if args.ulysses_size is None else args.ulysses_size
    args.passes = list(PASSES) if args.passes is None else args.passes
    if args.distributed:
        args.ranks = [args.nproc]


def shape_from_args(args: argparse.Namespace, device: torch.device | None = None) -> Shape:
    """The benchmarked attention (from settled ``args``, see :func:`settle`)."""
    if device is None:
        device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and device.type != "cuda":
        raise ValueError("--device cuda but no GPU is visible")
    return Shape(seq_len=args.seq_len, heads=args.heads, kv_heads=args.kv_heads or args.heads,
                 head_dim=args.head_dim, batch=args.batch, causal=not args.no_causal, window=args.window,
                 documents=args.doc_len if args.doc_lengths is None else args.doc_lengths, dtype=DTYPES[args.dtype],
                 device=device)


def distributed_device(args: argparse.Namespace, size: int, rank: int = 0) -> torch.device:
    """The device of rank ``rank`` of ``--distributed`` over ``size`` processes (one GPU each when there are enough,
    not ``--smoke``)."""
    use_cuda = args.device != "cpu" and torch.cuda.device_count() >= size and not args.smoke
    return torch.device("cuda", rank) if use_cuda else torch.device("cpu")


def configs(args: argparse.Namespace, size: int):
    """(backend label, CPConfig or the reason it cannot run at this size) for every requested backend."""
    for name in args.backends:
        backend = Backend(name)
        u = args.ulysses_size if backend == Backend.ULYSSES_RING else 1
        if backend == Backend.ULYSSES_RING and (u >= size or size % u):
            yield f"{name}(u={u})", f"ulysses_size {u} must divide N = {size} and be smaller"
            continue
        yield (f"{name}(u={u})" if u > 1 else name), CPConfig(backend=backend, kernel=args.kernel, ulysses_size=u,
                                                              check_ranks=not args.no_rank_check)
