"""Megatron integration (megatron-core, CPU, gloo): a tiny GPTModel (2 layers, GQA) built through ctx_plugin's
spec gives, for every backend at CP = 2 and 4 (hybrid: ulysses_size 2), the loss and every parameter gradient
of the CP = 1 run within 1e-5 relative (fp32); flags parse with Megatron's real parser and bad combinations
give clear messages."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

import torch  # noqa: E402

from ctx_plugin.names import Backend  # noqa: E402
from tests.distributed.harness import run_spawned  # noqa: E402

POSITIONS = ("rope", "learned_absolute")
SIZES = {Backend.ULYSSES_RING: [(4, 2)], **{b: [(2, 1), (4, 1)] for b in Backend if b != Backend.ULYSSES_RING}}
CASES = [(w, b.value, u, pos, "none") for b, sizes in SIZES.items() for w, u in sizes for pos in POSITIONS]
CASES += [(2, "zigzag", 1, "rope", "full"), (2, "ulysses", 1, "rope", "selective")]
_results: dict[int, list] = {}


def results(world: int):
    if world not in _results:
        cases = ([("zigzag", 1, pos, "none") for pos in POSITIONS] if world == 1
                 else [c[1:] for c in CASES if c[0] == world])
        _results[world] = run_spawned("tests.integration.megatron_ranks:gpt_step", world, {"cases": cases},
                                      timeout_s=600)
    return _results[world]


@pytest.mark.parametrize("world,backend,u,position,preset", CASES,
                         ids=[f"P{w}-{b}-u{u}-{p}-{r}" for w, b, u, p, r in CASES])
def test_gpt_model_matches_single_rank(world, backend, u, position, preset):
    reference = results(1)[0][f"zigzag-u1-{position}-none"]
    got = results(world)
    key = f"{backend}-u{u}-{position}-{preset}"
    for rank in range(world):
        assert abs(got[rank][key]["loss"] - reference["loss"]) <= 1e-5 * abs(reference["loss"])
    grads = got[0][key]["grads"]
    assert set(grads) == set(reference["grads"])
    for name, want in reference["grads"].items():
        want, have = torch.tensor(want), torch.tensor(grads[name])
        err = ((have - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def _parse(monkeypatch, *flags):
    from megatron.training.arguments import parse_args

    from ctx_plugin.megatron.args import add_arguments

    base = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "4096",
            "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--attention-dropout", "0"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *base, *flags])
    return parse_args(extra_args_provider=add_arguments)


def test_flags_with_megatrons_parser(monkeypatch):
    from ctx_plugin.megatron.args import settings_from_args

    args = _parse(monkeypatch, "--context-parallel-size", "4", "--cp-backend", "ulysses_ring", "--cp-ulysses-size",
                  "2", "--cp-kernel", "torch", "--cp-recompute", "mlp", "--group-query-attention",
                  "--num-query-groups", "2")
    s = settings_from_args(args)
    assert (s.cp_config.backend, s.cp_config.ulysses_size, s.cp_config.kernel) == ("ulysses_ring", 2, "torch")
    assert str(s.recompute) == "mlp"
    assert s.megatron_recompute == {"recompute_granularity": "selective", "recompute_method": None,
                                    "recompute_num_layers": None, "recompute_modules": ["mlp"]}
    default = settings_from_args(_parse(monkeypatch, "--context-parallel-size", "2"))
    assert default.cp_config.backend == "zigzag" and default.megatron_recompute["recompute_granularity"] is None
    assert settings_from_args(_parse(monkeypatch, "--cp-recompute", "sqrt")).megatron_recompute is None


BAD = [
    (["--cp-backend", "ringg"], None, "invalid choice"),
    (["--context-parallel-size", "4", "--cp-backend", "ulysses_ring", "--cp-ulysses-size", "3"], ValueError,
     "--cp-ulysses-size 3 must divide --context-parallel-size 4"),
    (["--cp-ulysses-size", "2"], ValueError, "applies to backend='ulysses_ring' only"),
    (["--context-parallel-size", "2", "--attention-backend", "local"], ValueError, "--attention-backend local"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], ValueError, "--cp-comm-type a2a conflicts"),
    (["--context-parallel-size", "16", "--cp-backend", "ulysses"], ValueError, "heads per tensor-parallel rank (8)"),
    (["--context-parallel-size", "4", "--cp-backend", "ulysses", "--group-query-attention", "--num-query-groups",
      "3"], None, None),
    (["--context-parallel-size", "3", "--seq-length", "4096"], ValueError, "--seq-length 4096 must be a multiple of 6"),
    (["--cp-recompute", "full", "--recompute-granularity", "full"], ValueError, "both set what to recompute"),
    (["--cp-recompute", "full:sideways:2"], ValueError, "method must be one of"),
    (["--attention-dropout", "0.1"], ValueError, "set --attention-dropout 0 (got 0.1)"),
]


@pytest.mark.parametrize("flags,error,message", BAD, ids=[" ".join(f) for f, _, _ in BAD])
def test_bad_flag_combinations(monkeypatch, flags, error, message):
    from ctx_plugin.megatron.args import settings_from_args

    if error is None and message == "invalid choice":
        with pytest.raises(SystemExit):
            _parse(monkeypatch, *flags)
        return
    try:
        args = _parse(monkeypatch, *flags)
    except SystemExit:
        pytest.fail(f"Megatron's parser rejected {flags}")
    if error is None:      # num_query_groups 3 is rejected by Megatron's own validation, not by the parser
        with pytest.raises(ValueError, match="query groups per tensor-parallel rank"):
            settings_from_args(args)
        return
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings_from_args(args)


def test_spec_from_megatron_args(monkeypatch):
    """``--spec ctx_plugin.megatron.spec layer_spec``: Megatron calls it; core attention is ctx_plugin's."""
    from megatron.training import global_vars

    from ctx_plugin.megatron.core_attention import CPCoreAttention
    from ctx_plugin.megatron.spec import layer_spec

    args = _parse(monkeypatch, "--transformer-impl", "local", "--context-parallel-size", "2", "--cp-backend",
                  "striped")
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    spec = layer_spec(None)
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is CPCoreAttention and core.params["cp_config"].backend == "striped"
