"""Attention whose values are of another width than its queries and keys (multi-head latent attention and its
kin in transformers 5.24) under ``ctx_plugin.hf.enable``: one CP rank in this process, against transformers' own
sdpa attention in float64 (logits and every gradient; dense layers only, as these models' routers run in fp32).
ctx_plugin pads the narrower side with zero columns and drops the output's padding (ctx_plugin.cp_attention);
DeepSeek-V3 and MiMo-V2-Flash are also checked at CP 2 and 4 in tests/integration/test_hf.py. The kinds with indexed (sparse,
DSA) attention layers stay refused by their ``layer_types``.
"""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")

import torch  # noqa: E402

import ctx_plugin.hf as cphf  # noqa: E402
from tests.unit.test_hf_multimodal import _against_sdpa, _assert_same, _tokens  # noqa: E402
from tests.unit.test_hf_refusals import _one_rank, _quiet  # noqa: E402,F401  (_quiet: autouse fixture)

MLA = dict(vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
           kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, initializer_range=0.2,
           max_position_embeddings=64)
DENSE = dict(num_hidden_layers=2, intermediate_size=64, first_k_dense_replace=2)
LATENT = {
    "DeepseekV2Config": dict(MLA, **DENSE, q_lora_rank=None),          # queries without their low-rank projection
    "DeepseekV3Config": dict(MLA, **DENSE),
    "MiniCPM3Config": dict(MLA, num_hidden_layers=2, intermediate_size=64),
    "Glm4MoeLiteConfig": dict(MLA, **DENSE),
    "YoutuConfig": dict(MLA, num_hidden_layers=2, intermediate_size=64),
    "LongcatFlashConfig": dict(MLA, num_layers=1, ffn_hidden_size=64, head_dim=8, n_routed_experts=4, moe_topk=2,
                               expert_ffn_hidden_size=32, zero_expert_num=0),
}


@pytest.mark.parametrize("name", sorted(LATENT))
def test_latent_attention_matches_hf(name):
    config = getattr(transformers, name)(**LATENT[name])
    assert config.v_head_dim != config.qk_nope_head_dim + config.qk_rope_head_dim      # values narrower
    cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    torch.manual_seed(0)
    ref = cls._from_config(config, experts_implementation="eager")  # LongCat's zero experts: eager, float64
    ids, pos = _tokens()
    (got, want), _ = _against_sdpa(ref, input_ids=ids, position_ids=pos)
    _assert_same(got, want)


def test_indexed_attention_stays_refused():
    config = transformers.DeepseekV32Config(**MLA, **DENSE)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"layer_types with \['indexed_attention'\] layers"):
        cphf.enable(model, *_one_rank())
