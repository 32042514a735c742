"""Each rank's own record of the stop signal Megatron handles (``--exit-signal-handler``), for the job scripts.

Megatron-LM stops on a signal through ``megatron.training.dist_signal_handler.DistributedSignalHandler``: its
``__enter__`` keeps the signal's current handler and installs its own, which only sets a flag (it calls no earlier
handler), and ``signals_received()`` all-gathers every rank's flag. ``set_global_variables`` (called by
``initialize_megatron``/``parse_and_validate_args``, in ``pretrain``) enters one for ``--exit-signal`` when
``--exit-signal-handler`` is given, and ``training.checkpoint_and_decide_exit`` asks it every iteration: once any
rank got the signal, all save (with ``--save``), leave the loop and ``sys.exit``. Data-loader workers enter one too
(``worker_init_fn``, in the worker processes). A handler installed before Megatron's would never run, so the entry
point swaps in :func:`recording` of the class: after each ``__enter__`` the rank's record handler
(:class:`ctx_plugin.slurm.signals.OwnSignalRecord`) is put in front of the handler Megatron has just installed and
calls it, and ``signals_received`` tells the record whether the ranks stop, so a rank stopped by another rank's
signal waits at exit for its own. Megatron's handling — its flag, the agreement, the save, ``release()`` restoring
the earlier handler — is unchanged. Outside the job scripts (no ``$CTX_ATTEMPT_DIR``) nothing is put in front.

Preemption. Megatron's handler takes one signal, the job's ``--exit-signal SIGUSR1`` (the time-limit warning), but a
preempted job's ranks get SIGTERM (SLURM's, and torchrun's), which would end them without saving. Under the job
scripts the rank's SIGTERM therefore sets the same flag (recorded too), so the ranks agree, save and stop within the
GraceTime as on the warning; ``release()`` restores SIGTERM's earlier handler as well.
"""
from __future__ import annotations

import signal

from ..slurm.signals import OwnSignalRecord


def recording(base: type, record: OwnSignalRecord) -> type:
    """A subclass of Megatron's ``DistributedSignalHandler`` (``base``) whose handlers ``record`` records."""

    class RecordedSignalHandler(base):
        """Megatron's DistributedSignalHandler, each signal it takes also recorded by the rank (ctx_plugin)."""

        def __enter__(self):
            entered = super().__enter__()
            record.chain(self.sig)
            self._ctx_term = None
            if self.sig != signal.SIGTERM and record.active():
                self._ctx_term = signal.getsignal(signal.SIGTERM)

                def on_term(signum, frame):
                    self._signal_received = True
                signal.signal(signal.SIGTERM, on_term)
                record.chain(signal.SIGTERM)
            return entered

        def release(self):
            released = super().release()
            if released and self._ctx_term is not None:
                signal.signal(signal.SIGTERM, self._ctx_term)
            return released

        def signals_received(self):
            received = super().signals_received()
            record.stopping(any(received))
            return received

    return RecordedSignalHandler
