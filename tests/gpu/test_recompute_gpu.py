"""Recompute regions on CUDA with dropout: the recomputation in backward draws the dropout masks of the forward, so
the gradients equal those without recompute, also for layers called with ``hidden_states=`` only (Megatron's
TransformerBlock), whose checkpoint must still save and restore the CUDA RNG (torch saves the device RNG state of
its positional tensor arguments' devices only).

Skipped without CUDA. ``python -m pytest -q tests/gpu/test_recompute_gpu.py`` (seconds)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ctx_plugin import recompute

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class DropoutLayer(nn.Module):
    def __init__(self, width: int, keyword: bool) -> None:
        super().__init__()
        self.keyword = keyword
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, *args, **kwargs):
        h = kwargs["hidden_states"] if self.keyword else args[0]
        return h + self.drop(self.down(self.drop(torch.relu(self.up(h)))))


def _grads(preset, keyword: bool):
    torch.manual_seed(0)
    layers = nn.ModuleList(DropoutLayer(64, keyword) for _ in range(4)).cuda().double()
    if preset is not None:
        recompute.apply(layers, preset)
    torch.manual_seed(1)
    x = torch.randn(2, 32, 64, device="cuda", dtype=torch.float64, requires_grad=True)
    h = x
    for layer in layers:
        h = layer(hidden_states=h) if keyword else layer(h)
    h.pow(2).sum().backward()
    return [x.grad, *(p.grad for p in layers.parameters())]


@pytest.mark.parametrize("preset", ["full", "full:uniform:2", "sqrt", "selective", "full+offload:1"])
@pytest.mark.parametrize("keyword", [True, False], ids=["hidden_states=", "positional"])
def test_dropout_masks_are_replayed_on_cuda(preset, keyword):
    want = _grads(None, keyword)
    got = _grads(preset, keyword)
    for g, w in zip(got, want):
        assert torch.equal(g, w), f"{preset}: gradients differ from no recompute (dropout masks not replayed)"
