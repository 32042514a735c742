"""A tiny megatron-core GPTModel with multi-latent attention (MLA: low-rank q and kv projections, queries and keys
of 24 = 16 + 8 RoPE channels, values of 16, its own RoPE or YaRN inside each attention) on spawned gloo ranks (see
test_megatron_mla.py): built through ctx_plugin's spec at CP > 1, or — the reference — with Megatron's own local
MLA spec on one rank, its core attention a plain float64 softmax attention written here (megatron-core 0.19's local
DotProductAttention does not take MLA's separate k/v channels; only Transformer Engine's does). Float64, biases,
init std 0.1; the loss and batches are test_megatron.py's (tests/integration/megatron_ranks.py)."""
from __future__ import annotations

import warnings

import torch

from tests.integration.megatron_ranks import SEQ, VOCAB, _batch, _cpu_shims, _step, model_parallel

# rope_type -> MLATransformerConfig fields beyond the shape (yarn: DeepSeek-V3's kind of settings, scaled down)
ROPE = {"rope": {"rope_type": "rope", "rotary_base": 10000},
        "yarn": {"rope_type": "yarn", "rotary_base": 10000, "rotary_scaling_factor": 4.0,
                 "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                 "mscale_all_dim": 0.5}}


def _reference_core_attention():
    """A MegatronModule computing softmax(q·kᵀ·scale)·v over Megatron's [s, b, heads, dim] tensors, causal or under
    the given mask (True: masked, as Megatron's)."""
    from megatron.core.transformer.module import MegatronModule

    class ReferenceCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type="self", cp_comm_type=None,
                     softmax_scale=None, k_channels=None, v_channels=None, pg_collection=None):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            assert attention_bias is None and packed_seq_params is None
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))        # [b, heads, s, dim]
            scores = q @ k.transpose(-1, -2) * self.softmax_scale
            s = scores.shape[-1]
            mask = torch.ones(s, s, dtype=torch.bool).triu(1) if attention_mask is None else attention_mask
            scores = scores.masked_fill(mask, float("-inf"))
            out = scores.softmax(-1) @ v
            return out.permute(2, 0, 1, 3).reshape(s, q.shape[0], -1)

    return ReferenceCoreAttention


def _with_core(spec, module, **params):
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=module, params=params)
    return spec


def _model(world: int, rope: str, core_spec, tp: int = 1, **fields):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                  q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
                                  v_head_dim=16, use_cpu_initialization=True, context_parallel_size=world,
                                  tensor_model_parallel_size=tp,
                                  attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=True,
                                  init_method_std=0.1, apply_rope_fusion=False, qk_layernorm=True,
                                  **ROPE[rope])
    for name, value in fields.items():      # after construction: Megatron's own checks of some need CUDA/TE
        setattr(config, name, value)
    spec = core_spec(get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True))
    torch.manual_seed(1234)
    with _cpu_shims():      # MLA's rotary embeddings are made on torch.cuda.current_device()
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="rope")
    return model.double()


def reference_step(rank: int, world: int, payload: dict) -> dict:
    """Megatron's own MLA model on one rank, with the causal mask its dataloader passes, per rope type; and per
    (rope type, document mix) of ``payload["thd"]`` on the unpacked batch of those documents with their
    block-diagonal causal mask (tests/integration/megatron_thd_ranks.py)."""
    from tests.integration.megatron_thd_ranks import MIXES, _block_mask
    from tests.integration.megatron_thd_ranks import _batch as _documents_batch

    warnings.filterwarnings("ignore")
    assert world == 1
    out = {}
    with model_parallel(), _cpu_shims():
        for rope in payload["ropes"]:
            model = _model(1, rope, lambda spec: _with_core(spec, _reference_core_attention()))
            out[rope] = _step(model, _batch(with_mask=True), None)
        for rope, mix in payload.get("thd", []):
            model = _model(1, rope, lambda spec: _with_core(spec, _reference_core_attention()))
            batch = {**_documents_batch(mix), "attention_mask": _block_mask(MIXES[mix][0])}
            out[f"{rope}-{mix}"] = _step(model, batch, None)
    return out


def mla_step(rank: int, world: int, payload: dict) -> dict:
    """ctx_plugin's MLA model per (backend, ulysses size, rope type, prepare_model: False, True or the recompute
    preset it applies, config fields) of ``payload["cases"]``, batches sharded by shard_batch, and per (backend, rope
    type, document mix) of ``payload["thd"]`` on the packed batch (``PackedSeqParams(qkv_format="thd")``); the
    messages of the cases refused at construction or first forward."""
    from tests.integration.megatron_thd_ranks import _batch as _documents_batch
    from tests.integration.megatron_thd_ranks import _packed_params

    warnings.filterwarnings("ignore")
    import ctx_plugin
    from ctx_plugin.megatron.args import MegatronCPSettings
    from ctx_plugin.megatron.core_attention import GroupsProvider
    from ctx_plugin.megatron.spec import gpt_layer_spec, prepare_model, shard_batch
    from ctx_plugin.recompute import RecomputeConfig

    def prepare(model, cp_config, provider, preset: str) -> None:
        prepare_model(model, MegatronCPSettings(cp_config=cp_config, recompute=RecomputeConfig.parse(preset),
                                                megatron_recompute=None), provider)

    out = {}
    with model_parallel(context_parallel_size=world) as parallel_state:
        cp_group = parallel_state.get_context_parallel_group()
        for backend, u, rope, prepared, fields in payload["cases"]:
            cp_config = ctx_plugin.CPConfig(backend=backend, ulysses_size=u, kernel="torch")
            provider = GroupsProvider(cp_config)
            key = "-".join(map(str, (backend, u, rope, prepared, *sorted(fields))))
            try:
                model = _model(world, rope, lambda spec: gpt_layer_spec(cp_config, base=spec,
                                                                        groups_provider=provider), **fields)
                groups = provider.get(cp_group)
                if prepared:        # True, or the name of the recompute preset prepare_model applies
                    prepare(model, cp_config, provider, "none" if prepared is True else prepared)
                batch = shard_batch(_batch(with_mask=True), config=cp_config, groups=groups)
                calls = []          # a recompute preset runs the layers' projections again in backward
                model.decoder.layers[0].self_attention.linear_kv_down_proj.register_forward_hook(
                    lambda *args: calls.append(1))
                with _cpu_shims():
                    out[key] = _step(model, batch, cp_group)
                out[key]["projection_calls"] = len(calls)
                out[key]["rope_classes"] = sorted({type(m.rotary_pos_emb).__name__ for m in model.modules()
                                                   if hasattr(m, "rotary_pos_emb")})
            except ValueError as e:
                out[key] = str(e)
        for backend, rope, mix in payload.get("thd", []):
            cp_config = ctx_plugin.CPConfig(backend=backend, kernel="torch")
            provider = GroupsProvider(cp_config)
            model = _model(world, rope, lambda spec: gpt_layer_spec(cp_config, base=spec, groups_provider=provider))
            prepare(model, cp_config, provider, "none")
            batch = shard_batch(_documents_batch(mix), config=cp_config, groups=provider.get(cp_group))
            try:
                with _cpu_shims():
                    out[f"thd-{backend}-{rope}-{mix}"] = _step(model, batch, cp_group,
                                                               packed_seq_params=_packed_params(batch))
            except ValueError as e:
                out[f"thd-{backend}-{rope}-{mix}"] = str(e)
    return out
