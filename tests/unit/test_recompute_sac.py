"""Selective checkpointing's recomputation (ctx_plugin/recompute/sac.py): an operator that runs more often in the
recomputation than in the forward, outside autograd, is run when the forward saved none of its results (ZeRO-3's
parameter gathers under its live-parameter and reuse-distance limits; torch's own cached mode refused them); under
grad mode torch's own checks decide, unchanged."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ctx_plugin.recompute.sac import selective_contexts

# sac.py patches torch's cached mode where this torch has the internals it reads (torch 2.13, constraints.txt); on
# another (torch 2.11 on the GPU machine) it hands over torch's own contexts, which these tests compare against
pytestmark = pytest.mark.skipif(not hasattr(torch.utils.checkpoint, "_RECOMPUTE"),
                                reason="this torch lacks the checkpoint internals that sac.py patches")


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def _run(contexts, extra):
    """A region saving its matmul; in backward its recomputation runs ``extra`` once more (a result discarded)."""
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    calls = []

    def region(x, w):
        calls.append(1)
        z = x.sin() @ w
        if len(calls) > 1:
            extra(x, w)                  # only in the recomputation, before the ops whose inputs backward needs
        return z.cos().sum()

    out = checkpoint(region, x, w, use_reentrant=False, context_fn=lambda: contexts(_policy))
    out.backward()
    want_x, want_w = torch.autograd.grad((x.sin() @ w).cos().sum(), (x, w))
    return torch.allclose(x.grad, want_x, rtol=1e-14, atol=0) and torch.allclose(w.grad, want_w, rtol=1e-14, atol=0)


def _gather(x, w):
    """What ZeRO-3's pre-forward hook does: outside autograd, an operator writing into a buffer (cat with out=)."""
    with torch.no_grad():
        torch.cat([x, x], out=torch.empty(8, 4, dtype=x.dtype))


def _under_grad(x, w):
    x.tan()                              # recorded by autograd: saves x for its backward


def test_an_extra_invocation_of_a_never_saved_operator_outside_autograd_runs():
    assert _run(selective_contexts, _gather)
    with pytest.raises(RuntimeError, match=r"encountered during backward but not found in storage"):
        _run(create_selective_checkpoint_contexts, _gather)                  # torch's own: refused


def _outcome(contexts, extra) -> str:
    try:
        return f"gradients {'exact' if _run(contexts, extra) else 'off'}"
    except RuntimeError as e:
        return f"refused: {str(e).split(' encountered')[0]}"


@pytest.mark.parametrize("extra", [_under_grad, lambda x, w: x @ w, lambda x, w: x.sin()],
                         ids=["new-op", "saved-op", "recomputed-op"])
def test_extra_invocations_under_grad_mode_are_left_to_torch(extra):
    """Under grad mode an extra operator saves tensors for backward, which the checkpoint matches to the forward's by
    their order: the mode leaves such invocations to torch's own checks, unchanged (whatever they make of them)."""
    ours, torchs = _outcome(selective_contexts, extra), _outcome(create_selective_checkpoint_contexts, extra)
    assert ours == torchs
    if extra is _under_grad:
        assert ours == "refused: aten.tan.default"
