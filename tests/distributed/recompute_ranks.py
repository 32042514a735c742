"""Recompute work inside spawned ranks: memory model vs. measurement, and communication per preset."""
from __future__ import annotations

import ctx_plugin
from tests.recompute_cases import measured_vs_model, train_step


def memory_and_comm(rank: int, world: int, payload: dict) -> dict:
    """Each config (backend, ulysses_size, shape, presets): the first preset's gradients are the reference."""
    out = {}
    for backend, u, shape, presets in payload["configs"]:
        cfg = ctx_plugin.CPConfig(backend=backend, ulysses_size=u, kernel="torch")
        groups = ctx_plugin.build_cp_groups(cfg)
        reference = None
        for preset in presets:
            measured, model = measured_vs_model(shape, preset, cfg, groups, payload["seq"])
            step = train_step(shape, preset, cfg, groups, payload["seq"])
            reference = reference or step["grads"]
            grad_err = max(((g - reference[name]).abs().max() / reference[name].abs().max()).item()
                           for name, g in step["grads"].items())
            out[f"{backend}-u{u}-{shape}-{preset}"] = {"measured": measured, "model": model, "comm": step["comm"],
                                                       "attention_runs": step["attention_runs"], "grad_err": grad_err}
    return out
