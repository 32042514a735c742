"""``ctx-plugin launch [--dry-run] sbatch <sbatch options> launch/<framework>.sbatch <job options> -- ...``

Checks a job script's ``sbatch`` line before submitting it: the allocation (nodes, GPUs per node, job or task,
tasks per node, cores per task) comes from the job script's ``#SBATCH`` lines and the sbatch options over them,
everything else from the job script's own options, and the same checks run that the job runs when it starts (:func:`ctx_plugin.slurm.job.plan_job`), with the site file read as the job reads it (so
``--dry-run`` prints the ``command.sh`` the job renders: the site's Python, run directory, container prefix). Then
it runs the line as given (or, with ``--dry-run``, prints it and that ``command.sh``).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..cliargs import option_value
from .checks import CHECKS
from .job import check_allocation, plan_job, render, site_environment

_OPTIONS = {"-N": "nodes", "--nodes": "nodes", "--gpus-per-node": "gpus_per_node", "--gres": "gres", "-G": "gpus",
            "--gpus": "gpus", "--gpus-per-task": "gpus_per_task", "--ntasks-per-node": "ntasks_per_node",
            "-c": "cpus_per_task", "--cpus-per-task": "cpus_per_task"}
"""The sbatch options that shape the allocation the job checks when it starts (long names also as ``--name=v``,
short ones also as ``-Nv``); every other option passes through unread."""


@dataclass(frozen=True)
class Allocation:
    """What an sbatch line (with its job script's ``#SBATCH`` lines) asks for, as far as the job's checks read it."""

    nodes: int = 1
    gpus_per_node: int | None = None
    gpus: int | None = None                   # --gpus / -G: for the whole job
    gpus_per_task: int | None = None
    ntasks_per_node: int | None = None
    cpus_per_task: int | None = None
    exclusive: bool = False

    @property
    def gpus_on_node(self) -> int:
        """GPUs one node would get (what SLURM_GPUS_ON_NODE says in the job)."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        if self.gpus_per_task is not None:
            return self.gpus_per_task * (self.ntasks_per_node or 1)
        return -(-self.gpus // self.nodes) if self.gpus else 0

    def environment(self) -> dict[str, str]:
        """The ``SLURM_*`` variables the job would find (those its checks read)."""
        env = {"SLURM_GPUS_ON_NODE": str(self.gpus_on_node)}
        for name, value in (("SLURM_GPUS_PER_NODE", self.gpus_per_node), ("SLURM_GPUS", self.gpus),
                            ("SLURM_GPUS_PER_TASK", self.gpus_per_task),
                            ("SLURM_NTASKS_PER_NODE", self.ntasks_per_node)):
            if value is not None:
                env[name] = str(value)
        if self.cpus_per_task is not None and not self.exclusive:     # --exclusive: the node's cores, unknown here
            env["SLURM_CPUS_ON_NODE"] = str(self.cpus_per_task)
        return env


def _count(option: str, value: str, typed: bool = False) -> int:
    """A count (``typed``: also ``type:count``, as the GPU options take it)."""
    count = value.rsplit(":", 1)[-1] if typed else value
    if not count.isdigit():
        if option in ("-N", "--nodes"):
            raise ValueError(f"sbatch --nodes {value}: give one node count (ranges cannot be checked against the "
                             f"parallel layout)")
        raise ValueError(f"cannot read a count from sbatch {option} {value!r}"
                         + (": use --gpus-per-node N" if typed else ""))
    return int(count)


def _read_options(tokens: list[str], found: dict) -> None:
    """The allocation options of ``tokens`` into ``found`` (later ones win, as sbatch takes them)."""
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--exclusive" or token.startswith("--exclusive="):
            found["exclusive"], i = True, i + 1
            continue
        name, inline = (token.split("=", 1) + [""])[:2] if token.startswith("--") else (token[:2], token[2:])
        field = _OPTIONS.get(name)
        if field is None:
            i += 1
            continue
        if inline:
            value, i = inline, i + 1
        elif i + 1 < len(tokens):
            value, i = tokens[i + 1], i + 2
        else:
            raise ValueError(f"sbatch {token} needs a value")
        if field == "gres":                                  # a list of resources: name[:type]:count,...
            value = next((r for r in value.split(",") if r.split(":")[0] == "gpu"), None)
            if value is not None:
                found["gpus_per_node"] = _count("--gres", value, typed=True)
        else:
            found[field] = _count(name, value, typed=field.startswith("gpus"))


def _directives(script: Path) -> list[str]:
    """The options of the job script's ``#SBATCH`` lines (sbatch reads them up to the first command)."""
    tokens = []
    for line in script.read_text().splitlines():
        line = line.strip()
        if line.startswith("#SBATCH"):
            tokens += shlex.split(line[len("#SBATCH"):], comments=True)
        elif line and not line.startswith("#"):
            break
    return tokens


def parse_sbatch_line(line: list[str]) -> tuple[Allocation, Path, str, list[str]]:
    """(the allocation asked for, job script, framework, job script arguments) of ``sbatch ...``: the script's
    ``#SBATCH`` lines first, the command line's options over them (ValueError when the line cannot be checked)."""
    if not line or Path(line[0]).name != "sbatch":
        raise ValueError("give the sbatch command line after 'launch': ctx-plugin launch sbatch -N 2 ... "
                         "launch/megatron.sbatch ...")
    script_at = next((i for i, t in enumerate(line) if t.endswith(".sbatch")), None)
    if script_at is None:
        raise ValueError("no job script in the sbatch line: give launch/megatron.sbatch or launch/deepspeed.sbatch "
                         "(or a copy whose name ends in .sbatch)")
    script = Path(line[script_at])
    if not script.is_file():
        raise ValueError(f"job script {script}: no such file")
    found = re.search(r"^ctx_job (\w+) ", script.read_text(), re.M)
    if found is None or found.group(1) not in CHECKS:
        raise ValueError(f"{script} is not a ctx_plugin job script (it has no 'ctx_job <framework>' line)")
    options: dict = {}
    _read_options(_directives(script), options)
    _read_options(line[1:script_at], options)
    return Allocation(**options), script, found.group(1), line[script_at + 1:]


def launch(line: list[str], *, dry_run: bool) -> int:
    allocation, script, framework, args = parse_sbatch_line(line)
    nodes = allocation.nodes
    outside = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}   # as a fresh job starts
    env = {**site_environment(script.parent, outside), **allocation.environment()}
    job_args, rest = (args[:args.index("--")], args[args.index("--"):]) if "--" in args else (args, [])
    if "--dry-run" not in job_args:
        job_args = [*job_args, "--dry-run"]       # check the job as it would start, without being inside SLURM
    if option_value(job_args, "--nodes") is None:
        job_args = [*job_args, "--nodes", str(nodes)]
    job = plan_job(framework, [*job_args, *rest], env=env)
    if job.nodes != nodes:
        raise ValueError(f"the job script's --nodes {job.nodes} disagrees with sbatch's {nodes}")
    check_allocation(env, job.nodes, job.nproc_per_node, job.device)     # as the job checks it when it starts
    print(f"ctx-plugin launch: {job.summary} ({job.nproc_per_node} {job.device} processes per node)")
    if dry_run:
        print(f"ctx-plugin launch: would run: {shlex.join(line)}\n"
              f"ctx-plugin launch: requeue on the time-limit warning: {'yes' if job.requeue else 'no'}\n"
              f"command.sh the job would write (the run directory's attempt-1/command.sh):\n{render(job, env)}")
        return 0
    return subprocess.run(line).returncode
