"""The planner: memory straight from the memory model, step times by the overlap rule, ranking, the command."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from ctx_plugin.cli import main
from ctx_plugin.memory import ModelSpec, ParallelSpec, estimate
from ctx_plugin.names import Backend
from ctx_plugin.plan import Cluster, enumerate_plans, explain, layouts, predict, ring_step

LLAMA = ModelSpec.preset("llama3-8b")

# A model small enough to compute by hand: L=1, h=64, 4 heads (4 K/V) × d=16, f=128, V=64.
TINY = ModelSpec(layers=1, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=64)
SEQ = 64
# Rates in FLOP/s chosen so that times are round numbers of seconds (the model's units are TFLOP/s and GB/s).
R_ATTN = 33280            # zigzag cp=4: F = 4·pairs·a·d/cp, pairs = 64·65/2 = 2080: 4·2080·4·16/4 = 133120 → 4 s;
                          # per step c = 1 s
R_MM = 4325376            # 3·L·2·t·h·(2q+2kv+3f) + 6·t·h·V = 3·1310720 + 393216 → 1 s


def cluster(*, nodes=1, gpus_per_node=4, intra=8192, inter=4096, memory=80.0) -> Cluster:
    return Cluster(nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_gib=memory, intra_bw_gbs=intra / 1e9,
                   inter_bw_gbs=inter / 1e9, attention_tflops=R_ATTN / 1e12, matmul_tflops=R_MM / 1e12)


def tiny(backend="zigzag", cp=4, tp=1, recompute="none", ulysses_size=1, **kw):
    c = cluster(**kw)
    parallel = ParallelSpec(cp=cp, backend=backend, ulysses_size=ulysses_size, tp=tp, sequence_parallel=tp > 1,
                            dp=c.gpus // (cp * tp), zero_stage=1)
    return predict(TINY, parallel, recompute, seq_len=SEQ, cluster=c)


def test_overlap_rule():
    assert ring_step(2.0, 1.0) == 0
    assert ring_step(1.0, 3.0) == 2.0
    assert ring_step(1.0, 1.0) == 0
    with pytest.raises(ValueError, match="non-negative"):
        ring_step(-1.0, 1.0)


def test_ring_hidden_and_exposed_by_hand():
    # zigzag cp=4, t=16 tokens per GPU: K/V step 2·16·4·16·2 = 4096 B, dK/dV hop (fp32) 8192 B.
    # Forward steps compute c = 1 s, backward 2.5 s.
    # 8192 B/s: T = 0.5, T' = 1. Forward 3 × ring_step(1, .5) = 0; backward ring_step(2.5, .5) +
    # 2 × ring_step(2.5, 1.5) + ring_step(2.5, 1) = 0, plus the last dK/dV hop 1 s → 1 s, every step hidden.
    hidden = tiny(intra=8192)
    assert hidden.ring_hidden is True and hidden.exposed_ms == pytest.approx(1000)
    assert hidden.ring_exposed_ms == pytest.approx(1000)
    # 4096 B/s: T = 1, T' = 2. Forward 3 × ring_step(1, 1) = 0; backward ring_step(2.5, 1) + 2 × ring_step(2.5, 3)
    # + ring_step(2.5, 2) + 2 = 0 + 1 + 0 + 2 = 3 s.
    exposed = tiny(intra=4096)
    assert exposed.ring_hidden is False and exposed.exposed_ms == pytest.approx(3000)
    # compute: attention 4 s × (1 + 2.5) + dense and head 1 s.
    assert hidden.compute_ms == pytest.approx(15000) and exposed.compute_ms == pytest.approx(15000)
    assert hidden.step_ms == pytest.approx(16000)


def test_crossing_nodes_switches_to_inter_node_bandwidth():
    one_node = tiny(gpus_per_node=4, intra=8192, inter=4096)
    two_nodes = tiny(nodes=2, gpus_per_node=2, intra=8192, inter=4096)   # the cp=4 group spans 2 nodes
    assert not one_node.cp_inter_node and two_nodes.cp_inter_node
    assert one_node.exposed_ms == pytest.approx(1000) and two_nodes.exposed_ms == pytest.approx(3000)


def test_minimum_tokens_to_hide_by_hand():
    # t* = t·max(T/c) (the backward step binds): T + T' = 1.5 s against 2.5 s → 16·0.6 = 9.6 → 10
    assert tiny(intra=8192).min_tokens_to_hide == 10
    assert tiny(intra=4096).min_tokens_to_hide == 20                          # 16·3/2.5 = 19.2 → 20
    # Llama-3-8B across 2 nodes at 480 TFLOP/s, 50 GB/s: 8 K/V of 32 heads: 8·6·480e12/(2.5·32·50e9) = 5760;
    # forward alone would need 8·2·480e12/(32·50e9) = 4800. 32 K/V heads (Llama-2-7B): 4× that.
    kw = dict(seq_len=131072, cluster=Cluster(nodes=2))
    assert predict(LLAMA, ParallelSpec(cp=16), "none", **kw).min_tokens_to_hide == 5760
    assert predict(ModelSpec.preset("llama2-7b"), ParallelSpec(cp=16), "none", **kw).min_tokens_to_hide == 23040
    # inside one node (450 GB/s) far fewer tokens suffice
    assert predict(LLAMA, ParallelSpec(cp=8, dp=2), "none", **kw).min_tokens_to_hide == 640


def test_other_backends_by_hand():
    # contiguous ring, causal: the last rank's queries 48..63 hold 16·48 + 16·17/2 = 904 of the 2080 pairs, against
    # 520 on average (≈ (2r−1)/r = 7/4 of the balanced work): attention 4 s · 904/520.
    assert tiny(backend="ring").compute_ms == pytest.approx((4 * 904 / 520 * 3.5 + 1) * 1000)
    # Ulysses over 4 ranks: 8 all-to-alls of 3/4 · 16·(2·4 + 2·4)·16·2 = 6144 B at 8192 B/s = 0.75 s each.
    u = tiny(backend="ulysses")
    assert u.exposed_ms == pytest.approx(6000) and u.ring_hidden is None and u.min_tokens_to_hide is None
    # all-gather: forward 3·2·16·4·16·2 = 12288 B (1.5 s), backward again + fp32 reduce-scatter 3× that (4.5 s)
    assert tiny(backend="allgather").exposed_ms == pytest.approx(6000)
    # tp=2, cp=2 (t=32, 2 heads per TP rank): 8 sequence-parallel collectives of 32·64·2·½ B = 0.25 s each;
    # ring of 2: c = 2 s, T = 0.5, T' = 1 → only the last dK/dV hop shows (1 s).
    assert tiny(cp=2, tp=2).exposed_ms == pytest.approx(3000)


def test_recompute_time_comes_from_the_memory_model():
    base = tiny()
    # full: the layer's matmuls once more (attention pinned): 1310720 FLOPs at R_MM
    assert tiny(recompute="full").recompute_ms == pytest.approx(1310720 / R_MM * 1000)
    assert tiny(recompute="full").compute_ms == pytest.approx(base.compute_ms + 1310720 / R_MM * 1000)
    # core_attn: the attention forward again (4 s) and its ring forward (hidden here)
    assert tiny(recompute="core_attn").recompute_ms == pytest.approx(4000)
    assert base.recompute_ms == 0 and tiny(recompute="selective").recompute_ms == 0
    # full recompute with TP repeats the layer's 4 forward sequence-parallel collectives (0.25 s each)
    assert tiny(cp=2, tp=2, recompute="full").exposed_ms == pytest.approx(tiny(cp=2, tp=2).exposed_ms + 1000)


CASES = [("ring", 8, 1, 1), ("zigzag", 8, 1, 1), ("striped", 4, 1, 1), ("ulysses", 8, 1, 1), ("ulysses", 4, 2, 1),
         ("ulysses_ring", 8, 1, 2), ("ulysses_ring", 4, 2, 2), ("allgather", 8, 1, 1), ("allgather", 8, 2, 1),
         ("zigzag", 16, 1, 1), ("zigzag", 4, 2, 1)]


@pytest.mark.parametrize("backend, cp, tp, u", CASES)
@pytest.mark.parametrize("preset", ["none", "selective", "mlp", "full:block:5", "full", "sqrt", "core_attn"])
def test_memory_equals_the_memory_model(backend, cp, tp, u, preset):
    parallel = ParallelSpec(cp=cp, backend=backend, ulysses_size=u, tp=tp, sequence_parallel=tp > 1,
                            dp=16 // (cp * tp), zero_stage=1)
    kw = dict(seq_len=131072, micro_batch=1, dtype=torch.bfloat16)
    plan = predict(LLAMA, parallel, preset, cluster=Cluster(nodes=2), **kw)
    assert plan.memory_bytes == estimate(LLAMA, parallel, preset, **kw).peak


def test_enumerated_memory_equals_the_memory_model():
    plans = enumerate_plans(LLAMA, 65536, Cluster(nodes=1), tp_options=(1, 2), micro_batch=2, zero_stage=2)
    assert {p.backend for p in plans} == set(Backend)
    for p in plans[::7]:
        parallel = ParallelSpec(cp=p.cp, backend=p.backend, tp=p.tp, sequence_parallel=p.tp > 1, dp=p.dp,
                                ulysses_size=p.ulysses_size if p.backend == Backend.ULYSSES_RING else 1, zero_stage=2)
        est = estimate(LLAMA, parallel, p.recompute, seq_len=65536, micro_batch=2, dtype=torch.bfloat16)
        assert p.memory_bytes == est.peak


def test_layouts_cover_every_backend():
    assert {b for b, _ in layouts(8)} == set(Backend)
    assert [u for b, u in layouts(8) if b == Backend.ULYSSES_RING] == [2, 4]
    assert len(layouts(1)) == 1


def test_ranking_fitting_first_then_by_memory():
    plans = enumerate_plans(LLAMA, 131072, Cluster(nodes=2), tp_options=(1, 2))
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    fitting = [p for p in plans if p.fits]
    rates = [p.tokens_per_s_per_gpu for p in fitting]
    assert rates == sorted(rates, reverse=True)
    for dp in {p.dp for p in fitting}:                 # at equal dp that is ascending step time
        steps = [p.step_ms for p in fitting if p.dp == dp]
        assert steps == sorted(steps)
    memory = [p.memory_bytes for p in plans if not p.fits]
    assert memory == sorted(memory)
    assert explain(plans[0], plans).startswith("winner: ")


def test_skipped_layouts_and_bad_input():
    # 28 heads, 4 K/V heads (Qwen2-7B): Ulysses over 8 cannot split the heads, so no ulysses at cp=8
    qwen = ModelSpec.preset("qwen2-7b")
    plans = enumerate_plans(qwen, 32768, Cluster(nodes=1), presets=["full"])
    assert not any(p.backend == Backend.ULYSSES and p.cp == 8 for p in plans)
    assert any(p.backend == Backend.ULYSSES and p.cp == 2 for p in plans)
    with pytest.raises(ValueError, match="valid tp"):
        enumerate_plans(LLAMA, 8192, Cluster(nodes=1), tp_options=(3,))
    with pytest.raises(ValueError, match="micro_batch must be a positive int"):
        enumerate_plans(LLAMA, 8192, Cluster(nodes=1), micro_batch=0)
    with pytest.raises(ValueError, match="no configuration can run"):
        enumerate_plans(LLAMA, 1001, Cluster(nodes=1))
    with pytest.raises(ValueError, match="nodes must be a positive int"):
        Cluster(nodes=0)
    with pytest.raises(ValueError, match="inter_bw_gbs must be a positive number"):
        Cluster(nodes=1, inter_bw_gbs=0)
    with pytest.raises(ValueError, match="not budget"):
        predict(LLAMA, ParallelSpec(cp=8), "budget:80", seq_len=8192, cluster=Cluster(nodes=1))


PLAN = ["plan", "--model", "llama3-8b", "--seq-len", "128k", "--nodes", "2", "--gpus-per-node", "8",
        "--gpu-memory", "80"]


def test_cli_prints_a_table_and_the_winner(capsys):
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    assert "rank backend" in out and "tok/s/GPU" in out
    rows = [line for line in out.splitlines() if line.strip()[:2] in ("1 ", "2 ")]
    assert len(rows) == 2
    assert "\nwinner: " in out and "because" in out and "tokens per GPU" in out


def test_cli_nothing_fits(capsys):
    assert main([*PLAN[:-1], "0.5", "--gpu-reserve", "0"]) == 1
    out = capsys.readouterr().out
    assert "nothing fits: the closest is" in out and "rank backend" in out


def test_cli_hf_config_and_bench(tmp_path, capsys):
    cfg = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
           "intermediate_size": 512, "vocab_size": 1000, "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "model_type": "llama"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"attention_tflops": 123.0}))
    assert main(["plan", "--model", str(path), "--seq-len", "16k", "--nodes", "1", "--tp", "1", "2",
                 "--bench", str(bench), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "attention 123," in out and "winner: " in out


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_cli_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "32k", "--nodes", "1", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "argument --nodes: '0' is not a whole number ≥ 1"),
    (["--model", "gpt5"], "neither a model preset"),
    (["--tp", "3"], "valid tp"),
    (["--bench", "missing.json"], "cannot read"),
    (["--top", "0"], "argument --top"),
])
def test_cli_bad_input(args, message, capsys, tmp_path):
    argv = list(PLAN)
    for flag, value in zip(args[::2], args[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, str(tmp_path / value) if flag == "--bench" else value]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_bench_without_the_key(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit):
        main([*PLAN, "--bench", str(bench)])
    assert "no 'attention_tflops' key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*PLAN, "--bench", str(bench), "--attention-tflops", "400"])
    assert "not both" in capsys.readouterr().err


def test_modifiers_make_configurations_fit_that_the_presets_alone_do_not():
    c = Cluster(nodes=1)
    plain = enumerate_plans(LLAMA, 1048576, c, zero_stage=(1, 3))
    assert not plain[0].fits                          # 1M tokens on 8 GPUs: no preset fits by itself
    plans = enumerate_plans(LLAMA, 1048576, c, zero_stage=(1, 3), modifiers=True)
    winner = plans[0]
    assert winner.fits and winner.recompute.has_modifiers and 0 < winner.mfu < 1
    for p in plans[:20]:                              # memory: the memory model's, less an offloaded optimizer
        parallel = ParallelSpec(cp=p.cp, backend=p.backend, tp=p.tp, dp=p.dp, zero_stage=p.zero_stage,
                                ulysses_size=p.ulysses_size if p.backend == Backend.ULYSSES_RING else 1)
        est = estimate(LLAMA, parallel, p.recompute, seq_len=1048576)
        assert p.memory_bytes == est.peak - (est.optimizer if p.offload_optimizer else 0)
        assert p.host_bytes >= est.host
    assert explain(winner, plans).startswith(f"winner: {winner.setup}: ")


def test_cli_modifiers_and_zero_stages(capsys):
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "1m", "--nodes", "1", "--modifiers", "--zero", "1", "3",
                 "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO 1/3, with memory modifiers and offload" in out and "MFU" in out and "+tile_loss" in out
