"""ctx_plugin's worker processes (demo, distributed benchmark, HF trainer) end through ``ctx_plugin.worker.leave``:
their exit code kept, what they printed flushed, no C++ static destructors run (gloo's threads outliving them
aborted finished ranks: SIGABRT, a failure to torchrun)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_leave_keeps_the_code_and_the_output():
    code = ("import atexit, sys\nfrom ctx_plugin.worker import leave\natexit.register(print, 'destructors ran')\n"
            "print('report', end='')\nsys.stderr.write('log')\nleave(3)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}     # stdout to a pipe: block-buffered
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "report", "log")


@pytest.mark.parametrize("module", ["ctx_plugin/demo.py", "ctx_plugin/bench/distributed.py", "ctx_plugin/train_hf.py"])
def test_worker_entry_points_leave_through_it(module):
    assert (ROOT / module).read_text().rstrip().endswith('if __name__ == "__main__":\n    leave(main())'), module
