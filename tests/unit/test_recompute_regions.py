"""What the layers of a recompute region are called with: the checkpoint gets the hidden states positionally also
from layers called with ``hidden_states=`` only (Megatron's TransformerBlock), so torch saves and restores the
device RNG of their device (dropout masks in the recomputation; the CUDA side: ``tests/gpu/test_recompute_gpu.py``);
a multi-layer region refuses a later layer called with other arguments than its first (it would run them with the
first one's), and accepts equal ones (the same objects, or equal tensors made anew)."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from ctx_plugin import recompute

apply_module = importlib.import_module("ctx_plugin.recompute.apply")    # the package's `apply` is the function
checkpointing_module = importlib.import_module("ctx_plugin.recompute.checkpointing")


class Layer(nn.Module):
    """A residual MLP layer scaled by a per-call ``gain`` tensor, taking its input only as ``hidden_states=``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        for p in self.parameters():
            nn.init.normal_(p, std=0.3)

    def forward(self, *, hidden_states, gain):
        return hidden_states + self.down(torch.tanh(self.up(hidden_states))) * gain


def _stack(preset):
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer(6) for _ in range(4)).double()
    if preset is not None:
        recompute.apply(layers, preset)
    return layers


def _grads(preset, gains):
    layers = _stack(preset)
    x = torch.randn(2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    h = x
    for layer, gain in zip(layers, gains()):
        h = layer(hidden_states=h, gain=gain)
    (h * torch.linspace(-1, 1, 6, dtype=torch.float64)).sum().backward()
    return [x.grad, *(p.grad for p in layers.parameters())]


def test_keyword_hidden_states_reach_the_checkpoint_positionally(monkeypatch):
    seen = []
    original = checkpointing_module.checkpoint

    def spy(fn, *args, **kwargs):
        seen.append(args)
        return original(fn, *args, **kwargs)
    monkeypatch.setattr(checkpointing_module, "checkpoint", spy)
    same = torch.tensor(0.7, dtype=torch.float64)
    want = _grads(None, lambda: [same] * 4)
    for preset, calls in (("full", 4), ("full:uniform:2", 2), ("selective", 4)):
        seen.clear()
        got = _grads(preset, lambda: [same] * 4)
        assert len(seen) == calls and all(len(a) == 1 and a[0].shape == (2, 5, 6) for a in seen), preset
        assert all(torch.equal(g, w) for g, w in zip(got, want)), preset


@pytest.mark.parametrize("preset", ["full:uniform:2", "sqrt"])
def test_a_multi_layer_region_takes_equal_arguments_and_refuses_others(preset):
    same = torch.tensor(0.7, dtype=torch.float64)
    want = _grads(None, lambda: [same] * 4)
    for gains in (lambda: [same] * 4, lambda: [torch.tensor(0.7, dtype=torch.float64) for _ in range(4)]):
        assert all(torch.equal(g, w) for g, w in zip(_grads(preset, gains), want))
    with pytest.raises(ValueError, match=r"layer 1 of a multi-layer recompute region .* another gain= than the "
                                         r"region's first layer"):
        _grads(preset, lambda: [torch.tensor(0.7 + 0.1 * i, dtype=torch.float64) for i in range(4)])
    with pytest.raises(ValueError, match="another gain="):       # a different shape is a difference too
        _grads(preset, lambda: [same, same.expand(1), same, same])
    layers = _stack(preset)
    assert all(apply_module.in_multi_layer_region(layer) for layer in layers)
    recompute.remove(layers)
    assert not any(apply_module.in_multi_layer_region(layer) for layer in layers)
    assert not apply_module.in_multi_layer_region(_stack("full")[0])
