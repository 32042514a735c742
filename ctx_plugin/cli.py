"""The ``ctx-plugin`` command.

``ctx-plugin demo [--nproc N] [demo options]`` starts N local processes with torchrun and runs
:mod:`ctx_plugin.demo` on them (the README's main job). ``ctx-plugin memory`` prints the memory model's table
for every recompute preset. ``ctx-plugin plan`` ranks every backend × parallel layout × recompute preset for a
model on a cluster by predicted memory and step time. ``ctx-plugin launch [--dry-run] sbatch ...
launch/<framework>.sbatch ...`` checks a job before submitting it.
"""
from __future__ import annotations

import argparse
import sys

from .bench.report import add_arguments as add_bench_arguments
from .bench.report import run as bench_run
from .memory.report import add_arguments as add_memory_arguments
from .memory.report import run as memory_report
from .plan.report import add_arguments as add_plan_arguments
from .plan.report import run as plan_report


def _demo(args: argparse.Namespace, rest: list[str]) -> int:
    import os

    from torch.distributed.run import main as torchrun

    if args.nproc < 1:
        raise SystemExit("--nproc must be at least 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # what torchrun would pick, without its warning banner
    torchrun(["--standalone", "--nproc-per-node", str(args.nproc), "-m", "ctx_plugin.demo", *rest])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctx-plugin", description="ctx_plugin: context-parallel attention tools")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny model with context parallelism on local processes and check "
                                       "its loss against the single-process run (other options: see "
                                       "python -m ctx_plugin.demo --help)")
    demo.add_argument("--nproc", type=int, default=4, help="number of local processes (ranks), default 4")
    memory = sub.add_parser("memory", help="memory per GPU for every recompute preset (and a plot vs. sequence length)")
    add_memory_arguments(memory)
    plan = sub.add_parser("plan", help="rank backends × (Ulysses, ring) sizes × recompute presets × TP for a model on "
                                       "a cluster by predicted memory and step time")
    add_plan_arguments(plan)
    bench = sub.add_parser("bench", help="time every backend's forward and forward+backward against the one-kernel "
                                         "ideal (simulated ranks on one device, or --distributed processes)")
    add_bench_arguments(bench)
    launch = sub.add_parser("launch", help="check a launch/*.sbatch job line (node × GPU count against the "
                                           "parallel layout, paths, backend) and submit it",
                            usage="ctx-plugin launch [--dry-run] sbatch <sbatch options> launch/megatron.sbatch "
                                  "<job options> -- <arguments>")
    launch.add_argument("--dry-run", action="store_true", help="check and print; submit nothing")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        return _demo(args, rest)
    if args.command == "launch":
        from .slurm.submit import launch as submit
        try:
            return submit(rest, dry_run=args.dry_run)
        except (ValueError, TypeError) as e:
            parser.error(str(e))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in ("memory", "bench"):
        try:
            if args.command == "bench":
                return bench_run(args, argv[argv.index("bench") + 1:] if argv is not None else
                                 sys.argv[sys.argv.index("bench") + 1:])
            return memory_report(args)
        except (ValueError, TypeError) as e:
            parser.error(str(e))
    if args.command == "plan":
        try:
            return plan_report(args)
        except (ValueError, TypeError) as e:
            parser.error(str(e))
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
