"""``ctx-plugin launch [--dry-run] sbatch <sbatch options> launch/<framework>.sbatch <job options> -- ...``

Checks a job script's ``sbatch`` line before submitting it: the node count and GPUs per node come from the
sbatch options, everything else from the job script's own options, and the same checks run that the job runs
when it starts (:func:`ctx_plugin.slurm.job.plan_job`), with the site file read as the job reads it (so
``--dry-run`` prints the ``command.sh`` the job renders: the site's Python, run directory, container prefix). Then
it runs the line as given (or, with ``--dry-run``, prints it and that ``command.sh``).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from ..cliargs import option_value
from .checks import CHECKS
from .job import plan_job, render, site_environment

_NODES = re.compile(r"^(?:-N|--nodes=?)(.*)$")
_GPUS = re.compile(r"^--(gpus-per-node|gres)=?(.*)$")


def _value(tokens: list[str], i: int, inline: str) -> tuple[str, int]:
    """An option's value, given inline (``-N2``, ``--nodes=2``) or as the next token; and the next index."""
    if inline:
        return inline, i + 1
    if i + 1 >= len(tokens):
        raise ValueError(f"sbatch {tokens[i]} needs a value")
    return tokens[i + 1], i + 2


def parse_sbatch_line(line: list[str]) -> tuple[int, int, Path, str, list[str]]:
    """(nodes, GPUs per node, job script, framework, job script arguments) of ``sbatch ...`` (ValueError when
    the line cannot be checked)."""
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
    nodes, gpus, opts, i = 1, 0, line[1:script_at], 0
    while i < len(opts):
        if (m := _NODES.match(opts[i])) and opts[i] not in ("--nodelist", "--nodefile"):
            value, i = _value(opts, i, m.group(1))
            if not value.isdigit():
                raise ValueError(f"sbatch --nodes {value}: give one node count (ranges cannot be checked against "
                                 f"the parallel layout)")
            nodes = int(value)
        elif m := _GPUS.match(opts[i]):
            value, i = _value(opts, i, m.group(2))
            if m.group(1) == "gres":                        # a list of resources: name[:type]:count,...
                value = next((r for r in value.split(",") if r.split(":")[0] == "gpu"), None)
                if value is None:
                    continue
            count = value.rsplit(":", 1)[-1]
            if not count.isdigit():
                raise ValueError(f"cannot read a GPU count per node from {value!r}: use --gpus-per-node N")
            gpus = int(count)
        else:
            i += 1
    return nodes, gpus, script, found.group(1), line[script_at + 1:]


def launch(line: list[str], *, dry_run: bool) -> int:
    nodes, gpus, script, framework, args = parse_sbatch_line(line)
    outside = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}   # as a fresh job starts
    env = {**site_environment(script.parent, outside), "SLURM_GPUS_ON_NODE": str(gpus)}
    job_args, rest = (args[:args.index("--")], args[args.index("--"):]) if "--" in args else (args, [])
    if "--dry-run" not in job_args:
        job_args = [*job_args, "--dry-run"]       # check the job as it would start, without being inside SLURM
    if option_value(job_args, "--nodes") is None:
        job_args = [*job_args, "--nodes", str(nodes)]
    job = plan_job(framework, [*job_args, *rest], env=env)
    if job.nodes != nodes:
        raise ValueError(f"the job script's --nodes {job.nodes} disagrees with sbatch's {nodes}")
    print(f"ctx-plugin launch: {job.summary} ({job.nproc_per_node} {job.device} processes per node)")
    if dry_run:
        print(f"ctx-plugin launch: would run: {shlex.join(line)}\n"
              f"ctx-plugin launch: requeue on the time-limit warning: {'yes' if job.requeue else 'no'}\n"
              f"command.sh the job would write (the run directory's attempt-1/command.sh):\n{render(job, env)}")
        return 0
    return subprocess.run(line).returncode
