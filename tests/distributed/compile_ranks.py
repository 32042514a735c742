"""Work for tests/distributed/test_compile.py, run inside spawned gloo ranks: ctx_plugin under ``torch.compile``."""
from __future__ import annotations

import warnings

import torch

SEQ = 32


def _attention_inputs():
    g = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(1, SEQ, h, 8, generator=g, dtype=torch.float64)  # noqa: E731
    return make(4), make(2), make(2), make(4), torch.randn(8, 8, generator=g, dtype=torch.float64)


def attention(backend: str, compiler: str) -> list:
    """A compiled function with work before and after ``cp_attention`` (a projection of q, a scale of the output),
    called with documents and windows that change from call to call: the errors of the gathered output and
    gradients against the float64 reference, one per call."""
    import ctx_plugin
    from ctx_plugin.core.documents import Documents
    from tests.reference import dense_with_grads, documents_with_grads

    cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    q, k, v, dout, w = _attention_inputs()

    def step(q, k, v, w, documents, window):
        out = ctx_plugin.cp_attention(q @ w, k, v, config=cfg, groups=groups, causal=True, documents=documents,
                                      window=window)
        return out * 2.0

    compiled = torch.compile(step, backend=compiler)
    errors = []
    for documents, window in ((Documents((0, 8, SEQ)), None), (Documents((0, 16, SEQ)), None), (None, None),
                              (None, (3, 0)), (Documents((0, 8, SEQ)), (2, 0))):
        shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1,  # noqa: E731
                                                    documents=documents)
        local = [shard(t).requires_grad_(True) for t in (q, k, v)]
        w_local = w.clone().requires_grad_(True)
        compiled(*local, w_local, documents, window).backward(shard(dout))
        gather = lambda t: ctx_plugin.gather_sequence(t, config=cfg, groups=groups, dim=1,  # noqa: E731
                                                      documents=documents)
        got = [gather(t.grad) for t in local]
        wq = (q @ w).detach().requires_grad_(True)
        if documents is not None:
            want = documents_with_grads(wq, k, v, 2.0 * dout, documents, causal=True, window=window)
        else:
            want = dense_with_grads(wq, k, v, 2.0 * dout, causal=True, window=window)
        want_dq = want[1] @ w.T                                    # through the projection
        torch.distributed.all_reduce(dw := w_local.grad.clone())   # each rank's share of the projection's gradient
        want_dw = torch.einsum("bshi,bshj->ij", q, want[1])
        errors.append(max(((a - b).abs().max() / b.abs().max()).item()
                          for a, b in ((got[0], want_dq), (got[1], want[2]), (got[2], want[3]), (dw, want_dw))))
    return errors


def hf(backend: str, preset: str, compiler: str) -> list:
    """A Qwen2 (biases, GQA, float64) switched to ctx_plugin's attention, ``preset`` applied, compiled whole, trained
    on packed batches whose documents change from step to step (cu_seq_lens_q/k): the loss and gradient errors
    against HF's own attention run on every document on its own, one per step."""
    import ctx_plugin
    import ctx_plugin.hf
    from ctx_plugin import recompute
    from tests.integration import hf_ranks as H

    cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    model = H.model("qwen2", None)
    ctx_plugin.hf.enable(model, cfg, groups)
    if preset != "none":
        recompute.apply(model.model.layers, preset)
    compiled = torch.compile(model, backend=compiler)
    errors = []
    for lengths in ([8, 16, 4, 12], [12, 4, 16, 8], [8, 16, 4, 12]):
        result = H.packed_step(model, compiled, "qwen2", cfg, groups, lengths, padded=False)
        errors.append(max(result["loss_err"], result["grad_err"]))
    return errors


def disagreement(rank: int) -> str | None:
    """A compiled call whose window differs on rank 1: the error every rank raises (None: no error)."""
    import ctx_plugin

    cfg = ctx_plugin.CPConfig(backend="ring", kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    q = torch.randn(1, SEQ // groups.size, 4, 8, dtype=torch.float64)
    step = torch.compile(lambda q, window: ctx_plugin.cp_attention(q * 1.0, q[:, :, :2], q[:, :, :2], config=cfg,
                                                                  groups=groups, window=window), backend="aot_eager")
    try:
        step(q, (3, 0) if rank == 1 else (4, 0))
    except ValueError as e:
        return str(e)
    return None


def fullgraph() -> str | None:
    """``torch.compile(..., fullgraph=True)`` of a function calling ``cp_attention``: torch's error (None: none)."""
    import ctx_plugin

    cfg = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    q = torch.randn(1, SEQ // groups.size, 2, 8, dtype=torch.float64)
    step = torch.compile(lambda q: ctx_plugin.cp_attention(q * 2.0, q, q, config=cfg, groups=groups),
                         fullgraph=True, backend="aot_eager")
    try:
        step(q)
    except Exception as e:          # noqa: BLE001 - torch's Unsupported, reported to the test
        return f"{type(e).__name__}: {e}"
    return None


def run(rank: int, world: int, payload: dict) -> dict:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    return {"attention": {f"{b}-{c}": attention(b, c) for b, c in payload["attention"]},
            "hf": {f"{b}-{p}-{c}": hf(b, p, c) for b, p, c in payload["hf"]},
            "disagreement": disagreement(rank), "fullgraph": fullgraph()}
