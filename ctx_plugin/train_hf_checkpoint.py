"""The stop-and-resume checkpoints of :mod:`ctx_plugin.train_hf`: a resumed run continues exactly where the stopped
one left off, or refuses.

A checkpoint ``<dir>/step<n>`` is DeepSpeed's (``save_checkpoint``: model, optimizer, scheduler, the losses so far
and the run's layout in its client state) plus, from every rank, its RNG states (``rng-rank<r>.pt``: CPU and the
current CUDA device; DeepSpeed saves none, and dropout would draw other masks after a resume), written before
DeepSpeed's files. DeepSpeed's ``save_checkpoint`` ends with a barrier; after it, rank 0 writes ``complete.json``
(through a temporary file and a rename), so a checkpoint cut short by the job's end (SIGKILL during the save) is
never resumed: DeepSpeed's own ``latest`` is written by rank 0 before the other ranks have finished, and a
requeued attempt reading it would fail on every attempt. A resume takes the newest complete checkpoint (the ranks
must see the same one) and refuses another layout (world size, context-parallel size, micro batch, accumulation,
the data's sample count, sequence length, --pack-eos and micro batches per pass: its skip over the data would land
on other samples)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

COMPLETE = "complete.json"


def layout(engine, cp_size: int, **data) -> dict:
    """What decides which samples each step trains (the resumed run must have the same): the parallel layout and
    batch sizes, and ``data`` (the sample count, their length, the documents' end token, the loader's micro batches
    per pass, which ``"dataloader_drop_last"`` changes, a digest of the token ids: another ``--seed`` or file)."""
    return {"world": dist.get_world_size(), "context_parallel": cp_size,
            "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "accumulation": engine.gradient_accumulation_steps(), **data}


def _rng_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"rng-rank{rank}.pt"


def _rng_state() -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None}


def save(engine, directory: Path, losses: list[float], run_layout: dict) -> Path:
    """Saves the checkpoint after ``len(losses)`` steps (every rank calls it); returns its directory."""
    rank, tag = dist.get_rank(), f"step{len(losses)}"
    tag_dir = directory / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), _rng_file(tag_dir, rank))
    engine.save_checkpoint(str(directory), tag=tag, client_state={"losses": losses, "layout": run_layout})
    if rank == 0:                       # every rank's files are written (save_checkpoint's closing barrier)
        part = tag_dir / f".{COMPLETE}.part"
        part.write_text(json.dumps({"step": len(losses), "layout": run_layout}))
        os.replace(part, tag_dir / COMPLETE)
    return tag_dir


def _newest_complete(directory: Path) -> int:
    steps = [int(d.name[4:]) for d in directory.glob("step*") if d.name[4:].isdigit() and (d / COMPLETE).is_file()]
    return max(steps, default=-1)


def resume(engine, directory: Path, run_layout: dict, device: torch.device) -> list[float]:
    """The losses of the newest complete checkpoint in ``directory``, with the engine's and this rank's RNG states
    restored from it; ``[]`` (start afresh) when there is none. ``ValueError`` when the ranks see different ones or
    the checkpoint's layout is not this run's."""
    rank = dist.get_rank()
    newest = _newest_complete(directory) if directory.is_dir() else -1
    seen = torch.tensor([newest, -newest], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if int(seen[0]) != -int(seen[1]):
        raise ValueError(f"the ranks see different complete checkpoints in {directory} (newest: steps "
                         f"{-int(seen[1])} to {int(seen[0])}): --checkpoint-dir must be one shared directory")
    latest = directory / "latest"
    named = latest.read_text().strip() if latest.is_file() else None
    if newest < 0:
        cut = f" ({named} has no {COMPLETE}: its save was cut short)" if named else ""
        print(f"rank {rank}: no complete checkpoint in {directory}{cut}: starting afresh", flush=True)
        return []
    tag_dir = directory / f"step{newest}"
    saved = json.loads((tag_dir / COMPLETE).read_text())["layout"]
    if saved != run_layout:
        changed = ", ".join(f"{k} {saved.get(k)} -> {run_layout.get(k)}" for k in sorted(saved.keys() | run_layout)
                            if saved.get(k) != run_layout.get(k))
        raise ValueError(f"{tag_dir} was saved by a run of another layout ({changed}): the resumed run would train "
                         f"other samples at each step; resume with the layout it was saved with")
    if named is not None and named != tag_dir.name and rank == 0:
        print(f"rank 0: {directory}/latest names {named}, which has no {COMPLETE} (its save was cut short): "
              f"resuming from {tag_dir.name}", flush=True)
    path, state = engine.load_checkpoint(str(directory), tag=tag_dir.name)
    if path is None:
        raise ValueError(f"DeepSpeed could not load {tag_dir}, marked complete")
    rng = torch.load(_rng_file(tag_dir, rank), weights_only=False)
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    print(f"rank {rank}: resumed from {path} after step {newest - 1}", flush=True)
    return list(state["losses"])
