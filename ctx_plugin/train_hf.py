"""``python -m ctx_plugin.train_hf --deepspeed_config ds.json --model config.json [...]`` (under torchrun)

Trains a Hugging Face causal LM with DeepSpeed and the config's ``"context_parallel"`` section: the program
``launch/deepspeed.sbatch`` runs unless given another. The model is built from a ``config.json`` (random
weights, seeded) or loaded with ``--pretrained``; the data is a ``.npy`` array of token ids, ``[samples,
seq_len]`` (or 1-D, a whole number of ``seq_len`` windows), or, without ``--data``, seeded synthetic sequences a
model can learn only by attending across the whole context. The loss of a step is the token mean over all its
micro batches (gradient accumulation) and data-parallel replicas, as in Hugging Face's Trainer. Rank 0 prints the
loss of every optimizer step and writes a JSON report.

Stop and resume: on ``SIGUSR1`` (SLURM's time-limit warning, which ``launch/deepspeed.sbatch`` passes to every
rank) or ``SIGTERM``, every rank finishes its optimizer step, the ranks agree on the step to stop after, save a
checkpoint (:mod:`ctx_plugin.train_hf_checkpoint`: DeepSpeed's ``save_checkpoint`` with the losses so far, each
rank's RNG states, a completion marker) under ``--checkpoint-dir`` and exit 0. ``--resume`` continues from the
newest complete checkpoint there (the same losses as an uninterrupted run, dropout included: the data is not
shuffled, the next micro-batch is the one after the last trained; another layout is refused), or starts afresh when
there is none, so a requeued job can pass it on every attempt. Under the job scripts each rank records
the signals its handler got in the attempt's ``signals/rank-<r>.txt``, and a rank stopped on another rank's signal
waits (after saving, at most 30 s) for its own (:class:`ctx_plugin.slurm.signals.StopRequest`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from .cliargs import output_file, parse_strict, random_seed
from .slurm.signals import StopRequest
from .worker import leave


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ctx_plugin.train_hf", description=__doc__.split("\n\n")[1],
                                exit_on_error=False)
    p.add_argument("--deepspeed_config", default=None, help="DeepSpeed config with a context_parallel section "
                                                           "(the launcher passes its --ds-config)")
    p.add_argument("--model", help="a model's config.json, or a directory holding one (required)")
    p.add_argument("--pretrained", action="store_true", help="load the weights saved in the --model directory")
    p.add_argument("--data", default=None, help=".npy token ids [samples, seq_len] or 1-D; default: synthetic")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (synthetic data; checked for --data)")
    p.add_argument("--samples", type=int, default=None, help="synthetic samples (default 64; not with --data)")
    p.add_argument("--pack-eos", type=int, default=None, metavar="ID",
                   help="packed documents: each sample holds documents that end after every token ID (Megatron's "
                        "--reset-attention-mask / --reset-position-ids reading); attention stays inside each, positions "
                        "restart, labels stop at each end. Needs train_micro_batch_size_per_gpu 1, and "
                        '"pad_documents": true in the section unless every document fits the layout')
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--seed", type=random_seed, default=1234)
    p.add_argument("--report", default=None, type=output_file,
                   help="rank 0 writes its losses and throughput here (JSON)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where a stop (SIGUSR1/SIGTERM) saves and --resume loads; default, under the job scripts: "
                        "<run dir>/checkpoints ($CTX_RUN_DIR, set by launch/deepspeed.sbatch's command.sh)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir, or start afresh if there is none")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The program's arguments, checked (``ValueError`` for bad input, also when called by the launcher)."""
    args = parse_strict(build_parser(), argv, required=("model",), what="ctx_plugin.train_hf")
    model = Path(args.model).expanduser()
    if not (model / "config.json").is_file() and not (model.is_file() and model.suffix == ".json"):
        raise ValueError(f"--model {args.model}: neither a config.json nor a directory holding one")
    if args.pretrained and not model.is_dir():
        raise ValueError("--pretrained loads weights from a directory: give --model the saved model's directory")
    if args.data is not None and not Path(args.data).expanduser().is_file():
        raise ValueError(f"--data {args.data}: no such file")
    if args.data is not None and args.samples is not None:
        raise ValueError(f"--samples {args.samples} sets the number of synthetic samples; with --data every sample of "
                         f"the file is used: drop --samples (or trim the file)")
    args.samples = 64 if args.samples is None else args.samples
    for name in ("seq_len", "samples", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.pack_eos is not None and args.pack_eos < 0:
        raise ValueError(f"--pack-eos must be a token id (>= 0), got {args.pack_eos}")
    return args


def checkpoint_dir(args: argparse.Namespace, env=os.environ) -> Path | None:
    """``--checkpoint-dir``, else ``$CTX_RUN_DIR/checkpoints`` (a job of launch/deepspeed.sbatch), else None;
    ``--resume`` without either is a ``ValueError``."""
    if args.checkpoint_dir:
        return Path(args.checkpoint_dir).expanduser().resolve()
    if env.get("CTX_RUN_DIR"):
        return Path(env["CTX_RUN_DIR"]) / "checkpoints"
    if args.resume:
        raise ValueError("--resume needs --checkpoint-dir DIR (under launch/deepspeed.sbatch: the run directory's "
                         "checkpoints/)")
    return None


def _model_config(args: argparse.Namespace):
    from transformers import AutoConfig

    model = Path(args.model).expanduser()
    return AutoConfig.from_pretrained(model) if model.is_dir() else \
        AutoConfig.for_model(**json.loads(model.read_text()))


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if args.pretrained:
        return AutoModelForCausalLM.from_pretrained(Path(args.model).expanduser())
    config = _model_config(args)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config)


def check_job(args: argparse.Namespace, cp_config, size: int) -> None:
    """What the job would refuse once started, checked without training (``ctx-plugin launch`` calls it with the
    DeepSpeed config's "context_parallel" section): the model, built from ``--model``'s config on the meta device
    (no weights, no memory), as :func:`ctx_plugin.hf.enable` checks it, and ``--seq-len`` against the layout's
    sequence unit (:func:`ctx_plugin.core.rules.check_seq_len`, as sharding the batches checks it). ``ValueError``."""
    from transformers import AutoModelForCausalLM

    from .core.rules import SettingNames, check_seq_len
    from .hf import check_model

    try:
        config = _model_config(args)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, TypeError, ValueError, KeyError) as e:
        raise ValueError(f"--model {args.model}: transformers cannot build a causal LM from it ({e})") from None
    check_model(model, cp_config, size)
    check_pack_eos(args, config.vocab_size)
    if args.data is not None:
        token_file(args, config.vocab_size)
    check_seq_len(cp_config, args.seq_len, size, SettingNames(seq_len="--seq-len", cp='"context_parallel.size"'))


def token_file(args: argparse.Namespace, vocab: int):
    """``--data``'s token ids, memory-mapped, as ``[samples, seq_len]``; ``ValueError`` unless they are integers
    in ``[0, vocab)`` (a float would be truncated, an id outside the embedding fails late on every rank) in a whole
    number of ``--seq-len`` windows."""
    import numpy as np

    try:
        array = np.load(Path(args.data).expanduser(), mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"--data {args.data}: not a .npy array of token ids ({e})") from None
    if not isinstance(array, np.ndarray):
        raise ValueError(f"--data {args.data}: a .npy file holding one array of token ids, got {type(array).__name__}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"--data {args.data}: token ids must be integers, got {array.dtype}")
    if array.ndim == 1:
        if array.size % args.seq_len:
            raise ValueError(f"--data {args.data}: {array.size} tokens are not a whole number of --seq-len "
                             f"{args.seq_len} windows (nothing is dropped silently)")
        array = array.reshape(-1, args.seq_len)
    if array.ndim != 2 or array.shape[1] != args.seq_len:
        raise ValueError(f"--data {args.data}: shape {tuple(array.shape)}, expected [samples, {args.seq_len}]")
    low, high = (int(array.min()), int(array.max())) if array.size else (0, 0)
    if low < 0 or high >= vocab:
        raise ValueError(f"--data {args.data}: token ids must lie in [0, {vocab}) (the model's vocab_size), found "
                         f"{low if low < 0 else high}")
    return array


def check_pack_eos(args: argparse.Namespace, vocab: int) -> None:
    if args.pack_eos is not None and args.pack_eos >= vocab:
        raise ValueError(f"--pack-eos {args.pack_eos} is no token of the model's vocabulary (vocab_size {vocab})")


def load_data(args: argparse.Namespace, vocab: int) -> list[dict]:
    """The training samples (``--data``'s, else seeded synthetic ones over ``vocab`` token ids)."""
    check_pack_eos(args, vocab)
    if args.data is None:
        from .demo import sample_batch

        tokens = sample_batch(torch.Generator().manual_seed(args.seed), args.samples, args.seq_len - 1, vocab)
    else:
        tokens = torch.from_numpy(token_file(args, vocab).astype("int64"))
    if args.pack_eos is None:
        return [{"input_ids": t, "labels": t.clone()} for t in tokens]
    return [{"input_ids": t, "labels": t.clone(), "position_ids": eos_positions(t, args.pack_eos)} for t in tokens]


def data_digest(samples: list[dict]) -> str:
    """A digest of the samples' token ids: a resumed run must train the data it was saved with."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(sample["input_ids"].numpy().tobytes())
    return digest.hexdigest()[:16]


def eos_positions(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """Position ids of a packed sample whose documents end after every ``eos`` token: 0, 1, ... restarting after each
    (the loader reads the documents from them, :func:`ctx_plugin.packing.documents_from_positions`)."""
    n = tokens.numel()
    index = torch.arange(n)
    starts = torch.zeros(n, dtype=torch.int64)
    starts[1:] = torch.where(tokens[:-1] == eos, index[1:], 0)
    return index - torch.cummax(starts, 0).values


def check_replicas(samples: int, replicas: int) -> None:
    """The samples split evenly over the data-parallel replicas (``DistributedSampler`` would otherwise repeat the
    first ones in every pass, and shift every later step's samples)."""
    if samples % replicas:
        raise ValueError(f"{samples} samples do not split evenly over {replicas} data-parallel replicas: the sampler "
                         f"would repeat the first {replicas - samples % replicas} in every pass; give a multiple of "
                         f"{replicas} samples")


def micro_batches(loader, skip: int):
    """The loader's micro-batches over and over (it does not shuffle), the first ``skip`` left out (a resume)."""
    skip %= len(loader)
    while True:
        for i, batch in enumerate(loader):
            if i >= skip:
                yield batch
        skip = 0


def train_step(engine, step: list[dict]) -> float:
    """One optimizer step of ``engine`` (``ctx_plugin.deepspeed.initialize``'s) over the micro batches ``step``
    (gradient accumulation), each micro batch's loss its share of the whole step's token mean (``step_tokens``);
    returns the step's loss. ``engine.step()`` follows every micro batch (DeepSpeed's managed accumulation updates at
    the boundary), or only the last with ``"managed_gradient_accumulation": false``, where each call is a boundary."""
    from . import deepspeed as cpds

    managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()   # DeepSpeed < 0.19: always
    count = cpds.step_tokens(engine, step)          # the loss is the token mean over the whole step
    loss_sum = 0.0
    for i, batch in enumerate(step):
        loss, report = cpds.lm_loss(engine, batch, step_tokens=count)   # +tile_loss: head and loss tiled
        engine.backward(loss)
        if managed or i == len(step) - 1:
            engine.step()
        loss_sum += report
    return loss_sum


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        build_parser().print_help()
        return 0
    stop = StopRequest()
    try:
        args = parse_args(argv)
        ckpt = checkpoint_dir(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.deepspeed_config is None:
        raise SystemExit("--deepspeed_config is required (launch/deepspeed.sbatch passes its --ds-config)")
    import torch.distributed as dist

    from . import deepspeed as cpds
    from . import train_hf_checkpoint as checkpoints

    model = load_model(args)
    try:
        data = load_data(args, model.config.vocab_size)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    engine, _, loader, _ = cpds.initialize(model=model, model_parameters=model.parameters(), training_data=data,
                                           config=args.deepspeed_config)
    try:
        check_replicas(len(data), dist.get_world_size() // engine.ctx_plugin_groups.size)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if len(loader) == 0:
        raise SystemExit(f"{len(data)} samples make no micro-batch of {engine.train_micro_batch_size_per_gpu()} per "
                         f"data-parallel replica: give more samples")
    if args.pack_eos is not None and engine.train_micro_batch_size_per_gpu() != 1:
        raise SystemExit(f"--pack-eos packs each sample's own documents: set train_micro_batch_size_per_gpu to 1 (got "
                         f"{engine.train_micro_batch_size_per_gpu()}) and raise gradient_accumulation_steps instead")
    rank, accumulation = dist.get_rank(), engine.gradient_accumulation_steps()
    # every rank built the same weights from --seed; from here each draws its own random numbers, so the ranks
    # sharing a sequence do not repeat each other's dropout masks on their shards (a resume restores these streams)
    torch.manual_seed(args.seed + 1 + rank)
    run_layout = checkpoints.layout(engine, engine.ctx_plugin_groups.size, samples=len(data), seq_len=args.seq_len,
                                    pack_eos=args.pack_eos, micro_batches=len(loader), data=data_digest(data))
    losses = []
    if args.resume:
        try:
            losses = checkpoints.resume(engine, ckpt, run_layout, engine.device)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    tokens, start = 0, time.perf_counter()
    batches = micro_batches(loader, len(losses) * accumulation)
    while len(losses) < args.steps:
        stop.step = len(losses)
        step = [{k: v.to(engine.device) if isinstance(v, torch.Tensor) else v for k, v in next(batches).items()}
                for _ in range(accumulation)]
        losses.append(train_step(engine, step))
        tokens += sum(batch["input_ids"].numel() for batch in step)
        if rank == 0:
            print(f"step {len(losses) - 1:>5}  loss {losses[-1]:.6f}", flush=True)
        if len(losses) < args.steps and stop.agreed(engine.device):
            if ckpt is None:
                saved = "no --checkpoint-dir, nothing saved"
            else:
                saved = f"saved {checkpoints.save(engine, ckpt, losses, run_layout)}"
            stop.await_own()
            print(f"rank {rank}: stopped by {stop.describe()} after step {len(losses) - 1}; {saved}", flush=True)
            break
    elapsed = time.perf_counter() - start
    total = torch.tensor([float(tokens)], device=engine.device)
    dist.all_reduce(total)
    if rank == 0:
        per_s = total.item() / elapsed
        print(f"done: {len(losses)} of {args.steps} steps, {per_s:,.0f} tokens/s over {dist.get_world_size()} "
              f"ranks", flush=True)
        if args.report:
            Path(args.report).write_text(json.dumps({"losses": losses, "tokens_per_s": per_s,
                                                     "world_size": dist.get_world_size()}, indent=2))
    engine.destroy()
    return 0


if __name__ == "__main__":
    leave(main())
