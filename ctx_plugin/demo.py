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
import resource
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ctx_plugin
from ctx_plugin.names import Backend, Kernel


@dataclass(frozen=True)
class TinyModelConfig:
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, S, H, D]`` at the given global ``positions`` ``[S]``."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs                   # [S, D/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, c: TinyModelConfig) -> None:
        super().__init__()
        self.c, self.head_dim = c, c.hidden // c.heads
        self.norm1, self.norm2 = nn.LayerNorm(c.hidden), nn.LayerNorm(c.hidden)
        self.qkv = nn.Linear(c.hidden, (c.heads + 2 * c.kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(c.hidden, c.hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(c.hidden, 4 * c.hidden), nn.GELU(), nn.Linear(4 * c.hidden, c.hidden))

    def forward(self, x, positions, cp_config, groups):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.c.heads * self.head_dim, self.c.kv_heads * self.head_dim, self.c.kv_heads * self.head_dim], -1)
        q = rope(q.view(b, s, self.c.heads, self.head_dim), positions)
        k = rope(k.view(b, s, self.c.kv_heads, self.head_dim), positions)
        v = v.view(b, s, self.c.kv_heads, self.head_dim)
        attn = ctx_plugin.cp_attention(q, k, v, config=cp_config, groups=groups, causal=True)
        x = x + self.proj(attn.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, c: TinyModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens, positions, cp_config, groups):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, cp_config, groups)
        return self.head(self.norm(x))


def sample_batch(generator: torch.Generator, batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Sequences ``start + i·stride (mod vocab)`` with a random start and stride per sequence: predicting the
    next token needs the stride, which only attention over earlier tokens (on other ranks too) can find."""
    start = torch.randint(vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 8, (batch, 1), generator=generator)
    return (start + stride * torch.arange(seq_len + 1)) % vocab


def train(model, cp_config, groups, steps: int, batch: int, seq_len: int, vocab: int, lr: float, seed: int):
    """Trains on seeded synthetic sequences; returns (global mean loss per step, tokens per second)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    device = next(model.parameters()).device
    data = torch.Generator().manual_seed(seed)
    shard = lambda t: ctx_plugin.shard_sequence(t, config=cp_config, groups=groups, dim=1)  # noqa: E731
    positions = ctx_plugin.sequence_positions(seq_len, config=cp_config, groups=groups, device=device)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        tokens = sample_batch(data, batch, seq_len, vocab)
        inputs, labels = shard(tokens[:, :-1]).to(device), shard(tokens[:, 1:]).to(device)  # labels pre-shifted
        logits = model(inputs, positions, cp_config, groups)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / (batch * seq_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        report = loss.detach().clone()
        if groups.size > 1:   # each rank's loss is a partial sum: gradients and the reported loss add up
            for p in model.parameters():
                dist.all_reduce(p.grad, group=groups.group)
            dist.all_reduce(report, group=groups.group)
        opt.step()
        losses.append(report.item())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return losses, steps * batch * seq_len / (time.perf_counter() - start)


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # process peak RSS (Linux: KiB)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default=Backend.ZIGZAG.value, choices=[b.value for b in Backend])
    p.add_argument("--ulysses-size", type=int, default=1, help="Ulysses group size for --backend ulysses_ring")
    p.add_argument("--kernel", default=Kernel.AUTO.value, choices=[k.value for k in Kernel])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: CUDA when every rank can have its own GPU, else CPU with gloo")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=1e-5, help="allowed relative loss difference (fp32)")
    p.add_argument("--json", default=None, help="write the report of rank 0 to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group()            # torchrun's env:// rendezvous; gloo for CPU, plus nccl when CUDA exists
    rank, world = dist.get_rank(), dist.get_world_size()
    gpus = torch.cuda.device_count()
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpus >= world)
    if use_cuda and gpus == 0:
        raise SystemExit("--device cuda was asked for but no GPU is visible")
    device = torch.device("cuda", rank % gpus) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    cp_config = ctx_plugin.CPConfig(backend=args.backend, kernel=args.kernel, ulysses_size=args.ulysses_size)
    cp_groups = ctx_plugin.build_cp_groups(cp_config)                  # every rank shares one sequence
    alone, _ = dist.new_subgroups(group_size=1)                         # a group of one for the reference run
    ref_config = ctx_plugin.CPConfig(kernel=args.kernel)                # on one rank every backend is plain attention
    ref_groups = ctx_plugin.build_cp_groups(ref_config, group=alone)
    model_cfg = TinyModelConfig()
    runs = {}
    for name, config, groups in (("reference", ref_config, ref_groups), ("context_parallel", cp_config, cp_groups)):
        torch.manual_seed(args.seed)
        model = TinyLM(model_cfg).to(device)
        runs[name] = train(model, config, groups, args.steps, args.batch, args.seq_len, model_cfg.vocab, args.lr,
                           args.seed)
    (ref_losses, _), (cp_losses, tokens_per_s) = runs["reference"], runs["context_parallel"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(cp_losses, ref_losses))
    memory = torch.tensor([_peak_memory_mib(device)], device=device)
    all_memory = [torch.zeros_like(memory) for _ in range(world)]
    dist.all_gather(all_memory, memory)
    ok = worst <= args.rtol
    if rank == 0:
        hybrid = f" (ulysses_size={cp_config.ulysses_size})" if cp_config.backend == Backend.ULYSSES_RING else ""
        print(f"ctx_plugin demo: {model_cfg.layers}-layer GQA model, backend={cp_config.backend}{hybrid}, "
              f"{world} {device.type} ranks, {args.seq_len} tokens per sequence ({args.seq_len // world} per rank)")
        print(f"{'step':>4}  {'loss (CP)':>12}  {'loss (1 process)':>16}  {'rel. diff':>9}")
        for i, (a, b) in enumerate(zip(cp_losses, ref_losses)):
            print(f"{i:>4}  {a:>12.6f}  {b:>16.6f}  {abs(a - b) / abs(b):>9.1e}")
        print(f"throughput: {tokens_per_s:,.0f} tokens/s over {world} ranks; peak memory per rank (MiB): "
              + ", ".join(f"{m.item():.0f}" for m in all_memory))
        print(("PASS" if ok else "FAIL") + f": loss matches the single-process run within {args.rtol:g} "
              f"(worst relative difference {worst:.1e})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ok": ok, "worst_rel_diff": worst, "cp_losses": cp_losses, "ref_losses": ref_losses,
                           "tokens_per_s": tokens_per_s, "world_size": world, "device": device.type,
                           "peak_memory_mib": [m.item() for m in all_memory], "args": vars(args),
                           "model": asdict(model_cfg)}, f, indent=2)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
