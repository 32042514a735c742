"""The memory model's bookkeeping (parameters, ZeRO, parallel splits) and the `ctx-plugin memory` command."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ctx_plugin.memory import GiB, ModelSpec, ParallelSpec, estimate, param_count

LLAMA = ModelSpec.preset("llama3-8b")


def test_llama3_8b_parameter_count():
    assert abs(param_count(LLAMA) - 8.03e9) < 0.01e9


def test_zero_stages_shard_over_data_and_context_ranks():
    kw = dict(seq_len=8192, dtype=torch.bfloat16)
    base = estimate(LLAMA, ParallelSpec(cp=4, dp=2, zero_stage=0), "none", **kw)
    z1 = estimate(LLAMA, ParallelSpec(cp=4, dp=2, zero_stage=1), "none", **kw)
    z3 = estimate(LLAMA, ParallelSpec(cp=4, dp=2, zero_stage=3), "none", **kw)
    n = param_count(LLAMA)
    assert base.params == 2 * n and base.grads == 2 * n and base.optimizer == 12 * n
    assert z1.optimizer == 12 * n // 8 and z1.grads == 2 * n
    assert z3.params == 2 * n // 8 and z3.grads == 2 * n // 8
    assert base.activations == z3.activations


def test_context_parallelism_divides_token_activations():
    one = estimate(LLAMA, ParallelSpec(cp=1), "full", seq_len=65536)
    eight = estimate(LLAMA, ParallelSpec(cp=8), "full", seq_len=65536)
    assert abs(eight.activations * 8 - one.activations) / one.activations < 0.01
    assert eight.cp_buffers > 0 and one.cp_buffers == 0


def test_tensor_parallel_divides_head_and_mlp_terms():
    one = estimate(LLAMA, ParallelSpec(), "none", seq_len=8192)
    tp = estimate(LLAMA, ParallelSpec(tp=4, sequence_parallel=True), "none", seq_len=8192)
    assert 3.5 < one.activations / tp.activations < 4.1


def test_spec_validation():
    with pytest.raises(ValueError, match="kv_heads"):
        ModelSpec(layers=2, hidden=64, heads=4, kv_heads=3, ffn=128, vocab=10)
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
        ModelSpec.preset("gpt5")
    with pytest.raises(ValueError, match="ulysses_size .* must divide cp"):
        ParallelSpec(cp=6, backend="ulysses_ring", ulysses_size=4)
    with pytest.raises(ValueError, match="sequence_parallel needs tp > 1"):
        ParallelSpec(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"seq_len must be a positive multiple of 16 \(zigzag over cp=8\)"):
        estimate(LLAMA, ParallelSpec(cp=8), "none", seq_len=1000)
    with pytest.raises(ValueError, match="resolve budget:10 first"):
        estimate(LLAMA, ParallelSpec(), "budget:10", seq_len=1024)


def test_hf_config(tmp_path):
    cfg = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
           "intermediate_size": 512, "vocab_size": 1000, "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "model_type": "llama"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = ModelSpec.from_hf_config(path)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab) == (4, 256, 8, 2, 512, 1000)
    assert spec.gated and spec.norm == "rms"
    with pytest.raises(ValueError, match="not a decoder-only transformer config"):
        ModelSpec.from_hf_config({"num_hidden_layers": 2})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ctx_plugin.cli", "memory", *args], capture_output=True, text=True,
                          timeout=120)


def test_memory_command_prints_every_preset_and_plots(tmp_path):
    png = tmp_path / "memory.png"
    proc = _cli("--model", "llama3-8b", "--seq-len", "128k", "--cp", "8", "--budget", "115", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    for preset in ("none", "attn_out", "selective", "core_attn", "mlp", "full:block:16", "full", "sqrt"):
        assert preset in rows
    est = estimate(LLAMA, ParallelSpec(cp=8, zero_stage=1), "full", seq_len=131072)
    assert f"{est.peak / GiB:.1f}" in rows["full"]
    assert "budget:115 → full:block:16 (fewest extra FLOPs" in proc.stdout    # 4.8%, not mlp's 7.8%
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_command_from_hf_config_and_bad_input(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                "intermediate_size": 128, "vocab_size": 100}))
    proc = _cli("--model", str(path), "--seq-len", "4096", "--cp", "2")
    assert proc.returncode == 0 and "sqrt" in proc.stdout, proc.stderr
    bad = _cli("--model", "llama3-8b", "--seq-len", "1000", "--cp", "8")
    assert bad.returncode == 2 and "positive multiple of 16" in bad.stderr
