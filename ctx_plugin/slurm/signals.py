"""Which ranks got the stop signal: a run record, written as it happens, in ``<attempt dir>/signals/``.

SLURM's time-limit warning reaches the batch script only; it passes ``SIGUSR1`` on to every rank
(``ctx_signal_node`` of ``launch/slurm_common.sh``: one task per node signals the children of that node's
torchrun, found below the pid its job script wrote). The ranks agree on the step to stop after, so a rank can stop
because another one was signalled before its own signal has come: only these records show that each rank got its
own.

- ``node-<i>.txt``, written by the job script on node ``i``, a line per rank it signalled:
  ``<time> node=<i> host=<node> pid=<pid> rank=<RANK> signal=USR1 sent`` (``gone``: the rank had exited), or
  ``<time> node=<i> host=<node> torchrun=<pid> signal=USR1 none`` when no rank was running there;
- ``rank-<r>.txt``, written by rank ``r``'s own handler, a line per signal handled: ``<time> rank=<r> pid=<pid>
  host=<node> signal=SIGUSR1 step=<step being trained>``; and ``... signal=none waited=<s>`` when it stopped on
  another rank's signal and none of its own came within :data:`OWN_SIGNAL_WAIT` seconds. The handler is
  :class:`StopRequest` where ctx_plugin stops the training (``ctx_plugin.train_hf`` installs it), and
  :class:`OwnSignalRecord` in front of a framework's own handler where the framework does (the Megatron entry point
  puts it in front of Megatron's ``--exit-signal-handler``: :mod:`ctx_plugin.megatron.stop_signal`).

:func:`summary` reads both into the one line the attempt's status gets (``signals=``).
"""
from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

OWN_SIGNAL_WAIT = 30.0
"""Seconds a rank stopped by another rank's signal waits, after saving, for its own (a recorded run only)."""


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


class RankRecord:
    """This rank's ``signals/rank-<RANK>.txt`` under the job scripts (``$CTX_ATTEMPT_DIR`` set); outside them
    ``path`` is None and nothing is written."""

    def __init__(self, env=os.environ) -> None:
        self.rank = env.get("RANK", "?")
        self.host = env.get("SLURMD_NODENAME") or socket.gethostname()
        attempt = env.get("CTX_ATTEMPT_DIR")
        self.path = Path(attempt) / "signals" / f"rank-{self.rank}.txt" if attempt else None

    def write(self, what: str) -> None:
        """One line appended with a single ``os.write`` (safe in a handler: no buffered stream to re-enter)."""
        if self.path is None:
            return
        line = f"{_now()} rank={self.rank} pid={os.getpid()} host={self.host} {what}\n"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as e:   # a record that cannot be written must not stop the save
            os.write(2, f"ctx_plugin: cannot write the signal record {self.path}: {e}\n".encode())

    def await_signal(self, came: Callable[[], bool], timeout: float) -> bool:
        """Waits at most ``timeout`` s until ``came()`` (this rank's own signal has come, its handler having run);
        False, recorded as ``signal=none``, when it did not. True at once outside the job scripts."""
        if came() or self.path is None:
            return True
        start = time.monotonic()
        while not came() and time.monotonic() - start < timeout:
            time.sleep(0.05)
        if not came():
            self.write(f"signal=none waited={time.monotonic() - start:.1f} (stopped on another rank's signal; none "
                       f"of its own came)")
            return False
        return True


class StopRequest:
    """Handlers of the stop signals (install it first thing, so a warning during start-up is kept): ``signal`` is
    the first one this rank got; ``agreed`` makes every rank stop after the same step.

    Under the job scripts (``$CTX_ATTEMPT_DIR`` set: they signal every rank) each handled signal is recorded in
    ``signals/rank-<RANK>.txt`` as it comes, with ``step`` (the step being trained, which the program sets), and
    :meth:`await_own` keeps a rank that stopped on another rank's signal until its own has come (bounded): its
    record then shows the delivery, and the signal does not meet it exiting, its handler gone."""

    def __init__(self, env=os.environ, signals=(signal.SIGUSR1, signal.SIGTERM)) -> None:
        self.signal: int | None = None
        self.step: int | None = None
        self._came = self._agreed = None              # monotonic times: its first signal, the agreed stop
        self._own_at_stop: int | None = None
        self._rank = RankRecord(env)
        self.record = self._rank.path
        for sig in signals:
            signal.signal(sig, self._set)

    def _set(self, signum, frame) -> None:
        if self.signal is None:
            self.signal, self._came = signum, time.monotonic()
        self._rank.write(f"signal={signal.Signals(signum).name} step={self.step}")

    def agreed(self, device) -> bool:
        """True on every rank once any rank has got a stop signal (a collective: every rank calls it each step)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if self.signal is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self._agreed is None:
            self._agreed, self._own_at_stop = time.monotonic(), self.signal
        return bool(flag.item())

    def await_own(self, timeout: float = OWN_SIGNAL_WAIT) -> bool:
        """Called once the ranks have agreed to stop (and saved): in a recorded run, waits at most ``timeout`` s for
        this rank's own signal; False when it never came (recorded as ``signal=none``)."""
        return self._rank.await_signal(lambda: self.signal is not None, timeout)

    def describe(self) -> str:
        """What stopped this rank, for its log (after :meth:`agreed`, and :meth:`await_own` if called)."""
        if self._own_at_stop is not None:
            return f"signal {self._own_at_stop}"
        if self.signal is not None:
            return (f"another rank's signal (its own, signal {self.signal}, came {self._came - self._agreed:.1f} s "
                    f"after the ranks agreed to stop)")
        if self.record is not None:
            return f"another rank's signal (none of its own came within {OWN_SIGNAL_WAIT:.0f} s)"
        return "another rank's signal"


class OwnSignalRecord:
    """This rank's record of the stop signals a framework's own handler takes, for programs whose framework stops
    the training itself (Megatron's ``--exit-signal-handler``): :meth:`chain`, called right after the framework has
    installed its handler for a signal, puts a handler in front of it that writes the record line (with
    ``step()``, the step being trained) and then calls the framework's, so the framework's handling is unchanged;
    :meth:`stopping`, called with what the ranks agreed (whether any of them got a signal), makes a rank that stops
    on another rank's signal wait at exit, after the framework has saved, for its own (at most
    :data:`OWN_SIGNAL_WAIT` s, as :meth:`StopRequest.await_own`).

    Only under the job scripts (``$CTX_ATTEMPT_DIR`` set) and only in the process that made it (the rank: a forked
    data-loader worker inherits the handler, and records nothing); otherwise nothing is installed or waited for."""

    def __init__(self, env=os.environ, step: Callable[[], object] = lambda: None) -> None:
        self.step = step
        self.came: list[int] = []                  # this rank's own signals, in order
        self._rank = RankRecord(env)
        self._pid = os.getpid()
        self._waits = False

    def active(self) -> bool:
        """Under the job scripts, in the process that made the record (the rank, not a forked worker)."""
        return self._rank.path is not None and os.getpid() == self._pid

    def chain(self, sig: int) -> None:
        """Records ``sig`` in front of the handler now installed for it; nothing when that is not a Python function
        (the default action or ignored: there is no framework handler to keep)."""
        handler = signal.getsignal(sig)
        if not self.active() or not callable(handler):
            return

        def record_then_handle(signum, frame):
            if os.getpid() == self._pid:
                self.came.append(signum)
                self._rank.write(f"signal={signal.Signals(signum).name} step={self.step()}")
            handler(signum, frame)

        signal.signal(sig, record_then_handle)

    def stopping(self, any_signal: bool) -> None:
        """The ranks' agreement: when some rank got a signal and this one has none of its own yet, it waits for its
        own when it exits (registered once, with ``atexit``)."""
        if any_signal and not self.came and not self._waits and self.active():
            self._waits = True
            atexit.register(self.await_own)

    def await_own(self, timeout: float = OWN_SIGNAL_WAIT) -> bool:
        """Waits at most ``timeout`` s for this rank's own signal; False when it never came (``signal=none``)."""
        return self._rank.await_signal(lambda: bool(self.came), timeout)


_NODE = re.compile(r"\bnode=(\S+) .*\bsignal=(\S+) (sent|gone|none)$")
_RANK = re.compile(r"\brank=(\S+) .*\bsignal=(\S+)")


def _ranks(ranks) -> str:
    return " ".join(sorted(ranks, key=lambda r: (not r.isdigit(), int(r) if r.isdigit() else 0, r)))


def _expected(attempt_dir: Path) -> int | None:
    job = attempt_dir / "job.txt"
    if job.is_file():
        for line in job.read_text().splitlines():
            if line.startswith("ranks=") and line[6:].isdigit():
                return int(line[6:])
    return None


def summary(attempt_dir: Path) -> str | None:
    """One line on the attempt's stop signals (None without records): to which ranks the job script sent which
    signal (of how many ranks ``job.txt`` says the job has), which signals the ranks' handlers recorded, and what
    went missing (ranks that had exited, nodes without ranks, ranks signalled whose handler recorded nothing, ranks
    whose own signal never came)."""
    where = attempt_dir / "signals"
    if not where.is_dir():
        return None
    sent: dict[str, set[str]] = defaultdict(set)
    gone, empty = set(), []
    for path in sorted(where.glob("node-*.txt")):
        for line in path.read_text(errors="replace").splitlines():
            if not (m := _NODE.search(line)):
                continue
            node, sig, result = m.groups()
            if result == "none":
                empty.append(node)
                continue
            rank = re.search(r"\brank=(\S+)", line).group(1)
            (sent[sig] if result == "sent" else gone).add(rank)
    got: dict[str, set[str]] = defaultdict(set)
    for path in sorted(where.glob("rank-*.txt")):
        for line in path.read_text(errors="replace").splitlines():
            if m := _RANK.search(line):
                got[m.group(2)].add(m.group(1))
    parts = []
    expected = _expected(attempt_dir)
    for sig, ranks in sorted(sent.items()):
        parts.append(f"sent SIG{sig} to ranks {_ranks(ranks)}"
                     + (f" ({len(ranks)} of {expected})" if expected is not None else ""))
    if gone:
        parts.append(f"ranks {_ranks(gone)} had exited")
    if empty:
        parts.append(f"no rank running on node {' '.join(sorted(set(empty), key=int))}")
    handled = [f"{sig} by ranks {_ranks(ranks)}" for sig, ranks in sorted(got.items()) if sig != "none"]
    if handled:
        parts.append("received: " + ", ".join(handled))
        unrecorded = set().union(*sent.values()) - set().union(*got.values())
        if unrecorded:   # signalled, and no line of its handler: it died of the signal, or keeps no record
            parts.append(f"no record from ranks {_ranks(unrecorded)}")
    elif sent:
        parts.append("no rank recorded receiving it (the program keeps no signal record; ctx_plugin.train_hf and "
                     "Megatron through ctx_plugin's entry point with --exit-signal-handler do)")
    if got.get("none"):
        parts.append(f"no signal of its own reached ranks {_ranks(got['none'])} within {OWN_SIGNAL_WAIT:.0f} s")
    return "; ".join(parts) or None
