"""``+tile_loss`` on a megatron-core GPTModel on spawned gloo ranks (see test_tiled_loss_frameworks.py).

The reference is Megatron's own model — local spec (its DotProductAttention), its output layer and its
vocab-parallel cross-entropy over the whole logits — called with labels on one rank (and, for tensor parallelism,
Megatron's own untiled loss on the same TP ranks). The tiled models are built through ctx_plugin's spec with
:func:`ctx_plugin.megatron.spec.prepare_model` and a ``<preset>+tile_loss`` preset, at CP 1 and 2 and TP 2 (with
and without sequence parallelism: its torch norms built by :func:`~tests.integration.megatron_ranks.
sequence_parallel_norms`).
The model has biases, GQA, init std 0.1, float64; the loss is Megatron-LM's masked token mean of the per-token
losses the model returns.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from tests.integration.megatron_ranks import (SEQ, VOCAB, _batch, _cpu_shims, masked_mean_backward,
                                              sequence_parallel_norms, whole_gradients)


def _model(core_spec, *, cp: int, tp: int, share: bool, sp: bool = False):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=128, use_cpu_initialization=True, context_parallel_size=cp,
                               tensor_model_parallel_size=tp, sequence_parallel=sp, attention_dropout=0.0,
                               hidden_dropout=0.0,
                               add_bias_linear=True, add_qkv_bias=True, init_method_std=0.1,
                               use_mup=True, mup_base_hidden_size=32)      # MuP: the output layer scales its logits
    torch.manual_seed(1234)
    with sequence_parallel_norms():
        model = GPTModel(config=config, transformer_layer_spec=core_spec(get_gpt_layer_local_spec()), vocab_size=VOCAB,
                         max_sequence_length=SEQ, position_embedding_type="rope",
                         share_embeddings_and_output_weights=share)
    return model.double()


def _step(model, batch, cp_group) -> dict:
    """Megatron-LM's loss (per-token losses from the model, masked token mean over the CP ranks), gradients summed
    over the CP group; output-layer calls counted."""
    calls = []
    handle = model.output_layer.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    per_token = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    handle.remove()
    loss, grads = masked_mean_backward(model, per_token.double(), batch["loss_mask"], cp_group)
    return {"loss": loss, "grads": grads, "calls": calls, "shape": list(per_token.shape)}


def run(rank: int, world: int, payload: dict) -> dict:
    """payload: {"runs": [{"tp": N, "cp": M, "sp": bool, "cases": [(kind, preset, share)], "refused": [fields]}]};
    each run initialises Megatron's parallel state anew (the rest of the world is data-parallel); ``sp``: sequence
    parallelism. kind "megatron": Megatron's own untiled model (CP 1); "ctx_plugin": ctx_plugin's spec,
    prepare_model and preset."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    out = {}
    for spec in payload["runs"]:
        tp, cp, sp = spec["tp"], spec["cp"], spec.get("sp", False)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        try:
            for kind, preset, share in spec["cases"]:
                key = f"tp{tp}{'-sp' if sp else ''}-cp{cp}-{kind}-{preset}-{'shared' if share else 'own'}"
                out[key] = _case(rank, kind, preset, share, tp, cp, sp)
            for fields in spec.get("refused", []):
                out[repr(sorted(fields.items()))] = _refused(fields, tp, cp)
        finally:
            parallel_state.destroy_model_parallel()
    return out


def _case(rank: int, kind: str, preset: str, share: bool, tp: int, cp: int, sp: bool) -> dict:
    from megatron.core import parallel_state

    import ctx_plugin
    from ctx_plugin.megatron.args import MegatronCPSettings
    from ctx_plugin.megatron.core_attention import GroupsProvider
    from ctx_plugin.megatron.spec import gpt_layer_spec, prepare_model, shard_batch
    from ctx_plugin.recompute import RecomputeConfig

    cp_group, tp_group = parallel_state.get_context_parallel_group(), parallel_state.get_tensor_model_parallel_group()
    if kind == "megatron":
        assert cp == 1
        with _cpu_shims():
            model = _model(lambda spec: spec, cp=1, tp=tp, share=share, sp=sp)
            result = _step(model, _batch(with_mask=True), None)
    else:
        cp_config = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
        settings = MegatronCPSettings(cp_config=cp_config, recompute=RecomputeConfig.parse(preset),
                                      megatron_recompute=None)
        provider = GroupsProvider(cp_config)
        model = _model(lambda spec: gpt_layer_spec(cp_config, base=spec, groups_provider=provider), cp=cp, tp=tp,
                       share=share, sp=sp)
        groups = prepare_model(model, settings, provider)
        batch = shard_batch(_batch(with_mask=False), config=cp_config, groups=groups)
        with _cpu_shims() if tp > 1 else contextlib.nullcontext():
            result = _step(model, batch, cp_group if cp > 1 else None)
    grads = {name: g.flatten().tolist() for name, g in whole_gradients(model, result["grads"], tp_group).items()}
    result["grads"] = grads if rank == 0 else None
    return result


def _refused(fields: dict, tp: int, cp: int) -> str:
    import ctx_plugin
    from ctx_plugin.megatron.args import MegatronCPSettings
    from ctx_plugin.megatron.core_attention import GroupsProvider
    from ctx_plugin.megatron.spec import gpt_layer_spec, prepare_model
    from ctx_plugin.recompute import RecomputeConfig

    cp_config = ctx_plugin.CPConfig(kernel="torch")
    settings = MegatronCPSettings(cp_config=cp_config, recompute=RecomputeConfig.parse("none+tile_loss"),
                                  megatron_recompute=None)
    provider = GroupsProvider(cp_config)
    model = _model(lambda spec: gpt_layer_spec(cp_config, base=spec, groups_provider=provider), cp=cp, tp=tp,
                   share=False)
    for name, value in fields.items():       # set after construction: Megatron's own checks of some need CUDA
        setattr(model.config, name, value)
    try:
        prepare_model(model, settings, provider)
    except ValueError as e:
        return str(e)
    return "accepted"
