"""Recompute presets: parsing, regions, framework mappings, application errors and budget resolution."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import ctx_plugin
from ctx_plugin import recompute
from ctx_plugin.memory import GiB, ModelSpec, ParallelSpec, estimate, resolve
from ctx_plugin.names import Recompute
from ctx_plugin.recompute import RecomputeConfig

ROUND_TRIP = ["none", "attn_out", "selective", "core_attn", "mlp", "full", "full:uniform:2", "full:block:3", "sqrt",
              "budget:40"]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_parse_round_trips(text):
    cfg = RecomputeConfig.parse(text)
    assert str(cfg) == text and RecomputeConfig.parse(str(cfg)) == cfg


def test_every_preset_name_parses():
    for name in Recompute:
        text = "budget:8" if name == Recompute.BUDGET else name.value
        assert RecomputeConfig.parse(text).preset == name


def test_parsed_fields():
    assert RecomputeConfig.parse("full") == RecomputeConfig(preset="full", method="uniform", num_layers=1)
    assert RecomputeConfig.parse("full:block:4") == RecomputeConfig(preset="full", method="block", num_layers=4)
    assert RecomputeConfig.parse("budget:12.5").budget_gib == 12.5


@pytest.mark.parametrize("text,message", [
    ("nothing", "unknown recompute preset 'nothing'"),
    ("full:diagonal:2", "method must be one of"),
    ("full:uniform:0", "positive integer"),
    ("full:uniform", "bad recompute preset"),
    ("selective:2", "bad recompute preset"),
    ("budget:lots", "bad recompute preset"),
    ("budget:-3", "positive number of GiB"),
    ("budget", "bad recompute preset"),
])
def test_bad_presets(text, message):
    with pytest.raises(ValueError, match=message):
        RecomputeConfig.parse(text)


def test_bad_types_and_fields():
    with pytest.raises(TypeError, match="must be a string"):
        RecomputeConfig.parse(3)
    with pytest.raises(ValueError, match="apply to the 'full' preset only"):
        RecomputeConfig(preset="mlp", num_layers=2)


MODIFIED = ["none+tile_loss", "selective+tile_mlp:512", "full:block:4+tile_loss:8192+tile_mlp+recompute_attn+offload:64",
            "sqrt+offload_attn:96.5", "budget:60+tile_loss+tile_mlp"]


@pytest.mark.parametrize("text", MODIFIED)
def test_modifiers_round_trip(text):
    cfg = RecomputeConfig.parse(text)
    assert str(cfg) == text and RecomputeConfig.parse(str(cfg)) == cfg and cfg.has_modifiers
    assert not cfg.base.has_modifiers and str(cfg.base) == text.split("+")[0]


def test_modifier_fields():
    cfg = RecomputeConfig.parse("full:uniform:2+offload_attn:12+tile_mlp:256+tile_loss")
    assert (cfg.tile_loss, cfg.loss_tokens, cfg.tile_mlp, cfg.mlp_tokens) == (True, None, True, 256)
    assert (cfg.offload_gib, cfg.offload_attention, cfg.recompute_attention) == (12.0, True, False)
    assert RecomputeConfig.parse("sqrt+tile_mlp+recompute_attn").modifiers == dict(
        tile_loss=False, loss_tokens=None, tile_mlp=True, mlp_tokens=None, recompute_attention=True,
        offload_gib=None, offload_attention=False)


@pytest.mark.parametrize("text,message", [
    ("full+sparkle", "unknown recompute modifier 'sparkle'"),
    ("none+offload:4", "offload applies to whole-layer checkpoint regions"),
    ("mlp+recompute_attn", "recompute_attn applies to whole-layer checkpoint regions"),
    ("budget:9+offload:4", "give an explicit full or sqrt preset"),
    ("full+offload", "needs a host-memory budget"),
    ("full+offload:lots", "bad recompute modifier"),
    ("full+offload:0", "positive number of GiB"),
    ("full+tile_mlp:0", "positive integer"),
    ("full+tile_loss:1.5", "bad recompute modifier"),
    ("full+recompute_attn:2", "bad recompute modifier"),
    ("full+tile_mlp+tile_mlp", "given twice"),
    ("full+offload:2+offload_attn:2", "given twice"),
    ("full+recompute_attn+offload_attn:8", "nothing is pinned"),
])
def test_bad_modifiers(text, message):
    with pytest.raises(ValueError, match=message):
        RecomputeConfig.parse(text)


def test_bad_modifier_fields():
    with pytest.raises(ValueError, match="mlp_tokens applies with tile_mlp=True only"):
        RecomputeConfig(preset="none", mlp_tokens=4)
    with pytest.raises(TypeError, match="tile_loss must be True or False"):
        RecomputeConfig(preset="none", tile_loss=1)
    with pytest.raises(ValueError, match="needs a host budget"):
        RecomputeConfig(preset="full", offload_attention=True)


def test_the_candidates_are_every_preset_a_budget_and_the_planner_try():
    assert [str(c) for c in recompute.candidates(3)] == ["none", "attn_out", "selective", "mlp", "full:block:1",
                                                         "full:block:2", "full", "sqrt"]


def test_regions():
    assert recompute.regions(RecomputeConfig.parse("full"), 3) == [(0, 1), (1, 2), (2, 3)]
    assert recompute.regions(RecomputeConfig.parse("full:uniform:2"), 5) == [(0, 2), (2, 4), (4, 5)]
    assert recompute.regions(RecomputeConfig.parse("full:block:2"), 5) == [(0, 1), (1, 2)]
    assert recompute.regions(RecomputeConfig.parse("sqrt"), 10) == [(0, 4), (4, 8), (8, 10)]
    assert recompute.regions(RecomputeConfig.parse("selective"), 4) == []
    assert recompute.regions(RecomputeConfig.parse("full:uniform:5"), 5) == [(0, 5)]
    for preset in ("full:block:6", "full:uniform:6"):         # more layers than the stack: refused, not clamped
        with pytest.raises(ValueError, match=f"recompute preset {preset} counts 6 layers, but the stack has 5"):
            recompute.regions(RecomputeConfig.parse(preset), 5)


def test_megatron_mapping():
    assert recompute.to_megatron("none", 8)["recompute_granularity"] is None
    assert recompute.to_megatron("attn_out", 8)["recompute_granularity"] is None
    assert recompute.to_megatron("mlp", 8) == {"recompute_granularity": "selective", "recompute_method": None,
                                              "recompute_num_layers": None, "recompute_modules": ["mlp"]}
    assert recompute.to_megatron("core_attn", 8)["recompute_modules"] == ["core_attn"]
    # megatron-core recomputes an MoE layer's MLP under "moe" ("mlp" is only the dense layers')
    assert recompute.to_megatron("mlp", 8, moe=True)["recompute_modules"] == ["mlp", "moe"]
    assert recompute.to_megatron("core_attn", 8, moe=True)["recompute_modules"] == ["core_attn"]
    for text in ("selective", "full", "full:block:2", "sqrt"):
        with pytest.raises(ValueError, match="Megatron cannot express"):
            recompute.to_megatron(text, 8)


def test_deepspeed_mapping():
    assert recompute.to_deepspeed("none", 8) is None
    assert recompute.to_deepspeed("sqrt", 9)["number_checkpoints"] == 3
    assert recompute.to_deepspeed("full:uniform:2", 8)["number_checkpoints"] == 4
    for text in ("selective", "mlp", "core_attn", "full:block:2"):
        with pytest.raises(ValueError, match="DeepSpeed cannot express"):
            recompute.to_deepspeed(text, 8)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def test_apply_errors_and_remove():
    layers = nn.ModuleList(_Layer() for _ in range(3))
    groups = ctx_plugin.build_cp_groups(ctx_plugin.CPConfig())
    with pytest.raises(ValueError, match="must be resolved"):
        recompute.apply(layers, "budget:10")
    with pytest.raises(ValueError, match=r"needs layers with an `.mlp` submodule; layers \[0, 1, 2\]"):
        recompute.apply(layers, "mlp")
    with pytest.raises(TypeError, match="groups"):         # the pins state is context-scoped: no groups taken
        recompute.apply(layers, "full", groups=groups)
    recompute.apply(layers, "full:uniform:3")
    assert all("forward" in vars(layer) for layer in layers)
    with pytest.raises(ValueError, match="already applied"):
        recompute.apply(layers, "full")
    x = torch.randn(2, 4, requires_grad=True)
    y = x
    for layer in layers:
        y = layer(y)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="layer 1 of a multi-layer recompute region was called with autograd on "
                                           "but not after the region's first layer"):
        layers[1](torch.randn(2, 4))
    with torch.no_grad():
        assert torch.equal(layers[1](y), layers[1].lin(y))        # without autograd: the layer alone
    recompute.remove(layers)
    assert all("forward" not in vars(layer) for layer in layers)
    assert list(layers.state_dict()) == [f"{i}.lin.{p}" for i in range(3) for p in ("weight", "bias")]


def test_core_attn_warns():
    layers = nn.ModuleList([_Layer()])
    with pytest.warns(UserWarning, match="repeating its ring/all-to-all communication"):
        recompute.apply(layers, "core_attn")


LLAMA = ModelSpec.preset("llama3-8b")
PAR = ParallelSpec(cp=8, zero_stage=1)


def test_extra_flops_of_the_issue_case_by_hand():
    """Llama-3-8B, 128k tokens over 8 ranks: per token and layer, projections 2·h·(2·q_w + 2·kv_w), SwiGLU MLP
    2·h·f·3, causal attention 2·(s+1)·q_w (s(s+1)/2 pairs: forward 2·2·q_w·(s+1)/2 per token); a step is 3× the
    projections and MLP (forward, backward twice), 3.5× the attention (flash's backward: 2.5×) and 3× the LM head
    2·h·V."""
    h, f, s, q_w, kv_w, vocab, layers = 4096, 14336, 131072, 4096, 1024, 128256, 32
    proj, mlp, attn = 2 * h * (2 * q_w + 2 * kv_w), 2 * h * f * 3, 2 * (s + 1) * q_w
    step = layers * (3 * (proj + mlp) + 3.5 * attn) + 3 * 2 * h * vocab
    kw = dict(seq_len=s)
    assert estimate(LLAMA, PAR, "mlp", **kw).recompute_fraction == pytest.approx(layers * mlp / step, rel=1e-12)
    assert estimate(LLAMA, PAR, "full:block:16", **kw).recompute_fraction == \
        pytest.approx(16 * (proj + mlp) / step, rel=1e-12)
    assert estimate(LLAMA, PAR, "mlp", **kw).recompute_flops == pytest.approx(layers * mlp * s / 8, rel=1e-12)
    assert round(100 * layers * mlp / step, 1) == 6.8 and round(100 * 16 * (proj + mlp) / step, 1) == 4.2


@pytest.mark.parametrize("budget,chosen", [
    (175, "none"),            # everything fits: nothing recomputed
    (135, "selective"),       # none (167.1 GiB) does not fit; selective (134.9) recomputes no matmul
    (134, "full:block:16"),   # 4.8% extra FLOPs (133.0 GiB), not mlp's 7.8% (the issue's case)
    (115, "full:block:25"),   # 7.5% < mlp's 7.8%
    (111.5, "mlp"),           # 7.8% (111.1 GiB) < full:block:26's 7.8%+ (111.6 GiB)
    (100, "sqrt"),            # full (98.9 GiB) and sqrt (95.6) recompute the same: the smaller peak
    (96, "sqrt"),
])
def test_budget_picks_least_extra_flops_that_fits(budget, chosen):
    """Hand-read from `ctx-plugin memory --model llama3-8b --seq-len 128k --cp 8` (ZeRO-1, Megatron's model state:
    56.1 GiB with its fp32 gradients)."""
    assert str(resolve(f"budget:{budget}", LLAMA, PAR, seq_len=131072)) == chosen
    assert str(recompute.resolve(f"budget:{budget}", LLAMA, PAR, seq_len=131072)) == chosen


def test_budget_rule_on_hand_made_estimates(monkeypatch):
    """The choice alone, on made-up (peak GiB, extra FLOPs) pairs: least FLOPs among those that fit; ties go to
    the preset without elementwise recompute, then to the smaller peak; candidates not listed do not fit."""
    import ctx_plugin.memory.model as model

    def run(table, budget):
        def fake(m, p, preset, **kw):
            peak, frac = table.get(str(preset), (1e9, 0.0))
            return SimpleNamespace(peak=peak * GiB, recompute_fraction=frac)
        monkeypatch.setattr(model, "estimate", fake)
        return str(resolve(f"budget:{budget}", LLAMA, PAR, seq_len=131072))

    base = {"none": (100, 0.0), "attn_out": (100, 0.0), "selective": (60, 0.0), "mlp": (50, 0.2),
            "full:block:3": (55, 0.1), "full": (40, 0.3), "sqrt": (30, 0.3)}
    assert run(base, 100) == "none"                 # ties with attn_out and selective: none
    assert run(base, 99) == "selective"
    assert run(base, 59) == "full:block:3"          # 0.1 < mlp's 0.2 although mlp comes first and is smaller
    assert run(base, 54) == "mlp"
    assert run(base, 49) == "sqrt"                  # full and sqrt tie on FLOPs: the smaller peak
    assert run({**base, "sqrt": (45, 0.3)}, 49) == "full"
    assert run({**base, "full:block:5": (35, 0.25)}, 49) == "full:block:5"
    with pytest.raises(ValueError, match=r"smallest estimate is 30\.0 GiB \(sqrt\)"):
        run(base, 29)


def test_concrete_presets_pass_through_resolve():
    assert str(resolve("full:block:3", LLAMA, PAR, seq_len=131072)) == "full:block:3"
    assert recompute.resolve("sqrt", LLAMA, PAR, seq_len=131072) == RecomputeConfig.parse("sqrt")


def test_impossible_budget_says_what_to_change():
    with pytest.raises(ValueError, match=r"no recompute preset fits 20 GiB per GPU: the smallest estimate is "
                                         r".* \(sqrt\)"):
        resolve("budget:20", LLAMA, PAR, seq_len=131072)


@pytest.mark.parametrize("text", ["full+offload_attn:123456789", "full+offload:0.1234567", "budget:80.5+tile_loss",
                                  "full:block:4+recompute_attn+offload:0.001", "sqrt+offload:1e-7",
                                  "full+offload:12345678901234567890", "budget:1e+2", "full+offload:1e+3"])
def test_a_preset_prints_as_it_parses_back(text):
    """str(config) is what error messages and mappings tell users to pass: it must parse back to the same config
    (`:g` printed 1.23457e+08, whose '+' split it, and rounded 0.1234567)."""
    config = RecomputeConfig.parse(text)
    assert RecomputeConfig.parse(str(config)) == config and "e+" not in str(config)
    assert RecomputeConfig.parse("full+offload:1e+3") == RecomputeConfig.parse("full+offload:1000")
