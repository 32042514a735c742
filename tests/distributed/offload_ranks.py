"""Activation offload inside spawned ranks: gradients, communication and host bytes against the same preset
without offload."""
from __future__ import annotations

import ctx_plugin
from tests.offload_cases import attention_saved_bytes, expected_host_bytes, offload_step


def offload_vs_plain(rank: int, world: int, payload: dict) -> dict:
    out = {}
    seq = payload["seq"]
    for backend, u, shape in payload["configs"]:
        cfg = ctx_plugin.CPConfig(backend=backend, ulysses_size=u, kernel="torch")
        groups = ctx_plugin.build_cp_groups(cfg)
        attention = attention_saved_bytes(cfg, groups, shape, seq)
        for preset, modifier in payload["presets"]:
            plain = offload_step(shape, preset, cfg, groups, seq)
            got = offload_step(shape, f"{preset}+{modifier}", cfg, groups, seq)
            out[f"{backend}-{shape}-{preset}+{modifier}"] = {
                "grad_diff": max((got["grads"][n] - g).abs().max().item() for n, g in plain["grads"].items()),
                "comm": got["comm"], "plain_comm": plain["comm"],
                "runs": [got["attention_runs"], plain["attention_runs"]],
                "held": got["held"], "after": got["after"],
                "want": expected_host_bytes(shape, f"{preset}+{modifier}", seq // world, attention)}
    return out
