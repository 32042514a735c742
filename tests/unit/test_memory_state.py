"""The model state the memory model counts per framework (:mod:`ctx_plugin.memory.state`), against figures that
do not come from it: Megatron's documented bytes per parameter (its distributed optimizer's "6 + 12/d" with fp32
gradients under bf16) and the bytes measured on real DeepSpeed 0.19.8 engines on two CPU ranks (live tensor
storages after the step and at the step's peak, foreach Adam, bf16, P = 3,281,920 parameters, largest 409,600,
5,120 below the persistence threshold, reduce bucket 1e6 elements; the measurement also holds the batch and the
activations, about 0.02 MB)."""
from __future__ import annotations

import pytest
import torch

from ctx_plugin.memory import ModelSpec, ParallelSpec, ZeroSettings, estimate, param_count
from ctx_plugin.memory.state import deepspeed_state, megatron_state
from ctx_plugin.names import Framework

LLAMA = ModelSpec.preset("llama3-8b")
P, N, LARGEST, PERSISTENT = 3_281_920, 2, 409_600, 5_120
BUCKET = ZeroSettings(reduce_bucket_size=1_000_000, stage3_prefetch_bucket_size=1_000_000)


def _ds(stage: int):
    return deepspeed_state(P, stage, N, torch.bfloat16, BUCKET, largest=LARGEST, persistent=PERSISTENT)


@pytest.mark.parametrize("stage, measured_mb", [(0, 78.787), (1, 39.404), (2, 39.404), (3, 41.404)])
def test_deepspeed_step_peak_is_the_measured_one(stage, measured_mb):
    got = _ds(stage).step / 1e6
    assert measured_mb - 0.03 <= got <= measured_mb, (stage, got)


@pytest.mark.parametrize("stage, measured_mb", [(0, 45.947), (1, 26.255), (3, 28.266)])
def test_deepspeed_state_after_the_step_is_the_measured_one(stage, measured_mb):
    s = _ds(stage)
    kept = s.params + s.optimizer + (s.buffers // 2 if stage == 3 else 0)       # ZeRO-3 keeps its bucket
    kept += s.grads if stage == 3 else 0                                        # and its gradient partition
    assert abs(kept / 1e6 - measured_mb) < 0.005, (stage, kept)


def test_megatron_distributed_optimizer_is_6_plus_12_over_d_bytes_per_parameter():
    n = param_count(LLAMA)
    est = estimate(LLAMA, ParallelSpec(cp=4, dp=2, zero_stage=1), "full", seq_len=8192)
    assert est.framework == Framework.MEGATRON
    assert (est.params, est.grads, est.optimizer, est.framework_buffers) == (2 * n, 4 * n, 12 * n // 8, 0)
    replicated = estimate(LLAMA, ParallelSpec(cp=4, dp=2), "full", seq_len=8192)
    assert replicated.params + replicated.grads + replicated.optimizer == 18 * n
    bf16 = megatron_state(n, 1, 8, torch.bfloat16, torch.bfloat16)         # --grad-reduce-in-bf16
    assert bf16.grads == 2 * n and bf16.step == 4 * n + 12 * n // 8 + 4 * n // 8
    fp32 = megatron_state(n, 0, 8, torch.float32, torch.float32)
    assert (fp32.params, fp32.grads, fp32.optimizer, fp32.step) == (4 * n, 4 * n, 8 * n, 16 * n)


def test_deepspeed_stages_and_their_buffers_at_scale():
    n, kw = param_count(LLAMA), dict(seq_len=8192, dtype=torch.bfloat16)
    z1 = estimate(LLAMA, ParallelSpec(cp=8, zero_stage=1, framework="deepspeed"), "full", **kw)
    z2 = estimate(LLAMA, ParallelSpec(cp=8, zero_stage=2), "full", **kw)
    z3 = estimate(LLAMA, ParallelSpec(cp=8, zero_stage=3), "full", **kw)
    assert z2.framework == z3.framework == z1.framework == Framework.DEEPSPEED
    bucket, head = 500_000_000, LLAMA.vocab * LLAMA.hidden
    assert z1.grads == 2 * n + 2 * n // 8 and z2.grads == 2 * n // 8 + 2 * head
    assert z1.framework_buffers == z2.framework_buffers == 4 * bucket
    assert z3.params < 2 * n // 8 + 2_000_000 and z3.grads == 2 * n // 8
    # ZeRO-3: bucket and its copy, the head gathered and its full gradient, the prefetch, half the reuse distance
    assert z3.framework_buffers == 4 * bucket + 2 * (500_000_000 + head + 50_000_000) + 2 * head
    # at 8k tokens the step binds: the fp32 copy of a whole sub-group (1e9 of its 1.004e9 elements) and Adam's
    # temporary (8 GB)
    assert z3.peak == z3.step_peak == z3.params + z3.grads + z3.optimizer + 2 * bucket + 8 * 10**9 > z3.training_peak
    long = estimate(LLAMA, ParallelSpec(cp=8, zero_stage=3), "full", seq_len=1 << 20)
    assert long.peak == long.training_peak > long.step_peak


def test_zero_settings_from_a_deepspeed_config():
    pytest.importorskip("deepspeed", reason="a DeepSpeed config is read with DeepSpeed's parser")
    z = ZeroSettings.from_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7}})
    assert z.reduce_bucket_size == 50_000_000 and z.stage3_prefetch_bucket_size == 50_000_000
    with pytest.raises(ValueError, match="auto"):
        ZeroSettings.from_config({"zero_optimization": {"reduce_bucket_size": "auto"}})
    # read as DeepSpeed reads them: the unprefixed names are the same settings, a misspelt key is an error
    named = ZeroSettings.from_config({"zero_optimization": {"prefetch_bucket_size": 7e6, "max_reuse_distance": 5,
                                                            "param_persistence_threshold": 9, "sub_group_size": 11}})
    assert (named.stage3_prefetch_bucket_size, named.stage3_max_reuse_distance,
            named.stage3_param_persistence_threshold, named.sub_group_size) == (7_000_000, 5, 9, 11)
    assert ZeroSettings.from_config({"zero_optimization": {"stage3_max_reuse_distance": 5}}) == \
        ZeroSettings(stage3_max_reuse_distance=5)
    with pytest.raises(ValueError, match="reduce_bucket_sizes: Extra inputs are not permitted"):
        ZeroSettings.from_config({"zero_optimization": {"reduce_bucket_sizes": 1e8}})
    with pytest.raises(ValueError, match="positive"):
        ZeroSettings(reduce_bucket_size=0)
    small = estimate(LLAMA, ParallelSpec(cp=8, zero_stage=2, zero_settings=z), "full", seq_len=8192)
    assert small.framework_buffers == 4 * 50_000_000


def test_a_framework_that_does_not_run_the_layout_is_refused():
    with pytest.raises(ValueError, match="ZeRO-2/3 are DeepSpeed's"):
        ParallelSpec(zero_stage=2, framework="megatron")
    with pytest.raises(ValueError, match="no tensor parallelism"):
        ParallelSpec(tp=2, framework="deepspeed")
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        estimate(LLAMA, ParallelSpec(cp=8, zero_stage=3, grad_dtype=torch.float32), "full", seq_len=8192)


def test_the_memory_command_counts_the_framework_it_is_told(capsys, tmp_path):
    from ctx_plugin.cli import main

    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e7}}')

    base = ["memory", "--model", "llama3-8b", "--seq-len", "128k", "--cp", "8", "--recompute", "full"]
    lines = {}
    for extra in ([], ["--framework", "deepspeed"], ["--grad-dtype", "bf16"],
                  ["--framework", "deepspeed", "--deepspeed-config", str(config)]):
        assert main(base + extra) == 0
        lines[tuple(extra)] = [l for l in capsys.readouterr().out.splitlines() if l.startswith("model state:")][0]
    assert "gradients 29.9" in lines[()] and "megatron's buffers 0.0" in lines[()]
    assert "gradients 16.8" in lines[("--framework", "deepspeed")]                 # 2P + the 2P/8 partition
    assert "deepspeed's buffers 1.9" in lines[("--framework", "deepspeed")]        # bucket + its copy: 2 GB
    assert "gradients 15.0" in lines[("--grad-dtype", "bf16")]
    assert "deepspeed's buffers 0.2" in lines[("--framework", "deepspeed", "--deepspeed-config", str(config))]


def test_megatrons_budget_counts_the_gradient_buffer_validate_args_chose():
    """budget:<GiB> from Megatron's arguments: fp32 gradients (bf16's default) cost 2 bytes per parameter more than
    --grad-reduce-in-bf16's, so a budget between the two resolves to a heavier preset only with bf16 gradients."""
    import argparse

    from ctx_plugin.megatron.args import add_arguments, settings_from_args

    def args_with(fp32_grads: bool, budget: str):
        args = add_arguments(argparse.ArgumentParser()).parse_args(["--cp-recompute", budget])
        for k, v in dict(context_parallel_size=8, num_attention_heads=32, num_query_groups=8,
                         group_query_attention=True, hidden_size=4096, ffn_hidden_size=14336, num_layers=32,
                         seq_length=131072, micro_batch_size=1, padded_vocab_size=128256, data_parallel_size=1,
                         swiglu=True, normalization="RMSNorm", bf16=True, use_distributed_optimizer=True,
                         untie_embeddings_and_output_weights=True, add_bias_linear=False,
                         position_embedding_type="rope", max_position_embeddings=131072,
                         create_attention_mask_in_dataloader=False,
                         accumulate_allreduce_grads_in_fp32=fp32_grads).items():
            setattr(args, k, v)
        return args

    model = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, family="megatron",
                      tied_embeddings=False)
    peaks = {g: estimate(model, ParallelSpec(cp=8, zero_stage=1, grad_dtype=g), "selective",
                         seq_len=131072).peak for g in (torch.float32, torch.bfloat16)}
    assert peaks[torch.float32] - peaks[torch.bfloat16] == 2 * param_count(model)
    budget = f"budget:{(peaks[torch.float32] + peaks[torch.bfloat16]) / 2 / 2**30:.3f}"
    fp32, bf16 = (str(settings_from_args(args_with(g, budget)).recompute) for g in (True, False))
    assert bf16 == "selective" and fp32 not in ("selective", "none", "attn_out")


@pytest.mark.parametrize("model_type, extra", [
    ("llama", {"attention_bias": True, "mlp_bias": True}), ("llama", {"tie_word_embeddings": True}),
    ("qwen3", {"head_dim": 16, "attention_bias": True}), ("qwen2", {}), ("mistral", {"attention_bias": True, "sliding_window": None}),
    ("granite", {"mlp_bias": True}), ("hunyuan_v1_dense", {"attention_bias": True, "mlp_bias": True, "head_dim": 16})])
def test_param_count_is_the_models_own(model_type, extra):
    """param_count against the parameters of the Hugging Face model its ModelSpec describes (GQA, q/k norms, tied
    embeddings, and the biases each type really builds from attention_bias/mlp_bias)."""
    transformers = pytest.importorskip("transformers")
    fields = {"model_type": model_type, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2, **extra}
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**fields))
    assert param_count(ModelSpec.from_hf_config(fields)) == sum(p.numel() for p in model.parameters())


def test_qwen3_without_head_dim_takes_transformers_default():
    """Qwen3's config class sets head_dim 128 when config.json gives none: that, not hidden / heads, is checked."""
    fields = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
              "num_hidden_layers": 3, "num_attention_heads": 4}
    with pytest.raises(ValueError, match=r"head_dim 128 × 4 heads is not hidden_size \(64\)"):
        ModelSpec.from_hf_config(fields)
    assert ModelSpec.from_hf_config({**fields, "hidden_size": 512}).head_dim == 128
