"""What a run directory keeps to reproduce and diagnose a job: records written when an attempt starts, and the
first failure found in its logs when it fails.

In ``<run dir>/attempt-<n>/`` (besides ``command.sh``, ``logs/``, ``status`` and ``batch.log``):

- ``job.txt``: job id, attempt, host, the number of ranks, the job script's arguments, the program, the checked
  layout;
- ``nodes.txt``: the job's nodes, one a line (the first is the rendezvous host);
- ``versions.txt``: Python, torch, ctx_plugin and the frameworks installed (deepspeed, megatron-core,
  transformers); ``git.txt``: the commit (and uncommitted changes, if any) of ctx_plugin's checkout and of the
  Megatron-LM checkout, where they are git work trees;
- ``ds_config.json`` (DeepSpeed jobs) and ``site.sh``: copies of the DeepSpeed config and of the site file;
- ``failure`` (failed attempts): which node and rank failed first, its exit code and the last lines of its log;
- ``signals/`` (attempts stopped by a signal): which ranks the job script signalled, on which node, and which
  ranks' handlers recorded their signal (:mod:`ctx_plugin.slurm.signals`).

``python -m ctx_plugin.slurm.records failure ATTEMPT_DIR`` writes ``failure`` (the batch script calls it) and
prints its first line; ``... signals ATTEMPT_DIR`` prints the summary of ``signals/`` the status gets.
"""
from __future__ import annotations

import importlib.metadata
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..cliargs import option_value
from . import signals

DISTRIBUTIONS = ("torch", "ctx_plugin", "deepspeed", "megatron-core", "transformers")
TAIL = 20
"""Lines of the failed node's log kept in ``failure``."""


def node_list(env) -> list[str]:
    """The job's nodes (``scontrol show hostnames $SLURM_JOB_NODELIST``), first the rendezvous host."""
    nodelist = env.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise ValueError(f"scontrol show hostnames {nodelist} failed: {out.stderr.strip()}")
    return out.stdout.split()


def versions() -> str:
    lines = [f"python {sys.version.split()[0]}"]
    for name in DISTRIBUTIONS:
        try:
            lines.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{name} not installed")
    return "\n".join(lines) + "\n"


def git_state(path: Path) -> str | None:
    """``<commit>`` (``+ uncommitted changes`` when dirty) of the git work tree holding ``path``, else None."""
    if shutil.which("git") is None:
        return None
    head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=60).stdout.strip()
    return head.stdout.strip() + (" + uncommitted changes" if dirty else "")


def write_records(attempt_dir: Path, *, framework: str, argv: list[str], summary: str, program: list[str],
                  ranks: int, env) -> None:
    """Writes the attempt's records (see the module docstring) into ``attempt_dir``."""
    attempt_dir.mkdir(parents=True, exist_ok=True)
    nodes = node_list(env)
    (attempt_dir / "nodes.txt").write_text("".join(n + "\n" for n in nodes))
    (attempt_dir / "job.txt").write_text(
        f"job_id={env.get('SLURM_JOB_ID', '')}\nattempt={int(env.get('SLURM_RESTART_COUNT') or 0) + 1}\n"
        f"started={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\nbatch_host={socket.gethostname()}\n"
        f"submit_dir={env.get('SLURM_SUBMIT_DIR', '')}\nnodes={','.join(nodes)}\nranks={ranks}\n"
        f"job_script=launch/{framework}.sbatch {shlex.join(argv)}\nprogram={shlex.join(program)}\n"
        f"layout={summary}\n")
    (attempt_dir / "versions.txt").write_text(versions())
    checkouts = {"ctx_plugin": Path(__file__).resolve().parents[1]}
    if framework == "megatron" and option_value(argv, "--megatron-lm"):
        checkouts["Megatron-LM"] = Path(option_value(argv, "--megatron-lm")).expanduser()
    (attempt_dir / "git.txt").write_text("".join(f"{name} {git_state(path) or 'not a git checkout'} ({path})\n"
                                                 for name, path in checkouts.items()))
    if framework == "deepspeed" and option_value(argv, "--ds-config"):
        shutil.copyfile(Path(option_value(argv, "--ds-config")).expanduser(), attempt_dir / "ds_config.json")
    if env.get("CTX_SITE"):
        shutil.copyfile(env["CTX_SITE"], attempt_dir / "site.sh")


_FIELD = re.compile(r"^\s*(time|host|rank|exitcode)\s*:\s*(.*?)\s*$")
_NODE_LOG = re.compile(r"^node-(\d+)-(.*)\.log$")
_TORCHRUN_LINE = re.compile(r"^[WEI]\d{4} .*torch/distributed/elastic/")   # torchrun's own report begins


def _root_cause(lines: list[str]) -> dict[str, str] | None:
    """torchrun's "Root Cause (first observed failure)" block of one node's log."""
    for i, line in enumerate(lines):
        if line.startswith("Root Cause (first observed failure)"):
            found = {}
            for field in lines[i + 1:i + 9]:
                if m := _FIELD.match(field):
                    found[m.group(1)] = m.group(2)
            return found
    return None


def first_failure(attempt_dir: Path) -> dict[str, str] | None:
    """The failure observed first over the nodes' logs: node index and name (SLURM's, from the attempt's
    ``nodes.txt``; else the host name in the log's name), rank, exit code, time, and the last lines of that node's
    log before torchrun's own report; None when no log names a failure."""
    found = []
    listed = attempt_dir / "nodes.txt"          # SLURM's node names, by node index (srun's %N is the host's name)
    names = listed.read_text().split() if listed.is_file() else []
    for log in sorted((attempt_dir / "logs").glob("node-*.log")):
        m = _NODE_LOG.match(log.name)
        if m is None:
            continue
        lines = log.read_text(errors="replace").splitlines()
        cause = _root_cause(lines)
        if cause is None:
            continue
        end = next((i for i, line in enumerate(lines) if _TORCHRUN_LINE.match(line)), len(lines))
        index = int(m.group(1))
        found.append({"node": m.group(1), "host": names[index] if index < len(names) else m.group(2), "rank": cause.get("rank", "?").split()[0],
                      "exit_code": cause.get("exitcode", "?").split()[0], "time": cause.get("time", ""),
                      "log": str(log), "tail": "\n".join(lines[max(0, end - TAIL):end])})
    if not found:
        return None
    return min(found, key=lambda f: (f["time"], int(f["node"])))


def write_failure(attempt_dir: Path) -> str:
    """Writes ``attempt_dir/failure``; returns its first line."""
    f = first_failure(attempt_dir)
    if f is None:
        head = "no rank's failure found in the logs (the job step failed before or outside torchrun)"
        (attempt_dir / "failure").write_text(head + "\n")
        return head
    head = f"first failure: node {f['node']} ({f['host']}) rank {f['rank']} exit code {f['exit_code']} at {f['time']}"
    (attempt_dir / "failure").write_text(f"{head}\nlog={f['log']}\nlast lines:\n{f['tail']}\n")
    return head


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("failure", "signals"):
        print("usage: python -m ctx_plugin.slurm.records {failure,signals} ATTEMPT_DIR", file=sys.stderr)
        return 2
    if argv[0] == "failure":
        print(write_failure(Path(argv[1])))
    else:
        print(signals.summary(Path(argv[1])) or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
