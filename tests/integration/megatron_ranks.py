"""A tiny megatron-core GPTModel on spawned gloo ranks (see test_megatron.py): built through ctx_plugin's spec at
CP > 1, or — the reference — with Megatron's own local spec (its DotProductAttention, RoPE and YaRN) on one rank.

The model has biases (linear and QKV), GQA (4 heads, 2 groups) and init std 0.1, runs in float64, and the loss is
computed here in float64 from the logits. Megatron's local attention, RoPE and YaRN call CUDA APIs on CPU; the
reference (and the YaRN cases, whose construction alone needs it) run under ``_cpu_shims``.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQ, BATCH, VOCAB = 32, 2, 128
YARN = {"yarn_rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 16, "yarn_beta_fast": 32.0,
        "yarn_beta_slow": 1.0, "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.5,    # attention factor ≈ 1.065, not 1
        "yarn_correction_range_round_to_int": True}
VARIANTS = {   # name: (TransformerConfig fields, GPTModel arguments, qk_layernorm in the layer spec)
    "base": ({}, {}, False),
    # honoured options: each changes the math (layer 2 skips RoPE, partial interleaved RoPE with Llama-3 scaling
    # and interpolation, a custom softmax scale with query-key layer scaling, an output gate, QK layernorm)
    "knobs": ({"apply_query_key_layer_scaling": True, "softmax_scale": 0.3, "attention_output_gate": True,
               "no_rope_freq": [0, 1], "rotary_interleaved": True, "qk_layernorm": True},
              {"rotary_percent": 0.5, "seq_len_interpolation_factor": 2.0, "rope_scaling": True}, True),
    # attention variants: layer 1 a window of 5 past tokens (under every rank's shard), layer 2 full
    # (window_attn_skip_freq), learnable softmax offsets; both layers a window of 12 with the off-by-one softmax
    "window": ({"window_size": (5, 0), "window_attn_skip_freq": 2, "softmax_type": "learnable"}, {}, False),
    "offbyone": ({"window_size": (12, 0), "softmax_type": "off-by-one"}, {}, False),
    # mixture of experts: 4 experts, top-2 routing, no capacity limit (Megatron's default: dropless), the
    # load-balancing and z losses (their gradients join backward through Megatron's MoEAuxLossAutoScaler); QKV
    # biases only (megatron-core's experts modify a view of a tensor-parallel reduction in place with linear biases)
    "moe": ({"add_bias_linear": False, "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.1,
             "moe_z_loss_coeff": 0.01, "moe_token_dispatcher_type": "allgather",
             "moe_router_load_balancing_type": "aux_loss"}, {}, False),
    # the same with the expert bias (sigmoid scores): the router counts its tokens per expert in a buffer
    "moe_bias": ({"add_bias_linear": False, "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.1,
                  "moe_z_loss_coeff": 0.01, "moe_token_dispatcher_type": "allgather",
                  "moe_router_load_balancing_type": "aux_loss", "moe_router_enable_expert_bias": True,
                  "moe_router_score_function": "sigmoid"}, {}, False),
    # quantile balancing instead of the auxiliary loss: the router accumulates a quantile per micro batch
    "moe_qb": ({"add_bias_linear": False, "num_moe_experts": 4, "moe_router_topk": 2,
                "moe_token_dispatcher_type": "allgather", "moe_router_load_balancing_type": "quantile_balancing"},
               {}, False),
}


def _batch(with_mask: bool):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],            # labels pre-shifted, then sharded
             "loss_mask": (torch.rand(BATCH, SEQ, generator=g) > 0.2).double(),
             "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous()}
    if with_mask:      # what Megatron's dataloader builds by default (create_attention_mask_in_dataloader)
        batch["attention_mask"] = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(BATCH, 1, SEQ, SEQ).clone()
    return batch


def _zigzag_rows_on_cpu(pos_emb, seq_dim, cp_group):
    """megatron's rope_utils.get_pos_emb_on_this_cp_rank without its pinned-memory CUDA index tensor."""
    size, rank = cp_group.size(), cp_group.rank()
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, torch.tensor([rank, 2 * size - rank - 1]))
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


@contextlib.contextmanager
def _cpu_shims():
    """Megatron's RotaryEmbedding/YaRN move frequencies to ``torch.cuda.current_device()`` (YaRN's constructor also
    slices a cache with a CUDA index at CP > 1), its DotProductAttention takes a buffer there, forks the CUDA RNG
    tracker around dropout (0 here) and builds its sliding-window mask on "cuda": point them at the CPU (the
    window mask by megatron-core's own function, its ``torch.ones`` made on the CPU)."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    class Tracker:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

    window_mask = fused_softmax.get_sliding_window_causal_mask

    def window_mask_on_cpu(*args):
        ones = torch.ones
        torch.ones = lambda *a, device=None, **kw: ones(*a, device="cpu", **kw)
        try:
            return window_mask(*args)
        finally:
            torch.ones = ones

    saved = (torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker, yarn.get_pos_emb_on_this_cp_rank,
             rope.get_pos_emb_on_this_cp_rank)
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: Tracker()
    yarn.get_pos_emb_on_this_cp_rank = rope.get_pos_emb_on_this_cp_rank = _zigzag_rows_on_cpu
    fused_softmax.get_sliding_window_causal_mask = window_mask_on_cpu
    try:
        yield
    finally:
        (torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker, yarn.get_pos_emb_on_this_cp_rank,
         rope.get_pos_emb_on_this_cp_rank) = saved
        fused_softmax.get_sliding_window_causal_mask = window_mask


@contextlib.contextmanager
def sequence_parallel_norms():
    """megatron-core's torch norms (``WrappedTorchNorm``, the local spec's) refuse sequence parallelism, which its
    fused norms (apex's FusedLayerNorm, Transformer Engine's) take: inside the block they are built as usual and
    their parameters marked ``sequence_parallel`` as those mark theirs (each TP rank's gradient is then its share of
    the sequence, which finalize_model_grads sums over the TP ranks: :func:`whole_gradients`)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build = WrappedTorchNorm.__new__

    def build_marked(cls, config, *args, **kwargs):
        sequence_parallel, config.sequence_parallel = config.sequence_parallel, False
        try:
            norm = build(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for p in norm.parameters():
            p.sequence_parallel = sequence_parallel
        return norm

    WrappedTorchNorm.__new__ = build_marked
    try:
        yield
    finally:
        WrappedTorchNorm.__new__ = build


@contextlib.contextmanager
def model_parallel(**sizes):
    """Megatron's model-parallel state for the block (``initialize_model_parallel(**sizes)``), destroyed after it."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(**sizes)
    try:
        yield parallel_state
    finally:
        parallel_state.destroy_model_parallel()


def relative_errors(loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> dict:
    """``loss_err`` and ``grad_err`` (the worst parameter's max error over its max, its max floored at 1e-6 of the
    largest gradient) of a CP run against the reference."""
    floor = 1e-6 * max(g.abs().max().item() for g in ref_grads.values())
    grad_err = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(floor)).item() for n, g in ref_grads.items())
    return {"loss_err": abs(loss - ref_loss) / abs(ref_loss), "grad_err": grad_err}


def _model(world: int, position: str, variant: str, core_spec, tp: int = 1, sp: bool = False, **refused):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields, model_args, qk_layernorm = VARIANTS[variant]
    config = TransformerConfig(**{**dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                         ffn_hidden_size=128, use_cpu_initialization=True,
                                         context_parallel_size=world, tensor_model_parallel_size=tp,
                                         sequence_parallel=sp, attention_dropout=0.0, hidden_dropout=0.0,
                                         add_bias_linear=True, add_qkv_bias=True, init_method_std=0.1), **fields})
    for name, value in refused.items():     # after construction: Megatron's own checks of some need CUDA
        setattr(config, name, value)
    for name, value in (YARN.items() if position == "yarn" else ()):
        setattr(config, name, value)            # what Megatron-LM's arguments set for --position-embedding-type yarn
    spec = core_spec(get_gpt_layer_local_spec(num_experts=fields.get("num_moe_experts"), qk_layernorm=qk_layernorm))
    torch.manual_seed(1234)
    with _cpu_shims() if position == "yarn" else contextlib.nullcontext(), sequence_parallel_norms():
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type=position, **model_args)
    return model.double()


def cp_model(world: int, cp_config, position: str, variant: str = "base", preset: str = "none", tp: int = 1,
             sp: bool = False):
    """``(model, groups)``: the tiny GPT of :func:`_model` (``world``: the CP size) with ctx_plugin's core attention for
    ``cp_config``, prepared as the entry point prepares it (layout-aware RoPE, the recompute ``preset``)."""
    from ctx_plugin.megatron.args import MegatronCPSettings
    from ctx_plugin.megatron.core_attention import GroupsProvider
    from ctx_plugin.megatron.spec import gpt_layer_spec, prepare_model
    from ctx_plugin.recompute import RecomputeConfig

    settings = MegatronCPSettings(cp_config=cp_config, recompute=RecomputeConfig.parse(preset),
                                  megatron_recompute=None)
    provider = GroupsProvider(cp_config)
    model = _model(world, position, variant,
                   lambda spec: gpt_layer_spec(cp_config, base=spec, groups_provider=provider), tp=tp, sp=sp)
    return model, prepare_model(model, settings, provider)


class _GatherVocabulary(torch.autograd.Function):
    """The tensor-parallel ranks' logits (each its vocabulary shard, the last dimension) side by side; backward: this
    rank's shard of the gradient (megatron-core's gather_from_tensor_model_parallel_region allocates on CUDA)."""

    @staticmethod
    def forward(ctx, logits, group):
        ctx.group = group
        parts = [torch.empty_like(logits) for _ in range(group.size())]
        dist.all_gather(parts, logits.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.group.size(), dim=-1)[ctx.group.rank()].contiguous(), None


def whole_parameters(model, tensors: dict, tp_group) -> dict:
    """``tensors`` (one per parameter name, shaped like this rank's parameter) with every tensor-parallel shard
    gathered along its ``partition_dim``: the sharded linear layers' (``tensor_model_parallel``) and the learnable
    softmax offsets, sharded over heads (megatron-core marks those with no attribute)."""
    out = {}
    for name, p in model.named_parameters():
        t = tensors[name]
        if tp_group is not None and tp_group.size() > 1 and (getattr(p, "tensor_model_parallel", False)
                                                              or name.endswith("softmax_offset")):
            parts = [torch.empty_like(t) for _ in range(tp_group.size())]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, dim=getattr(p, "partition_dim", 0))
        out[name] = t
    return out


def whole_gradients(model, grads: dict, tp_group) -> dict:
    """Every parameter's whole gradient from this rank's (:func:`whole_parameters`), the TP-replicated parameters'
    first reduced over the TP ranks as megatron-core's finalize_model_grads reduces them
    (``_allreduce_non_tensor_model_parallel_grads``): summed under sequence parallelism (norms, row-parallel biases,
    the router: each rank's share of the tokens) and for QK layernorms (each rank's share of the heads), averaged
    where a module asks for it."""
    config = model.config
    out = {}
    for name, p in model.named_parameters():
        g = grads[name]
        if tp_group is not None and tp_group.size() > 1:
            average = getattr(p, "average_gradients_across_tp_domain", False)
            if average or (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                    config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
                g = g.clone()
                dist.all_reduce(g, group=tp_group)            # (gloo has no ReduceOp.AVG)
                g = g / tp_group.size() if average else g
        out[name] = g
    return whole_parameters(model, out, tp_group)


def masked_mean_backward(model, per_token: torch.Tensor, mask: torch.Tensor, group) -> tuple[float, dict]:
    """Back-propagates the masked token mean of ``per_token`` over ``group``'s ranks (each rank's tokens' sum over
    the global token count); returns that mean and every parameter's gradient summed over ``group`` (what DDP over
    data×context ranks does)."""
    stats = torch.stack([(per_token * mask).sum().detach(), mask.sum()])
    if group is not None:
        dist.all_reduce(stats, group=group)
    ((per_token * mask).sum() / stats[1]).backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if group is not None:
            dist.all_reduce(g, group=group)
        grads[name] = g
    return (stats[0] / stats[1]).item(), grads


def loss_and_grads(model, batch, group, *, tp_group=None, **forward) -> tuple[float, dict]:
    """Global loss (float64, from the logits) and gradients summed over ``group`` (:func:`masked_mean_backward`).
    ``tp_group``: the model's tensor-parallel group, whose ranks' vocabulary shards of the logits are gathered first.
    ``forward``: more keywords of the model's forward (e.g. packed_seq_params)."""
    logits = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), **forward)
    if tp_group is not None:
        logits = _GatherVocabulary.apply(logits, tp_group)
    per_token = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    return masked_mean_backward(model, per_token, batch["loss_mask"], group)


def _step(model, batch, group, **forward) -> dict:
    """:func:`loss_and_grads` as JSON, and the weights' sum."""
    loss, grads = loss_and_grads(model, batch, group, **forward)
    return {"loss": loss, "grads": {name: g.flatten().tolist() for name, g in grads.items()},
            "weights": sum(p.detach().double().sum().item() for p in model.parameters())}


def _offset_shards(model) -> dict:
    """How the distributed checkpoint shards the softmax offsets: key -> (type, global shape, fragmentation)."""
    return {k: (type(v).__name__, tuple(v.global_shape), tuple(v.axis_fragmentations))
            for k, v in model.sharded_state_dict().items() if k.endswith("softmax_offset")}


def reference_step(rank: int, world: int, payload: dict) -> dict:
    """Megatron's own GPTModel (local spec: DotProductAttention, its RoPE/YaRN) on one rank, with the causal mask
    its dataloader passes; one result per (position embedding, variant)."""
    warnings.filterwarnings("ignore")
    assert world == 1
    out = {}
    with model_parallel(), _cpu_shims():
        for position, variant in payload["cases"]:
            model = _model(1, position, variant, lambda spec: spec)
            out[f"{position}-{variant}"] = {**_step(model, _batch(with_mask=True), None),
                                            "offsets": _offset_shards(model)}
    return out


def gpt_step(rank: int, world: int, payload: dict) -> dict:
    """For each (backend, ulysses_size, position embedding, recompute, variant, dataloader mask): the global loss
    and CP-summed gradients of ctx_plugin's model, batches sharded by ``shard_batch``. ``payload["thd"]``: packed
    document cases of :func:`tests.integration.megatron_thd_ranks.thd_step` run first in the same launch (under
    ``"thd"``), saving them a launch of their own."""
    warnings.filterwarnings("ignore")
    import ctx_plugin
    from ctx_plugin.megatron.spec import gpt_layer_spec, shard_batch

    out = {}
    if payload.get("thd"):
        from tests.integration.megatron_thd_ranks import thd_step

        out["thd"] = thd_step(rank, world, {"cases": payload["thd"]})
    with model_parallel(context_parallel_size=world) as parallel_state:
        cp_group = parallel_state.get_context_parallel_group()
        for backend, u, position, preset, variant, with_mask in payload["cases"]:
            cp_config = ctx_plugin.CPConfig(backend=backend, ulysses_size=u, kernel="torch")
            model, groups = cp_model(world, cp_config, position, variant, preset)
            batch = shard_batch(_batch(with_mask), config=cp_config, groups=groups)
            assert batch.get("attention_mask") is None          # checked to be causal, then dropped
            with _cpu_shims() if position == "yarn" or variant == "moe" else contextlib.nullcontext():
                result = _step(model, batch, cp_group)      # (megatron-core's MoE router moves itself to CUDA)
            out[case_key(backend, u, position, preset, variant, with_mask)] = {
                **result, "grads": result["grads"] if rank == 0 else None,
                "rope_class": type(getattr(model, "rotary_pos_emb", None)).__name__, "offsets": _offset_shards(model)}
        for backend in payload.get("unprepared", []):      # gpt_layer_spec without prepare_model: Megatron's RoPE
            cp_config = ctx_plugin.CPConfig(backend=backend, kernel="torch")
            model = _model(world, "rope", "base", lambda spec: gpt_layer_spec(cp_config, base=spec))
            groups = ctx_plugin.build_cp_groups(cp_config, group=cp_group)
            try:
                with _cpu_shims():
                    out[f"unprepared-{backend}"] = _step(model, shard_batch(_batch(True), config=cp_config,
                                                                            groups=groups), cp_group)
            except ValueError as e:
                out[f"unprepared-{backend}"] = str(e)
        for fields in payload.get("refused", []):      # options the issue reproduced as silently wrong
            cp_config = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
            try:
                _model(world, "rope", "base", lambda spec: gpt_layer_spec(cp_config, base=spec), **fields)
            except ValueError as e:
                out[repr(sorted(fields.items()))] = str(e)
    return out


def case_key(backend, u, position, preset, variant, with_mask) -> str:
    return f"{backend}-u{u}-{position}-{preset}-{variant}-{'mask' if with_mask else 'nomask'}"
