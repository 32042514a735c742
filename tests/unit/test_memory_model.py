"""The memory model's bookkeeping (parameters, ZeRO, parallel splits) and the `ctx-plugin memory` command."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ctx_plugin.memory import GiB, ModelSpec, ParallelSpec, estimate, param_count, resolve

LLAMA = ModelSpec.preset("llama3-8b")


def test_llama3_8b_parameter_count():
    assert abs(param_count(LLAMA) - 8.03e9) < 0.01e9


def test_zero_stages_shard_over_data_and_context_ranks():
    kw = dict(seq_len=8192, dtype=torch.bfloat16)
    base = estimate(LLAMA, ParallelSpec(cp=4, dp=2, zero_stage=0), "none", **kw)
    z1 = estimate(LLAMA, ParallelSpec(cp=4, dp=2, zero_stage=1), "none", **kw)
    z3 = estimate(LLAMA, ParallelSpec(cp=4, dp=2, zero_stage=3), "none", **kw)
    n = param_count(LLAMA)
    assert base.params == 2 * n and base.grads == 4 * n and base.optimizer == 12 * n     # Megatron: fp32 grads
    assert z1.optimizer == 12 * n // 8 and z1.grads == 4 * n
    assert 2 * n // 8 <= z3.params < 2 * n // 8 + 2**20 and z3.grads == 2 * n // 8      # DeepSpeed's ZeRO-3
    assert base.activations == z3.activations


def test_context_parallelism_divides_token_activations():
    one = estimate(LLAMA, ParallelSpec(cp=1), "full", seq_len=65536)
    eight = estimate(LLAMA, ParallelSpec(cp=8), "full", seq_len=65536)
    assert abs(eight.activations * 8 - one.activations) / one.activations < 0.01
    assert eight.cp_buffers > 0 and estimate(LLAMA, ParallelSpec(cp=1), "full", seq_len=65536,
                                             device="cpu").cp_buffers == 0
    d = LLAMA.head_dim                       # on CUDA one GPU has FlashAttention-2's backward workspace
    assert one.cp_buffers == 65536 * LLAMA.heads * d * 4 + 2 * 65536 * LLAMA.heads * d * 2


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
    with pytest.raises(ValueError, match=r"seq_len must be a positive multiple of 16, got 1000 \(zigzag over cp 8\)"):
        estimate(LLAMA, ParallelSpec(cp=8), "none", seq_len=1000)
    six = ModelSpec(layers=2, hidden=48, heads=6, kv_heads=3, ffn=96, vocab=10)      # what cp_attention refuses too
    with pytest.raises(ValueError, match=r"needs K/V heads per tensor-parallel rank \(3\) to divide 2"):
        estimate(six, ParallelSpec(cp=2, backend="ulysses"), "none", seq_len=64)
    with pytest.raises(ValueError, match="there are 6 query heads per tensor-parallel rank; use a cp that divides 6"):
        estimate(six, ParallelSpec(cp=4, backend="ulysses"), "none", seq_len=64)
    estimate(six, ParallelSpec(cp=3, backend="ulysses"), "none", seq_len=63)          # 3 K/V heads over 3 ranks
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
    assert spec.gated and spec.norm == "rms" and spec.family == "hf" and not spec.attention_bias
    assert ModelSpec.from_hf_config({**cfg, "model_type": "qwen2"}).attention_bias
    with pytest.raises(ValueError, match="not a decoder-only transformer config"):
        ModelSpec.from_hf_config({"model_type": "llama", "num_hidden_layers": 2})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ctx_plugin.cli", "memory", *args], capture_output=True, text=True,
                          timeout=120)


def test_memory_command_prints_every_preset_and_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib: pip install 'ctx-plugin[plot]'")
    png = tmp_path / "memory.png"
    proc = _cli("--model", "llama3-8b", "--seq-len", "128k", "--cp", "8", "--budget", "115", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    for preset in ("none", "attn_out", "selective", "core_attn", "mlp", "full:block:16", "full", "sqrt"):
        assert preset in rows
    est = estimate(LLAMA, ParallelSpec(cp=8, zero_stage=1), "full", seq_len=131072)
    assert f"{est.peak / GiB:.1f}" in rows["full"]
    chosen = resolve("budget:115", LLAMA, ParallelSpec(cp=8, zero_stage=1), seq_len=131072)
    assert f"budget:115 → {chosen} (fewest extra FLOPs" in proc.stdout
    assert "blocks: ctx_plugin (ctx_plugin's own block" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_command_from_hf_config_and_bad_input(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                "intermediate_size": 128, "vocab_size": 100, "model_type": "gpt_neox"}))
    proc = _cli("--model", str(path), "--seq-len", "4096", "--cp", "2")
    assert proc.returncode == 2 and "model_type 'gpt_neox' is not one whose decoder layers" in proc.stderr
    qwen3 = tmp_path / "qwen3.json"
    qwen3.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                 "intermediate_size": 128, "vocab_size": 100, "model_type": "qwen3", "head_dim": 16}))
    proc = _cli("--model", str(qwen3), "--seq-len", "4096", "--cp", "2")
    assert proc.returncode == 0 and "sqrt" in proc.stdout and "blocks: hf (Hugging Face" in proc.stdout, proc.stderr
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                 "intermediate_size": 128, "vocab_size": 100, "rms_norm_eps": 1e-5,
                                 "model_type": "llama"}))
    proc = _cli("--model", str(llama), "--seq-len", "4096", "--cp", "2", "--recompute", "full+tile_loss+offload:8")
    assert proc.returncode == 0, proc.stderr
    assert "blocks: hf (Hugging Face" in proc.stdout and "full+tile_loss+offload:8" in proc.stdout
    assert "host" in proc.stdout and "sqrt" not in proc.stdout
    bad = _cli("--model", "llama3-8b", "--seq-len", "1000", "--cp", "8")
    assert bad.returncode == 2 and "positive multiple of 16" in bad.stderr


HF_LLAMA = ModelSpec.preset("llama3-8b", family="hf")
MODS = dict(seq_len=1 << 20, dtype=torch.bfloat16)
P8 = ParallelSpec(cp=8, zero_stage=3)


def test_hf_family_differs_from_ctx_plugin_block():
    """HF keeps fp32 norm copies and separate q/k/v: other bytes than ctx_plugin's fused block."""
    assert estimate(HF_LLAMA, P8, "none", **MODS).activations != estimate(LLAMA, P8, "none", **MODS).activations
    assert estimate(HF_LLAMA, P8, "none", **MODS).family == "hf"
    with pytest.raises(ValueError, match="family must be one of"):
        ModelSpec.preset("llama3-8b", family="gpt")


def test_modifiers():
    full = estimate(HF_LLAMA, P8, "full", **MODS)
    tiled = estimate(HF_LLAMA, P8, "full+tile_loss:1024", **MODS)
    t, v, h = 131072, HF_LLAMA.vocab, HF_LLAMA.hidden                   # 131072 local tokens → 1024 per chunk
    assert full.logits_peak == t * v * 3 * 4
    # one chunk's fp32 logits next to the head-weight gradient summed so far and the hidden gradients done, or
    # autograd's out-of-place sum of two chunks' weight gradients (tests/unit/test_memory_blocks.py measures both)
    assert tiled.logits_peak == max(1024 * v * 3 * 4 + v * h * 2 + (t - 1024) * h * 2, 3 * v * h * 2 + t * h * 2)
    assert tiled.recompute_fraction > full.recompute_fraction            # the head runs again
    assert estimate(HF_LLAMA, P8, "full+tile_mlp", **MODS).recompute_peak < full.recompute_peak
    attn = estimate(HF_LLAMA, P8, "full+recompute_attn", **MODS)
    assert attn.attention_passes == 2 and full.attention_passes == 1
    assert attn.activations < full.activations and attn.recompute_fraction > 2 * full.recompute_fraction
    off = estimate(HF_LLAMA, P8, "full+offload:40", **MODS)
    x = (1 << 20) // 8 * 4096 * 2                                        # one region input, bf16
    assert off.host == 32 * x and off.fits_host and full.host == 0
    assert full.activations - off.activations == 32 * x                  # all on the host after the forward ...
    assert off.recompute_peak == full.recompute_peak + x                 # ... in backward: the previous region's
    #  input prefetched while the current one's is freed after its recomputation (HF's bf16 norms keep fp32 copies)
    both = estimate(HF_LLAMA, P8, "full+offload_attn:40", **MODS)
    assert both.host > off.host and not both.fits_host                   # pins too: over the 40 GiB budget
    assert both.peak < off.peak < full.peak


def test_budget_keeps_tiling_modifiers():
    with pytest.raises(ValueError, match="no recompute preset fits 120 GiB"):
        resolve("budget:120", HF_LLAMA, P8, seq_len=1 << 19)              # the logits alone need more
    tiled = resolve("budget:120+tile_loss+tile_mlp", HF_LLAMA, P8, seq_len=1 << 19)
    assert tiled.tile_loss and tiled.tile_mlp and str(tiled).startswith("full:block:")
    assert estimate(HF_LLAMA, P8, tiled, seq_len=1 << 19).peak <= 120 * GiB


def test_estimate_refuses_tensor_parallelism_it_does_not_model():
    """As the CLI does: K/V heads that tp does not divide (Megatron would replicate them; the model splits them)."""
    eight = ModelSpec(layers=2, hidden=256, heads=8, kv_heads=2, ffn=512, vocab=100)
    estimate(eight, ParallelSpec(tp=2), "none", seq_len=64)
    with pytest.raises(ValueError, match=r"kv_heads 2 is not divisible by tp 4: the memory model splits the K/V "
                                         r"heads .* valid tp: \[1, 2\]"):
        estimate(eight, ParallelSpec(tp=4), "none", seq_len=64)
    with pytest.raises(ValueError, match=r"heads 8 is not divisible by tp 3"):
        estimate(eight, ParallelSpec(tp=3), "none", seq_len=64)


def test_a_preset_run_as_another_family_is_that_familys_model():
    """`memory --model qwen2-7b --family hf`: the Hugging Face Qwen2 has q/k/v biases (7,615,616,512 parameters, the
    real model's); a family swapped onto the ctx_plugin preset dropped them."""
    from ctx_plugin.memory.report import model_from

    model = model_from("qwen2-7b", "hf")
    assert model == ModelSpec.preset("qwen2-7b", family="hf") and model.attention_bias
    assert param_count(model) == 7_615_616_512
    assert model_from("qwen2-7b") == ModelSpec.preset("qwen2-7b")
    assert model_from("llama3-8b", "megatron").family == "megatron"


def test_the_plot_draws_the_configuration_reported():
    """`memory --recompute full+tile_loss --plot`: the plot draws that configuration (it drew every table preset,
    unmodified); without --recompute, every preset of the table."""
    import argparse

    from ctx_plugin.memory.report import add_arguments, plot_series, recompute_arg, table_presets

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "llama3-8b", "--seq-len", "128k", "--cp", "8"])
    parallel = ParallelSpec(cp=8, zero_stage=1)
    one = recompute_arg("full+tile_loss")
    lens, series = plot_series(LLAMA, parallel, args, torch.bfloat16, [one])
    assert list(series) == ["full+tile_loss"] and 131072 in lens
    assert series["full+tile_loss"][lens.index(131072)] == \
        estimate(LLAMA, parallel, one, seq_len=131072).peak / GiB
    _, every = plot_series(LLAMA, parallel, args, torch.bfloat16, table_presets(LLAMA.layers))
    assert list(every) == [str(p) for p in table_presets(LLAMA.layers)]
