"""The planner's modifiers and the longest-sequence search: each modifier's cost by hand, the search against a
brute-force scan, monotonicity in host memory, the command's errors, and the README's table."""
from __future__ import annotations

import itertools
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ctx_plugin.cli import main
from ctx_plugin.memory import ModelSpec, ParallelSpec, ZeroSettings, estimate
from ctx_plugin.memory.model import layer_flops, param_count
from ctx_plugin.plan import Cluster, predict
from ctx_plugin.plan.costs import copy_exposed, mlp_chunks, optimizer_offload, tile_mlp_forwards
from ctx_plugin.plan.longest import longest, parallel_layouts, unit
from ctx_plugin.plan.longest_report import summary
from ctx_plugin.plan.predict import footprint
from ctx_plugin.plan.search import rank_key
from ctx_plugin.plan.variants import Checker, fitting, offload_budget_gib, settings
from ctx_plugin.recompute.presets import RecomputeConfig, candidates

# test_plan.py's hand-computable model and rates: zigzag cp=4, t=16 tokens per GPU, attention forward 4 s,
# dense forward+backward of the layer + head 1 s (R_MM FLOP/s).
TINY = ModelSpec(layers=1, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=64)
SEQ, R_ATTN, R_MM = 64, 33280, 4325376     # attention: 4·(64·65/2 pairs)·4·16/4 = 133120 FLOPs → 4 s


def cluster(**kw) -> Cluster:
    base = dict(nodes=1, gpus_per_node=4, gpu_memory_gib=80.0, intra_bw_gbs=8192 / 1e9, inter_bw_gbs=4096 / 1e9,
                attention_tflops=R_ATTN / 1e12, matmul_tflops=R_MM / 1e12)
    return Cluster(**{**base, **kw})


def tiny(recompute="none", *, model=TINY, offload_optimizer=False, zero=1, framework=None, **kw):
    c = cluster(**kw)
    parallel = ParallelSpec(cp=4, backend="zigzag", dp=c.gpus // 4, zero_stage=zero, framework=framework,
                            zero_settings=TOY)
    return predict(model, parallel, recompute, seq_len=SEQ, cluster=c, offload_optimizer=offload_optimizer)


def seconds(flops: float, rate: float = R_MM) -> float:
    return flops / rate * 1000          # in ms, as Prediction reports


def test_tile_loss_costs_the_logits_once_more():
    # 2·t·h·V = 2·16·64·64 FLOPs at the matmul rate, on top of the preset's own recompute
    for preset in ("none", "full"):
        extra = tiny(preset + "+tile_loss").recompute_ms - tiny(preset).recompute_ms
        assert extra == pytest.approx(seconds(2 * 16 * 64 * 64))


def test_tile_mlp_costs_one_mlp_forward_outside_regions_and_the_nested_share_inside():
    mlp = 2 * 16 * 64 * 128 * 3              # gated MLP forward: 2·t·h·f·3
    assert tiny("none+tile_mlp").recompute_ms - tiny("none").recompute_ms == pytest.approx(seconds(mlp))
    assert tiny("selective+tile_mlp").recompute_ms - tiny("selective").recompute_ms == pytest.approx(seconds(mlp))
    assert tiny("mlp+tile_mlp").recompute_ms == pytest.approx(tiny("mlp").recompute_ms)     # replaces its checkpoint
    # inside a full region with 4 chunks of 4 tokens: 3/4 of an MLP forward more (torch's nested checkpoint)
    assert mlp_chunks(16, 4, 64) == 4 and mlp_chunks(16, None, 64) == 1
    assert tiny("full+tile_mlp:4").recompute_ms - tiny("full").recompute_ms == pytest.approx(seconds(mlp * 3 / 4))
    assert tiny("full+tile_mlp").recompute_ms == pytest.approx(tiny("full").recompute_ms)    # one chunk: nothing
    assert tile_mlp_forwards(RecomputeConfig.parse("full:block:2+tile_mlp:4"), 5, 4) == (3.0, 2 * 3 / 4)


def nested_mlp_calls(chunks: int) -> int:
    """MLP forwards of one checkpointed layer whose MLP runs over checkpointed chunks, forward and backward."""
    from torch.utils.checkpoint import checkpoint
    calls, lin = [0], torch.nn.Linear(4, 4)

    def mlp(x):
        calls[0] += 1
        return lin(x).relu()

    def layer(x):
        return torch.cat([checkpoint(mlp, c, use_reentrant=False) for c in x.split(16 // chunks)]) + x

    checkpoint(layer, torch.randn(16, 4, requires_grad=True), use_reentrant=False).sum().backward()
    return calls[0]


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_nested_chunk_recompute_count_is_what_torch_does(chunks):
    # forward + the region's recompute (2·n) + the chunks' own recompute, n − 1 of them (costs.tile_mlp_forwards)
    assert nested_mlp_calls(chunks) == 2 * chunks + (chunks - 1)


def test_recompute_attn_costs_the_attention_forward_and_its_communication_again():
    full, again = tiny("full"), tiny("full+recompute_attn")
    assert again.recompute_ms - full.recompute_ms == pytest.approx(4000)        # F = 4 s at the attention rate
    # ring steps of 1 s compute hide 0.5 s transfers: the forward ring adds nothing; a slower link shows it
    assert again.exposed_ms == pytest.approx(full.exposed_ms)
    slow_full, slow = tiny("full", intra_bw_gbs=1024 / 1e9), tiny("full+recompute_attn", intra_bw_gbs=1024 / 1e9)
    # 1024 B/s: K/V step 4096 B = 4 s against 1 s of compute, 3 forward steps: 3 × 3 s again
    assert slow.exposed_ms - slow_full.exposed_ms == pytest.approx(9000)
    # the count of forward passes agrees with the memory model's
    est = estimate(TINY, ParallelSpec(cp=4, dp=1), "full+recompute_attn", seq_len=SEQ)
    assert est.attention_passes == 2
    assert estimate(TINY, ParallelSpec(cp=4, dp=1), "full", seq_len=SEQ).attention_passes == 1


def test_offload_copies_are_exposed_beyond_their_layer_compute():
    # copy_exposed by hand: 2 layers, 8 B each way at 1 B/s = 4 s per layer and direction; forward hides 3 s,
    # backward 5 s: exposed 2 × (1 + 0)
    assert copy_exposed(8, 2, 3.0, 5.0, 1.0) == pytest.approx(2.0)
    assert copy_exposed(0, 0, 3.0, 5.0, 1.0) == 0
    # TINY full+offload: the region input (t·h·e = 2048 B) goes down and back. Layer forward: dense 1310720 FLOPs
    # + attention 4 s; backward: 2 × dense + 2.5 × 4 s + the dense recompute. At 64 B/s (two GPUs per 128 B/s
    # link) each copy takes 32 s.
    c = dict(host_bw_gbs=128 / 1e9, gpus_per_host_link=2)
    p = tiny("full+offload:1", **c)
    est = estimate(TINY, ParallelSpec(cp=4, dp=1), "full+offload:1", seq_len=SEQ)
    assert est.host == 2048 and p.host_bytes == 2048
    dense = 1310720 / R_MM
    expected = (32 - (dense + 4)) + (32 - (3 * dense + 10))
    assert p.offload_ms == pytest.approx(expected * 1000)
    assert p.exposed_ms - tiny("full", **c).exposed_ms == pytest.approx(expected * 1000)
    # one GPU per link: twice the bandwidth
    assert Cluster(nodes=1, gpus_per_node=8, gpus_per_host_link=1).host_bandwidth == 2 * Cluster(nodes=1).host_bandwidth


def test_optimizer_offload_moves_the_state_to_host_and_costs_the_cpu_step():
    c = cluster(host_bw_gbs=1e3 / 1e9, host_adam_gparams_s=1e3 / 1e9, gpus_per_host_link=1)
    params = param_count(TINY)
    shard = -(-params // 4)                                 # ZeRO over dp × cp = 4
    host, cost = optimizer_offload(params, 4, 2, c)
    assert host == 16 * shard
    assert cost == pytest.approx(shard * 4 / 1e3 + shard * 4 / 1e3)    # 2·2 B/param over PCIe + 4 ranks' Adam
    on, off = (tiny("none", offload_optimizer=o, host_bw_gbs=1e3 / 1e9, host_adam_gparams_s=1e3 / 1e9,
                    gpus_per_host_link=1, framework="deepspeed") for o in (True, False))
    est = estimate(TINY, ParallelSpec(cp=4, dp=1, zero_stage=1, framework="deepspeed", zero_settings=TOY), "none",
                   seq_len=SEQ)
    assert off.memory_bytes - on.memory_bytes == est.peak - est.offloaded_peak and on.host_bytes == 16 * shard
    assert est.peak == est.training_peak and est.peak - est.offloaded_peak == est.optimizer
    # without a framework the offloaded configuration is DeepSpeed's, the other Megatron's (fp32 gradients)
    assert tiny("none", offload_optimizer=True).estimate.framework == "deepspeed"
    assert tiny("none").estimate.grads == 4 * params
    assert on.optimizer_ms == pytest.approx(cost * 1000) and on.exposed_ms - off.exposed_ms == pytest.approx(cost * 1000)
    with pytest.raises(ValueError, match="ZeRO stage 1, 2 or 3"):
        tiny("none", offload_optimizer=True, zero=0)


def test_host_memory_binds():
    # 8 GPUs per node share 1 GiB (0.5 reserved): 64 MiB per rank, less than the optimizer offload of llama3-8b
    small = Cluster(nodes=1, host_memory_gib=1.0, host_reserve_gib=0.5)
    assert small.host_bytes_per_rank == 2**26
    fp = footprint(ModelSpec.preset("llama3-8b"), ParallelSpec(cp=8, zero_stage=3), "full", seq_len=8192,
                   cluster=small, offload_optimizer=True)
    assert not fp.host_fits and not fp.fits and fp.gpu_fits
    assert offload_budget_gib(ModelSpec.preset("llama3-8b"), ParallelSpec(cp=8), small, torch.bfloat16, True) is None
    with pytest.raises(ValueError, match="host_reserve_gib"):
        Cluster(nodes=1, host_memory_gib=64, host_reserve_gib=64)


def test_gpu_reserve_is_left_free():
    """A plan fits under the card's memory less the reserve (the CUDA context, NCCL, fragmentation), not the card."""
    model, layout = ModelSpec.preset("llama3-8b"), ParallelSpec(cp=8, zero_stage=3)
    need = footprint(model, layout, "full", seq_len=8192, cluster=Cluster(nodes=1)).gpu_bytes
    card = need / 2**30 + 1.0
    fits = {reserve: footprint(model, layout, "full", seq_len=8192,
                               cluster=Cluster(nodes=1, gpu_memory_gib=card, gpu_reserve_gib=reserve)).gpu_fits
            for reserve in (0.0, 0.99, 1.01)}
    assert fits == {0.0: True, 0.99: True, 1.01: False}
    assert Cluster(nodes=1).gpu_bytes == 75 * 2**30                 # an 80 GiB card less the default 5 GiB
    with pytest.raises(ValueError, match="gpu_reserve_gib must be ≥ 0 and below gpu_memory_gib"):
        Cluster(nodes=1, gpu_memory_gib=4, gpu_reserve_gib=4)


def test_mfu_is_model_flops_over_step_time_and_peak():
    p = tiny("full+tile_loss", peak_tflops=1e-6)
    dense, _, attn = layer_flops(TINY, ParallelSpec(cp=4), 16, SEQ)
    model_flops = 3 * (dense + attn) + 6 * 16 * 64 * 64          # no recompute counted
    assert p.model_flops == pytest.approx(model_flops)
    assert p.mfu == pytest.approx(model_flops / (p.step_ms / 1000 * 1e6))


# ---------------------------------------------------------------- the search against a brute-force scan

SMALL = ModelSpec(layers=3, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=3000)    # the logits weigh most
DEEP = ModelSpec(layers=4, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=256)       # the layers weigh most
# DeepSpeed's buckets scaled to these models (its defaults, 5e8 elements, would be all of a few MiB GPU)
TOY = ZeroSettings(reduce_bucket_size=1000, stage3_prefetch_bucket_size=1000, stage3_max_reuse_distance=2000)


def two_gpus(gpu_mib: float, host_mib: float) -> Cluster:
    return Cluster(nodes=1, gpus_per_node=2, gpu_memory_gib=gpu_mib / 1024, host_memory_gib=host_mib / 1024,
                   gpu_reserve_gib=0.0, host_reserve_gib=0.0)


def brute_force_fits(model: ModelSpec, c: Cluster, seq_len: int, stages=(0, 3), tps=(1,), zero=TOY) -> list:
    """Every configuration (no dominance rule) that fits at ``seq_len`` and that a framework runs, predicted."""
    out = []
    for layout in parallel_layouts(model, c, tps, stages, zero_settings=zero):
        for z, base in itertools.product(stages, candidates(model.layers)):
            parallel = replace(layout, zero_stage=z)
            for s in settings(base, optimizer=z >= 1, offload=True):
                if layout.tp > 1 and (z > 1 or s.offload_optimizer):      # Megatron: ZeRO 0/1, no optimizer offload
                    continue
                budget = offload_budget_gib(model, parallel, c, torch.bfloat16, s.offload_optimizer)
                if s.offload is not None and budget is None:
                    continue
                rec = s.apply(base, budget)
                fp = footprint(model, parallel, rec, seq_len=seq_len, cluster=c, offload_optimizer=s.offload_optimizer)
                if fp.fits:
                    out.append(predict(model, parallel, rec, seq_len=seq_len, cluster=c,
                                       offload_optimizer=s.offload_optimizer))
    return out


@pytest.mark.parametrize("model, gpu_mib, host_mib", [(SMALL, 40, 40), (SMALL, 24, 200), (DEEP, 8, 0.5),
                                                     (DEEP, 8, 4), (DEEP, 8, 1000)])
def test_longest_equals_a_brute_force_scan(model, gpu_mib, host_mib):
    c = two_gpus(gpu_mib, host_mib)
    result = longest(model, c, zero_stages=(0, 3), zero_settings=TOY)
    step = unit(parallel_layouts(model, c, (1,)))
    assert result.unit == step == 4 and result.seq_len % step == 0
    at = brute_force_fits(model, c, result.seq_len)
    assert at, "the brute force finds nothing that fits at the planner's longest length"
    assert not brute_force_fits(model, c, result.seq_len + step)
    assert not result.closest.fits and result.closest.tokens_per_gpu * result.closest.cp == result.seq_len + step
    # the fastest configuration is the brute force's fastest
    best = sorted(at, key=rank_key)[0]
    assert result.winner.tokens_per_s_per_gpu == pytest.approx(best.tokens_per_s_per_gpu)
    assert result.winner.fits and all(p.fits for p in result.plans)


@pytest.mark.parametrize("model, gpus, gpu_mib, host_mib, tps", [
    (SMALL, 2, 40, 40, (1, 2)), (DEEP, 2, 8, 4, (2,)), (DEEP, 4, 8, 4, (1, 2)), (DEEP, 4, 8, 4, (2,)),
    (SMALL, 4, 40, 40, (2,))])
def test_longest_with_tensor_parallelism_equals_a_brute_force_scan(model, gpus, gpu_mib, host_mib, tps):
    """With tensor parallelism (and sequence parallelism's unit), only what a framework runs: tp 2 at ZeRO 0 or 1
    without optimizer offload."""
    c = Cluster(nodes=1, gpus_per_node=gpus, gpu_memory_gib=gpu_mib / 1024, host_memory_gib=host_mib / 1024,
                gpu_reserve_gib=0.0, host_reserve_gib=0.0)
    stages = (0, 1, 3)
    result = longest(model, c, tp_options=tps, zero_stages=stages, zero_settings=TOY)
    step = unit(parallel_layouts(model, c, tps, stages, zero_settings=TOY))
    assert {p.tp for p in parallel_layouts(model, c, tps, stages, zero_settings=TOY)} == set(tps)
    assert result.unit == step and result.seq_len % step == 0
    at = brute_force_fits(model, c, result.seq_len, stages=stages, tps=tps)
    assert at, "the brute force finds nothing that fits at the planner's longest length"
    assert not brute_force_fits(model, c, result.seq_len + step, stages=stages, tps=tps)
    best = sorted(at, key=rank_key)[0]
    assert result.winner.tokens_per_s_per_gpu == pytest.approx(best.tokens_per_s_per_gpu)
    for p in [*result.plans, result.closest] + ([result.host_bound] if result.host_bound else []):
        assert p.tp == 1 or (p.zero_stage <= 1 and not p.offload_optimizer), p.setup


def test_more_host_memory_never_shortens_the_longest_sequence():
    results = [longest(DEEP, two_gpus(8, h), zero_stages=(0, 3), zero_settings=TOY) for h in (0.5, 1, 2, 4, 8, 1000)]
    lengths = [r.seq_len for r in results]
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0]
    # where host memory holds the length back, a configuration that fits its GPUs one unit longer says so
    bound = results[3].host_bound
    assert lengths[3] < lengths[-1] and bound is not None and bound.gpu_fits and not bound.host_fits
    assert "host memory binds" in summary(results[3], two_gpus(8, 4))


def test_nothing_fits_is_one_clear_error():
    with pytest.raises(ValueError, match="nothing fits even"):
        longest(SMALL, Cluster(nodes=1, gpus_per_node=2, gpu_memory_gib=1e-4, gpu_reserve_gib=0), zero_settings=TOY)


# ---------------------------------------------------------------- the command

LONGEST = ["plan", "--model", "llama3-8b", "--max-seq-len", "--nodes", "1"]


@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "4k"], "drop --seq-len"),
    (["--plot", "x.png"], "drop --plot"),
    (["--all-presets"], "drop --all-presets"),
    (["--modifiers"], "drop --modifiers"),
    (["--host-memory", "0"], "argument --host-memory: '0' must be > 0"),
    (["--host-reserve", "2000"], "host_reserve_gib must be ≥ 0 and below host_memory_gib"),
    (["--host-reserve", "-1"], "must be ≥ 0"),
    (["--gpu-reserve", "80"], "gpu_reserve_gib must be ≥ 0 and below gpu_memory_gib (80)"),
    (["--gpu-reserve", "-1"], "argument --gpu-reserve"),
    (["--gpus-per-host-link", "0"], "--gpus-per-host-link"),
    (["--host-adam", "nan"], "not finite"),
    (["--zero", "4"], "invalid choice"),
])
def test_cli_errors_are_one_line(extra, message, capsys, tmp_path):
    argv = [*LONGEST, *(str(tmp_path / e) if e.endswith(".png") else e for e in extra)]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr()
    assert exc.value.code == 2 and err.out == ""
    assert err.err.count("\n") == 1 and err.err.startswith("ctx-plugin plan: error: ") and message in err.err


def test_cli_needs_a_length_or_the_search(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama3-8b", "--nodes", "1"])
    assert "give --seq-len <tokens> (plan one length) or --max-seq-len" in capsys.readouterr().err


# ---------------------------------------------------------------- the README's table

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_rows() -> dict[str, str]:
    """The planner table's rows: the command → the value the README states."""
    text = README.read_text()
    block = text[text.index("<!-- planner-table -->"):text.index("<!-- /planner-table -->")]
    rows = re.findall(r"^\| ([^|]+?) \| `(ctx-plugin plan [^`]+)` \| ([^|]+?) \| [^|]+ \| ([^|]+?) \|$", block, re.M)
    return {cmd: (value, binds) for _, cmd, value, binds in rows}


def test_readme_table_is_what_the_planner_prints(capsys):
    rows = readme_rows()
    assert len(rows) == 4
    for cmd, (value, binds) in rows.items():
        assert main(cmd.split()[1:]) == 0
        out = capsys.readouterr().out
        if "--max-seq-len" in cmd:
            found = re.search(r"longest sequence: ([\d,]+) ", out).group(1)
            assert value.startswith(found + " "), (cmd, value, found)
            term = re.search(r"does not fit: (GPU memory|host memory) binds", out).group(1)
            assert binds.startswith(term), (cmd, binds, term)
            # what binds is over its limit (the +offload budget, floored to 3 digits, may bind before the node)
            over = re.search(r"does not fit: .*?: ([-\d,.]+) MiB \(([-\d.]+)%\) over", out)
            assert not over.group(1).startswith("-"), (cmd, over.group(0))      # 0.00: a few bytes over
        else:
            found = re.search(r"MFU ([\d.]+%)", out).group(1)
            assert value.startswith(found), (cmd, value, found)


def test_summary_names_the_binding_term():
    c = Cluster(nodes=1, gpus_per_node=2, gpu_memory_gib=40 / 1024, host_memory_gib=40 / 1024, gpu_reserve_gib=0.0,
                host_reserve_gib=0.0)
    text = summary(longest(SMALL, c, zero_stages=(0, 3), zero_settings=TOY), c)
    assert "longest sequence: " in text and "fastest configuration there: " in text
    assert re.search(r"does not fit: (GPU memory binds: .* over; its largest part is|host memory binds: )", text)


def test_fitting_yields_exactly_the_minimal_fitting_settings_at_their_lowest_stage():
    c, stages = two_gpus(8, 4), (0, 1, 3)
    layout = ParallelSpec(cp=2, backend="zigzag", dp=1, zero_settings=TOY)
    result = longest(DEEP, c, zero_stages=(0, 3), zero_settings=TOY)
    for seq_len in (result.seq_len // 16 * 4, result.seq_len * 3 // 32 * 4, result.seq_len * 5 // 32 * 4):
        check = Checker(DEEP, c, seq_len, micro_batch=1, dtype=torch.bfloat16)
        got = {(rec, opt, par.zero_stage) for par, rec, opt, _ in fitting(check, layout, candidates(DEEP.layers), stages)}
        want = set()
        for base in candidates(DEEP.layers):
            fit = {}
            for s in settings(base, optimizer=True, offload=True):
                for z in stages:
                    if s.offload_optimizer and z == 0:
                        continue
                    found = check(replace(layout, zero_stage=z), s, base)
                    if found is not None and found[3].fits:
                        fit[s] = z
                        break
            for s, z in fit.items():
                if not any(s != m and s.covers(m) for m in fit):
                    rec = check.tighten(check(replace(layout, zero_stage=stages[-1]), s, base), s, base)[1]
                    want.add((rec, s.offload_optimizer, z))
        assert got == want and len(want) > 1


def test_a_higher_zero_stage_heavier_than_a_lower_one_is_still_searched():
    """At DeepSpeed's default bucket sizes (2 GB and more of fixed buffers) ZeRO-3 weighs more than Megatron's ZeRO-1
    for a small model: the search tries each layout at its lightest stage, and matches the brute-force scan."""
    from ctx_plugin.plan.variants import stage_order

    c = two_gpus(3 * 1024, 1000)
    assert stage_order(SMALL, ParallelSpec(cp=2, dp=1), (1, 3), torch.bfloat16) == (3, 1)
    assert stage_order(ModelSpec.preset("llama3-8b"), ParallelSpec(cp=8), (0, 1, 2, 3), torch.bfloat16) == (0, 1, 2, 3)
    result = longest(SMALL, c, zero_stages=(1, 3))
    assert result.plans and {p.zero_stage for p in result.plans} == {1}
    step = unit(parallel_layouts(SMALL, c, (1,)))
    assert brute_force_fits(SMALL, c, result.seq_len, stages=(1, 3), zero=ZeroSettings())
    assert not brute_force_fits(SMALL, c, result.seq_len + step, stages=(1, 3), zero=ZeroSettings())
