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

from .bench.options import add_arguments as add_bench_arguments
from .bench.report import check as bench_check
from .bench.report import run as bench_run
from .cliargs import OneLineParser, positive_int, without_option
from .demo import add_arguments as add_demo_arguments
from .demo import check as demo_check
from .memory.report import add_arguments as add_memory_arguments
from .memory.report import run as memory_report
from .plan.report import add_arguments as add_plan_arguments
from .plan.report import run as plan_report


def _demo(args: argparse.Namespace, rest: list[str]) -> int:
    """Checks the demo's arguments here, once, then starts the ranks (whose own parsing cannot fail)."""
    import os

    from torch.distributed.run import main as torchrun

    demo_check(args, args.nproc)
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # what torchrun would pick, without its warning banner
    torchrun(["--standalone", "--nproc-per-node", str(args.nproc), "-m", "ctx_plugin.demo",
              *without_option(rest, "--nproc")])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = OneLineParser(prog="ctx-plugin", description="ctx_plugin: context-parallel attention tools")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny model with context parallelism on local processes and check "
                                       "its loss against the single-process run (its options: ctx-plugin demo "
                                       "--help)")
    demo.add_argument("--nproc", type=positive_int, default=4, help="number of local processes (ranks), default 4")
    add_demo_arguments(demo)
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
    commands = {"demo": demo, "memory": memory, "plan": plan, "bench": bench, "launch": launch}
    args, rest = parser.parse_known_args(argv)
    own = commands[args.command]                           # errors read "ctx-plugin <command>: error: ..."
    if rest and args.command != "launch":
        own.error(f"unrecognized arguments: {' '.join(rest)}")
    tail = argv[argv.index(args.command) + 1:]             # the command's own arguments, as given
    try:
        if args.command == "launch":
            from .slurm.submit import launch as submit
            return submit(rest, dry_run=args.dry_run)
        if args.command == "demo":
            return _demo(args, tail)
        if args.command == "bench":
            bench_check(args, tail)
            return bench_run(args, tail)
        if args.command == "memory":
            return memory_report(args)
        return plan_report(args)
    except (ValueError, TypeError) as e:
        own.error(str(e))
    return 2


if __name__ == "__main__":
    sys.exit(main())
