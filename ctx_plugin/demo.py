"""The quick-start job: a tiny causal language model trained with context parallelism.

Run on every rank under torchrun (``ctx-plugin demo`` starts torchrun for you). Each rank holds 1/P of every
sequence: token ids, pre-shifted labels and RoPE positions are sharded with the backend's layout, attention
runs through :func:`ctx_plugin.cp_attention`, the loss is each rank's token sum over the global token count,
and gradients are summed over the context-parallel group. Every rank also trains the same model on the full
sequence alone (a size-1 group) and the job checks that both runs have the same loss at every step.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

import ctx_plugin
from ctx_plugin import recompute
from ctx_plugin.cliargs import nonnegative_float, output_file, positive_float, positive_int, random_seed, tokens
from ctx_plugin.core.documents import Documents
from ctx_plugin.core.kernels import kernel_unavailable
from ctx_plugin.core.rules import SettingNames, check_split, padding_units
from ctx_plugin.models import DecoderConfig, DecoderLM
from ctx_plugin.names import Backend, Kernel, Recompute
from ctx_plugin.packing import shift_labels
from ctx_plugin.recompute.presets import RecomputeConfig, regions
from ctx_plugin.worker import leave


def sample_batch(generator: torch.Generator, batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Sequences ``start + i·stride (mod vocab)`` with a random start and stride per sequence: predicting the
    next token needs the stride, which only attention over earlier tokens (on other ranks too) can find."""
    start = torch.randint(vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 8, (batch, 1), generator=generator)
    return (start + stride * torch.arange(seq_len + 1)) % vocab


def document_unit(cp_config, world: int) -> int:
    """Every packed document's length is a multiple of this: the layout's document unit over ``world`` ranks and the
    one-process reference's (its zigzag over one rank: 2)."""
    return math.lcm(padding_units(cp_config, world)[0], 2)


def packed_documents(generator: torch.Generator, count: int, seq_len: int, unit: int) -> Documents:
    """``count`` documents of seeded random lengths, each a multiple of ``unit``, filling ``seq_len`` tokens."""
    cuts = torch.randperm(seq_len // unit - 1, generator=generator)[:count - 1].add(1).sort().values * unit
    return Documents((0, *cuts.tolist(), seq_len))


def train(model, cp_config, groups, steps: int, batch: int, seq_len: int, vocab: int, lr: float, seed: int, *,
          recompute: RecomputeConfig | None = None, documents: int = 0, document_unit: int = 1):
    """Trains on seeded synthetic sequences; returns (global mean loss per step, tokens per second). With
    ``recompute.tile_loss`` (``+tile_loss[:<tokens>]``) the head and loss run over chunks of tokens. ``documents``
    > 0: every step packs that many documents (random lengths, multiples of ``document_unit``) into each sequence:
    attention inside each, positions restarting, no target across a document's end."""
    tile = recompute is not None and recompute.tile_loss
    loss_tokens = recompute.loss_tokens if tile else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    device = next(model.parameters()).device
    data = torch.Generator().manual_seed(seed)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        tokens = sample_batch(data, batch, seq_len, vocab)
        docs = packed_documents(data, documents, seq_len, document_unit) if documents else None
        shard = lambda t: ctx_plugin.shard_sequence(t, config=cp_config, groups=groups, dim=1,  # noqa: E731
                                                    documents=docs)
        positions = ctx_plugin.sequence_positions(seq_len, config=cp_config, groups=groups, device=device,
                                                  documents=docs)
        targets = tokens[:, 1:] if docs is None else shift_labels(tokens[:, :-1], docs)   # pre-shifted
        inputs, labels = shard(tokens[:, :-1]).to(device), shard(targets).to(device)
        loss = model.loss(inputs, positions, labels, tile=tile, loss_tokens=loss_tokens, documents=docs) \
            / (targets != -100).sum().item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        report = loss.detach().clone()
        if groups.size > 1:   # each rank's loss is a partial sum: gradients and the reported loss add up
            for p in model.parameters():
                dist.all_reduce(p.grad, group=groups.group)
            dist.all_reduce(report, group=groups.group)
        opt.step()
        losses.append(report.item())
    if device.type == "cuda":   # once, after training: the throughput must include all queued GPU work
        torch.cuda.synchronize(device)
    return losses, steps * batch * seq_len / (time.perf_counter() - start)


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # process peak RSS (Linux: KiB)


MODEL = DecoderConfig(vocab=128, hidden=64, heads=4, kv_heads=2, ffn=256, layers=2)
DTYPE = torch.float32
"""The demo trains in float32 (its --rtol default is float32's)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options (``ctx-plugin demo`` parses and checks them before it starts any process)."""
    p.add_argument("--backend", default=Backend.ZIGZAG.value, choices=[b.value for b in Backend])
    p.add_argument("--ulysses-size", type=positive_int, default=1, help="Ulysses group size for --backend ulysses_ring")
    p.add_argument("--kernel", default=Kernel.AUTO.value, choices=[k.value for k in Kernel])
    p.add_argument("--recompute", default="none", help="recompute preset for the context-parallel run (e.g. "
                                                         "selective, full, sqrt, full+tile_loss; see "
                                                         "ctx_plugin.recompute)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: CUDA when every rank can have its own GPU, else CPU with gloo")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--seq-len", type=tokens, default=256)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--seed", type=random_seed, default=0)
    p.add_argument("--documents", type=positive_int, default=None, metavar="N",
                   help="pack N documents of random lengths into every sequence (attention inside each document)")
    p.add_argument("--rtol", type=nonnegative_float, default=1e-5, help="allowed relative loss difference (fp32)")
    p.add_argument("--json", type=output_file, default=None, help="write the report of rank 0 to this file")


def check(args: argparse.Namespace, world: int) -> None:
    """``ValueError`` naming the fix for options that cannot run on ``world`` ranks (before any process starts)."""
    cp_config = ctx_plugin.CPConfig(backend=args.backend, kernel=args.kernel, ulysses_size=args.ulysses_size)
    check_split(cp_config, world, seq_len=args.seq_len, heads=MODEL.heads, kv_heads=MODEL.kv_heads,
                names=SettingNames(seq_len="--seq-len", cp="--nproc", ulysses_size="--ulysses-size"))
    if args.documents is not None:
        unit = document_unit(cp_config, world)
        most = args.seq_len // unit
        if args.seq_len % unit:
            raise ValueError(f"--documents: --seq-len {args.seq_len} must be a multiple of {unit}, the document unit of "
                             f"{args.backend} over --nproc {world} and of the one-process reference")
        if args.documents > most:
            raise ValueError(f"--documents {args.documents}: a --seq-len {args.seq_len} sequence holds at most {most} "
                             f"documents of a multiple of {unit} tokens ({args.backend} over --nproc {world} splits "
                             f"every document); give fewer documents or a longer --seq-len")
    preset = RecomputeConfig.parse(args.recompute)
    if preset.preset == Recompute.BUDGET:
        raise ValueError("--recompute budget:<GiB> is for real models (ctx_plugin.recompute.resolve picks a preset "
                         "from the memory model); give a preset such as selective or full")
    try:
        regions(preset.for_layers, MODEL.layers)
    except ValueError as e:
        raise ValueError(f"--recompute {args.recompute}: {e} (the demo's model has {MODEL.layers} layers)") from None
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no GPU is visible; use --device cpu or auto")
    device = rank_device(args, world)
    why = kernel_unavailable(Kernel(args.kernel), device, DTYPE, MODEL.head_dim)
    if why is not None:
        raise ValueError(f"--kernel {args.kernel} cannot run on the demo's {device.type} ranks ({DTYPE}): {why}")


def rank_device(args: argparse.Namespace, world: int, rank: int = 0) -> torch.device:
    """Rank ``rank``'s device: CUDA for --device cuda, or auto when every one of the ``world`` ranks has a GPU."""
    gpus = torch.cuda.device_count()
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpus >= world)
    return torch.device("cuda", rank % gpus) if use_cuda and gpus else torch.device("cpu")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group()            # torchrun's env:// rendezvous; gloo for CPU, plus nccl when CUDA exists
    rank, world = dist.get_rank(), dist.get_world_size()
    check(args, world)                   # ctx-plugin demo checked it before starting the ranks; torchrun -m did not
    device = rank_device(args, world, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cp_config = ctx_plugin.CPConfig(backend=args.backend, kernel=args.kernel, ulysses_size=args.ulysses_size)
    cp_groups = ctx_plugin.build_cp_groups(cp_config)                  # every rank shares one sequence
    alone, _ = dist.new_subgroups(group_size=1)                         # a group of one for the reference run
    ref_config = ctx_plugin.CPConfig(kernel=args.kernel)                # on one rank every backend is plain attention
    ref_groups = ctx_plugin.build_cp_groups(ref_config, group=alone)
    model_cfg = MODEL
    preset = RecomputeConfig.parse(args.recompute)
    runs = {}
    for name, config, groups in (("reference", ref_config, ref_groups), ("context_parallel", cp_config, cp_groups)):
        torch.manual_seed(args.seed)
        model = DecoderLM(model_cfg, config, groups).to(device, DTYPE)
        if name == "context_parallel":      # the layers' part of the preset; the loss applies +tile_loss
            recompute.apply(model.blocks, preset.for_layers, final_norm=model.norm)
        runs[name] = train(model, config, groups, args.steps, args.batch, args.seq_len, model_cfg.vocab, args.lr,
                           args.seed, recompute=preset if name == "context_parallel" else None,
                           documents=args.documents or 0, document_unit=document_unit(cp_config, world))
    (ref_losses, _), (cp_losses, tokens_per_s) = runs["reference"], runs["context_parallel"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(cp_losses, ref_losses))
    memory = torch.tensor([_peak_memory_mib(device)], device=device)
    all_memory = [torch.zeros_like(memory) for _ in range(world)]
    dist.all_gather(all_memory, memory)
    ok = worst <= args.rtol
    if rank == 0:
        hybrid = f" (ulysses_size={cp_config.ulysses_size})" if cp_config.backend == Backend.ULYSSES_RING else ""
        print(f"ctx_plugin demo: {model_cfg.layers}-layer GQA model, backend={cp_config.backend}{hybrid}, "
              f"recompute={args.recompute}, " + (f"{args.documents} packed documents per sequence, "
                                                 if args.documents else "") +
              f"{world} {device.type} ranks, {args.seq_len} tokens per sequence ({args.seq_len // world} per rank)")
        print(f"{'step':>4}  {'loss (CP)':>12}  {'loss (1 process)':>16}  {'rel. diff':>9}")
        for i, (a, b) in enumerate(zip(cp_losses, ref_losses)):
            print(f"{i:>4}  {a:>12.6f}  {b:>16.6f}  {abs(a - b) / abs(b):>9.1e}")
        print(f"throughput: {tokens_per_s:,.0f} tokens/s over {world} ranks; peak memory per rank (MiB): "
              + ", ".join(f"{m.item():.0f}" for m in all_memory))
        verdict = "PASS: loss matches the single-process run within" if ok else \
            "FAIL: loss differs from the single-process run by more than"
        print(f"{verdict} {args.rtol:g} (worst relative difference {worst:.1e})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ok": ok, "worst_rel_diff": worst, "cp_losses": cp_losses, "ref_losses": ref_losses,
                           "tokens_per_s": tokens_per_s, "world_size": world, "device": device.type,
                           "peak_memory_mib": [m.item() for m in all_memory], "args": vars(args),
                           "model": asdict(model_cfg)}, f, indent=2)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    leave(main())
