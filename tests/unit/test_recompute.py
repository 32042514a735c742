"""Recompute presets on real decoder stacks (one process): gradients, attention runs, FLOPs, memory model."""
from __future__ import annotations

import pytest
import torch

import ctx_plugin
from tests.recompute_cases import LAYERS, PRESETS, SHAPES, measured_vs_model, train_step

CFG = ctx_plugin.CPConfig(kernel="torch")
SEQ = 32


@pytest.fixture(scope="module")
def steps():
    groups = ctx_plugin.build_cp_groups(CFG)
    return {p: train_step("gqa-gated", p, CFG, groups, SEQ) for p in PRESETS}


@pytest.mark.parametrize("preset", PRESETS[1:])
def test_gradients_equal_no_recompute(steps, preset):
    for name, grad in steps[preset]["grads"].items():
        torch.testing.assert_close(grad, steps["none"]["grads"][name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("preset", PRESETS)
def test_attention_runs_once_per_layer_except_core_attn(steps, preset):
    want = 2 * LAYERS if preset == "core_attn" else LAYERS
    assert steps[preset]["attention_runs"] == want


def test_backward_flops_order_the_presets(steps):
    flops = {p: steps[p]["flops"] for p in PRESETS}
    assert flops["none"] <= flops["attn_out"] <= flops["selective"] <= flops["full"]
    assert flops["none"] < flops["full"]
    assert flops["core_attn"] > flops["none"] and flops["mlp"] > flops["none"]


def test_sqrt_recomputes_about_one_forward(steps):
    """Chen's √n checkpointing re-runs each layer once (all but the pinned attention and the last matmul that
    nothing saved depends on): between 60% and 100% of a forward pass."""
    extra = steps["sqrt"]["flops"] - steps["none"]["flops"]
    forward = steps["none"]["forward_flops"]
    assert 0.6 * forward <= extra <= forward, f"extra {extra / forward:.2f} forwards"


@pytest.mark.parametrize("seq", [32, 96])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("preset", PRESETS)
def test_memory_model_matches_saved_bytes(preset, shape, seq):
    """The activation estimate against the bytes a real stack keeps for backward: exact (the model counts every
    tensor, so a forgotten LSE, norm statistic or any one tensor is a failure)."""
    measured, model = measured_vs_model(shape, preset, CFG, ctx_plugin.build_cp_groups(CFG), seq)
    assert model == measured, f"model {model} vs measured {measured} ({model - measured:+} bytes)"


@pytest.mark.parametrize("preset", ["selective", "full", "sqrt"])
def test_several_forwards_in_flight_before_their_backwards(preset):
    """Pipeline schedules run several micro-batches' forwards before their backwards: each recomputation must
    replay its own forward's attention outputs."""
    from tests.recompute_cases import build_blocks, decoder_config

    def grads(p):
        groups = ctx_plugin.build_cp_groups(CFG)
        blocks = build_blocks(decoder_config("gqa-gated"), CFG, groups, p)
        pos = torch.arange(SEQ)
        xs = [torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        outs = []
        for x in xs:                       # both forwards first ...
            for block in blocks:
                x = block(x, pos)
            outs.append(x)
        for y in reversed(outs):           # ... then the backwards, last first
            y.pow(2).sum().backward()
        return {n: p.grad for n, p in blocks.named_parameters()}

    want, got = grads("none"), grads(preset)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("preset,tracked,refused", [
    ("full", True, True), ("selective", True, True), ("sqrt", True, True), ("full:block:1", True, True),
    ("mlp", True, True), ("none+tile_mlp", True, True), ("none", True, False), ("attn_out", True, False),
    ("full", False, False)])
def test_running_statistics_in_a_recomputed_part_are_refused(preset, tracked, refused):
    """A BatchNorm's running statistics would be updated again by the recomputation (num_batches_tracked 2 after one
    step): refused where the preset re-runs the module, accepted where it does not or with the statistics off."""
    from torch import nn

    from ctx_plugin.recompute import apply, remove

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=tracked))

        def forward(self, x):
            return x + self.mlp(x)

    layers = [Layer() for _ in range(2)]
    if refused:
        with pytest.raises(ValueError, match=r"layer 0's mlp\.1 \(BatchNorm1d\) updates running statistics in its "
                                             r"forward: recompute preset .* re-runs it in backward"):
            apply(layers, preset)
        return
    apply(layers, preset)
    remove(layers)
