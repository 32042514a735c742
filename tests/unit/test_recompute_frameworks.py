"""Recompute presets next to what frameworks do to layers (one process): module hooks that hand on aliases of a
layer's output (ZeRO-3), Hugging Face's own gradient checkpointing, and what the selective policy saves."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import ctx_plugin
from ctx_plugin import hf, recompute
from ctx_plugin.recompute.checkpointing import selective_policy

PRESETS = ["attn_out", "selective", "core_attn", "mlp", "full", "full:uniform:2", "full:block:1", "sqrt"]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.mlp = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.mlp(torch.tanh(self.lin(x)))


class _Alias(torch.autograd.Function):
    """What ZeRO-3's module hooks put around every module's inputs and outputs: the same memory (``detach``) as a
    new autograd node, whose backward fetches or releases the module's parameters (here: counts)."""

    @staticmethod
    def forward(ctx, x, calls):
        ctx.calls = calls
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.calls.append(1)
        return grad, None


def _stack(preset: str, hooks: list | None):
    torch.manual_seed(0)
    layers = nn.ModuleList(_Block() for _ in range(3))
    if hooks is not None:
        for layer in layers:
            layer.register_forward_pre_hook(lambda m, args: (_Alias.apply(args[0], hooks),))
            layer.register_forward_hook(lambda m, args, out: _Alias.apply(out, hooks))
    recompute.apply(layers, preset)
    return layers


@pytest.mark.parametrize("preset", ["full:uniform:2", "full:uniform:3", "sqrt"])
def test_multi_layer_regions_hand_on_hook_wrapped_outputs(preset):
    """A later layer of a region gets an alias of the region's output made by the previous layer's hooks: the
    region's output goes on through the hooks (each hook's backward runs), gradients exact."""
    x = torch.randn(2, 5, 8, dtype=torch.float64)

    def grads(layers):
        layers.double()
        y = x.clone().requires_grad_()
        out = y
        for layer in layers:
            out = layer(out)
        out.pow(2).sum().backward()
        return [y.grad, *(p.grad for p in layers.parameters())]

    hooks: list = []
    want, got = grads(_stack("none", None)), grads(_stack(preset, hooks))
    assert len(hooks) == 2 * 3                       # every wrapper's backward ran: the gradient went through them
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


def test_a_region_layer_called_with_other_memory_is_an_error():
    layers = _stack("full:uniform:3", [])
    out = layers[0](torch.randn(2, 5, 8))
    with pytest.raises(RuntimeError, match="called with something other than the previous layer's output"):
        layers[1](out.clone())


def _hf_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, use_cache=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).train()
    groups = ctx_plugin.build_cp_groups(ctx_plugin.CPConfig(kernel="torch"))
    hf.enable(model, groups.config, groups)
    return model, groups


def _step(model):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, position_ids=torch.arange(16).expand(2, 16)).logits.sum().backward()


@pytest.mark.parametrize("preset", [*PRESETS, "none+tile_mlp:4"])
def test_hf_gradient_checkpointing_then_a_preset_is_refused(preset):
    pytest.importorskip("transformers")
    model, groups = _hf_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")             # transformers' deprecation notice, core_attn's warning
        model.gradient_checkpointing_enable()
        with pytest.raises(ValueError, match=r"decoder layers \[0, 1, 2\] use Hugging Face's own gradient "
                                             r"checkpointing .* use one or the other"):
            recompute.apply(model.model.layers, preset)


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "attn_out"])   # attn_out patches nothing
def test_a_preset_then_hf_gradient_checkpointing_fails_at_forward(preset):
    pytest.importorskip("transformers")
    model, groups = _hf_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recompute.apply(model.model.layers, preset)
        _step(model)                                  # fine on its own
        model.gradient_checkpointing_enable()
        with pytest.raises(ValueError, match=r"decoder layers \[0\] use Hugging Face's own gradient checkpointing"):
            _step(model)
        model.gradient_checkpointing_disable()
        _step(model)


def test_hf_gradient_checkpointing_alone_is_left_alone():
    pytest.importorskip("transformers")
    model, groups = _hf_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable()
    recompute.apply(model.model.layers, "none")
    _step(model)


def test_selective_saves_matmuls_and_no_collective():
    """Collectives are recomputed: the CP attention is pinned, and a saved torch.distributed collective aliases a
    buffer its owner frees or refills (ZeRO-3's parameter gathers gave NaN gradients)."""
    policy = [selective_policy(None, op) for op in (
        torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
        torch.ops.c10d._allgather_base_.default, torch.ops.c10d.allreduce_.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.all_reduce.default,
        torch.ops.aten.add.Tensor)]
    assert policy == [CheckpointPolicy.MUST_SAVE] * 2 + [CheckpointPolicy.PREFER_RECOMPUTE] * 5
