"""The end of ctx_plugin's own torch.distributed worker processes (the demo, the distributed benchmark, the HF
trainer), started by torchrun one per rank."""
from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """Ends a rank's process with ``code`` once everything it writes is written (reports, checkpoints, logs):
    without C++ static destructors, which gloo's background threads sometimes outlive ("terminate called without an
    active exception": SIGABRT after a finished run, so torchrun reports the run as failed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
