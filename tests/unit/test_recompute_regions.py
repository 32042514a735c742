"""What the layers of a recompute region are called with. The checkpoint gets the hidden states positionally also
from layers called with ``hidden_states=`` only (Megatron's TransformerBlock), so torch saves and restores the device
RNG of their device (dropout masks in the recomputation; the CUDA side: ``tests/gpu/test_recompute_gpu.py``).

A multi-layer region (``full:uniform:N``, ``sqrt``) is one checkpoint spanning its layers' calls: each layer runs with
the arguments the model gives *it* (here a per-layer ``gain``, as Gemma-3 gives its sliding-window and full-attention
layers different ``position_embeddings``) and returns its own output; only the region's input is saved, and backward
replays each layer once with its own arguments. A later layer called out of order or with something other than the
previous layer's output is an error; a failure inside or between a region's layers leaves no checkpoint hooks
behind."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from ctx_plugin import recompute

checkpointing_module = importlib.import_module("ctx_plugin.recompute.checkpointing")
span_module = importlib.import_module("ctx_plugin.recompute.span")


class Layer(nn.Module):
    """A residual MLP layer scaled by a per-call ``gain`` tensor, taking its input only as ``hidden_states=``; counts
    its forward calls (in a list: a recomputation cut short restores the layer's own attributes)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        for p in self.parameters():
            nn.init.normal_(p, std=0.3)
        self.calls = [0]

    def forward(self, *, hidden_states, gain):
        self.calls[0] += 1
        return hidden_states + self.down(torch.tanh(self.up(hidden_states))) * gain


def _stack(preset):
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer(6) for _ in range(4)).double()
    if preset is not None:
        recompute.apply(layers, preset)
    return layers


def _gains():
    return [torch.tensor(0.7 + 0.1 * i, dtype=torch.float64) for i in range(4)]


def _run(layers, gains, *, outputs=None, packed=None):
    """Grads of the input and parameters; ``outputs`` collects each layer's output, ``packed`` counts the tensors
    autograd saves outside any checkpoint (through hooks around the whole forward)."""
    x = torch.randn(2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()

    def pack(t):
        packed.append(t.shape)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if packed is not None else _nothing():
        h = x
        for layer, gain in zip(layers, gains):
            h = layer(hidden_states=h, gain=gain)
            if outputs is not None:
                outputs.append(h.detach().clone())
    (h * torch.linspace(-1, 1, 6, dtype=torch.float64)).sum().backward()
    return [x.grad, *(p.grad for p in layers.parameters())]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_keyword_hidden_states_reach_the_checkpoint_positionally(monkeypatch):
    seen = []
    original, original_opener = checkpointing_module.checkpoint, span_module.opener

    def spy(fn, *args, **kwargs):
        seen.append(args)
        return original(fn, *args, **kwargs)

    def spy_opener():
        start = original_opener()

        def spy_start(fn, context_fn, *args):
            seen.append(args)
            return start(fn, context_fn, *args)
        return spy_start
    monkeypatch.setattr(checkpointing_module, "checkpoint", spy)
    monkeypatch.setattr(span_module, "opener", spy_opener)
    want = _run(_stack(None), _gains())
    for preset, calls in (("full", 4), ("full:uniform:2", 2), ("selective", 4)):
        seen.clear()
        got = _run(_stack(preset), _gains())
        assert len(seen) == calls and all(len(a) == 1 and a[0].shape == (2, 5, 6) for a in seen), preset
        assert all(torch.equal(g, w) for g, w in zip(got, want)), preset


@pytest.mark.parametrize("preset,regions", [("full:uniform:2", 2), ("sqrt", 2), ("full:uniform:4", 1)])
def test_each_layer_of_a_region_runs_with_its_own_arguments(preset, regions):
    want_outputs, got_outputs, plain_saved, saved = [], [], [], []
    want = _run(_stack(None), _gains(), outputs=want_outputs, packed=plain_saved)
    layers = _stack(preset)
    got = _run(layers, _gains(), outputs=got_outputs, packed=saved)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(g, w) for g, w in zip(got_outputs, want_outputs)), "each layer's own output"
    # Outside the checkpoints only each region's input is saved (plain autograd saves ~4 tensors per layer)
    assert saved == [(2, 5, 6)] * regions and len(plain_saved) > 4 * 3
    assert [layer.calls[0] for layer in layers] == [2] * 4, "forward once, replayed once in backward"
    with torch.no_grad():
        h = torch.ones(2, 5, 6, dtype=torch.float64)
        for layer, gain in zip(layers, _gains()):
            h = layer(hidden_states=h, gain=gain)
    assert [layer.calls[0] for layer in layers] == [3] * 4


def test_a_layer_called_out_of_turn_is_an_error_and_leaves_no_hooks():
    want = _run(_stack(None), _gains())
    layers = _stack("full:uniform:4")
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    h = layers[0](hidden_states=x, gain=_gains()[0])
    with pytest.raises(RuntimeError, match="something other than the previous layer's output"):
        layers[1](hidden_states=h * 2, gain=_gains()[1])
    h = layers[0](hidden_states=x, gain=_gains()[0])
    with pytest.raises(RuntimeError, match="layer 2 of a multi-layer recompute region was called while layer 1"):
        layers[2](hidden_states=h, gain=_gains()[2])
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert all(torch.equal(g, w) for g, w in zip(_run(layers, _gains()), want))


def test_a_failure_inside_or_between_layers_leaves_no_hooks():
    want = _run(_stack(None), _gains())
    layers = _stack("sqrt")
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="must match the size"):     # inside layer 1: a gain of the wrong shape
        layers[1](hidden_states=layers[0](hidden_states=x, gain=_gains()[0]), gain=torch.ones(3, dtype=torch.float64))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    layers[0](hidden_states=x, gain=_gains()[0])      # between layers: the model stops after the region's first layer
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None, "the region's span is open"
    assert all(torch.equal(g, w) for g, w in zip(_run(layers, _gains()), want)), "the next forward closes it"
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("preset", ["full:uniform:2", "sqrt", "full:uniform:4+offload:1"])
def test_dropout_inside_a_region_draws_the_same_masks_in_the_replay(preset):
    """The span saves the RNG state at its first layer and restores it for the replay: every layer's dropout mask
    in backward is the one its forward drew (here on the CPU; the GPU's: tests/gpu/test_recompute_gpu.py)."""
    def grads(preset):
        torch.manual_seed(0)
        layers = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Tanh()) for _ in range(4)).double()
        if preset is not None:
            recompute.apply(layers, preset)
        x = torch.randn(2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        torch.manual_seed(2)
        h = x
        for layer in layers:
            h = layer(h)
        (h * torch.linspace(-1, 1, 6, dtype=torch.float64)).sum().backward()
        return [x.grad, *(p.grad for p in layers.parameters())]
    want = grads(None)
    assert all(torch.equal(g, w) for g, w in zip(grads(preset), want))


def test_a_torch_without_the_checkpoint_generator_is_a_clear_error_at_apply(monkeypatch):
    """Refused when the preset is applied, before any forward; one-layer presets do not need the generator."""
    from torch.utils import checkpoint as ckpt

    monkeypatch.delattr(ckpt, "_checkpoint_without_reentrant_generator")
    with pytest.raises(RuntimeError, match=r"multi-layer recompute regions use; use a preset with one layer per "
                                           r"region \(full, full:block:N, selective\)"):
        _stack("sqrt")
    _stack("full:block:2")


def test_a_checkpoint_generator_taking_unknown_arguments_is_a_clear_error(monkeypatch):
    from torch.utils import checkpoint as ckpt

    def generator(fn, preserve_rng_state, context_fn, new_option, *args):
        yield
    monkeypatch.setattr(ckpt, "_checkpoint_without_reentrant_generator", generator)
    with pytest.raises(RuntimeError, match=r"takes \['new_option'\], which ctx_plugin's multi-layer recompute "
                                           r"regions do not know"):
        _stack("full:uniform:2")
