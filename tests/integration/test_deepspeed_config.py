"""``ctx_plugin.deepspeed.initialize``'s checks that need no ranks: they raise before torch.distributed starts (so on
every rank alike, before any collective). Batch sizes, ZeRO-3's memory_efficient_linear under ``selective``, models
whose attention ctx_plugin cannot switch, Hugging Face's own gradient checkpointing next to a preset."""
from __future__ import annotations

import warnings

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'ctx-plugin[deepspeed]'")
pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ctx_plugin.deepspeed as cpds  # noqa: E402
from tests.integration.deepspeed_ranks import Wrapped, qwen2  # noqa: E402

BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _sizes(world, size, **given):
    out = cpds.batch_sizes(given, world=world, size=size)
    return tuple(out.get(k) for k in BATCH)


def test_train_batch_size_is_counted_in_data_parallel_replicas():
    """8 ranks, CP 4: 2 replicas. DeepSpeed gets train_batch_size × 4 (it counts every rank as data parallel)."""
    assert _sizes(8, 4, train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2) == \
        (32, 2, 2)
    assert _sizes(8, 4, train_batch_size=8, train_micro_batch_size_per_gpu=2) == (32, 2, 2)
    assert _sizes(8, 4, train_batch_size=8, gradient_accumulation_steps=4) == (32, 1, 4)
    assert _sizes(8, 4, train_batch_size=6) == (24, 3, 1)
    assert _sizes(8, 1, train_batch_size=8) == (8, 1, 1)
    assert _sizes(8, 4, train_micro_batch_size_per_gpu=2) == (None, 2, None)       # DeepSpeed derives the rest
    # Both readings of train_batch_size fit (an error, below) only when one of the two keys is missing:
    assert _sizes(8, 4, train_batch_size=16, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4) == \
        (64, 2, 4)
    assert _sizes(8, 1, train_batch_size=16, train_micro_batch_size_per_gpu=2) == (16, 2, 1)     # no CP: one reading


@pytest.mark.parametrize("given,message", [
    (dict(train_batch_size=16, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1),
     r'"train_batch_size" is 16 \(it counts the context-parallel ranks\); give 4 = train_micro_batch_size_per_gpu '
     r"× gradient_accumulation_steps × 2 data-parallel replica\(s\) \(8 ranks / \"context_parallel.size\" 4"),
    (dict(train_batch_size=6, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1),
     r'"train_batch_size" is 6; give 4 = '),
    (dict(train_batch_size=6, train_micro_batch_size_per_gpu=2),
     r'"train_batch_size" \(6\) must be .*: a multiple of train_micro_batch_size_per_gpu \(2\) × 2'),
    (dict(train_batch_size=3), r'"train_batch_size" \(3\) must be .*: a multiple of gradient_accumulation_steps '
                               r"\(1\) × 2"),
    (dict(train_batch_size=4, gradient_accumulation_steps=0), r'"gradient_accumulation_steps" must be a positive int'),
    (dict(train_batch_size=4.0), r'"train_batch_size" must be a positive int'),
    (dict(train_batch_size=16, train_micro_batch_size_per_gpu=2),        # DeepSpeed alone: accumulation 1
     r'"train_batch_size" \(16\) with "train_micro_batch_size_per_gpu" \(2\) and no "gradient_accumulation_steps" '
     r'is ambiguous: as micro batch × accumulation × 2 data-parallel replica\(s\) .* "gradient_accumulation_steps": '
     r'4; counting all 8 ranks, .* "gradient_accumulation_steps": 1\. Give "gradient_accumulation_steps": 4 with '
     r'"train_batch_size" 16, or 1 with "train_batch_size" 4 \(or none\)'),
    (dict(train_batch_size=16),                                           # DeepSpeed alone: micro batch 2
     r'"train_batch_size" \(16\) with "gradient_accumulation_steps" \(1 when not given\) and no '
     r'"train_micro_batch_size_per_gpu" is ambiguous: .* "train_micro_batch_size_per_gpu": 8; counting all 8 ranks, '
     r'.* "train_micro_batch_size_per_gpu": 2\. Give "train_micro_batch_size_per_gpu": 8 with "train_batch_size" 16, '
     r'or 2 with "train_batch_size" 4'),
    (dict(train_batch_size=32, gradient_accumulation_steps=2),
     r'"train_batch_size" \(32\) with "gradient_accumulation_steps" \(2\) and no "train_micro_batch_size_per_gpu" is '
     r'ambiguous: .* "train_micro_batch_size_per_gpu": 8; counting all 8 ranks, .* "train_micro_batch_size_per_gpu": '
     r'2\. Give "train_micro_batch_size_per_gpu": 8 with "train_batch_size" 32, or 2 with "train_batch_size" 8'),
])
def test_wrong_train_batch_sizes_say_which_value_to_use(given, message):
    with pytest.raises(ValueError, match=message):
        cpds.batch_sizes(given, world=8, size=4)


def _config(preset="none", zero=0, **zero_keys):
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": zero, **zero_keys},
            "context_parallel": {"size": 2, "recompute": preset}}


def _initialize(model, config, **kw):
    assert not dist.is_initialized()
    with pytest.raises((ValueError, TypeError)) as e:
        cpds.initialize(model=model, model_parameters=model.parameters(), config=config, **kw)
    assert not dist.is_initialized(), "the check must come before any process group starts"
    return str(e.value)


def test_zero3_memory_efficient_linear_is_turned_off_under_selective():
    selective = cpds.RecomputeConfig.parse("selective")
    assert cpds._zero_config(_config(zero=3), selective)["zero_optimization"] == \
        {"stage": 3, "memory_efficient_linear": False}
    assert cpds._zero_config(_config(zero=3), cpds.RecomputeConfig.parse("full"))["zero_optimization"] == {"stage": 3}
    assert "memory_efficient_linear" not in cpds._zero_config(_config(zero=2), selective)["zero_optimization"]
    message = _initialize(qwen2(), _config("selective", 3, memory_efficient_linear=True))
    assert '"zero_optimization.memory_efficient_linear": true and "context_parallel.recompute": "selective" ' \
           "cannot be combined" in message


def test_deepspeeds_linear_left_installed_in_the_process_is_refused_under_selective():
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    original = torch.nn.functional.linear
    torch.nn.functional.linear = zero3_linear_wrap          # what an earlier ZeRO-3 engine leaves behind
    try:
        message = _initialize(qwen2(), _config("selective", 1))
        with pytest.raises(ValueError, match="DeepSpeed never puts it back"):
            cpds._refuse_patched_linear(None, ())            # the forward pre-hook: installed after initialize
    finally:
        torch.nn.functional.linear = original
    assert "torch.nn.functional.linear is DeepSpeed's memory_efficient_linear" in message
    cpds._refuse_patched_linear(None, ())


def test_a_model_ctx_plugin_cannot_switch_needs_attention_callback():
    message = _initialize(Wrapped(qwen2()), _config())
    assert message.startswith("Wrapped is not a Hugging Face model (no set_attn_implementation)") and \
        "pass attention=fn" in message
    assert "attention= must be a callable taking the CPGroups" in \
        _initialize(Wrapped(qwen2()), _config(), attention="model")
    assert 'attention= wires the model to context parallelism: it needs a "context_parallel" section' in \
        _initialize(Wrapped(qwen2()), {"train_micro_batch_size_per_gpu": 1}, attention=lambda groups: None)


def test_hf_gradient_checkpointing_next_to_a_preset_is_refused():
    model = qwen2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable()
    assert "use Hugging Face's own gradient checkpointing (model.gradient_checkpointing_enable()) and the " \
           "recompute preset full at once" in _initialize(model, _config("full", 3))
