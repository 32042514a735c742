"""``ctx-plugin plan --modifiers`` when nothing fits: the closest configuration it names is the one with the least
GPU memory over every layout × preset × memory-saving setting (modifiers and optimizer offload included), not only
over the plain presets; when something fits, the configurations that do not are the plain presets, as before."""
from __future__ import annotations

import re
from dataclasses import replace

import torch

from ctx_plugin.cli import main
from ctx_plugin.memory import ModelSpec
from ctx_plugin.plan import Cluster, enumerate_plans, explain
from ctx_plugin.plan.frameworks import runnable
from ctx_plugin.plan.longest import parallel_layouts
from ctx_plugin.plan.variants import Checker, saving_sets
from ctx_plugin.recompute.presets import candidates

LLAMA = ModelSpec.preset("llama3-8b")
SEQ = 8 * 2**20                                # 8M tokens on one node of 8 × 80 GiB: nothing fits, whatever is set
STAGES = (0, 1, 2, 3)


def _least_gpu_memory(cluster: Cluster) -> int:
    """By brute force: the least GPU memory of any memory-saving setting of any preset on any tp-1 layout, at
    ZeRO-3 (the least memory a layout has), with and without optimizer offload."""
    check = Checker(LLAMA, cluster, SEQ, micro_batch=1, dtype=torch.bfloat16)
    best = None
    for layout in parallel_layouts(LLAMA, cluster, (1,), STAGES):
        top = replace(layout, zero_stage=3)
        for base in candidates(LLAMA.layers):
            for setting in saving_sets(base, optimizer=runnable(1, 3, True), offload=True):
                found = check(top, setting, base)
                if found is not None:
                    assert not found[3].fits
                    best = found[3].gpu_bytes if best is None else min(best, found[3].gpu_bytes)
    return best


def test_the_closest_configuration_may_carry_modifiers():
    cluster = Cluster(nodes=1)
    plans = enumerate_plans(LLAMA, SEQ, cluster, zero_stage=STAGES, modifiers=True)
    assert not any(p.fits for p in plans)
    closest = min(plans, key=lambda p: p.memory_bytes)
    assert plans[0] is closest                                    # ranked first: least memory among the misfits
    assert closest.memory_bytes == _least_gpu_memory(cluster)
    plain = min(p.memory_bytes for p in plans if not p.recompute.has_modifiers and not p.offload_optimizer)
    assert closest.memory_bytes < plain / 10                      # 133.2 GiB, against sqrt's 2482 GiB
    assert closest.recompute.has_modifiers and closest.offload_optimizer
    assert re.fullmatch(r"full(:block:\d+)?\+tile_loss\+tile_mlp\+recompute_attn\+offload:105", str(closest.recompute))
    text = explain(closest, plans)
    shown = str(closest.recompute)
    assert shown.endswith("+offload:105")                        # its budget, to 3 significant digits
    assert closest.recompute.offload_gib == 105 and text.startswith(
        f"nothing fits: the closest is {closest.layout} with recompute {shown}, optimizer offload, which needs "
        f"{closest.memory_gib:.1f} GiB > 75 GiB, and offloads ")
    assert "GiB offload budget" in text and "2482" not in text
    # the plain presets are still there, each with its own memory
    assert any(p.recompute == candidates(LLAMA.layers)[0] for p in plans)


def test_a_budget_rounded_down_binds_as_the_budget():
    """The planner's offload budget is what the host leaves to 3 significant digits (105.04 → 105 GiB): a setting
    that offloads more than it but fits the node's share names the budget, not the node's host memory."""
    from ctx_plugin.memory import ParallelSpec
    from ctx_plugin.plan.predict import predict

    p = predict(LLAMA, ParallelSpec(cp=8, backend="ulysses", zero_stage=3),
                "full+tile_loss+tile_mlp+recompute_attn+offload:105", seq_len=3440832, cluster=Cluster(nodes=1),
                offload_optimizer=True)
    assert not p.fits and p.gpu_fits
    assert p.reason.startswith("offloads 105.01 GiB per rank > its 105.00 GiB offload budget"), p.reason


def test_the_cli_names_the_closest_with_its_modifiers(capsys):
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "8m", "--nodes", "1", "--modifiers",
                 "--zero", "0", "1", "2", "3"]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("nothing fits"))
    assert re.search(r"ulysses cp=8 tp=1 dp=1 with recompute full(:block:\d+)?\+tile_loss\+tile_mlp\+recompute_attn"
                     r"\+offload:", line), line
    assert ", optimizer offload, which needs 133.2 GiB > 75 GiB" in line and "sqrt" not in line
    assert "+offload:105, optimizer offload" in line, line     # what the host leaves, to 3 significant digits


def test_without_modifiers_or_when_something_fits_the_misfits_are_the_plain_presets():
    cluster = Cluster(nodes=1)
    plans = enumerate_plans(LLAMA, 2**20, cluster, zero_stage=(1, 3), modifiers=True)
    assert plans[0].fits
    misfits = [p for p in plans if not p.fits]
    assert misfits and not any(p.recompute.has_modifiers or p.offload_optimizer for p in misfits)
    plain = enumerate_plans(LLAMA, SEQ, cluster, zero_stage=STAGES)
    assert not any(p.recompute.has_modifiers or p.offload_optimizer for p in plain)
    assert explain(plain[0], plain).startswith(f"nothing fits: the closest is {plain[0].layout} with recompute "
                                               f"{plain[0].recompute}, which needs ")
