"""Tensor × context parallelism on a megatron-core GPTModel (see test_megatron_tp.py), on 4 spawned gloo ranks.

First Megatron's own model (local spec: DotProductAttention, its RoPE) at TP 2, CP 1 on the whole batch — the
reference, initialised as the TP 2 model is (megatron-core draws a learnable softmax offset per tensor-parallel
rank) — then ctx_plugin's model at TP 2 × CP (world ÷ 2) for each case, its batch sharded over the CP ranks. Both
report the loss and every parameter's whole gradient: summed over the CP group (what DDP over data × context ranks
does), the tensor-parallel shards gathered along their partition dimension. The tiny model of
:mod:`tests.integration.megatron_ranks` (biases, GQA, init std 0.1, float64): at TP 2 each rank holds 2 heads and
1 query group, so Ulysses replicates that group's K/V over its 2 ranks.
"""
from __future__ import annotations

import contextlib
import warnings

from tests.integration.megatron_ranks import (_batch, _cpu_shims, _model, cp_model, loss_and_grads, model_parallel,
                                              whole_gradients, whole_parameters)

TP = 2


def _whole(model, grads: dict, tp_group) -> dict:
    """Every parameter's whole gradient (as lists) and the weights' sum over the whole parameters."""
    weights = whole_parameters(model, {name: p.detach() for name, p in model.named_parameters()}, tp_group)
    return {"grads": {name: g.flatten().tolist() for name, g in whole_gradients(model, grads, tp_group).items()},
            "weights": sum(w.double().sum().item() for w in weights.values())}


def run(rank: int, world: int, payload: dict) -> dict:
    """payload: {"cases": [(backend, ulysses size, position embedding, variant, dataloader mask)], "sp": [(backend,
    ulysses size, position embedding, variant, recompute preset)], "mla": [(backend, rope type)]}; returns
    {"reference-<position>-<variant>": ..., "<case key>": ..., "sp-<case key>-<preset>": ..., "mla-reference-<rope>":
    ..., "mla-<backend>-<rope>": ...} with loss, whole gradients (rank 0) and weights. "sp": Megatron's sequence
    parallelism on (each TP rank holds half of its CP rank's tokens between the attention and MLP blocks), the
    norms built by :func:`~tests.integration.megatron_ranks.sequence_parallel_norms`; their references are
    Megatron's TP 2 model with it ("reference-sp-...") and, but for MoE (which megatron-core refuses to train at TP
    > 1 without it), without it. The multi-latent attention model is
    tests/integration/megatron_mla_ranks.py's, its reference core attention a float64 softmax at TP 2."""
    warnings.filterwarnings("ignore")
    import ctx_plugin
    from ctx_plugin.megatron.args import MegatronCPSettings
    from ctx_plugin.megatron.core_attention import GroupsProvider
    from ctx_plugin.megatron.spec import gpt_layer_spec, prepare_model, shard_batch
    from ctx_plugin.recompute import RecomputeConfig
    from tests.integration import megatron_mla_ranks as mla

    assert world % TP == 0
    cp = world // TP
    out = {}
    with model_parallel(tensor_model_parallel_size=TP) as parallel_state, _cpu_shims():
        tp_group = parallel_state.get_tensor_model_parallel_group()
        references = {(c[2], c[3], False) for c in payload["cases"]} | {
            (c[2], c[3], sp) for c in payload.get("sp", []) for sp in ((True,) if c[3] == "moe" else (False, True))}
        for position, variant, sp in sorted(references):
            model = _model(1, position, variant, lambda spec: spec, tp=TP, sp=sp)
            loss, grads = loss_and_grads(model, _batch(with_mask=True), None, tp_group=tp_group)
            out[reference_key(position, variant, sp)] = {"loss": loss, **_whole(model, grads, tp_group)}
        for rope in sorted({rope for _, rope in payload.get("mla", [])}):
            model = mla._model(1, rope, lambda spec: mla._with_core(spec, mla._reference_core_attention()), tp=TP)
            loss, grads = loss_and_grads(model, _batch(with_mask=True), None, tp_group=tp_group)
            out[f"mla-reference-{rope}"] = {"loss": loss, **_whole(model, grads, tp_group)}
    with model_parallel(tensor_model_parallel_size=TP, context_parallel_size=cp) as parallel_state:
        tp_group, cp_group = (parallel_state.get_tensor_model_parallel_group(),
                              parallel_state.get_context_parallel_group())
        for backend, u, position, variant, with_mask in payload["cases"]:
            cp_config = ctx_plugin.CPConfig(backend=backend, ulysses_size=u, kernel="torch")
            model, groups = cp_model(cp, cp_config, position, variant, tp=TP)
            assert groups.size == cp
            batch = shard_batch(_batch(with_mask), config=cp_config, groups=groups)
            with _cpu_shims() if position == "yarn" else contextlib.nullcontext():
                loss, grads = loss_and_grads(model, batch, cp_group, tp_group=tp_group)
            out[case_key(backend, u, position, variant, with_mask)] = {"loss": loss, **_whole(model, grads, tp_group)}
        for backend, u, position, variant, preset in payload.get("sp", []):
            cp_config = ctx_plugin.CPConfig(backend=backend, ulysses_size=u, kernel="torch")
            model, groups = cp_model(cp, cp_config, position, variant, preset, tp=TP, sp=True)
            batch = shard_batch(_batch(False), config=cp_config, groups=groups)
            with _cpu_shims():                  # the sequence-parallel transformer block forks the CUDA RNG tracker
                loss, grads = loss_and_grads(model, batch, cp_group, tp_group=tp_group)
            out[sp_key(backend, u, position, variant, preset)] = {"loss": loss, **_whole(model, grads, tp_group)}
        for backend, rope in payload.get("mla", []):
            cp_config = ctx_plugin.CPConfig(backend=backend, kernel="torch")
            provider = GroupsProvider(cp_config)
            model = mla._model(cp, rope, lambda spec: gpt_layer_spec(cp_config, base=spec, groups_provider=provider),
                               tp=TP)
            groups = prepare_model(model, MegatronCPSettings(cp_config=cp_config, recompute=RecomputeConfig.parse(
                "none"), megatron_recompute=None), provider)
            batch = shard_batch(_batch(with_mask=True), config=cp_config, groups=groups)
            with _cpu_shims():      # MLA's rotary embeddings: on torch.cuda.current_device()
                loss, grads = loss_and_grads(model, batch, cp_group, tp_group=tp_group)
            out[f"mla-{backend}-{rope}"] = {"loss": loss, **_whole(model, grads, tp_group)}
    return {k: {**v, "grads": v["grads"] if rank == 0 else None} for k, v in out.items()}


def reference_key(position, variant, sp: bool = False) -> str:
    return f"reference-{'sp-' if sp else ''}{position}-{variant}"


def case_key(backend, u, position, variant, with_mask) -> str:
    return f"{backend}-u{u}-{position}-{variant}-{'mask' if with_mask else 'nomask'}"


def sp_key(backend, u, position, variant, preset) -> str:
    return f"sp-{backend}-u{u}-{position}-{variant}-{preset}"
