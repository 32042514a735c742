"""Options ctx_plugin's Megatron adapter does not implement are errors at model set-up (one process, no
communication): every row of ctx_plugin.megatron.options, the core attention's own arguments, mask tensors,
the dataloader's masks in shard_batch, and rotary embeddings other than RoPE and YaRN. Sliding windows (megatron-core's
window_size and per-layer choice) and softmax offsets against a float64 reference here, and against Megatron's own
model in test_megatron.py with the other options it honours."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

import torch  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import ctx_plugin  # noqa: E402
from ctx_plugin.megatron.core_attention import CPCoreAttention, GroupsProvider  # noqa: E402
from ctx_plugin.megatron.options import MODEL_OPTIONS  # noqa: E402

CP_CONFIG = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
# A value each refused option is refused with, written out here (not taken from the table) so that a row
# dropped from the table fails this test, and so does a table row without a test.
REFUSED = {"attention_dropout": 0.1, "qk_clip": True,
           "log_max_attention_logit": True, "experimental_attention_variant": "dsa",
           "fp8_dot_product_attention": True, "fp8_multi_head_attention": True, "use_kitchen_attention": True,
           "flash_attention_version": 3, "batch_invariant_mode": True, "deterministic_mode": True, "flash_decode": True,
           "position_embedding_type": "mrope", "cuda_graph_impl": "transformer_engine", "enable_cuda_graph": True,
           "external_cuda_graph": True, "overlap_moe_expert_parallel_comm": True}


def _config(*, init_method_std: float = 0.02, **fields) -> TransformerConfig:
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
                               init_method_std=init_method_std)
    for name, value in fields.items():      # after construction: Megatron's own checks of some need CUDA/TE
        setattr(config, name, value)
    return config


def _core(config=None, **kwargs) -> CPCoreAttention:
    args = {"layer_number": 1, "attn_mask_type": AttnMaskType.causal, "cp_config": CP_CONFIG,
            "groups_provider": GroupsProvider(CP_CONFIG), **kwargs}
    return CPCoreAttention(config if config is not None else _config(), **args)


def test_every_refused_option_is_tested():
    assert {option.field for option in MODEL_OPTIONS} == set(REFUSED)


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_core_attention_refuses(field):
    _core()                                   # the plain config is accepted
    with pytest.raises(ValueError, match="cannot honour these settings") as e:
        _core(_config(**{field: REFUSED[field]}))
    assert f"{field}={REFUSED[field]!r} (--{field.replace('_', '-')})" in str(e.value)


WINDOWS = [((5, 0), True, (5, 0)), ((0, 0), True, (0, 0)), ((-1, 0), True, (None, 0)), ((3, 2), False, (3, 2)),
           ((0, 4), False, (0, 4)), ((-1, -1), False, (None, None)), ([2, 0], True, (2, 0))]
BAD_WINDOWS = [((5, 1), True, "has right=1 under a causal mask"), ((-1, -1), True, "has right=-1 under a causal mask"),
               ((-1, 0), False, "means no window to Transformer Engine"),
               ((-1, 4), False, "has one unlimited side"), ((4, -1), False, "has one unlimited side"),
               ((4,), True, "must be two integers"),
               ((True, 0), True, "must be two integers"), ((-2, 0), True, "must be two integers"),
               ("4,0", True, "must be two integers"), ((4.0, 0), True, "must be two integers")]


@pytest.mark.parametrize("window_size,causal,want", WINDOWS)
def test_window_size_maps_onto_ctx_plugins_window(window_size, causal, want):
    from ctx_plugin.megatron.options import window

    assert window(window_size, causal) == want


@pytest.mark.parametrize("window_size,causal,message", BAD_WINDOWS)
def test_window_sizes_megatron_reads_two_ways_are_refused(window_size, causal, message):
    from ctx_plugin.megatron.options import window

    with pytest.raises(ValueError, match=message):
        window(window_size, causal)


@pytest.mark.parametrize("skip,windowed", [(None, [1, 2, 3, 4]), (2, [1, 3]), ([0, 1, 1, 0], [2, 3])])
def test_windows_per_layer_as_megatron_decides(skip, windowed):
    config = _config(num_layers=4, window_size=(6, 0), window_attn_skip_freq=skip)
    for layer in range(1, 5):
        assert _core(config, layer_number=layer).window == ((6, 0) if layer in windowed else None)
    assert _core(_config(), layer_number=1).window is None


def test_softmax_offsets():
    assert _core(_config(softmax_type="vanilla")).softmax_offset is None
    assert _core(_config(softmax_type="off-by-one")).softmax_offset is None          # zeros at each call
    torch.manual_seed(3)
    offset = _core(_config(softmax_type="learnable", init_method_std=0.5)).softmax_offset
    assert isinstance(offset, torch.nn.Parameter) and offset.shape == (4,) and offset.dtype == torch.float32
    torch.manual_seed(3)
    assert torch.equal(offset, torch.empty(4).normal_(0, 0.5))           # megatron-core's init_method, its draw
    with pytest.raises(ValueError, match="softmax_type='softmax1' is not one of"):
        _core(_config(softmax_type="softmax1"))


@pytest.mark.parametrize("softmax_type,window_size", [("off-by-one", (3, 0)), ("learnable", None),
                                                      ("learnable", (2, 0)), ("vanilla", (0, 0))])
def test_windows_and_offsets_against_a_float64_reference(softmax_type, window_size):
    """One rank: the core attention against an explicit masked softmax with a sink column (plain PyTorch)."""
    core = _core(_config(softmax_type=softmax_type, window_size=window_size, init_method_std=1.0)).double()
    q, k, v = (t.requires_grad_() for t in _qkv())
    i = torch.arange(8)
    allowed = i[None, :] <= i[:, None]
    if window_size is not None:
        allowed &= i[None, :] >= i[:, None] - window_size[0]
    sink = core.softmax_offset if softmax_type == "learnable" else torch.zeros(4, dtype=torch.float64)
    scores = torch.einsum("ibhd,jbhd->bhij", q, k.repeat_interleave(2, 2)) / 4.0
    scores = torch.cat([scores.masked_fill(~allowed, float("-inf")), sink[None, :, None, None].expand(2, 4, 8, 1)], -1)
    probs = scores.softmax(-1)[..., :-1] if softmax_type != "vanilla" else scores[..., :-1].softmax(-1)
    want = torch.einsum("bhij,jbhd->ibhd", probs, v.repeat_interleave(2, 2)).reshape(8, 2, 64)
    out = core(q, k, v, None)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    inputs = (q, k, v) + ((core.softmax_offset,) if softmax_type == "learnable" else ())
    dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    for have, ref in zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(want, inputs, dout)):
        torch.testing.assert_close(have, ref, rtol=1e-12, atol=1e-12)


def test_multi_token_prediction_is_refused_under_context_parallelism():
    """megatron-core builds the MTP layers from its own spec (their attention is not ctx_plugin's) and rolls their
    tokens by zigzag chunks: refused at CP > 1, from the config (the core attention) and from the flags."""
    from types import SimpleNamespace

    from ctx_plugin.megatron.options import check_model_options

    _core(_config(mtp_num_layers=1))                            # CP 1: nothing is sharded
    with pytest.raises(ValueError, match=r"mtp_num_layers=1 \(--mtp-num-layers\) with context_parallel_size=2: "
                                         r"megatron-core builds the multi-token-prediction layers from its own"):
        _core(_config(mtp_num_layers=1, context_parallel_size=2))
    check_model_options(SimpleNamespace(mtp_num_layers=None, context_parallel_size=4))
    with pytest.raises(ValueError, match="mtp_num_layers=2 .* context_parallel_size=4"):
        check_model_options(SimpleNamespace(mtp_num_layers=2, context_parallel_size=4))


def test_core_attention_arguments():
    with pytest.raises(TypeError, match=r"arguments it does not implement: \['qk_channels'\]"):
        _core(qk_channels=16)
    _core(k_channels=24, v_channels=16)             # multi-latent attention's widths (its tensors carry them)
    with pytest.raises(ValueError, match="cp_comm_type='a2a' .* conflicts"):
        _core(cp_comm_type="a2a")
    _core(cp_comm_type="p2p")
    with pytest.raises(ValueError, match="causal and no_mask attention, not padding"):
        _core(attn_mask_type=AttnMaskType.padding)
    with pytest.raises(ValueError, match="self-attention only"):
        _core(attention_type="cross")
    with pytest.raises(ValueError, match="context_parallel_size=2 in the TransformerConfig but the context-parallel "
                                         "group has 1 ranks"):
        _core(_config(context_parallel_size=2))


def _qkv(s=8, b=2):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(s, b, 4, 16, generator=g, dtype=torch.float64),
            *(torch.randn(s, b, 2, 16, generator=g, dtype=torch.float64) for _ in range(2)))


def test_mask_tensors_are_refused():
    core = _core()
    q, k, v = _qkv()
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)[None, None]
    with pytest.raises(ValueError, match="got an attention_mask with attn_mask_type causal.*"
                                         "--no-create-attention-mask-in-dataloader"):
        core(q, k, v, causal)
    out = core(q, k, v, None)                # the causal mask the attention applies itself
    scores = torch.einsum("ibhd,jbhd->bhij", q, k.repeat_interleave(2, 2)) / 4.0
    want = torch.einsum("bhij,jbhd->ibhd", scores.masked_fill(causal[0], float("-inf")).softmax(-1),
                        v.repeat_interleave(2, 2))
    torch.testing.assert_close(out, want.reshape(8, 2, 64), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="attn_mask_type no_mask"):
        _core(attn_mask_type=AttnMaskType.no_mask)(q, k, v, causal)


def _megatron_batch(reset_attention_mask: bool, seq=16):
    """A sample as Megatron's GPTDataset builds it (its own mask/position function), batched."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = torch.arange(seq) % 7               # token 6 is the end of each document
    mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
        tokens, eod_token=6, reset_position_ids=False, reset_attention_mask=reset_attention_mask,
        eod_mask_loss=False, create_attention_mask=True)
    return {"tokens": tokens[None].repeat(2, 1), "labels": tokens[None].repeat(2, 1),
            "loss_mask": loss_mask[None].repeat(2, 1), "position_ids": position_ids[None].repeat(2, 1),
            "attention_mask": mask[None].repeat(2, 1, 1, 1)}


def test_shard_batch_checks_and_drops_the_dataloader_mask():
    from ctx_plugin.megatron.spec import shard_batch

    groups = ctx_plugin.build_cp_groups(CP_CONFIG)
    batch = _megatron_batch(reset_attention_mask=False)
    assert batch["attention_mask"].shape == (2, 1, 16, 16)
    sharded = shard_batch(batch, config=CP_CONFIG, groups=groups)
    assert sharded["attention_mask"] is None and torch.equal(sharded["tokens"], batch["tokens"])
    reset = _megatron_batch(reset_attention_mask=True)          # documents end at tokens 6 and 13
    with pytest.raises(ValueError, match="the document at token 0 of sample 0 holds 7 tokens, not a multiple of 2"):
        shard_batch(reset, config=CP_CONFIG, groups=groups)        # zigzag splits every document in two chunks
    dataset = {key: value.reshape(1, -1) for key, value in batch.items() if key != "attention_mask"}
    dataset.update(cu_seqlens=torch.tensor([[0, 7, 16, 32]], dtype=torch.int32), cu_seqlens_padded=None,
                   max_seqlen=torch.tensor([16], dtype=torch.int32))       # the dataset's own documents (THD)
    with pytest.raises(ValueError, match=r"--dataloader-inter-document-masking/--sft: the dataset's document at token 0 "
                                         r"of sample 0 holds 7 tokens, not a multiple of 2.*pad every document to a "
                                         r"multiple of 2 in the data"):
        shard_batch(dataset, config=CP_CONFIG, groups=groups)
    ring = ctx_plugin.CPConfig(backend="ring", kernel="torch")
    packed = shard_batch(reset, config=ring, groups=ctx_plugin.build_cp_groups(ring))
    assert packed["attention_mask"] is None and packed["tokens"].shape == (1, 32)
    assert packed["cu_seqlens"].tolist() == [[0, 7, 14, 16, 23, 30, 32]] and packed["max_seqlen"].tolist() == [7]
    padding = reset["attention_mask"].clone()
    padding[1, 0, :, 15] = True                                # the last key hidden from every query: padding
    with pytest.raises(ValueError, match="attention_mask row 1 is neither Megatron's causal mask nor its "
                                         "block-diagonal causal mask of documents .*query 15 may not see key 15"):
        shard_batch({**reset, "attention_mask": padding}, config=ring, groups=ctx_plugin.build_cp_groups(ring))
    with pytest.raises(ValueError, match="must be Megatron's bool"):
        shard_batch({**batch, "attention_mask": batch["attention_mask"].float()}, config=CP_CONFIG, groups=groups)


def test_rotary_embeddings_other_than_rope_and_yarn_are_refused(monkeypatch):
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rotary_pos_embedding import (MultimodalRotaryEmbedding,
                                                                             RotaryEmbedding)

    from ctx_plugin.megatron.rope import LayoutRotaryEmbedding, use_layout_rope

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")      # MultimodalRotaryEmbedding's constructor
    groups = ctx_plugin.build_cp_groups(CP_CONFIG)

    class MyRope(RotaryEmbedding):
        pass

    for rope in (MultimodalRotaryEmbedding(kv_channels=16, rotary_percent=1.0),
                 MyRope(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)):
        with pytest.raises(ValueError, match=f"rotary embedding .*{type(rope).__name__} is not supported"):
            use_layout_rope(SimpleNamespace(rotary_pos_emb=rope, modules=list), CP_CONFIG, groups)
    model = SimpleNamespace(rotary_pos_emb=RotaryEmbedding(kv_channels=16, rotary_percent=1.0,
                                                           use_cpu_initialization=True), modules=list)
    use_layout_rope(model, CP_CONFIG, groups)
    use_layout_rope(model, CP_CONFIG, groups)            # again: already layout-aware
    assert type(model.rotary_pos_emb) is LayoutRotaryEmbedding
