"""Real blocks of every family measured against the memory model (one process, CPU): what the layers keep for
backward, and the activation peak of a whole step (layers, final norm, LM head, cross-entropy — tiled with
``+tile_loss`` — backward)."""
from __future__ import annotations

import contextlib
import gc
import warnings
from unittest import mock

import torch
import torch.nn.functional as F

import ctx_plugin
from ctx_plugin import recompute
from ctx_plugin.memory import ModelSpec, ParallelSpec, estimate, layer_activations, saved_bytes
from ctx_plugin.memory.blocks import layer_terms
from ctx_plugin.memory.specs import HF_MODEL_TYPES
from ctx_plugin.memory.measure import step_bytes
from ctx_plugin.tiled_loss import lm_loss_sum

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, BATCH = 64, 160, 3, 4, 2, 2
CFG = ctx_plugin.CPConfig(kernel="sdpa_cpu")    # a flash-style kernel: no score matrices, as on GPUs


def spec(family: str, vocab: int, **kw) -> ModelSpec:
    return ModelSpec(layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, vocab=vocab,
                     family=family, **kw)


def _hf(kind: str, vocab: int, dtype: torch.dtype, groups, cfg=CFG):
    import transformers
    import ctx_plugin.hf

    common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, attention_dropout=0.0, use_cache=False,
                  initializer_range=0.1)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=False))
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:             # another type of HF_MODEL_TYPES, all layers full attention (windows keep the same tensors)
        config = transformers.AutoConfig.for_model(kind, **common, head_dim=HIDDEN // HEADS, pad_token_id=0,
                                                   bos_token_id=1, eos_token_id=2)
        if getattr(config, "layer_types", None):
            config.layer_types = ["full_attention"] * LAYERS
        if hasattr(config, "sliding_window"):
            config.sliding_window = None
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(dtype).train()
    ctx_plugin.hf.enable(model, cfg, groups)
    layers = model.model.layers

    def run_layers(x, pos):
        return model.model(inputs_embeds=x, position_ids=pos.expand(x.shape[0], -1), use_cache=False).last_hidden_state

    return model, layers, run_layers, model.lm_head


def _ctx(vocab: int, dtype: torch.dtype, groups, cfg=CFG):
    from ctx_plugin.models import CoreAttention, DecoderBlock, DecoderConfig, RMSNorm

    c = DecoderConfig(hidden=HIDDEN, ffn=FFN, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, vocab=vocab)
    layers = torch.nn.ModuleList(DecoderBlock(c, CoreAttention(cfg, groups)) for _ in range(LAYERS))
    norm, head = RMSNorm(HIDDEN), torch.nn.Linear(HIDDEN, vocab, bias=False)
    model = torch.nn.ModuleDict(dict(layers=layers, norm=norm, head=head)).to(dtype)

    def run_layers(x, pos):
        for block in layers:
            x = block(x, pos)
        return norm(x)

    return model, layers, run_layers, head


@contextlib.contextmanager
def _device_only():
    """Offload's host copies are CPU tensors here as everything else: the measuring mode does not count them (they
    are host memory, read from the offload's own ``held_bytes``); copies back to the device are counted."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from ctx_plugin.memory.measure import _StorageTracker
    from ctx_plugin.recompute.offload import HostOffload

    to_host = HostOffload._to_host

    def device_only(self, t):
        host, copied = to_host(self, t)
        tracker = _get_current_dispatch_mode()
        if isinstance(tracker, _StorageTracker):
            tracker.ignore_storage(host)
        return host, copied

    with mock.patch.object(HostOffload, "_to_host", device_only):
        yield


class GradientsOnly:
    """The selected kernel, its backward replaced by allocating its three gradients (zeros): a stand-in whose
    backward holds what every kernel returns and nothing of a CPU kernel's own temporaries."""

    def __init__(self, kernel):
        self.kernel, self.name = kernel, kernel.name

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def forward(self, *args, **kwargs):
        return self.kernel.forward(*args, **kwargs)

    def backward(self, dout, q, k, v, out, lse, **kwargs):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@contextlib.contextmanager
def stand_in_kernel():
    """Every cp_attention call under it runs :class:`GradientsOnly` around the kernel it selects."""
    import ctx_plugin.core.api as api

    select = api.select_kernel
    with mock.patch.object(api, "select_kernel", lambda *a, **kw: GradientsOnly(select(*a, **kw))):
        yield


def measure(family: str, preset: str, dtype: torch.dtype, *, seq_len: int = 64, vocab: int = 256,
            kind: str = "llama", batch: int = BATCH, cp: int = 1, backend: str = "zigzag", rank: int = 0) -> dict:
    """Measured and modelled bytes: ``layers`` (kept by the decoder layers on the device), ``peak`` (a step's
    device activations) and ``host`` (offloaded after the forward). ``cp`` > 1: rank ``rank`` of ``cp`` simulated
    ranks with ``backend`` (``seq_len`` the global length) and the :func:`stand_in_kernel`, whose backward allocates
    exactly its gradients (on CPU the model counts no kernel workspace)."""
    if cp == 1:
        cfg, groups = CFG, ctx_plugin.build_cp_groups(CFG)
    else:
        from ctx_plugin.bench.simulated import SILENT, simulated_groups

        cfg = ctx_plugin.CPConfig(backend=backend, kernel="sdpa_cpu", check_ranks=False)
        groups = simulated_groups(cfg, rank, cp, SILENT, "cpu")
    with stand_in_kernel() if cp > 1 else contextlib.nullcontext(), \
            mock.patch("torch.distributed.all_reduce", lambda *a, **k: None) if cp > 1 else contextlib.nullcontext():
        return _measure(family, preset, dtype, seq_len, vocab, kind, batch, cfg, groups)   # (HF's input checks
        # agree over the CP group: one simulated rank agrees with itself)


def _measure(family: str, preset: str, dtype: torch.dtype, seq_len: int, vocab: int, kind: str, batch: int, cfg,
             groups) -> dict:
    config = recompute.RecomputeConfig.parse(preset)
    cp = groups.size
    torch.manual_seed(0)
    build = _ctx if family == "ctx_plugin" else lambda v, d, g, c: _hf(kind, v, d, g, c)
    model, layers, run_layers, head = build(vocab, dtype, groups, cfg)
    final_norm = model["norm"] if family == "ctx_plugin" else model.model.norm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # core_attn warns by design
        recompute.apply(layers, config.for_layers, final_norm=final_norm)     # +tile_loss is the loss's (below)
    local = seq_len // cp
    x0 = torch.randn(batch, local, HIDDEN, dtype=dtype, requires_grad=True)
    pos = ctx_plugin.sequence_positions(seq_len, config=cfg, groups=groups)
    labels = torch.randint(0, vocab, (batch * local,))
    fixed = [*model.parameters(), *model.buffers(), x0, pos]

    def only_layers():                # without the final norm: what the layers alone keep
        x = x0 * 1.0
        if family == "ctx_plugin":
            for block in layers:
                x = block(x, pos)
            return x
        return run_layers(x, pos)

    offload = recompute.host_offload(layers)
    with _device_only():
        out, kept = saved_bytes(only_layers, exclude=fixed)
    host = offload.held_bytes if offload is not None else 0
    out.float().sum().backward()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients accumulate in place: only their per-operator temporaries count

    def step():
        hidden = run_layers(x0 * 1.0, pos)
        if config.tile_loss:           # +tile_loss: the head and loss over chunks (ctx_plugin.tiled_loss)
            return lm_loss_sum(hidden, labels.view(batch, local), head, tokens=config.loss_tokens)
        return F.cross_entropy(head(hidden).flatten(0, 1).float(), labels)

    gc.collect()
    gc.disable()     # tensors freed by reference counting only: a cyclic collection mid-step would move the peak
    try:             # with the process's allocation history (e.g. which modules were imported before)
        with _device_only():
            _, peak = step_bytes(step, exclude=[*fixed, *(p.grad for p in model.parameters())])
    finally:
        gc.enable()
    m = spec(family, vocab, qk_norm=family == "hf" and HF_MODEL_TYPES[kind])
    parallel = ParallelSpec(cp=cp, backend=cfg.backend)
    est = estimate(m, parallel, preset, seq_len=seq_len, micro_batch=batch, dtype=dtype, device="cpu")
    k = layer_terms(m, parallel, seq_len, batch, dtype, "cpu")
    head = k.head - (k.norm_drop if config.tile_mlp else 0)     # the final norm's kept (+tile_mlp chunks it)
    layers_model = est.activations - k.shared - head            # the layers' on the device (less what is offloaded)
    assert est.host or layers_model == sum(layer_activations(m, parallel, preset, seq_len=seq_len,
                                                             micro_batch=batch, dtype=dtype, device="cpu"))
    if family == "hf":            # HF's model runs the final norm (its output is the result) and builds cos/sin
        layers_model += k.shared + head - k.x
    model_peak = est.activations + est.transient
    return {"activations": est.activations, "layers": kept, "layers_model": layers_model, "peak": peak,
            "peak_model": model_peak, "host": host, "host_model": est.host,
            "attention_binds": est.attention_peak + est.cp_buffers > max(est.logits_peak, est.recompute_peak)}
