"""+tile_mlp and +recompute_attn on real layers (one process): gradients equal to the same model without them
(float64 exact up to the chunk sums' round-off, fp32 1e-6), with every preset, on ctx_plugin's block and a Hugging
Face Llama (attention and MLP biases, GQA, init std 0.1; its reference runs HF's own sdpa attention, no ctx_plugin);
what the tiled layers keep and their peak; the refusals. Megatron's layer and the CP runs: tests/distributed."""
from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import ctx_plugin
from ctx_plugin import hf, recompute
from ctx_plugin.models import CoreAttention, DecoderBlock, DecoderConfig
from ctx_plugin.recompute.tiling import chunk_sizes

CFG = ctx_plugin.CPConfig(kernel="torch")
PRESETS = ["none", "attn_out", "selective", "core_attn", "mlp", "full", "full:uniform:2", "full:block:2", "sqrt"]
REGION_PRESETS = ["full", "full:uniform:2", "full:block:2", "sqrt"]
C = DecoderConfig(hidden=32, ffn=96, layers=3, heads=4, kv_heads=2, gated=False)      # GELU MLP with biases
SEQ = 22


def _blocks(preset: str | None, dtype, c: DecoderConfig = C):
    groups = ctx_plugin.build_cp_groups(CFG)
    torch.manual_seed(0)
    blocks = nn.ModuleList(DecoderBlock(c, CoreAttention(CFG, groups)) for _ in range(c.layers)).to(dtype)
    for p in blocks.parameters():
        if p.dim() == 1:
            nn.init.normal_(p, 0.5, 0.3)          # norms' weights and biases: nothing trivially one or zero
    if preset is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")       # core_attn warns by design
            recompute.apply(blocks, preset)
    return blocks


def _grads(preset: str | None, dtype=torch.float64, c: DecoderConfig = C):
    blocks = _blocks(preset, dtype, c)
    x = torch.randn(2, SEQ, c.hidden, generator=torch.Generator().manual_seed(1), dtype=dtype).requires_grad_()
    y = x
    for block in blocks:
        y = block(y, torch.arange(SEQ))
    (y.pow(2) * torch.linspace(-1, 1, SEQ, dtype=dtype)[:, None]).sum().backward()
    return {"input": x.grad, **{name: p.grad for name, p in blocks.named_parameters()}}


def _compare(got: dict, want: dict, rtol: float) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        err = ((got[name] - w).abs().max() / w.abs().max()).item()
        assert err <= rtol, f"{name}: relative error {err:.1e}"


@pytest.fixture(scope="module")
def reference():
    return _grads(None)


def test_chunk_sizes():
    assert chunk_sizes(22, 5) == [5, 5, 4, 4, 4] and chunk_sizes(8, 8) == [8] and chunk_sizes(3, 100) == [3]
    assert chunk_sizes(22, 32) == [22]


@pytest.mark.parametrize("preset", PRESETS)
def test_tile_mlp_exact_with_every_preset(reference, preset):
    _compare(_grads(f"{preset}+tile_mlp:5"), reference, 1e-12)       # 5 chunks of 5, 5, 4, 4, 4 tokens


@pytest.mark.parametrize("preset", REGION_PRESETS)
def test_recompute_attn_exact(reference, preset):
    _compare(_grads(f"{preset}+recompute_attn"), reference, 0.0)      # the same ops again: bit for bit
    _compare(_grads(f"{preset}+recompute_attn+tile_mlp:7"), reference, 1e-12)


def test_tile_mlp_fp32_and_automatic_chunks():
    """fp32 within 1e-6; plain +tile_mlp chunks by the input width (hidden 8: 22 tokens → 3 chunks)."""
    c = DecoderConfig(hidden=8, ffn=24, layers=3, heads=2, kv_heads=1, gated=True)
    want = _grads(None, torch.float32, c)
    for preset in ("none+tile_mlp", "selective+tile_mlp", "sqrt+tile_mlp:4"):
        _compare(_grads(preset, torch.float32, c), want, 1e-6)
    seen = []
    block = _blocks("none+tile_mlp", torch.float32, c)[0]
    block.mlp.up.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape[:-1])))
    with torch.no_grad():
        block(torch.randn(2, SEQ, c.hidden), torch.arange(SEQ))
    assert seen == [(2, 8), (2, 7), (2, 7)]


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norms_run_in_chunks(norm):
    """+tile_mlp chunks the layer's norms too (ctx_plugin's RMSNorm, torch's LayerNorm): each runs once per chunk,
    in the forward and again in backward (its recomputation), exact in float64 (the LayerNorm's bias included)."""
    from unittest import mock

    from ctx_plugin.models import RMSNorm

    c = DecoderConfig(hidden=8, ffn=24, layers=2, heads=2, kv_heads=1, norm=norm)
    cls = RMSNorm if norm == "rms" else nn.LayerNorm
    seen, original = [], cls.forward

    def forward(self, x):
        seen.append(tuple(x.shape[:-1]))
        return original(self, x)

    with mock.patch.object(cls, "forward", forward):
        want = _grads(None, c=c)
        _compare(_grads("none+tile_mlp:9", c=c), want, 1e-12)
    untiled = [(2, SEQ)] * 2 * c.layers
    assert seen[:len(untiled)] == untiled
    chunks = [(2, 8), (2, 7), (2, 7)]
    assert seen[len(untiled):] == chunks * 2 * c.layers + chunks[::-1] * 2 * c.layers, seen[len(untiled):]


def _hf_llama(groups):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                         attention_bias=True, mlp_bias=True, initializer_range=0.1, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double().train()
    for name, p in model.named_parameters():
        if p.dim() == 1:
            nn.init.normal_(p, 0.5 if "norm" in name else 0.0, 0.2)
    if groups is not None:
        hf.enable(model, groups.config, groups)
    return model


def _hf_grads(preset: str | None):
    groups = None if preset is None else ctx_plugin.build_cp_groups(CFG)
    model = _hf_llama(groups)
    if preset is not None:
        recompute.apply(model.model.layers, preset)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids, position_ids=torch.arange(SEQ).expand(2, SEQ)).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["none+tile_mlp:5", "selective+tile_mlp:3", "mlp+tile_mlp:8",
                                    "full:uniform:2+tile_mlp", "sqrt+tile_mlp:5+recompute_attn"])
def test_hf_llama_layers(preset):
    """Reference: the HF model with its own sdpa attention, no ctx_plugin; round-off of two attention kernels."""
    pytest.importorskip("transformers")
    _compare(_hf_grads(preset), _hf_grads(None), 1e-10)


def test_final_norm_is_tiled_and_restored():
    """The DeepSpeed entry point finds a Hugging Face model's final norm next to its layers; apply(final_norm=)
    chunks it under +tile_mlp only, remove(final_norm=) restores it."""
    pytest.importorskip("transformers")
    from ctx_plugin.deepspeed import _decoder_layers

    model = _hf_llama(None)
    layers, norm = _decoder_layers(model)
    assert layers is model.model.layers and norm is model.model.norm
    recompute.apply(layers, "full", final_norm=norm)
    assert "forward" not in vars(norm)
    recompute.remove(layers, final_norm=norm)
    recompute.apply(layers, "full+tile_mlp:4", final_norm=norm)
    assert "forward" in vars(norm)
    recompute.remove(layers)              # the final norm stays tiled: the error says how to remove it
    with pytest.raises(ValueError, match=r"already applied .*recompute\.remove\(layers, final_norm=\.\.\.\) first"):
        recompute.apply(layers, "none+tile_mlp", final_norm=norm)
    recompute.remove(layers, final_norm=norm)
    assert "forward" not in vars(norm)
    with pytest.raises(ValueError, match="counts 4 layers, but the stack has 3"):    # refused before patching
        recompute.apply(layers, "full:block:4+tile_mlp", final_norm=norm)
    assert not any("forward" in vars(m) for m in (norm, layers[0].mlp, layers[0].input_layernorm))
    with pytest.raises(ValueError, match=r"apply\(layers, 'full\+tile_mlp', final_norm=<the model's final norm>\)"):
        recompute.to_megatron("full+tile_mlp", 32)
    with pytest.raises(ValueError, match=r"chunks the final norm over the sequence, but its LayerNorm"):
        recompute.apply(layers, "none+tile_mlp", final_norm=nn.LayerNorm((2, 4)))


@pytest.mark.parametrize("kind", ["gemma2", "phi", "cohere", "olmo2", "nemotron"])
def test_hf_families_norms(kind):
    """Norm layouts beyond Llama's, chunked with the final norm under full+tile_mlp: Gemma2's four norms per layer,
    Phi's and Cohere's one (attention and MLP in parallel), OLMo2's norms after attention and MLP, Nemotron's
    LayerNorm1P. Reference: the same HF model with its own attention (sdpa; Gemma2's eager), no ctx_plugin; float64,
    except inside Gemma's and Cohere's norms, which compute in fp32 whatever the input (chunks round there as fp32
    does)."""
    transformers = pytest.importorskip("transformers")
    from ctx_plugin.deepspeed import _decoder_layers

    config = transformers.AutoConfig.for_model(kind, vocab_size=64, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=8, use_cache=False, pad_token_id=0, bos_token_id=1,
                                               eos_token_id=2,
                                               attn_implementation="eager" if kind == "gemma2" else "sdpa")
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * 2
    grads = []
    for tiled in (False, True):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).double().train()
        for p in model.parameters():
            if p.dim() == 1:
                nn.init.normal_(p, 0.5, 0.2)
        if tiled:
            hf.enable(model, CFG, ctx_plugin.build_cp_groups(CFG))
            layers, final = _decoder_layers(model)
            recompute.apply(layers, "full+tile_mlp:5", final_norm=final)
            assert final is not None and "forward" in vars(final)
            assert all("forward" in vars(norm) for norm in recompute.tiling.layer_norms(layers[0]))
        ids = torch.randint(3, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, position_ids=torch.arange(SEQ).expand(2, SEQ)).logits.pow(2).mean().backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    _compare(grads[1], grads[0], 1e-6 if kind in ("gemma2", "cohere") else 1e-12)


class _Sizes(TorchDispatchMode):
    """The storages created under it (weakly), and the most bytes of them alive after any operator (``peak``:
    what a step adds to parameters and inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.refs or self.refs[ref.cdata][0].expired():
                    self.refs[ref.cdata] = (ref, t.untyped_storage().nbytes())
        self.peak = max(self.peak, sum(n for ref, n in self.refs.values() if not ref.expired()))
        return out


def _saved(preset: str) -> tuple[int, int]:
    """(bytes of the largest storage a 2-layer stack keeps for backward, bytes of all it keeps)."""
    c = DecoderConfig(hidden=16, ffn=256, layers=2, heads=2, kv_heads=1, gated=True)
    blocks = _blocks(preset, torch.float32, c)
    x0 = torch.randn(1, TOKENS, c.hidden, requires_grad=True)
    sizes = _Sizes()
    with sizes:
        x = x0 * 1.0
        for block in blocks:
            x = block(x, torch.arange(TOKENS))
    gc.collect()
    result = StorageWeakRef(x.untyped_storage()).cdata
    alive = [n for key, (ref, n) in sizes.refs.items() if not ref.expired() and key != result]
    x.sum().backward()
    return max(alive), sum(alive)


TOKENS, TOKEN_FFN = 64, 64 * 256 * 4       # one fp32 tokens × ffn tensor


@pytest.fixture(scope="module")
def tiled_none():
    return _saved("none+tile_mlp:16")


def test_tile_mlp_keeps_no_tokens_by_ffn_tensor(tiled_none):
    """none keeps the MLP's inside (several tokens × ffn tensors); none+tile_mlp only the MLP's input."""
    largest, total = _saved("none")
    assert largest >= TOKEN_FFN and tiled_none[0] < TOKEN_FFN
    assert tiled_none[1] <= total - 2 * TOKEN_FFN * 2        # two layers, at least two such tensors each


@pytest.mark.parametrize("preset", ["selective", "core_attn", "mlp", "full", "sqrt"])
def test_tile_mlp_keeps_no_more_under_any_preset(tiled_none, preset):
    """With any preset the tiled stack keeps no more than none+tile_mlp: under selective too, whose policy must not
    save the chunks' matrix products (they would add up to tokens × ffn tensors, one chunk at a time)."""
    largest, total = _saved(f"{preset}+tile_mlp:16")
    assert largest < TOKEN_FFN and total <= tiled_none[1], f"{preset}+tile_mlp keeps {total} bytes"


def _mlp_peak(preset: str) -> int:
    """Peak bytes of a forward+backward through a 1-layer stack with a large MLP (ffn = 64 × hidden)."""
    c = DecoderConfig(hidden=16, ffn=1024, layers=1, heads=2, kv_heads=1, gated=True)
    blocks = _blocks(preset, torch.float32, c)
    for p in blocks.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(8, 32, c.hidden, requires_grad=True)
    with _Sizes() as peak:
        y = blocks[0](x, torch.arange(32))
        y.sum().backward()
        del y
    return peak.peak


@pytest.mark.parametrize("preset", ["none", "full"])
def test_peak_falls_by_the_chunking_factor(preset):
    """8 × 32 tokens × 1024 ffn (gate, up, activation, product: ~4 MiB of intermediates, dominating); 8 chunks
    of 4 tokens: the peak falls by well over half the chunking factor (attention and hidden-sized tensors stay)."""
    untiled, tiled = _mlp_peak(preset), _mlp_peak(f"{preset}+tile_mlp:4")
    assert tiled * 4 < untiled, f"{preset}: peak {untiled} → {tiled} bytes"


def test_unpinned_restores_the_enclosing_mode():
    """A +recompute_attn region inside a recording one: attention runs plainly there (not remembered), and the
    enclosing recording goes on after it."""
    from ctx_plugin.recompute import pinning as pins
    from ctx_plugin.recompute.pinning import Recording

    run = Recording()
    x = torch.ones(2, requires_grad=True)
    with pins.recording(run):
        with pins.unpinned():
            pins.run(lambda: x * 2)
        assert run.outputs == []
        pins.run(lambda: x * 3)
    assert len(run.outputs) == 1
    with pins.replaying(run):
        with pins.unpinned():
            assert torch.equal(pins.run(lambda: x * 5), x * 5)      # computed, not the remembered x * 3
        assert torch.equal(pins.run(lambda: x * 7), x * 3)          # replayed


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4)])

    def forward(self, x):
        return self.experts[0](x)


class _RouterMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x), self.lin(x).sum(-1)         # a second output that depends on the tokens


class _Layer(nn.Module):
    def __init__(self, mlp: nn.Module | None) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        out = self.mlp(x)
        return out[0] if isinstance(out, tuple) else out


def test_refusals():
    with pytest.raises(ValueError, match=r"\+tile_loss .* applied by the loss .* config\.for_layers \(full\)"):
        recompute.apply([_Layer(nn.Linear(4, 4))], "full+tile_loss")
    with pytest.raises(ValueError, match=r"\+tile_mlp needs layers with an `.mlp` submodule; layer 0"):
        recompute.apply([_Layer(None)], "none+tile_mlp")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        recompute.apply([_Layer(_MoE())], "full+tile_mlp")
    with pytest.raises(ValueError, match="sequence_dim must be a non-negative int"):
        recompute.apply([_Layer(nn.Linear(4, 4))], "none+tile_mlp", sequence_dim=-1)
    layers = [_Layer(_RouterMLP())]
    recompute.apply(layers, "none+tile_mlp:2")
    with pytest.raises(ValueError, match="output 1 of _RouterMLP depends on the tokens"):
        layers[0](torch.randn(1, 4, 4))
    layers = [_Layer(nn.Linear(4, 4))]
    recompute.apply(layers, "none+tile_mlp:2", sequence_dim=2)
    with pytest.raises(ValueError, match=r"no sequence dimension 2 before the hidden one; pass apply\(\.\.\., "):
        layers[0](torch.randn(1, 4, 4))
    recompute.remove(layers)
    assert "forward" not in vars(layers[0].mlp)


class _NormLayer(_Layer):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__(nn.Linear(4, 4))
        self.input_layernorm = norm

    def forward(self, x):
        return super().forward(self.input_layernorm(x))


class _WideRMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))


class _WideLayerNorm(nn.Module):           # no parameters: only its normalized_shape says what it normalises
    def __init__(self) -> None:
        super().__init__()
        self.normalized_shape = (4, 4)


def test_norms_that_chunking_would_change_are_refused():
    with pytest.raises(ValueError, match=r"layer 0's norms over the sequence, but its LayerNorm normalises over "
                                         r"more than the last dimension \(normalized_shape \(4, 4\)\)"):
        recompute.apply([_NormLayer(nn.LayerNorm((4, 4)))], "full+tile_mlp")
    with pytest.raises(ValueError, match=r"its _WideRMSNorm .* \(parameters that are not vectors\)"):
        recompute.apply([_NormLayer(_WideRMSNorm())], "none+tile_mlp")
    with pytest.raises(ValueError, match=r"its _WideLayerNorm .* \(normalized_shape \(4, 4\)\)"):
        recompute.apply([_NormLayer(_WideLayerNorm())], "none+tile_mlp")
    layers = [_NormLayer(nn.RMSNorm(4))]
    recompute.apply(layers, "none+tile_mlp:2")
    assert "forward" in vars(layers[0].input_layernorm)
    with pytest.raises(ValueError, match="already applied"):
        recompute.apply(layers, "none")
    recompute.remove(layers)
    assert "forward" not in vars(layers[0].input_layernorm) and "forward" not in vars(layers[0].mlp)
    recompute.apply(layers, "none")         # removed: applies again


def test_mixtures_of_experts_without_an_experts_attribute_are_refused():
    """JetMoE keeps its experts in input_linear/output_linear next to a router: chunking its calls changed the
    router logits it returns (one entry per chunk) and broke its load-balancing loss under a padding mask."""
    transformers = pytest.importorskip("transformers")
    config = transformers.JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, kv_channels=8, intermediate_size=32,
                                       num_local_experts=4, num_experts_per_tok=2)
    model = transformers.JetMoeForCausalLM(config)
    with pytest.raises(ValueError, match=r"cannot tile layer 0's JetMoeMoE \(a JetMoeMoE\): a mixture-of-experts"):
        recompute.apply(model.model.layers, "none+tile_mlp:16")

    class _Routed(nn.Module):           # a router next to the experts, whatever the class is called
        def __init__(self) -> None:
            super().__init__()
            self.router, self.input_linear = nn.Linear(4, 2), nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"cannot tile layer 0's _Routed \(its `router`\)"):
        recompute.apply([_Layer(_Routed())], "none+tile_mlp")

    class _Experts(nn.Module):          # named as experts, at any depth
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 4))

    class _Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = _Experts()
    with pytest.raises(ValueError, match=r"cannot tile layer 0's _Wrapped \(its 'block', a _Experts\)"):
        recompute.apply([_Layer(_Wrapped())], "none+tile_mlp")
