"""The rank's own signal record in front of Megatron's --exit-signal-handler (ctx_plugin.megatron.stop_signal), on
megatron's own DistributedSignalHandler (megatron/training/dist_signal_handler.py of the installed megatron-core):
Megatron's flag, agreement and release work as without it, and the rank records each signal its handler takes.
The entry point's use of it under SLURM (both ranks of a two-node Megatron job) is in test_slurm.py."""
from __future__ import annotations

import atexit
import os
import signal

import pytest

pytest.importorskip("megatron.training.dist_signal_handler", reason="needs megatron-core: pip install "
                    "'ctx-plugin[megatron]'")

from megatron.training.dist_signal_handler import DistributedSignalHandler  # noqa: E402

from ctx_plugin.megatron.stop_signal import recording  # noqa: E402
from ctx_plugin.slurm.signals import OwnSignalRecord, summary  # noqa: E402


@pytest.fixture
def usr1():
    saved = signal.getsignal(signal.SIGUSR1)
    yield saved
    signal.signal(signal.SIGUSR1, saved)


def test_megatrons_handler_recorded_and_unchanged(tmp_path, usr1, monkeypatch):
    exits = []
    monkeypatch.setattr(atexit, "register", exits.append)
    record = OwnSignalRecord(env={"CTX_ATTEMPT_DIR": str(tmp_path), "RANK": "2", "SLURMD_NODENAME": "n1"},
                             step=lambda: 17)
    handler_class = recording(DistributedSignalHandler, record)
    handler = handler_class(signal.SIGUSR1).__enter__()       # as Megatron's set_global_variables does
    assert handler.signals_received() == [False] and exits == []
    os.kill(os.getpid(), signal.SIGUSR1)
    assert handler.signals_received() == [True]                # Megatron's own flag: it stops and saves
    assert exits == []                                          # its own signal came: nothing to wait for at exit
    line = (tmp_path / "signals" / "rank-2.txt").read_text()
    assert line.endswith(f" rank=2 pid={os.getpid()} host=n1 signal=SIGUSR1 step=17\n"), line
    assert summary(tmp_path) == "received: SIGUSR1 by ranks 2"
    assert handler.release() and signal.getsignal(signal.SIGUSR1) is usr1   # Megatron's release restores the earlier
    # another rank's signal stops this one (the all-gather says so): it waits for its own at exit
    other = recording(DistributedSignalHandler, OwnSignalRecord(env={"CTX_ATTEMPT_DIR": str(tmp_path), "RANK": "3"}))
    waiting = other(signal.SIGUSR1).__enter__()
    monkeypatch.setattr(DistributedSignalHandler, "signals_received", lambda self: [True, False])
    assert any(waiting.signals_received()) and len(exits) == 1
    waiting.release()


def test_outside_the_job_scripts_megatrons_handler_is_left_alone(usr1):
    handler = recording(DistributedSignalHandler, OwnSignalRecord(env={"RANK": "0"}))(signal.SIGUSR1).__enter__()
    installed = signal.getsignal(signal.SIGUSR1)
    assert installed.__qualname__ == "DistributedSignalHandler.__enter__.<locals>.handler"
    os.kill(os.getpid(), signal.SIGUSR1)
    assert handler._signal_received
    handler.release()


@pytest.fixture
def term():
    saved = signal.getsignal(signal.SIGTERM)
    yield saved
    signal.signal(signal.SIGTERM, saved)


def test_a_preempted_ranks_sigterm_stops_megatron_like_the_warning(tmp_path, usr1, term, monkeypatch):
    """Under the job scripts SIGTERM (preemption: SLURM's and torchrun's) sets Megatron's flag too, so the ranks save
    and stop instead of dying unsaved; it is recorded, and release() restores SIGTERM's handler. Outside the job
    scripts SIGTERM is left alone."""
    monkeypatch.setattr(atexit, "register", lambda f: None)
    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))       # what was there before
    before = signal.getsignal(signal.SIGTERM)
    record = OwnSignalRecord(env={"CTX_ATTEMPT_DIR": str(tmp_path), "RANK": "0", "SLURMD_NODENAME": "n1"},
                             step=lambda: 5)
    handler = recording(DistributedSignalHandler, record)(signal.SIGUSR1).__enter__()
    assert handler.signals_received() == [False]
    os.kill(os.getpid(), signal.SIGTERM)
    assert handler.signals_received() == [True] and seen == []          # Megatron's flag, not the old handler
    assert "signal=SIGTERM step=5" in (tmp_path / "signals" / "rank-0.txt").read_text()
    assert handler.release() and signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGUSR1) is usr1
    outside = recording(DistributedSignalHandler, OwnSignalRecord(env={"RANK": "0"}))(signal.SIGUSR1).__enter__()
    assert signal.getsignal(signal.SIGTERM) is before
    outside.release()
