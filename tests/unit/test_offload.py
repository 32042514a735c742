"""Activation offload to host memory (``+offload:<GiB>``, ``+offload_attn:<GiB>``; ctx_plugin.recompute.offload),
one process, CPU tensors (the same code path as CUDA with plain host copies): gradients bit-identical to the same
preset without offload (float64), the host bytes held exactly the region inputs (+ the pinned attention tensors,
each once) and all released after backward, the device input no longer referenced after forward, the copies back
started one region ahead, the budget error, eval/no-grad, several forwards in flight, retain_graph, layers taking
``hidden_states=`` (Megatron) and a Hugging Face decoder stack."""
from __future__ import annotations

import gc
import re
import warnings
import weakref

import pytest
import torch
from torch import nn

import ctx_plugin
from ctx_plugin import hf, recompute
from ctx_plugin.recompute import offload as offload_module
from ctx_plugin.recompute.presets import gib_text
from ctx_plugin.recompute.offload import HostOffload, host_offload
from tests.offload_cases import MODIFIED, attention_bytes_cp1, expected_host_bytes, offload_step
from tests.recompute_cases import BATCH, build_blocks, decoder_config

CFG = ctx_plugin.CPConfig(kernel="torch")
SEQ = 16
SHAPE = "gqa-gated"


def _grads_equal(got: dict, want: dict) -> None:
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


@pytest.fixture(scope="module")
def plain():
    groups = ctx_plugin.build_cp_groups(CFG)
    return {p: offload_step(SHAPE, p, CFG, groups, SEQ) for p in MODIFIED}


@pytest.mark.parametrize("modifier", ["offload:1", "offload_attn:1"])
@pytest.mark.parametrize("preset", MODIFIED)
def test_round_trip_exact_and_host_bytes_accounted(plain, preset, modifier):
    got = offload_step(SHAPE, f"{preset}+{modifier}", CFG, ctx_plugin.build_cp_groups(CFG), SEQ)
    _grads_equal(got["grads"], plain[preset]["grads"])
    assert got["attention_runs"] == plain[preset]["attention_runs"]
    want = expected_host_bytes(SHAPE, f"{preset}+{modifier}", SEQ, attention_bytes_cp1(SHAPE, SEQ))
    assert got["held"] == want, f"held {got['held']} vs {want} bytes"
    assert got["after"] == 0, "host memory must be released after backward"


def _stack(preset: str, shape: str = SHAPE):
    groups = ctx_plugin.build_cp_groups(CFG)
    blocks = build_blocks(decoder_config(shape), CFG, groups, preset).double()
    return blocks, host_offload(blocks)


def _input(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, SEQ, decoder_config(SHAPE).hidden, generator=g, dtype=torch.float64)


def _forward(blocks, x):
    for block in blocks:
        x = block(x, torch.arange(SEQ))
    return x


@pytest.mark.parametrize("preset", ["full", "sqrt+offload:1", "full+offload_attn:1"])
def test_region_inputs_are_not_kept_on_the_device(preset):
    """After forward nothing references a region's input tensor any more (only its host copy): without offload the
    checkpoint keeps it."""
    blocks, _ = _stack(preset)
    x = _input() * 1.0
    first = weakref.ref(x)
    y = _forward(blocks, x)
    del x
    gc.collect()
    assert (first() is None) == ("offload" in preset)
    y.sum().backward()


def test_copies_back_start_one_region_ahead(monkeypatch):
    """When region i's first tensor is needed in backward, region i−1's copies back are already under way (and
    only those: region i−2's are not); entries come back in the reverse order of the regions."""
    blocks, offload = _stack("full+offload_attn:1")
    groups_in_order: list = []
    real_open, real_take = HostOffload._open, HostOffload._take
    log: list = []

    def opening(self, region):
        group = real_open(self, region)
        groups_in_order.append(group)
        return group

    def taking(self, entry):
        i = groups_in_order.index(entry.group)
        fetched = [any(e.device is not None or (e.handed is not None and e.handed() is not None) for e in g.live())
                   for g in groups_in_order]
        log.append((i, fetched))
        return real_take(self, entry)

    monkeypatch.setattr(HostOffload, "_open", opening)
    monkeypatch.setattr(HostOffload, "_take", taking)
    _forward(blocks, _input() * 1.0).pow(2).sum().backward()
    firsts = {}
    for i, fetched in log:
        firsts.setdefault(i, fetched)
    assert list(firsts) == [2, 1, 0]
    for i, fetched in firsts.items():
        if i > 0:
            assert fetched[i - 1], f"region {i - 1} not brought back while region {i} starts"
        if i > 1:
            assert not fetched[i - 2], f"region {i - 2} brought back too early"


def test_budget_exceeded_is_a_clear_error_before_copying():
    region_bytes = BATCH * SEQ * decoder_config(SHAPE).hidden * 8
    budget = 2.5 * region_bytes / 2**30                 # two regions' inputs fit, the third does not
    blocks, offload = _stack(f"full+offload:{budget!r}")
    with pytest.raises(ValueError, match=rf"\+offload:{re.escape(gib_text(budget))}: offloading needs at least {3 * region_bytes} "
                                         rf"bytes .* \({2 * region_bytes} held \+ {region_bytes} for the next "
                                         r"tensor\), over the budget of .*raise it, e\.g\. \+offload:"):
        _forward(blocks, _input() * 1.0)
    assert offload.peak_bytes == 2 * region_bytes      # the third region's input was never copied


def test_attention_offload_counts_its_saved_output_once():
    """The remembered attention output and the attention's saved ``out`` are one tensor: one host copy."""
    blocks, offload = _stack("full:block:1+offload_attn:1")
    y = _forward(blocks, _input() * 1.0)
    want = BATCH * SEQ * decoder_config(SHAPE).hidden * 8 + attention_bytes_cp1(SHAPE, SEQ)
    assert offload.held_bytes == want
    y.sum().backward()


@pytest.mark.parametrize("mode", ["no_grad", "eval_no_grad", "inference"])
def test_a_forward_without_backward_offloads_nothing(mode):
    blocks, offload = _stack("full+offload_attn:1")
    context = torch.inference_mode() if mode == "inference" else torch.no_grad()
    if mode == "eval_no_grad":
        blocks.eval()
    with context:
        _forward(blocks, _input())
    assert offload.peak_bytes == 0


def test_several_forwards_in_flight_before_their_backwards():
    """Pipeline schedules: two micro-batches' forwards, then their backwards (last first): each brings back its
    own tensors; host memory adds up and falls back per backward."""
    def run(preset):
        blocks, offload = _stack(preset)
        outs, held = [], []
        for seed in range(2):
            outs.append(_forward(blocks, _input(seed) * 1.0))
            held.append(offload and offload.held_bytes)
        for y in reversed(outs):
            y.pow(2).sum().backward()
            held.append(offload and offload.held_bytes)
        return {n: p.grad for n, p in blocks.named_parameters()}, held

    want, _ = run("sqrt")
    got, held = run("sqrt+offload_attn:1")
    _grads_equal(got, want)
    one = expected_host_bytes(SHAPE, "sqrt+offload_attn:1", SEQ, attention_bytes_cp1(SHAPE, SEQ))
    assert held[:2] == [one, 2 * one]
    del got
    gc.collect()


def test_retain_graph_backward_twice():
    """``backward(retain_graph=True)``: host copies stay until the graph is freed and come back again for the
    second backward; gradients accumulate exactly as without offload."""
    def run(preset):
        blocks, offload = _stack(preset)
        y = _forward(blocks, _input() * 1.0).pow(2).sum()
        y.backward(retain_graph=True)
        held = offload and offload.held_bytes
        y.backward()
        del y
        gc.collect()
        return {n: p.grad for n, p in blocks.named_parameters()}, held, offload and offload.held_bytes

    want, _, _ = run("full")
    got, held, after = run("full+offload_attn:1")
    _grads_equal(got, want)
    assert held == expected_host_bytes(SHAPE, "full+offload_attn:1", SEQ, attention_bytes_cp1(SHAPE, SEQ))
    assert after == 0


class _KeywordBlock(nn.Module):
    """A layer called as Megatron's block calls its layers: ``layer(hidden_states=..., attention_mask=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.mlp = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, hidden_states, attention_mask=None):
        return hidden_states + self.mlp(torch.tanh(self.lin(hidden_states))) * attention_mask


def test_layers_taking_hidden_states_by_keyword():
    def run(preset):
        torch.manual_seed(0)
        layers = nn.ModuleList(_KeywordBlock() for _ in range(3)).double()
        recompute.apply(layers, preset)
        x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 1.0
        mask = torch.full((2, 5, 1), 0.5, dtype=torch.float64)
        first = weakref.ref(x)
        for layer in layers:
            x = layer(hidden_states=x, attention_mask=mask)
        gc.collect()
        kept = first() is not None
        held = host_offload(layers) and host_offload(layers).held_bytes
        x.pow(2).sum().backward()
        return {n: p.grad for n, p in layers.named_parameters()}, kept, held

    want, kept, _ = run("full")
    got, kept_offloaded, held = run("full+offload:1")
    _grads_equal(got, want)
    assert kept and not kept_offloaded
    assert held == 3 * 2 * 5 * 8 * 8                 # the three regions' hidden states, not the shared mask


def test_hugging_face_decoder_stack():
    """A Qwen2 decoder stack (q/k/v biases, GQA) under ctx_plugin's attention, float64: gradients of
    ``full+offload_attn`` equal ``full``'s, host memory used and then released."""
    transformers = pytest.importorskip("transformers")

    def run(preset):
        config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                          use_cache=False, initializer_range=0.1)
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(config).double().train()
        groups = ctx_plugin.build_cp_groups(CFG)
        hf.enable(model, groups.config, groups)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            recompute.apply(model.model.layers, preset)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=ids, position_ids=torch.arange(16).expand(2, 16)).logits.pow(2).mean()
        offload = host_offload(model.model.layers)
        held = offload and offload.held_bytes
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}, held, offload and offload.held_bytes

    want, _, _ = run("full")
    got, held, after = run("full+offload_attn:1")
    _grads_equal(got, want)
    # per layer: its input [2, 16, 32] and the attention's q, out [2, 16, 4, 8], k, v [2, 16, 2, 8], LSE [2, 4, 16]
    assert held == 3 * 8 * (2 * 16 * 32 + 2 * 16 * 8 * (2 * 4 + 2 * 2) + 2 * 4 * 16)
    assert after == 0


def test_unsupported_device_is_refused():
    offload = HostOffload(1, attention=False, flag="+offload:1")
    with pytest.raises(ValueError, match=r"supports CPU and CUDA tensors, got one on meta"):
        offload.pack(offload_module._Group(None), torch.empty(4, device="meta"))


def test_offload_needs_a_hidden_states_tensor():
    layers = nn.ModuleList([nn.Identity()])
    recompute.apply(layers, "full+offload:1")
    with pytest.raises(TypeError, match=r"\+offload:1 offloads a region's hidden states"):
        layers[0](hidden_states=[torch.ones(2, requires_grad=True)])


def test_offload_with_recompute_attn():
    """``+recompute_attn`` leaves the attention in the region (nothing pinned): only the region inputs move."""
    groups = ctx_plugin.build_cp_groups(CFG)
    want = offload_step(SHAPE, "sqrt+recompute_attn", CFG, groups, SEQ)
    got = offload_step(SHAPE, "sqrt+recompute_attn+offload:1", CFG, groups, SEQ)
    _grads_equal(got["grads"], want["grads"])
    assert got["attention_runs"] == want["attention_runs"] == 2 * decoder_config(SHAPE).layers
    assert got["held"] == expected_host_bytes(SHAPE, "sqrt+offload:1", SEQ, 0) and got["after"] == 0
