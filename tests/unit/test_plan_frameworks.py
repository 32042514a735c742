"""The planner searches only what a framework runs (tensor parallelism is Megatron's: ZeRO 0 or 1, no optimizer
offload), splits each CP rank's tokens over TP under sequence parallelism, splits the heads over TP as the memory
model counts them, and names only the options a search has not tried when nothing fits."""
from __future__ import annotations

import pytest

from ctx_plugin.cli import main
from ctx_plugin.core.config import CPConfig
from ctx_plugin.core.rules import SettingNames, check_sequence_parallel, check_tp_heads, sequence_unit
from ctx_plugin.memory import ModelSpec, ParallelSpec
from ctx_plugin.plan import Cluster, enumerate_plans, explain, longest, predict
from ctx_plugin.plan.longest import parallel_layouts, unit
from ctx_plugin.plan.search import untried

LLAMA = ModelSpec.preset("llama3-8b")


def megatron_runs(p) -> bool:
    return p.tp == 1 or (p.zero_stage <= 1 and not p.offload_optimizer)


def test_tp_is_searched_only_at_megatron_zero_stages():
    plans = enumerate_plans(LLAMA, 131072, Cluster(nodes=1), tp_options=(1, 2), zero_stage=(1, 3))
    assert {(p.tp, p.zero_stage) for p in plans} == {(1, 1), (1, 3), (2, 1)}
    plans = enumerate_plans(LLAMA, 524288, Cluster(nodes=1), tp_options=(1, 2), zero_stage=(1, 3), modifiers=True)
    assert all(megatron_runs(p) for p in plans)
    assert any(p.tp == 2 for p in plans) and any(p.tp == 1 and p.offload_optimizer for p in plans)


def test_the_longest_search_leaves_out_tp_with_zero_2_3_and_optimizer_offload():
    result = longest(ModelSpec.preset("llama3-70b"), Cluster(nodes=4), tp_options=(1, 2, 4, 8))
    rows = [*result.plans, result.closest] + ([result.host_bound] if result.host_bound else [])
    assert all(megatron_runs(p) for p in rows), [p.setup for p in rows if not megatron_runs(p)]
    assert not any(p.tp > 1 and p.zero_stage == 3 for p in result.plans)


@pytest.mark.parametrize("call", [
    lambda: enumerate_plans(LLAMA, 8192, Cluster(nodes=1), tp_options=(2,), zero_stage=3),
    lambda: enumerate_plans(LLAMA, 8192, Cluster(nodes=1), tp_options=(2, 4), zero_stage=(2, 3), modifiers=True),
    lambda: longest(LLAMA, Cluster(nodes=1), tp_options=(2,), zero_stages=(2, 3)),
])
def test_a_search_with_nothing_runnable_is_one_clear_error(call):
    with pytest.raises(ValueError, match=r"nothing to search: .*tp=2 with ZeRO-[23]: no supported framework runs it"):
        call()


def test_predict_refuses_what_no_framework_runs():
    kw = dict(seq_len=8192, cluster=Cluster(nodes=1))
    parallel = ParallelSpec(cp=4, tp=2, sequence_parallel=True, dp=1, zero_stage=3)
    with pytest.raises(ValueError, match="tp=2 with ZeRO-3: no supported framework"):
        predict(LLAMA, parallel, "full", **kw)
    with pytest.raises(ValueError, match="tp=2 with ZeRO-1 and optimizer offload"):
        predict(LLAMA, ParallelSpec(cp=4, tp=2, sequence_parallel=True, dp=1, zero_stage=1), "full",
                offload_optimizer=True, **kw)
    assert predict(LLAMA, ParallelSpec(cp=4, tp=2, sequence_parallel=True, dp=1, zero_stage=1), "full", **kw).tp == 2


# ---------------------------------------------------------------- sequence parallelism: seq_len / cp over tp

def test_sequence_parallel_rule():
    zigzag = CPConfig(backend="zigzag")
    assert sequence_unit(zigzag, 2) == 4 and sequence_unit(zigzag, 2, 4) == 8 and sequence_unit(zigzag, 1, 8) == 8
    check_sequence_parallel(zigzag, 8200, 2, 4)
    names = SettingNames(seq_len="--seq-length", cp="--context-parallel-size", tp="--tensor-model-parallel-size")
    with pytest.raises(ValueError, match=r"--seq-length must be a positive multiple of 8 .*got 8196; pad the "
                                         r"sequence to a multiple of 8 \(e.g. 8192 or 8200\)"):
        check_sequence_parallel(zigzag, 8196, 2, 4, names)


def test_the_planner_splits_each_cp_ranks_tokens_over_tp():
    # 100,004 tokens: 4 × 25,001, so cp 1, 2, 4 split them, but 8 TP ranks cannot split one rank's share
    plans = enumerate_plans(LLAMA, 100004, Cluster(nodes=1), tp_options=(1, 8))
    assert plans and {p.tp for p in plans} == {1}
    with pytest.raises(ValueError, match="no configuration can run: .*sequence parallelism splits each of the cp 1 "
                                         "ranks' tokens over tp 8"):
        enumerate_plans(LLAMA, 100004, Cluster(nodes=1), tp_options=(8,))
    with pytest.raises(ValueError, match="multiple of 8"):
        predict(LLAMA, ParallelSpec(cp=2, tp=4, sequence_parallel=True, dp=1, zero_stage=1), "full", seq_len=8196,
                cluster=Cluster(nodes=1))
    # the longest search's lengths are multiples of cp × tp too
    assert unit([ParallelSpec(cp=1, tp=8, sequence_parallel=True)]) == 8
    assert unit(parallel_layouts(LLAMA, Cluster(nodes=1), (8,))) == 8


# ---------------------------------------------------------------- heads over TP: one rule, two readings

def test_tp_heads_rule():
    check_tp_heads(32, 8, 16)                                # megatron-core replicates each K/V head on 2 ranks
    with pytest.raises(ValueError, match=r"K/V heads 8 is not divisible by tp 16: the memory model .*valid tp: "
                                         r"\[1, 2, 4, 8\]"):
        check_tp_heads(32, 8, 16, SettingNames(tp="tp", kv_heads="K/V heads"), replicate_kv=False)
    with pytest.raises(ValueError, match=r"kv_heads 4 is neither divisible by tensor-parallel size 7 nor a divisor "
                                         r"of it .*valid tensor-parallel size: \[1, 2, 4, 28\]"):
        check_tp_heads(28, 4, 7)
    with pytest.raises(ValueError, match="query heads 4 is not divisible by tensor-parallel size 3"):
        check_tp_heads(4, 2, 3)


def test_the_planner_refuses_tp_beyond_the_kv_heads():
    with pytest.raises(ValueError, match="K/V heads 8 is not divisible by tp 16"):
        enumerate_plans(LLAMA, 8192, Cluster(nodes=1, gpus_per_node=16), tp_options=(16,))


# ---------------------------------------------------------------- nothing fits: what is left to try

def _advice(capsys, *extra) -> str:
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "128k", "--nodes", "2", "--gpu-memory", "0.5",
                 "--gpu-reserve", "0",
                 *extra]) == 1
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("nothing fits"))


def test_nothing_fits_names_only_untried_options(capsys):
    text = _advice(capsys)
    assert "--tp 2 4 8" in text and "--zero 2 3" in text and "--modifiers" in text and "add nodes" in text
    text = _advice(capsys, "--tp", "1", "2", "4", "8", "--zero", "0", "1", "2", "3")
    assert "--tp" not in text and "--zero" not in text and "--modifiers" in text
    text = _advice(capsys, "--tp", "2", "--zero", "0", "1")
    assert "--tp 4 8)" in text and "--tp 1 --zero 2 3" in text
    assert untried(LLAMA, Cluster(nodes=2), (1, 2, 4, 8), (0, 1, 2, 3), True) == []
    plans = enumerate_plans(LLAMA, 131072, Cluster(nodes=2, gpu_memory_gib=0.5, gpu_reserve_gib=0))
    assert explain(plans[0], plans).endswith("; add nodes, or shorten the sequence")


def test_the_output_says_what_it_left_out(capsys):
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "32k", "--nodes", "1", "--tp", "1", "2",
                 "--zero", "1", "3", "--top", "1"]) == 0
    assert "not searched: tp 2 with ZeRO-3 (no supported framework runs them" in capsys.readouterr().out


# ---------------------------------------------------------------- one framework's search and model state

def test_a_search_for_one_framework_keeps_to_it_and_counts_its_state():
    c = Cluster(nodes=2, gpu_reserve_gib=0)
    both = enumerate_plans(LLAMA, 131072, c, tp_options=(1, 2), zero_stage=(1,), modifiers=True)
    mega = enumerate_plans(LLAMA, 131072, c, tp_options=(1, 2), zero_stage=(1,), modifiers=True,
                           framework="megatron")
    ds = enumerate_plans(LLAMA, 131072, c, zero_stage=(1, 3), modifiers=True, framework="deepspeed")
    assert not any(p.offload_optimizer for p in mega) and any(p.tp == 2 for p in mega)
    assert {p.estimate.framework for p in mega} == {"megatron"} and {p.estimate.framework for p in ds} == {"deepspeed"}
    # without a framework: Megatron's state for ZeRO-1, DeepSpeed's wherever the optimizer is offloaded
    assert all(p.estimate.framework == ("deepspeed" if p.offload_optimizer else "megatron") for p in both)
    plain = [next(p for p in enumerate_plans(LLAMA, 131072, c, framework=f, presets=["selective"])
                  if p.layout == "zigzag cp=16 tp=1 dp=1") for f in ("megatron", "deepspeed")]
    gib = 2**30          # DeepSpeed: bf16 gradients (2P + the 2P/16 partition) and 2 GB of buckets vs fp32 ones
    n = 8_030_261_248
    assert plain[0].memory_bytes - plain[1].memory_bytes == 4 * n - (2 * n + 2 * n // 16) - 4 * 500_000_000
    assert plain[1].fits and not plain[0].fits and plain[0].memory_bytes > 89 * gib


@pytest.mark.parametrize("call, match", [
    (lambda: enumerate_plans(LLAMA, 8192, Cluster(nodes=1), zero_stage=(1, 3), framework="megatron"),
     "Megatron's distributed optimizer is ZeRO-1"),
    (lambda: longest(LLAMA, Cluster(nodes=1), tp_options=(1, 2), framework="deepspeed"),
     "DeepSpeed's context_parallel section has no tensor parallelism"),
    (lambda: predict(LLAMA, ParallelSpec(cp=8, zero_stage=1, framework="megatron"), "full", seq_len=8192,
                     cluster=Cluster(nodes=1), offload_optimizer=True), "Megatron: its distributed optimizer"),
])
def test_a_framework_that_does_not_run_the_search_is_one_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
