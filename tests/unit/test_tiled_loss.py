"""Tiled logits and loss (ctx_plugin.tiled_loss, ``+tile_loss``): the same loss and gradients as plain PyTorch's
untiled head + cross-entropy (float64 to rounding, float32 within 1e-6), ignored targets, a last chunk shorter than
the others, a head with a bias; the chunks the head actually runs on; what forward keeps and the peak of a step on a
32k vocabulary; ctx_plugin's own model (DecoderLM.loss) against a dense-attention float64 reference."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ctx_plugin
from ctx_plugin import recompute
from ctx_plugin.memory.measure import step_bytes
from ctx_plugin.models import DecoderConfig, DecoderLM
from ctx_plugin.tiled_loss import CHUNK_LOGITS_MIB, auto_tokens, lm_loss_sum, map_chunks
from tests.reference import dense_attention

TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


class CountingHead(torch.nn.Linear):
    """An LM head (with a bias) that records the number of tokens of every call."""

    def __init__(self, hidden: int, vocab: int, dtype) -> None:
        super().__init__(hidden, vocab, bias=True, dtype=dtype)
        self.calls: list[int] = []

    def forward(self, x):
        self.calls.append(x.shape[0])
        return super().forward(x)


def _case(dtype, vocab=97, hidden=24, batch=3, seq=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = CountingHead(hidden, vocab, dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g, dtype=dtype) * 0.5)
        head.bias.copy_(torch.randn(vocab, generator=g, dtype=dtype))
    x = torch.randn(batch, seq, hidden, generator=g, dtype=dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :5] = -100                        # ignored targets, inside and across chunks
    labels[2, 7] = -100
    return head, x, labels


def _untiled(head, x, labels):
    """Plain PyTorch: the whole logits, one cross-entropy."""
    x = x.clone().requires_grad_(True)
    loss = F.cross_entropy(F.linear(x, head.weight, head.bias).flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum")
    gx, gw, gb = torch.autograd.grad(loss, [x, head.weight, head.bias])
    return loss.detach(), gx, gw, gb


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("tokens", [1, 5, 16, 51, 1000, None], ids=lambda t: f"tokens{t}")
def test_tiled_equals_untiled(dtype, tokens):
    head, x, labels = _case(dtype)
    want = _untiled(head, x, labels)
    xg = x.clone().requires_grad_(True)
    loss = lm_loss_sum(xg, labels, head, tokens=tokens)
    got = (loss.detach(), *torch.autograd.grad(loss, [xg, head.weight, head.bias]))
    assert loss.dtype == dtype
    for name, a, b in zip(("loss", "d hidden", "d weight", "d bias"), got, want):
        assert _rel(a, b) <= TOL[dtype], (name, _rel(a, b))
    n, size = x.shape[0] * x.shape[1], tokens or auto_tokens(97)
    chunks = [min(size, n - s) for s in range(0, n, size)]
    assert head.calls[:len(chunks)] == chunks, "forward runs each chunk once, in order"
    assert sorted(head.calls[len(chunks):]) == sorted(chunks), "backward recomputes each chunk once"


def test_low_precision_logits_are_upcast():
    head, x, labels = _case(torch.bfloat16)
    want = F.cross_entropy(F.linear(x, head.weight, head.bias).float().flatten(0, 1), labels.flatten(),
                           reduction="sum")
    got = lm_loss_sum(x, labels, head, tokens=7)
    assert got.dtype == torch.float32 and _rel(got, want) <= 1e-6


def test_all_ignored_chunk_and_all_ignored():
    head, x, labels = _case(torch.float64)
    labels[1] = -100                                   # whole chunks of ignored targets
    want = _untiled(head, x, labels)
    xg = x.clone().requires_grad_(True)
    loss = lm_loss_sum(xg, labels, head, tokens=4)
    for a, b in zip((loss.detach(), *torch.autograd.grad(loss, [xg, head.weight, head.bias])), want):
        assert _rel(a, b) <= 1e-12
    xg = x.clone().requires_grad_(True)
    loss = lm_loss_sum(xg, torch.full_like(labels, 7), head, tokens=4, ignore_index=7)
    loss.backward()
    assert loss.item() == 0 and not xg.grad.any()


def test_no_grad_computes_chunks_directly():
    head, x, labels = _case(torch.float64)
    with torch.no_grad():
        got = lm_loss_sum(x, labels, head, tokens=10)
    assert _rel(got, _untiled(head, x, labels)[0]) <= 1e-12 and len(head.calls) == math.ceil(51 / 10)


def test_map_chunks_per_token_values_and_layout():
    """Megatron's layout: hidden [s, b, h], labels [b, s], per-token losses [b, s] concatenated along s."""
    head, x, labels = _case(torch.float64)
    hidden = x.transpose(0, 1).contiguous().requires_grad_(True)          # [s, b, h]

    def per_token(h, y):
        return F.cross_entropy(head(h).permute(1, 2, 0), y, reduction="none")     # [b, c]

    got = map_chunks(per_token, hidden, labels, tokens=4, hidden_dim=0, labels_dim=1, out_dim=1)
    want = F.cross_entropy(F.linear(x, head.weight, head.bias).transpose(1, 2), labels, reduction="none")
    assert got.shape == labels.shape and _rel(got, want) <= 1e-12
    weights = torch.rand(labels.shape, dtype=torch.float64)
    (gh,) = torch.autograd.grad((got * weights).sum(), [hidden])
    xr = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad((F.cross_entropy(F.linear(xr, head.weight, head.bias).transpose(1, 2), labels,
                                                 reduction="none") * weights).sum(), [xr])
    assert _rel(gh.transpose(0, 1), gx) <= 1e-12


def test_auto_tokens():
    assert auto_tokens(32768) == CHUNK_LOGITS_MIB * 2**20 // (4 * 32768) == 2048
    assert auto_tokens(128256) == 523 and auto_tokens(10**12) == 1
    assert auto_tokens(1000, target_mib=1) == 262


@pytest.mark.parametrize("call,error,match", [
    (lambda h, x, y: lm_loss_sum(x, y, h, tokens=0), ValueError, "positive int"),
    (lambda h, x, y: lm_loss_sum(x, y, h, tokens=2.0), ValueError, "positive int"),
    (lambda h, x, y: lm_loss_sum(x, y, h, tokens=True), ValueError, "positive int"),
    (lambda h, x, y: lm_loss_sum(x, y[:, :-1], h), ValueError, "must match hidden"),
    (lambda h, x, y: lm_loss_sum(x, y.double(), h), TypeError, "integer tensor"),
    (lambda h, x, y: lm_loss_sum(x.long(), y, h), TypeError, "floating-point"),
    (lambda h, x, y: lm_loss_sum(x, y, "head"), TypeError, "callable"),
    (lambda h, x, y: lm_loss_sum(x, y, lambda t: h(t)), TypeError, "give the chunk size explicitly"),
    (lambda h, x, y: lm_loss_sum(x[:, :0], y[:, :0], h), ValueError, "no tokens"),
    (lambda h, x, y: auto_tokens(0), ValueError, "vocab"),
])
def test_bad_input(call, error, match):
    head, x, labels = _case(torch.float64)
    with pytest.raises(error, match=match):
        call(head, x, labels)


def _step_memory(loss_fn, head, x, labels) -> tuple[int, int]:
    """(bytes alive after forward besides the loss, peak bytes of forward + backward)."""
    head.weight.grad = torch.zeros_like(head.weight)        # gradients accumulate in place: only temporaries count
    head.bias.grad = torch.zeros_like(head.bias)
    return step_bytes(lambda: loss_fn(x, labels),
                      exclude=[*head.parameters(), head.weight.grad, head.bias.grad, x, labels])


def test_memory_falls_by_the_chunking_factor():
    """Vocabulary 32k, 512 tokens, fp32: the untiled loss keeps the [tokens, vocab] log-probabilities for backward
    and peaks at a few logits-sized tensors; the tiled loss (8 chunks of 64 tokens) keeps no logits and peaks at
    the same few tensors of one chunk: 8× lower (plus one head-gradient temporary)."""
    vocab, hidden, tokens, chunk = 32768, 32, 512, 64
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=True)
    x = torch.randn(tokens, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    logits_bytes = tokens * vocab * 4
    kept_untiled, peak_untiled = _step_memory(
        lambda h, y: F.cross_entropy(head(h), y, reduction="sum"), head, x, labels)
    kept_tiled, peak_tiled = _step_memory(lambda h, y: lm_loss_sum(h, y, head, tokens=chunk), head, x, labels)
    assert kept_untiled >= logits_bytes                      # the log-probabilities, [tokens, vocab]
    assert kept_tiled <= 4096                                # the chunk losses only; no logits at all
    assert 2 * logits_bytes <= peak_untiled <= 4 * logits_bytes
    # the chunk's share of the untiled peak, plus the one weight/bias-gradient temporary a chunk's backward adds before
    # it accumulates into .grad (the untiled backward has it too, once its logits are gone) and the small inputs
    factor, head_bytes = tokens // chunk, (vocab * hidden + vocab) * 4
    predicted = peak_untiled / factor + head_bytes
    assert 0.95 * predicted <= peak_tiled <= predicted + 2 * tokens * hidden * 4, (peak_tiled, predicted)


# ctx_plugin's own model: DecoderLM.loss, one process (CP groups of one), against a float64 reference whose attention
# is dense plain PyTorch and whose loss is the untiled cross-entropy of the whole logits.

def _decoder(preset: str):
    cfg = ctx_plugin.CPConfig(kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    c = DecoderConfig(vocab=211, hidden=32, heads=4, kv_heads=2, ffn=64, layers=3, gated=False)
    torch.manual_seed(3)
    model = DecoderLM(c, cfg, groups).double()
    for p in model.parameters():                              # non-trivial init: biases and norms not at 0 / 1
        torch.nn.init.normal_(p, std=0.3)
    config = recompute.RecomputeConfig.parse(preset)
    recompute.apply(model.blocks, config.for_layers)
    return model, config


def _dense_reference(model, tokens, positions, labels):
    ref, _ = _decoder("none")
    ref.load_state_dict(model.state_dict())
    for block in ref.blocks:
        block.attn.core.forward = lambda q, k, v, documents=None: dense_attention(q, k, v, causal=True)
    logits = ref(tokens, positions)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("preset", ["none+tile_loss:5", "full+tile_loss:13", "selective+tile_loss", "sqrt+tile_loss:1"])
def test_decoder_lm_tiled_loss(preset):
    model, config = _decoder(preset)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 211, (2, 24), generator=g)
    labels = torch.randint(0, 211, (2, 24), generator=g)
    labels[:, :3] = -100
    positions = torch.arange(24)
    want, want_grads = _dense_reference(model, tokens, positions, labels)
    calls = []
    model.head.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    loss = model.loss(tokens, positions, labels, tile=config.tile_loss, loss_tokens=config.loss_tokens)
    loss.backward()
    assert _rel(loss.detach(), want) <= 1e-12
    for name, p in model.named_parameters():
        assert _rel(p.grad, want_grads[name]) <= 1e-10, name
    size = config.loss_tokens or auto_tokens(211)
    chunks = [min(size, 48 - s) for s in range(0, 48, size)]
    assert calls[:len(chunks)] == chunks and sorted(calls[len(chunks):]) == sorted(chunks)
    assert torch.equal(model(tokens, positions), model.head(model.hidden_states(tokens, positions)))


def test_decoder_lm_loss_options():
    model, _ = _decoder("none")
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="with tile=True"):
        model.loss(tokens, torch.arange(4), tokens, loss_tokens=2)
    with pytest.raises(TypeError, match="True or False"):
        model.loss(tokens, torch.arange(4), tokens, tile=2)


def test_backward_writes_each_chunk_gradient_once():
    """The chunks' input gradients are concatenated once (split's backward), not each written into a zero-filled
    gradient of the whole input (a narrow per chunk: O(tokens² / chunk) bytes, 64 input-sized tensors here)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Written(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and func is not torch.ops.aten.detach.default and t._base is None:
                    self.bytes += t.numel() * t.element_size()
            return out

    tokens, hidden, vocab, chunk = 4096, 64, 8, 64
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab)
    x = torch.randn(tokens, hidden, requires_grad=True)
    loss = lm_loss_sum(x, torch.randint(0, vocab, (tokens,)), head, tokens=chunk)
    written = Written()
    with written:
        loss.backward()
    input_bytes = tokens * hidden * 4
    # per chunk: recomputed logits and their gradient, the chunk's input gradient; then one concatenation
    assert written.bytes <= 8 * input_bytes, written.bytes / input_bytes
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
