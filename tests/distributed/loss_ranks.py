"""Rank functions of test_loss_normalisation.py: ``ctx_plugin.deepspeed``'s losses on gloo ranks with a stand-in
engine (no DeepSpeed needed: the losses read only its device and accumulation steps)."""
from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB = 11


class Engine:
    """What the losses read of a DeepSpeed engine."""

    ctx_plugin_recompute = None
    device = torch.device("cpu")

    def __init__(self, accumulation: int) -> None:
        self.accumulation = accumulation

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation


def micro_batch(rank: int, index: int, ignored: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 logits ``[1, 6, VOCAB]`` and labels of ``rank``'s shard of micro batch ``index``, the first
    ``ignored`` labels -100."""
    g = torch.Generator().manual_seed(100 * rank + index)
    logits = torch.randn(1, 6, VOCAB, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, 6), generator=g)
    labels[0, :ignored] = -100
    return logits, labels


def _gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return parts


def gradients(rank: int, world: int, payload: dict) -> dict:
    """An independent check of the scaling: a float64 head ``W`` shared by the ranks, each rank's micro batches'
    hidden states ``x`` (labels as :func:`micro_batch`), each micro batch's loss backpropagated as DeepSpeed does
    (divided by the accumulation steps, then the gradients averaged over the ranks). Returns the relative error of
    that gradient against the gradient of the token mean over every rank's and micro batch's targets, computed
    directly on the gathered batches — with step_tokens, and without (the mean of the micro batches' means)."""
    from ctx_plugin.deepspeed import causal_lm_loss, step_tokens

    ignored = payload["ignored"][rank]
    engine = Engine(len(ignored))
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(5, VOCAB, generator=g, dtype=torch.float64)
    xs = [torch.randn(1, 6, 5, generator=torch.Generator().manual_seed(10 * rank + i), dtype=torch.float64)
          for i in range(len(ignored))]
    labels = [micro_batch(rank, i, n)[1] for i, n in enumerate(ignored)]
    every_x = torch.cat([torch.cat(_gather(x, world), 1) for x in xs], 1)
    every_label = torch.cat([torch.cat(_gather(t, world), 1) for t in labels], 1)
    reference = weight.clone().requires_grad_(True)
    torch.nn.functional.cross_entropy((every_x @ reference)[0], every_label[0], ignore_index=-100).backward()
    out = {}
    for mode in ("step", "micro"):
        w = weight.clone().requires_grad_(True)
        count = step_tokens(engine, [{"labels": t} for t in labels]) if mode == "step" else None
        for x, t in zip(xs, labels):
            loss, _ = causal_lm_loss(x @ w, t, engine, step_tokens=count)
            (loss / engine.gradient_accumulation_steps()).backward()
        grad = w.grad.clone()
        dist.all_reduce(grad)
        grad /= world
        out[mode] = ((grad - reference.grad).abs().max() / reference.grad.abs().max()).item()
    return out


def losses(rank: int, world: int, payload: dict) -> dict:
    """``payload["ignored"][rank]``: per micro batch, how many labels this rank ignores. The step's count, and per
    micro batch (loss to backpropagate, report) with step_tokens and without (None where the micro batch has no
    label on any rank), each rank's local cross-entropy sums, and what a refused call raised."""
    from ctx_plugin.deepspeed import causal_lm_loss, step_tokens

    engine = Engine(len(payload["ignored"][rank]))
    batches = [micro_batch(rank, i, n) for i, n in enumerate(payload["ignored"][rank])]
    count = step_tokens(engine, [{"labels": labels} for _, labels in batches])
    out = {"count": count, "step": [], "micro": [], "sums": []}
    for logits, labels in batches:
        out["sums"].append(torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100,
                                                             reduction="sum").item())
        loss, report = causal_lm_loss(logits, labels, engine, step_tokens=count)
        out["step"].append((loss.item(), report))
        try:
            loss, report = causal_lm_loss(logits, labels, engine)
            out["micro"].append((loss.item(), report))
        except ValueError as e:
            out["micro"].append(str(e))
    out["refused"] = {}
    for name, given in payload["refused"].items():
        logits, labels = batches[0]
        try:
            causal_lm_loss(logits, labels, engine, step_tokens=given[rank])
            out["refused"][name] = None
        except (TypeError, ValueError) as e:
            out["refused"][name] = f"{type(e).__name__}: {e}"
    try:
        step_tokens(engine, [{"labels": torch.full((1, 6), -100)}])
    except ValueError as e:
        out["refused"]["empty step"] = str(e)
    probe = torch.ones(1)
    dist.all_reduce(probe)                    # nothing left waiting after the refusals
    out["probe"] = probe.item()
    return out
