"""Renders and checks one SLURM job of ``launch/megatron.sbatch`` or ``launch/deepspeed.sbatch``.

``python -m ctx_plugin.slurm.job FRAMEWORK [job options] -- <framework arguments>`` runs inside the batch script
(or outside SLURM with ``--dry-run``): it checks the job (:mod:`ctx_plugin.slurm.checks`), makes the run
directory and writes ``command.sh`` there — one ``srun`` task per node, each starting ``torchrun`` with a static
rendezvous on the job's first node — which the batch script then runs, recording the final status.

Each attempt of the job (a requeued job keeps its id; SLURM counts ``SLURM_RESTART_COUNT``) gets its own directory
``<run dir>/attempt-<n>`` with ``command.sh``, the logs, its status and the run records
(:mod:`ctx_plugin.slurm.records`). The ranks (torchrun's children, below the pid each node writes to ``pids/``) get
SLURM's time-limit warning as ``SIGUSR1`` (torchrun ignores it, and so does a program that installs no handler):
a program that handles it (``ctx_plugin.train_hf``, Megatron with ``--exit-signal-handler --exit-signal SIGUSR1``)
saves and stops. Which ranks were signalled, and which handled it, is recorded in the attempt's ``signals/``
(:mod:`ctx_plugin.slurm.signals`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..cliargs import option_value, parse_strict
from .checks import CHECKS, check_requeue
from .preflight import check_rendezvous, free_port
from .records import write_records

_PROGRAM_HELP = {"megatron": "pretrain_gpt.py's arguments (Megatron's flags and ctx_plugin's --cp-* flags)",
                 "deepspeed": "the training program and its arguments: train.py ... or -m module ... (the launcher "
                              "appends --deepspeed_config <--ds-config>)"}

# (first, count) of the default rendezvous ports: 20000-31999, with the preflight's 200 tries still below 32768
_PORTS = (20000, 12000)


def _port(text: str) -> int:
    """``--master-port``: a TCP port an unprivileged rank can listen on (argparse ``type=``)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1024 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port in 1024-65535")
    return port


def job_parser(framework: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"launch/{framework}.sbatch", exit_on_error=False, allow_abbrev=False,
                                usage=f"%(prog)s [job options] -- {_PROGRAM_HELP[framework]}")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes (default: the job's allocation; outside SLURM, for --dry-run: 1)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per node (default: the GPUs SLURM gives each node; required on CPU nodes)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: cuda when the node has GPUs, else CPU processes with gloo")
    p.add_argument("--master-port", type=_port, default=None,
                   help=f"rendezvous port, 1024-65535 (default {_PORTS[0]} + job id mod {_PORTS[1]}: below "
                        f"Linux's ephemeral ports, 32768-60999, which outgoing connections take)")
    p.add_argument("--run-dir", default=None, help="default: $CTX_RUNS_DIR (else <submit dir>/runs)/<framework>-<job id>")
    p.add_argument("--requeue", action="store_true",
                   help="on SLURM's time-limit warning, once the ranks have saved and stopped, requeue the job (same "
                        "id; the next attempt resumes); also CTX_REQUEUE=1 in the site file")
    p.add_argument("--dry-run", action="store_true", help="check the job and print what would run; run nothing")
    p.add_argument("--handoff-fd", type=int, default=None, help=argparse.SUPPRESS)
    if framework == "megatron":
        p.add_argument("--megatron-lm", help="the Megatron-LM checkout whose pretrain_gpt.py runs (required)")
    else:
        p.add_argument("--ds-config", help='the DeepSpeed config (with a "context_parallel" section; required)')
    return p


_REQUIRED = {"megatron": ("megatron_lm",), "deepspeed": ("ds_config",)}


@dataclass(frozen=True)
class Job:
    framework: str
    nodes: int
    nproc_per_node: int
    device: str
    threads: int
    port: int
    run_dir: Path
    program: list[str]
    summary: str
    dry_run: bool
    requeue: bool = False
    attempt: int = 1

    @property
    def attempt_dir(self) -> Path:
        """``<run dir>/attempt-<n>``: this attempt's command.sh, logs, status and records."""
        return self.run_dir / f"attempt-{self.attempt}"


def _gpus_on_node(env) -> int:
    if env.get("SLURM_GPUS_ON_NODE"):
        return int(env["SLURM_GPUS_ON_NODE"])
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0
    return 0


def _check_tasks(env, nodes: int, device: str) -> None:
    """The allocation's shape the job script relies on: one task per node (torchrun starts the node's ranks) holding
    all of the node's GPUs, the same number on every node (the batch node's count is every node's)."""
    per_node = env.get("SLURM_NTASKS_PER_NODE")
    if per_node and per_node != "1":
        raise ValueError(f"the job was submitted with --ntasks-per-node {per_node}: the job script runs one task per "
                         f"node, whose torchrun starts the node's ranks (--nproc-per-node); drop it from the sbatch "
                         f"line (GPUs: --gpus-per-node N)")
    if device != "cuda":
        return
    if env.get("SLURM_GPUS_PER_TASK"):
        raise ValueError(f"the job was submitted with --gpus-per-task {env['SLURM_GPUS_PER_TASK']}: the job script's "
                         f"one task per node would see only those GPUs; request them per node: --gpus-per-node N")
    if nodes > 1 and env.get("SLURM_GPUS") and not env.get("SLURM_GPUS_PER_NODE"):
        raise ValueError(f"the job was submitted with --gpus {env['SLURM_GPUS']} (for the whole job), which SLURM may "
                         f"spread unevenly over its {nodes} nodes while every node starts as many ranks as the first "
                         f"has GPUs; request them per node: --gpus-per-node N")


def _check_cores(env, nproc: int, device: str) -> None:
    cpus = env.get("SLURM_CPUS_ON_NODE")
    if device == "cuda" and cpus and cpus.isdigit() and int(cpus) < nproc:
        raise ValueError(f"the job has {cpus} CPU core(s) per node for {nproc} GPU processes (sbatch gave its one task "
                         f"per node the default cores): every rank, its data loader and its CUDA launches would share "
                         f"them; submit with --exclusive (whole nodes) or --cpus-per-task=<cores per node>")


def check_allocation(env, nodes: int, nproc: int, device: str) -> None:
    """The checks the job makes of its allocation (``SLURM_*`` in ``env``) when it starts; ``ctx-plugin launch``
    runs them on the allocation an sbatch line asks for."""
    _check_tasks(env, nodes, device)
    _check_cores(env, nproc, device)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def site_environment(launch_dir: Path, env=os.environ) -> dict[str, str]:
    """The environment the job script sees once it has read the site file: ``ctx_site`` of
    ``launch/slurm_common.sh`` (``$CTX_SITE``, else ``launch/site.sh``; ``CTX_PY``'s default), run by bash."""
    out = subprocess.run(["bash", "-c", 'set -euo pipefail; source "$CTX_LAUNCH_DIR/slurm_common.sh"; ctx_site; env -0'],
                         env={**env, "CTX_LAUNCH_DIR": str(launch_dir.resolve())}, capture_output=True, timeout=60)
    if out.returncode != 0:
        raise ValueError(out.stderr.decode(errors="replace").strip() or f"reading the site file failed "
                                                                       f"(exit code {out.returncode})")
    return dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item)


def run_dir(framework: str, given: str | None, env=os.environ) -> Path:
    """``--run-dir``, else ``$CTX_RUNS_DIR`` (default ``<submit dir>/runs``) / ``<framework>-<job id>``."""
    if given:
        return Path(given).expanduser().resolve()
    runs = Path(env.get("CTX_RUNS_DIR") or Path(env.get("SLURM_SUBMIT_DIR", ".")) / "runs")
    return (runs / f"{framework}-{env.get('SLURM_JOB_ID') or 'dryrun'}").expanduser().resolve()


def plan_job(framework: str, argv: list[str], env=os.environ) -> Job:
    """Parses and checks the job (``ValueError`` naming what to change); reads the allocation from ``env``."""
    if framework not in CHECKS:
        raise ValueError(f"unknown framework {framework!r}; one of {sorted(CHECKS)}")
    ours, rest = _split(argv)
    args = parse_strict(job_parser(framework), ours, required=_REQUIRED[framework],
                        what=f"launch/{framework}.sbatch (framework arguments go after --)")
    for flag, value in (("--nodes", args.nodes), ("--nproc-per-node", args.nproc_per_node)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    in_job = bool(env.get("SLURM_JOB_ID"))
    if not in_job and not args.dry_run:
        raise ValueError(f"launch/{framework}.sbatch runs inside a SLURM job: submit it with sbatch (or use "
                         f"ctx-plugin launch), or add --dry-run to see what would run")
    allocated = int(env["SLURM_JOB_NUM_NODES"]) if in_job else None
    nodes = args.nodes or allocated or 1
    if allocated is not None and nodes != allocated:
        raise ValueError(f"--nodes {nodes} but the job has {allocated} nodes (sbatch -N)")
    gpus = _gpus_on_node(env)
    device = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cuda" and in_job and not gpus:
        raise ValueError("--device cuda but the job's nodes have no GPU: request them (sbatch --gpus-per-node N)")
    nproc = args.nproc_per_node or (gpus if device == "cuda" else None)
    if not nproc or nproc < 1:
        raise ValueError("no GPU on the node: give --nproc-per-node N to run N CPU processes per node (gloo), or "
                         "request GPUs (sbatch --gpus-per-node N)")
    if device == "cuda" and gpus and nproc > gpus:
        raise ValueError(f"--nproc-per-node {nproc} is more than the {gpus} GPUs of each node")
    if in_job:
        check_allocation(env, nodes, nproc, device)
    extra = {"megatron_lm": args.megatron_lm} if framework == "megatron" else {"ds_config": args.ds_config}
    summary = CHECKS[framework](rest, world=nodes * nproc, device=device, **extra)
    if framework == "megatron":
        program = ["-m", "ctx_plugin.megatron.pretrain_gpt", "--megatron-lm",
                   str(Path(args.megatron_lm).expanduser().resolve()), *rest]
    else:
        script = rest if rest[0] == "-m" else [str(Path(rest[0]).expanduser().resolve()), *rest[1:]]
        program = [*script, "--deepspeed_config", str(Path(args.ds_config).expanduser().resolve())]
    job_id = env.get("SLURM_JOB_ID", "")
    requeue_env = env.get("CTX_REQUEUE", "")
    if requeue_env not in ("", "0", "1"):
        raise ValueError(f"CTX_REQUEUE={requeue_env!r} (site file): give 1 (requeue on the time-limit warning) or 0")
    requeue = args.requeue or requeue_env == "1"
    if requeue:
        check_requeue(framework, rest)
    restarts = env.get("SLURM_RESTART_COUNT") or "0"
    if not restarts.isdigit():
        raise ValueError(f"SLURM_RESTART_COUNT={restarts!r} is not a count")
    cpus = int(env.get("SLURM_CPUS_ON_NODE") or os.cpu_count() or 1)
    return Job(framework=framework, nodes=nodes, nproc_per_node=nproc, device=device,
               threads=max(1, cpus // nproc), port=args.master_port or _PORTS[0] + int(job_id or 0) % _PORTS[1],
               run_dir=run_dir(framework, args.run_dir, env), program=program, summary=summary, dry_run=args.dry_run,
               requeue=requeue, attempt=int(restarts) + 1)


def render(job: Job, env=os.environ) -> str:
    """The job's ``command.sh``: site file, environment defaults, then one ``srun`` task per node (the same text in
    a dry run: the rendezvous host is read from the allocation when it runs)."""
    py = env.get("CTX_PY") or sys.executable
    prefix = shlex.split(env.get("CTX_EXEC_PREFIX", ""))
    torchrun = [*prefix, py, "-m", "torch.distributed.run", f"--nnodes={job.nodes}",
                f"--nproc-per-node={job.nproc_per_node}"]
    # SLURM's time-limit warning reaches the ranks, torchrun's children, as SIGUSR1 (the batch script signals the
    # ranks below the pid written here on every node, also through a CTX_EXEC_PREFIX that forks): torchrun ignores
    # it, the ranks inherit the ignore and handle it if they can; their own subprocesses (compilers, data-loader
    # workers) are not signalled
    pid_file = shlex.quote(str(job.attempt_dir / "pids")) + '/node-"$SLURM_NODEID".pid'
    inner = (f"trap '' USR1; echo $$ > {pid_file}; exec " + shlex.join(torchrun) + ' --node-rank="$SLURM_NODEID" --master-addr="$CTX_MASTER_ADDR" '
             f"--master-port={job.port} " + shlex.join(job.program))
    # --export=ALL: the environment of this script (site file, defaults) even under sbatch --export=NONE, which srun
    # would otherwise inherit (SLURM_EXPORT_ENV) and start the tasks without PATH or the rendezvous variables
    srun = ["srun", "--export=ALL", f"--nodes={job.nodes}", f"--ntasks={job.nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1",
            f"--output={job.attempt_dir}/logs/node-%n-%N.log", *shlex.split(env.get("CTX_SRUN_ARGS", ""))]
    site = env.get("CTX_SITE")
    defaults = [("OMP_NUM_THREADS", str(job.threads), "CPU cores per process")]
    if job.device == "cuda" and job.framework == "megatron":
        defaults.append(("CUDA_DEVICE_MAX_CONNECTIONS", "1", "one GPU work queue: Megatron's TP/SP communication "
                                                             "overlaps GEMMs in the order it issues them"))
    if job.device == "cpu" and job.framework == "deepspeed":
        defaults.append(("DS_ACCELERATOR", "cpu", "DeepSpeed on CPU processes (gloo)"))
    lines = ["#!/usr/bin/env bash",
             f"# ctx_plugin {job.framework} job: {job.nodes} node(s) × {job.nproc_per_node} {job.device} processes",
             f"# {job.summary}",
             "# Runs inside the SLURM allocation (launch/*.sbatch runs it and records the status).",
             "set -euo pipefail",
             f"source {shlex.quote(site)}   # site settings (CTX_SITE)" if site else "# no site file (CTX_SITE)"]
    lines += [f"export {name}=${{{name}:-{value}}}   # default: {why}" for name, value, why in defaults]
    lines += ["export PYTHONUNBUFFERED=1",
              f"export CTX_RUN_DIR={shlex.quote(str(job.run_dir))}   # the programs' checkpoints go under it",
              f"export CTX_ATTEMPT={job.attempt}",
              f"export CTX_ATTEMPT_DIR={shlex.quote(str(job.attempt_dir))}   # the ranks record their stop signals "
              "in its signals/",
              # awk reads scontrol's whole output: `head -n 1` exits early, and under pipefail scontrol's SIGPIPE on
              # a long node list ended the script before srun (assigned apart from export, so a failure stops it)
              'CTX_MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk \'NR == 1\')   '
              "# rendezvous host: the job's first node (checked to resolve at start)",
              "export CTX_MASTER_ADDR",
              f"mkdir -p {shlex.quote(str(job.attempt_dir / 'logs'))} {shlex.quote(str(job.attempt_dir / 'pids'))}",
              "exec " + shlex.join(srun) + " \\\n    bash -c " + shlex.quote(inner), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in CHECKS:
        print(f"usage: python -m ctx_plugin.slurm.job {{{','.join(CHECKS)}}} [job options] -- ...", file=sys.stderr)
        return 2
    framework, argv = argv[0], argv[1:]
    handoff = option_value(argv, "--handoff-fd")
    try:
        job = plan_job(framework, argv)
    except (ValueError, TypeError) as e:
        return _failed_at_start(framework, argv, e)
    if job.dry_run:
        print(f"[dry run] {job.summary}\n[dry run] run directory: {job.run_dir}\n"
              f"[dry run] requeue on the time-limit warning: {'yes' if job.requeue else 'no'}\n"
              f"[dry run] command.sh:\n{render(job)}")
        return 0
    try:
        host = check_rendezvous(os.environ)
        port = free_port(job.port)
    except (ValueError, OSError) as e:
        return _failed_at_start(framework, argv, e)
    notes = [] if port == job.port else [f"port {job.port} is in use on {host}: the rendezvous uses {port}"]
    job = dataclasses.replace(job, port=port)
    text = render(job)
    (job.attempt_dir / "logs").mkdir(parents=True, exist_ok=True)
    (job.attempt_dir / "command.sh").write_text(text)
    write_records(job.attempt_dir, framework=framework, argv=argv, summary=job.summary, program=job.program,
                  ranks=job.nodes * job.nproc_per_node, env=os.environ)
    out = [f"ctx_plugin: {job.summary}", f"ctx_plugin: run directory {job.run_dir}, attempt {job.attempt}",
           *(f"ctx_plugin: {n}" for n in notes)]
    (job.attempt_dir / "batch.log").write_text("".join(line + "\n" for line in out))
    print("\n".join(out), flush=True)
    if handoff is not None:
        os.write(int(handoff), f"{job.run_dir}\n{job.attempt_dir}\n{int(job.requeue)}\n".encode())
    return 0


def _failed_at_start(framework: str, argv: list[str], e: Exception) -> int:
    """A job that cannot start still leaves its status (in the run directory and in its attempt's)."""
    print(f"ctx_plugin launch: {e}", file=sys.stderr)
    if os.environ.get("SLURM_JOB_ID") and "--dry-run" not in argv:
        where = run_dir(framework, option_value(argv, "--run-dir"))
        attempt = where / f"attempt-{int(os.environ.get('SLURM_RESTART_COUNT') or 0) + 1}"
        attempt.mkdir(parents=True, exist_ok=True)
        reason = " ".join(str(e).split())
        for path in (attempt / "status", where / "status"):
            path.write_text(f"failed\nreason={reason}\njob_id={os.environ['SLURM_JOB_ID']}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
