"""``--cp-recompute budget:<GiB>`` under Megatron (its real parser, no processes): the dense model spec built from
Megatron's flags is refused for what it cannot describe — MoE layers (``--num-experts``) and attention of another
width than ``--hidden-size`` (``--kv-channels``) — resolved or not; a dense model resolves to a concrete preset."""
from __future__ import annotations

import dataclasses
import sys

import pytest

pytest.importorskip("megatron.training", reason="needs megatron-core and Megatron-LM's training package")

from ctx_plugin.names import Recompute  # noqa: E402

BASE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "4096",
        "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--attention-dropout", "0",
        "--hidden-dropout", "0"]


def _args(monkeypatch, *flags):
    """Megatron's parsed flags, with the two values ``budget:`` needs from Megatron's later setup."""
    from megatron.training.arguments import parse_args

    from ctx_plugin.megatron.args import add_arguments

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *flags])
    args = parse_args(extra_args_provider=add_arguments)
    args.padded_vocab_size, args.data_parallel_size = 1024, 1
    return args


@pytest.mark.parametrize("resolve_budget", [True, False])
def test_budget_with_experts_is_refused(monkeypatch, resolve_budget):
    from ctx_plugin.megatron.args import settings_from_args

    args = _args(monkeypatch, "--cp-recompute", "budget:80", "--num-experts", "4")
    with pytest.raises(ValueError, match=r"--cp-recompute budget:80 with --num-experts 4: the memory model that "
                                         r"resolves budget:<GiB> covers dense decoders only .* give a concrete "
                                         r"preset instead, e\.g\. --cp-recompute full$"):
        settings_from_args(args, resolve_budget=resolve_budget)
    settings_from_args(_args(monkeypatch, "--cp-recompute", "full", "--num-experts", "4"))   # a preset: fine


@pytest.mark.parametrize("resolve_budget", [True, False])
def test_budget_with_latent_attention_is_refused(monkeypatch, resolve_budget):
    from ctx_plugin.megatron.args import settings_from_args

    args = _args(monkeypatch, "--cp-recompute", "budget:80", "--multi-latent-attention")
    with pytest.raises(ValueError, match=r"--cp-recompute budget:80 with --multi-latent-attention: the memory model "
                                         r"that resolves budget:<GiB> sizes standard attention .* give a concrete "
                                         r"preset instead, e\.g\. --cp-recompute full$"):
        settings_from_args(args, resolve_budget=resolve_budget)
    settings_from_args(_args(monkeypatch, "--cp-recompute", "full", "--multi-latent-attention"))   # a preset: fine


def test_budget_with_kv_channels_of_their_own_is_refused(monkeypatch):
    from ctx_plugin.megatron.args import settings_from_args

    args = _args(monkeypatch, "--cp-recompute", "budget:80", "--kv-channels", "64")
    with pytest.raises(ValueError, match=r"--cp-recompute budget:80 with --kv-channels 64: the memory model that "
                                         r"resolves budget:<GiB> sizes the attention --hidden-size wide \(8 heads × "
                                         r"64 is not --hidden-size 256\); give a concrete preset instead, e\.g\. "
                                         r"--cp-recompute full \(`ctx-plugin memory` to choose it\)$"):
        settings_from_args(args)
    same = settings_from_args(_args(monkeypatch, "--cp-recompute", "budget:80", "--kv-channels", "32"))
    assert same.recompute.preset != Recompute.BUDGET


def test_budget_resolves_for_a_dense_model(monkeypatch):
    from ctx_plugin.megatron.args import settings_from_args

    settings = settings_from_args(_args(monkeypatch, "--cp-recompute", "budget:80", "--swiglu",
                                        "--normalization", "RMSNorm"))
    assert settings.recompute.preset == Recompute.NONE        # a tiny model fits 80 GiB without recompute


@pytest.mark.parametrize("flags,tied", [([], True), (["--untie-embeddings-and-output-weights"], False)])
def test_budget_counts_the_output_layer_as_megatron_builds_it(monkeypatch, flags, tied):
    """Megatron ties the output layer to the word embeddings unless --untie-embeddings-and-output-weights."""
    import ctx_plugin.memory as memory
    from ctx_plugin.megatron.args import settings_from_args

    seen = []
    real = memory.resolve
    monkeypatch.setattr(memory, "resolve", lambda preset, model, *a, **kw: seen.append(model) or real(
        preset, model, *a, **kw))
    settings_from_args(_args(monkeypatch, "--cp-recompute", "budget:80", *flags))
    assert [m.tied_embeddings for m in seen] == [tied]


def test_budget_counts_the_dataloader_mask(monkeypatch):
    """Megatron's dataloader mask ([micro batch, 1, seq, seq] bool on every GPU through the step) is taken from the
    budget: a budget 8 MiB above the lightest preset's estimate resolves to it without the mask, and to a heavier
    preset with the 16 MiB mask of 4096 tokens."""
    import torch

    from ctx_plugin.megatron.args import settings_from_args
    from ctx_plugin.megatron.budget import model_spec
    from ctx_plugin.memory import ParallelSpec
    from ctx_plugin.memory.model import GiB, estimate

    args = _args(monkeypatch, "--cp-recompute", "budget:80", "--no-create-attention-mask-in-dataloader")
    peak = estimate(model_spec(args), ParallelSpec(), "none", seq_len=4096, dtype=torch.float32).peak
    budget = f"budget:{(peak + 8 * 2 ** 20) / GiB:.9f}"
    without = settings_from_args(_args(monkeypatch, "--cp-recompute", budget,
                                       "--no-create-attention-mask-in-dataloader"))
    assert str(without.recompute) == "none"
    with_mask = settings_from_args(_args(monkeypatch, "--cp-recompute", budget))
    assert str(with_mask.recompute) not in ("none", "budget")
    with pytest.raises(ValueError, match=r"no recompute preset fits .* and 0\.0 GiB the framework holds besides"):
        settings_from_args(_args(monkeypatch, "--cp-recompute", f"budget:{peak / 4 / GiB:.9f}"))



UNDESCRIBED_FLAGS = [["--qk-layernorm"], ["--qk-l2-norm"], ["--attention-output-gate"], ["--fp32-residual-connection"],
                     ["--squared-relu"], ["--quick-geglu"], ["--openai-gelu"],
                     ["--swiglu", "--activation-func-clamp-value", "7.0"]]


def test_every_undescribed_flag_is_tested():
    from ctx_plugin.megatron.budget import UNDESCRIBED

    assert sorted(f[-1] if f[-1].startswith("--") else f[-2] for f in UNDESCRIBED_FLAGS) == \
        sorted("--" + name.replace("_", "-") for name, _, _ in UNDESCRIBED)


@pytest.mark.parametrize("flags", UNDESCRIBED_FLAGS)
def test_budget_with_layers_the_model_does_not_describe_is_refused(monkeypatch, flags):
    """Every flag of UNDESCRIBED, through Megatron's parser and through the SLURM launcher's check (which parses
    them itself): one error naming the flag and the fix; a concrete preset runs."""
    from ctx_plugin.megatron.args import settings_from_args
    from ctx_plugin.slurm.checks import _megatron_parser

    flag = next(f for f in flags if f != "--swiglu")
    message = (rf"--cp-recompute budget:80 with {flag} \(.+\): the memory model that resolves budget:<GiB> does "
               rf"not describe this, so it would under-count what each layer keeps; give a concrete preset instead, "
               rf"e\.g\. --cp-recompute full$")
    for resolve_budget in (True, False):
        with pytest.raises(ValueError, match=message):
            settings_from_args(_args(monkeypatch, "--cp-recompute", "budget:80", *flags), resolve_budget=resolve_budget)
    launcher, _ = _megatron_parser().parse_known_args([*BASE, "--cp-recompute", "budget:80", *flags])
    launcher.padded_vocab_size, launcher.data_parallel_size = 1024, 1
    with pytest.raises(ValueError, match=message):
        settings_from_args(launcher)
    settings_from_args(_args(monkeypatch, "--cp-recompute", "full", *flags))      # a preset: fine



PARAM_FLAGS = [[], ["--disable-bias-linear"], ["--disable-bias-linear", "--add-qkv-bias", "--no-bias-gelu-fusion"],
               ["--swiglu"], ["--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
                "--no-rope-fusion"],
               ["--use-rotary-position-embeddings", "--no-rope-fusion", "--untie-embeddings-and-output-weights"],
               ["--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu",
                "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96", "--disable-bias-linear",
                "--no-bias-swiglu-fusion", "--max-position-embeddings", "80"]]


def test_model_spec_counts_megatrons_parameters():
    """The ModelSpec budget:<GiB> is resolved with counts exactly the parameters of the GPT model Megatron-LM builds
    from the same flags (its parser, validate_args and config; plain GeLU and SwiGLU MLPs with their default widths,
    with and without --add-bias-linear, QKV biases alone, learned absolute positions (the default) or RoPE, GQA,
    RMSNorm, an untied output layer), and the SLURM launcher's check, which runs before Megatron completes its
    arguments, describes the same model."""
    from megatron.training.arguments import parse_args  # noqa: F401 (the skip above covers Megatron-LM's parser)

    from ctx_plugin.megatron.budget import model_spec
    from ctx_plugin.slurm.checks import _megatron_parser
    from tests.distributed.harness import run_spawned
    from tests.memory_megatron import PARAM_BASE

    counts = run_spawned("tests.memory_megatron:param_counts", 1, PARAM_FLAGS)[0]
    assert len(counts) == len(PARAM_FLAGS)
    for flags in PARAM_FLAGS:
        counted, built, fields = counts[" ".join(flags)]
        assert counted == built, f"{flags or 'defaults'}: the memory model counts {counted}, Megatron builds {built}"
        launcher, _ = _megatron_parser().parse_known_args(PARAM_BASE + flags)
        launcher.padded_vocab_size = 96
        assert dataclasses.asdict(model_spec(launcher)) == fields, flags


@pytest.mark.parametrize("flags,named", [
    (("--hidden-dropout", "0.1"), "--hidden-dropout 0.1: .* dropout masks"),
    (("--optimizer", "sgd"), "--optimizer sgd: .* counts Adam's state"),
    (("--mtp-num-layers", "1", "--position-embedding-type", "rope"), "--mtp-num-layers 1: .* multi-token-prediction"),
])
def test_budget_with_what_the_model_does_not_count_is_refused(monkeypatch, flags, named):
    """Dropout masks (Megatron's default --hidden-dropout is 0.1: +12% kept bytes measured), another optimizer's
    state, multi-token-prediction layers: each would make the chosen preset's memory other than estimated."""
    from ctx_plugin.megatron.args import settings_from_args

    with pytest.raises(ValueError, match=r"--cp-recompute budget:80 with " + named):
        settings_from_args(_args(monkeypatch, "--cp-recompute", "budget:80", *flags), resolve_budget=False)


def test_megatron_recompute_modules_next_to_a_preset_is_refused(monkeypatch):
    """--recompute-modules would be overwritten (core_attn, mlp) or have no effect (ctx_plugin's own presets)."""
    from ctx_plugin.megatron.args import settings_from_args

    for preset in ("core_attn", "selective", "none"):
        with pytest.raises(ValueError, match="--recompute-modules"):
            settings_from_args(_args(monkeypatch, "--cp-recompute", preset, "--recompute-modules", "mlp"))


def test_multi_token_prediction_next_to_a_preset_ctx_plugin_applies_is_refused(monkeypatch):
    """ctx_plugin's presets wrap the decoder's layers only; Megatron's own fields (mlp, core_attn) reach the MTP
    layers as Megatron builds them."""
    from ctx_plugin.megatron.args import settings_from_args

    mtp = ("--mtp-num-layers", "1", "--position-embedding-type", "rope")
    for preset in ("full", "sqrt", "selective", "none+tile_mlp"):
        with pytest.raises(ValueError, match=rf"--cp-recompute {preset.replace('+', '.')} with --mtp-num-layers 1"):
            settings_from_args(_args(monkeypatch, "--cp-recompute", preset, *mtp))
    assert settings_from_args(_args(monkeypatch, "--cp-recompute", "mlp", *mtp)).megatron_recompute is not None


def test_megatron_options_a_tiled_norm_cannot_follow_are_refused(monkeypatch):
    """+tile_mlp chunks the norms: TE's fused residual RMSNorm returns the residual too (it failed only in the first
    forward, naming +tile_mlp), and Megatron's norm offloading frees the input the chunks' views point into."""
    from ctx_plugin.megatron.args import settings_from_args

    with pytest.raises(ValueError, match=r"full\+tile_mlp with --fused-residual-rmsnorm: .* drop "
                                         r"--fused-residual-rmsnorm, or \+tile_mlp"):
        settings_from_args(_args(monkeypatch, "--cp-recompute", "full+tile_mlp", "--fused-residual-rmsnorm"))
    args = _args(monkeypatch, "--cp-recompute", "none+tile_mlp")
    args.fine_grained_activation_offloading, args.offload_modules = True, ["mlp_norm", "core_attn", "attn_norm"]
    with pytest.raises(ValueError, match=r"--offload-modules attn_norm mlp_norm: .* drop attn_norm and mlp_norm"):
        settings_from_args(args)
    args.offload_modules = ["core_attn"]
    settings_from_args(args)
    assert settings_from_args(_args(monkeypatch, "--cp-recompute", "full",
                                    "--fused-residual-rmsnorm")).recompute.preset == "full"


def test_switches_and_presets_set_in_code_are_flag_errors(monkeypatch):
    """settings_from_args on a namespace built in code: a string for a switch, a preset of another type."""
    from ctx_plugin.megatron.args import settings_from_args

    for flag in ("cp_no_rank_check", "cp_pad_documents"):
        args = _args(monkeypatch)
        setattr(args, flag, "false")
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} is a switch: True or False, got 'false'"):
            settings_from_args(args)
    args = _args(monkeypatch)
    args.cp_recompute = 3
    with pytest.raises(ValueError, match="--cp-recompute: a recompute preset must be a string, got int"):
        settings_from_args(args)
