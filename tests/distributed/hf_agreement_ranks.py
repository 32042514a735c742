"""Spawned ranks for test_hf_agreement.py: an attention argument ctx_plugin refuses, or a token id the model does not
have, on one rank only."""
from __future__ import annotations

import warnings

import torch

from tests.distributed.agreement_ranks import outcome


def one_rank_refused(rank: int, world: int, payload) -> dict:
    import transformers

    import ctx_plugin
    import ctx_plugin.hf as cphf

    warnings.simplefilter("ignore")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    cfg = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    cphf.enable(model, cfg, groups)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16)[None]
    local = ctx_plugin.shard_sequence(ids, config=cfg, groups=groups, dim=1)
    local_pos = ctx_plugin.shard_sequence(pos, config=cfg, groups=groups, dim=1)
    if payload.get("unsharded"):    # every rank given the whole sequence, not its shard
        return outcome(lambda: model(input_ids=ids, position_ids=pos))
    if payload.get("packed"):       # DataCollatorWithFlattening's restarting positions, no documents given
        packed = torch.cat((torch.arange(6), torch.arange(10)))[None]
        local_pos = ctx_plugin.shard_sequence(packed, config=cfg, groups=groups, dim=1)
        return outcome(lambda: model(input_ids=local, position_ids=local_pos))
    if payload.get("bad_token"):                    # a token beyond the vocabulary on one rank's shard only
        local = local.clone()
        local[0, 2] = 64 if rank == payload["odd"] else local[0, 2]
        return outcome(lambda: model(input_ids=local, position_ids=local_pos))
    return outcome(lambda: model(input_ids=local, position_ids=local_pos, output_attentions=rank == payload["odd"]))
