"""megatron-core's MoE router recomputed by ctx_plugin's presets (a non-reentrant checkpoint: autograd on, which
megatron-core's router reads as "not a recomputation"): the recomputation leaves the router's expert-bias counts and
the MoE metrics tracker as the forward left them (they doubled), no module keeps a recomputed tensor (the token
dispatcher's routing probabilities kept the recomputed region's graph alive after its backward), the gradients are
the preset none's; the global auxiliary loss, which a recomputation cannot reproduce, is refused."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

import torch  # noqa: E402

from tests.distributed.harness import run_spawned  # noqa: E402

PRESETS = ["none", "selective", "full", "full:uniform:2", "sqrt", "full+offload_attn:1"]
# the expert bias (with the auxiliary and z losses: the metrics tracker) under every preset; quantile balancing
CASES = [("moe_bias", p) for p in PRESETS] + [("moe_qb", "none"), ("moe_qb", "full")]
_results: dict = {}


def results() -> dict:
    if not _results:
        _results.update(run_spawned("tests.integration.megatron_moe_ranks:router_state", 1, {"cases": CASES},
                                    timeout_s=600)[0])
    return _results


@pytest.mark.parametrize("variant,preset", [c for c in CASES if c[1] != "none"])
def test_a_recomputed_router_leaves_its_state_and_the_gradients_as_without_a_preset(variant, preset):
    got, want = results()[f"{variant}|{preset}"], results()[f"{variant}|none"]
    assert got["counts"] == want["counts"] and any(torch.tensor(b).abs().sum() for r in want["counts"] for b in r), \
        (got["counts"], want["counts"])
    assert got["metrics"].keys() == want["metrics"].keys() and (got["metrics"] or variant == "moe_qb")
    for name, values in want["metrics"].items():
        assert torch.allclose(torch.tensor(got["metrics"][name]), torch.tensor(values), rtol=1e-12, atol=0), name
    assert got["replaced"] == want["replaced"], "a module kept a tensor its recomputation made"
    for name, g in want["grads"].items():
        assert torch.allclose(torch.tensor(got["grads"][name]), torch.tensor(g), rtol=1e-10, atol=1e-12), name


def _args(monkeypatch, *flags):
    from megatron.training.arguments import parse_args

    from ctx_plugin.megatron.args import add_arguments

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "256",
                                      "--num-attention-heads", "8", "--seq-length", "4096", "--max-position-embeddings",
                                      "4096", "--micro-batch-size", "1", "--attention-dropout", "0", "--hidden-dropout",
                                      "0", "--context-parallel-size", "2", "--num-experts", "4", *flags])
    args = parse_args(extra_args_provider=add_arguments)
    args.padded_vocab_size, args.data_parallel_size = 1024, 1
    return args


@pytest.mark.parametrize("preset,refused", [("full", True), ("selective", True), ("core_attn", False),
                                            ("none", False)])
def test_the_global_auxiliary_loss_is_refused_with_presets_that_recompute_the_router(monkeypatch, preset, refused):
    pytest.importorskip("megatron.training", reason="needs Megatron-LM's training package")
    from ctx_plugin.megatron.args import settings_from_args

    args = _args(monkeypatch, "--cp-recompute", preset, "--moe-router-load-balancing-type", "global_aux_loss")
    if refused:
        with pytest.raises(ValueError, match=rf"--cp-recompute {preset} with --moe-router-load-balancing-type "
                                             r"global_aux_loss: the router's recomputation"):
            settings_from_args(args)
    else:
        settings_from_args(args)
    settings_from_args(_args(monkeypatch, "--cp-recompute", preset))      # aux_loss: recomputed exactly
