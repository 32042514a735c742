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
