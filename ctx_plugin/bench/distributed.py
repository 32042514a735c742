"""The real-process benchmark, run on every rank under torchrun (``ctx-plugin bench --distributed`` starts it).

For each backend the world is one context-parallel group of N = world size ranks. Per rank it measures
(medians over ``--reps``, each repetition started together behind a barrier):

- *real*: ``cp_attention`` with its communication (NCCL on GPUs, gloo on CPU);
- *compute*: the same rank's work with the communication taken out (the simulated-rank transport that moves
  nothing, :data:`ctx_plugin.bench.simulated.SILENT`);
- *comm*: the communication alone (the real groups, the rank-agreement check and the backend run with a local
  kernel that does nothing, :class:`NullKernel`).

The hidden share of the communication is ``(compute + comm − real) ÷ comm`` (clipped to [0, 1]): 1 when the
transfers cost nothing beyond the compute, 0 when they add fully. The table reports the slowest rank's real
time against the one-kernel ideal, as the simulated mode does. With the ranks' agreement check on (the default;
``--no-rank-check`` turns it off) it also reports that check's own time per call (*check µs*: building the
signature and its all-reduce on the CPU-side group, median of :data:`CHECK_REPS` calls, slowest rank).
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ..core import agreement
from ..core.api import _document_code
from ..core.attention import run_backend
from ..core.groups import build_cp_groups
from ..core.kernels import accum_dtype, select_kernel
from ..core.mask import Mask
from ..names import Kernel
from ..worker import leave
from .harness import Shape, attention_step, call_time, ideal_share, median_time
from .options import add_arguments, configs, distributed_device, settle, shape_from_args
from .planning import plan_ms
from .report import row, write_outputs
from .simulated import SILENT, simulated_groups


CHECK_REPS = 200


class NullKernel:
    """A local kernel that computes nothing (outputs of the right shape, uninitialised): times communication."""

    name = "none"

    def forward(self, q, k, v, *, causal, scale, window=(None, None), softcap=None):
        return torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=accum_dtype(q.dtype),
                                                 device=q.device)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, window=(None, None), softcap=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def comm_step(shape: Shape, config, groups, q, k, v, dout, backward: bool):
    """``cp_attention``'s communication without its compute: the ranks' agreement check and the backend with
    :class:`NullKernel` (forward, or forward and backward; the shape's documents as :func:`attention_step` passes
    them)."""
    kernel = NullKernel()
    docs = shape.documents_for(config, groups.size)
    mask = Mask(shape.causal, shape.mask["window"], documents=docs).within(shape.seq_len)

    def go():
        agreement.check(groups, agreement.attention_signature(
            q, k, v, groups=groups, causal=shape.causal, softmax_scale=None, kernel=kernel.name, error=None,
            window=mask.window, documents=_document_code(docs, given=docs is not None)))
        out = run_backend(q, k, v, config=config, groups=groups, kernel=kernel, mask=mask,
                          scale=shape.head_dim ** -0.5)
        if backward:
            out.backward(dout)
    return go


def _timed(shape: Shape, config, groups, tensors, backward: bool, reps: int, step=attention_step) -> float:
    together = dist.barrier if isinstance(groups.cp.group, dist.ProcessGroup) else None   # real ranks: together
    return median_time(step(shape, config, groups, *tensors, backward), shape.device, reps, before=together)


def _check_time(shape: Shape, groups, tensors) -> float:
    """Seconds of one rank-agreement check as ``cp_attention`` makes it (signature, encoding, all-reduce on the
    CPU-side group), median of :data:`CHECK_REPS` calls started together; 0 when the groups do not check."""
    if groups.check_group is None:
        return 0.0
    q, k, v, _ = tensors
    kernel = select_kernel(groups.config.kernel, q.device, q.dtype, q.shape[-1]).name

    def check():
        agreement.check(groups, agreement.attention_signature(q, k, v, groups=groups, causal=shape.causal,
                                                              softmax_scale=None, kernel=kernel, error=None))
    return median_time(check, torch.device("cpu"), CHECK_REPS, before=lambda: dist.barrier(group=groups.check_group))


def _gather(x: float, device: torch.device) -> list[float]:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.item() for o in out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctx-plugin bench --distributed")
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.distributed = True              # ctx-plugin bench --distributed checked these arguments before starting us
    settle(args)
    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    device = distributed_device(args, size, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = shape_from_args(args, device)
    args.ranks = [size]
    rows = []
    for pass_ in args.passes:
        backward = pass_ == "fwd+bwd"
        full, kernel = call_time(shape, Kernel(args.kernel), backward, args.reps, windowed=False) if rank == 0 \
            else (0.0, "")                                      # ideal_time's full-mask call, scaled per backend
        full = max(_gather(full, device))
        for label, config in configs(args, size):
            if isinstance(config, str):
                rows.append({"backend": label, "ranks": size, "pass": pass_, "skipped": config})
                continue
            tensors = shape.tensors(shape.seq_len // size, torch.Generator().manual_seed(rank), grad=backward)
            real_groups = build_cp_groups(config)
            silent = simulated_groups(config, rank, size, SILENT, device.type)
            real = _timed(shape, config, real_groups, tensors, backward, args.reps)
            comm = _timed(shape, config, real_groups, tensors, backward, args.reps, step=comm_step)
            compute = _timed(shape, config, silent, tensors, backward, args.reps)
            hidden = min(1.0, max(0.0, (compute + comm - real) / comm)) if comm > 0 else 1.0
            times, comms, hiddens = _gather(real, device), _gather(comm, device), _gather(hidden, device)
            extra = {}
            if real_groups.check_group is not None:
                extra["check_us"] = max(_gather(_check_time(shape, real_groups, tensors), device)) * 1e6
            if shape.documents is not None:   # each process its own ring rank's plans, the slowest reported
                mine = plan_ms(shape, config, size, ring_ranks=(real_groups.ring.rank,))
                extra["plan_ms"] = max(_gather(mine, device))
            unit = shape.document_unit(config, size)
            rows.append(row(shape, label, size, pass_, kernel, times, full * ideal_share(shape, unit), unit,
                            comm_ms=max(comms) * 1e3, hidden_comm=min(hiddens), **extra))
    if rank == 0:
        write_outputs(args, shape, rows, f"{size} processes, {dist.get_backend_config()}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())
