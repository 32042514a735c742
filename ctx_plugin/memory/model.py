"""The activation-memory model: bytes per GPU for a decoder-only transformer under a recompute preset and its
memory modifiers.

What each layer keeps is counted tensor by tensor for the block family that runs (:mod:`.blocks`: ctx_plugin's
own block, Hugging Face Llama/Mistral/Qwen2-style layers, megatron-core's GPT layers), held to the measured byte
on CPU in bf16 and fp32 (``tests/unit/test_memory_blocks.py``), and so is a whole step's activation peak: the most
of (a) everything kept plus the loss's fp32 logits, log-softmax and its gradient, (b) everything kept plus the final
norm's backward temporaries, (c) during the layers' backward, what the layers not yet done keep, the working set
re-materialised by the current layer or region (region presets: its layers' ``none`` tensors but the pinned
attention and the region input; ``mlp``: the MLP's intermediates; ``selective``: the norms and activations), the
MLP backward's temporaries and the incoming gradient, or once the MLP is done its norm's backward temporaries and
two gradients, (d) when a layer's attention backward starts, the same less the layer's MLP and MLP-norm tensors,
with the attention's incoming gradient, plus the attention's communication buffers and kernel workspace
(:mod:`.buffers`), which exist only then (held to measured bytes at CP 2–8 with simulated ranks of every backend).
Modifiers: ``+tile_loss`` (one chunk's logits; over several, the head-weight gradients autograd sums and the
chunks' hidden gradients), ``+tile_mlp`` (no MLP intermediates kept, the norms only their input and output; one
chunk's in backward, and a norm chunk's recomputation and temporaries),
``+recompute_attn`` (regions keep only their input; the attention runs twice per step), ``+offload`` /
``+offload_attn`` (region inputs, and pins by elements, in ``host`` memory; during a region's backward its copies
back — its input only while recomputed, unless a norm keeps it — and the previous region's, prefetched). Held to
measured bytes as the presets are (``+tile_mlp``: the last chunk's backward with the earlier chunks' input
gradients and the MLP weights' gradients summed over chunks).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..core.rules import SettingNames, check_heads, check_seq_len, check_tp_heads, document_unit
from ..names import Framework, Recompute
from ..recompute.presets import RecomputeConfig, candidates, regions
from ..tiled_loss import auto_tokens
from .blocks import layer_terms
from .buffers import cp_buffers
from .flops import BACKWARD, Packing, check_documents, pack
from .specs import ModelSpec, ParallelSpec, ceil_div
from .state import model_state

_NAMES = SettingNames(cp="cp", heads="query heads per tensor-parallel rank",
                      kv_heads="K/V heads per tensor-parallel rank")
_TP_NAMES = SettingNames(heads="heads", kv_heads="kv_heads", tp="tp")
GiB = 2**30
_REGIONS = (Recompute.FULL, Recompute.SQRT)
_LAYER_KEPT = (Recompute.NONE, Recompute.ATTN_OUT, Recompute.CORE_ATTN, Recompute.MLP)   # layers keep their own


def _chunk(tokens: int, per_chunk: int | None, default: int) -> int:
    """Tokens in one chunk of ``tokens`` split into chunks of at most ``per_chunk`` (``default`` when None)."""
    n = max(1, -(-tokens // (per_chunk or default)))
    return -(-tokens // n)


def layer_activations(m: ModelSpec, p: ParallelSpec, recompute: RecomputeConfig, *, seq_len: int,
                      micro_batch: int, dtype: torch.dtype, device: str = "cuda") -> list[int]:
    """Bytes each layer keeps for backward on one rank (a region's input is charged to its first layer; offloaded
    tensors are still counted here: :func:`estimate` moves them to ``host``). ``device``: see :func:`estimate`."""
    recompute = RecomputeConfig.parse(recompute)
    k = layer_terms(m, p, seq_len, micro_batch, dtype, device)
    # the tiled MLP keeps only its input (kept anyway), the tiled norms their input and output
    tiled = k.mlp_inner + 2 * k.norm_drop if recompute.tile_mlp else 0
    none = k.none - tiled
    preset = recompute.preset
    if preset in (Recompute.NONE, Recompute.ATTN_OUT):
        return [none] * m.layers
    if preset == Recompute.CORE_ATTN:
        return [none - k.lse + k.core_extra] * m.layers
    if preset == Recompute.MLP:
        return [k.none - k.mlp_inner - (tiled - k.mlp_inner if recompute.tile_mlp else 0)] * m.layers
    if preset == Recompute.SELECTIVE:
        return [k.selective - (k.mlp_outs if recompute.tile_mlp else 0)] * m.layers
    if preset == Recompute.BUDGET:
        raise ValueError(f"resolve {recompute} first (ctx_plugin.recompute.resolve)")
    pins = 0 if recompute.recompute_attention else k.pins
    sizes = [none] * m.layers
    for start, stop in regions(recompute, m.layers):
        for i in range(start, stop):
            sizes[i] = pins + (k.x if i == start else 0)
    return sizes


def _input_kept(k, recompute: RecomputeConfig) -> int:
    """Bytes of the layer input that its own tensors keep (a tiled input norm keeps it whatever its dtype)."""
    return k.x if recompute.tile_mlp else k.x_in_none


def _backward_peak(m: ModelSpec, recompute: RecomputeConfig, k, per_layer: list[int], chunk_inner: int,
                   chunk_temps: tuple[int, int], in_flight: list[int], norm_bwd: int) -> tuple[int, int]:
    """Activations alive at the worst moment of the layers' backward: what the layers not yet done keep, the
    recomputed working set of the current layer or region and the incoming gradient, with either the MLP
    backward's temporaries or, once the MLP is done (its intermediates freed: the peak when +tile_mlp leaves one
    chunk's), the MLP norm's backward temporaries. ``chunk_temps``: a +tile_mlp chunk's backward temporaries in a
    layer that is not recomputed, and in one that is (``selective``, regions). ``in_flight``: offloaded bytes back
    on the device while each region runs backward. ``norm_bwd``: a layer norm's backward beyond its kept tensors
    (a +tile_mlp chunk's recomputation and temporaries, and the earlier chunks' input gradients).

    Also returns the activations alive when the attention's backward starts (the MLP's and its norm's tensors
    freed; the attention's incoming gradient and the layer's output gradient alive), to which its transient
    communication buffers add (:attr:`MemoryEstimate.attention_peak`)."""
    tiled = recompute.tile_mlp
    drop = k.sel_norm_drop if tiled else 0      # what a selective layer's tiled norms do not re-materialise
    inner, (temps, temps_rec) = (chunk_inner, chunk_temps) if tiled else (0, (k.bwd_temps,) * 2)
    preset = recompute.preset
    working = {Recompute.MLP: k.mlp_inner, Recompute.SELECTIVE: k.sel_working - (k.sel_mlp + drop if tiled else 0)
               }.get(preset, 0) + inner
    if preset == Recompute.MLP and tiled:
        working = inner
    kept = sum(per_layer)
    peak = kept + working + (temps_rec if preset == Recompute.SELECTIVE else temps) + k.grad
    # the norm's backward: its output's slot holds the incoming gradient, the layer's output gradient waits
    norm = k.grad + norm_bwd
    sel_rest = k.sel_working - k.sel_mlp - drop if preset == Recompute.SELECTIVE else 0    # once the MLP is done
    peak = max(peak, kept + sel_rest + norm)
    # at the attention's backward the layer's MLP and MLP norm are done: what they kept, or re-materialised, is freed
    mlp_norm = 2 * k.x + (0 if tiled else k.norm_drop)
    mlp_kept = mlp_norm + (0 if tiled or preset == Recompute.MLP else k.mlp_inner)
    # selective: the norm and the MLP's cached inputs products (its output's stays until the layer is done)
    sel_kept = mlp_norm + (0 if tiled else k.mlp_outs - k.x)
    attention = kept + sel_rest - (mlp_kept if preset in _LAYER_KEPT else sel_kept * (preset == Recompute.SELECTIVE)) \
        + k.grad + k.attn_grads
    per_layer_rec = k.none - k.mlp_inner - k.pins - 2 * k.norm_drop * tiled   # tiled: one MLP chunk at a time
    if recompute.recompute_attention:
        per_layer_rec += k.pins
    for (start, stop), back in zip(regions(recompute, m.layers), in_flight or [0] * m.layers):
        n = stop - start      # the last layer's MLP backward (its intermediates, the others' untiled), then its norm's
        rec = n * per_layer_rec - _input_kept(k, recompute) + back + (0 if tiled else (n - 1) * k.mlp_inner)
        peak = max(peak, sum(per_layer[:stop]) + rec + max((inner if tiled else k.mlp_inner) + temps_rec + k.grad,
                                                           norm))
        attention = max(attention, sum(per_layer[:stop]) + rec - mlp_norm + k.grad + k.attn_grads)
    return peak + k.shared, attention + k.shared


def param_count(m: ModelSpec, tp: int = 1) -> int:
    """Parameters held by one tensor-parallel rank (norms replicated)."""
    kv_w = max(m.kv_heads // tp, 1) * m.head_dim
    q_w, f = m.hidden // tp, ceil_div(m.ffn, tp)
    norm = (1 if m.norm == "rms" else 2) * m.hidden
    up = (2 if m.gated else 1) * f                            # a gated MLP's gate and up projections, or fc1
    mlp = (up + f) * m.hidden + (up + m.hidden if m.mlp_bias else 0)
    bias = ((q_w + 2 * kv_w) if m.attention_bias else 0) + (m.hidden if m.output_bias else 0)
    qk_norm = 2 * m.head_dim if m.qk_norm else 0
    layer = m.hidden * (q_w + 2 * kv_w) + bias + q_w * m.hidden + mlp + 2 * norm + qk_norm
    embed = ceil_div(m.vocab, tp) * m.hidden
    return m.layers * layer + embed * (1 if m.tied_embeddings else 2) + m.position_embeddings * m.hidden + norm


def layout_packing(p: ParallelSpec, seq_len: int, documents=None) -> Packing:
    """How ``documents`` (None, a mean length or a list of lengths: :mod:`ctx_plugin.memory.flops`) fill a sequence
    of ``seq_len`` tokens under ``p``'s layout, each document padded to the layout's document unit."""
    unit = 1 if documents is None else document_unit(p.cp_config, p.cp)
    return pack(seq_len, documents, unit=unit)


def layer_flops(m: ModelSpec, p: ParallelSpec, t: int, seq_len: int, documents=None) -> tuple[float, float, float]:
    """(projection+MLP, MLP, attention) forward FLOPs of one layer on one rank: the projections and MLP over all
    ``t`` tokens (document padding included), the causal attention over the pairs of the packed documents
    (:func:`layout_packing`; one document of ``seq_len`` tokens without ``documents``): ``4·pairs·q_w·t/seq_len``."""
    d, f = m.head_dim, ceil_div(m.ffn, p.tp)
    q_w, kv_w = m.heads // p.tp * d, max(m.kv_heads // p.tp, 1) * d
    mlp = 2 * t * m.hidden * f * (3 if m.gated else 2)
    proj = 2 * t * m.hidden * (2 * q_w + 2 * kv_w)
    pairs = layout_packing(p, seq_len, documents).pairs
    return proj + mlp, mlp, 4 * pairs * q_w * t / seq_len


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU (one rank) for one training step's peak, and the recompute it costs."""

    params: int
    """Parameters on the GPU through forward and backward (:mod:`ctx_plugin.memory.state`)."""
    grads: int
    """Gradients alive at the backward's peak (the framework's buffer or partition, and full gradients in flight)."""
    optimizer: int
    """fp32 master weights (16-bit training) and Adam's two moments."""
    activations: int
    """Kept for backward on the GPU after the forward: all layers (less what is offloaded), per-model tensors,
    the final norm/head inputs."""
    per_layer: list[int] = field(repr=False)
    """Activations kept by each layer (offloaded ones included)."""
    recompute_peak: int
    """Activations beyond :attr:`activations` alive at the worst moment of the layers' backward: the recomputed
    working set of a layer or region, its backward temporaries, the incoming gradient, regions prefetched back."""
    cp_buffers: int
    """Transient context-parallel communication buffers of one attention call (and on CUDA the kernel's backward
    workspace), alive only inside the attention's backward: they add to :attr:`attention_peak`."""
    attention_peak: int
    """Activations beyond :attr:`activations` alive when a layer's attention backward starts (negative when less
    is: the final norm's and the layer's MLP tensors are freed by then): the recomputed working set of its layer or
    region less the MLP's and its norm's, the attention's incoming gradient and the layer's output gradient."""
    logits_peak: int
    """At the loss: the logits' fp32 copy, the saved log-softmax and its gradient; with +tile_loss one chunk's, and
    from the second chunk on the sum of the head-weight gradients so far and the hidden gradients done (autograd
    sums the chunks' weight gradients out of place before accumulating them: three at its additions; Megatron's
    gradient-accumulation fusion writes them into ``main_grad`` instead, less than counted)."""
    recompute_flops: float
    """Extra FLOPs of recomputation per micro batch on one rank (the attention's too with +recompute_attn; the
    planner times them)."""
    step_flops: float
    """A step's forward+backward FLOPs per micro batch on one rank: the layers' projections and MLP (3×: forward,
    backward), their attention (1 + :data:`~ctx_plugin.memory.flops.BACKWARD`×) and the LM head (3×)."""
    host: int = 0
    """Bytes per rank in host memory (+offload / +offload_attn: the region inputs, and the pinned attention
    tensors, of every region, all held between the forward and their region's backward)."""
    host_budget: int | None = None
    """The offload budget (``+offload:<GiB>``) in bytes; a run whose :attr:`host` exceeds it stops with an error."""
    attention_passes: int = 1
    """How many times each layer's attention (with its ring / all-to-all communication) runs forward per step: 2
    with core_attn or +recompute_attn (re-run in backward), else 1."""
    family: str = "ctx_plugin"
    """The block family described (:attr:`ModelSpec.family`)."""
    framework_buffers: int = 0
    """The framework's buffers next to the activations: DeepSpeed's gradient reduction bucket and its copy, and
    ZeRO-3's gathered parameters and a full parameter's gradient."""
    step_peak: int = 0
    """The model state at the optimizer step's peak (fp32 gradient copies and the update's temporaries; the
    activations are gone by then)."""
    framework: Framework = Framework.MEGATRON
    """The framework whose model state is counted (:attr:`ParallelSpec.runs_on`)."""

    @property
    def recompute_fraction(self) -> float:
        """:attr:`recompute_flops` relative to :attr:`step_flops` (the *extra FLOPs* column)."""
        return self.recompute_flops / self.step_flops

    @property
    def training_peak(self) -> int:
        """Model state + the framework's buffers + kept activations + the largest transient (:attr:`transient`)."""
        return self.params + self.grads + self.optimizer + self.framework_buffers + self.activations + \
            self.transient

    @property
    def transient(self) -> int:
        """The largest transient beyond the kept activations: the loss's, the layers' backward (:attr:`recompute_peak`)
        or the attention's backward with its communication buffers."""
        return max(self.logits_peak, self.recompute_peak, self.attention_peak + self.cp_buffers)

    @property
    def peak(self) -> int:
        """The larger of the forward/backward peak and the optimizer step's."""
        return max(self.training_peak, self.step_peak)

    @property
    def offloaded_peak(self) -> int:
        """The peak with the optimizer offloaded (DeepSpeed ZeRO-Offload: state and step on the host)."""
        return self.training_peak - self.optimizer

    @property
    def fits_host(self) -> bool:
        """Whether the offloaded bytes fit the offload budget (always True without offload)."""
        return self.host_budget is None or self.host <= self.host_budget


def check_layout(model: ModelSpec, parallel: ParallelSpec, seq_len: int, names: SettingNames | None = None) -> None:
    """``ValueError`` for a sequence or heads the layout cannot split, naming the settings as ``names`` does (a
    command line's flags; default: :func:`estimate`'s argument names)."""
    if not isinstance(model, ModelSpec) or not isinstance(parallel, ParallelSpec):
        raise TypeError("estimate(model=ModelSpec, parallel=ParallelSpec, ...)")
    per_rank = _NAMES if names is None else replace(names, heads=f"{names.heads} per {names.tp} rank",
                                                    kv_heads=f"{names.kv_heads} per {names.tp} rank")
    check_seq_len(parallel.cp_config, seq_len, parallel.cp, names or _NAMES)
    check_tp_heads(model.heads, model.kv_heads, parallel.tp, names or _TP_NAMES, replicate_kv=False)
    check_heads(parallel.cp_config, model.heads // parallel.tp, model.kv_heads // parallel.tp, parallel.cp, per_rank)


def _offloaded(recompute: RecomputeConfig, k, num_layers: int, device: str) -> list[tuple[int, int, int]]:
    """(host bytes held, bytes copied, device bytes freed) of each region: its input, and its layers' pinned
    attention with offload_attn (copied by elements; on the device whole storages go, as the QKV output v is a view
    of). On CUDA each copy holds :func:`ctx_plugin.recompute.pinned.host_block` bytes (small ones torch's
    power-of-two blocks)."""
    if recompute.offload_gib is None:
        return []
    from ..recompute.pinned import host_block

    held = (host_block(k.x, device), sum(host_block(part, device) for part in k.pins_parts))
    attn = recompute.offload_attention
    return [(held[0] + n * held[1] * attn, k.x + n * k.pins_host * attn, k.x + n * k.pins * attn)
            for n in (stop - start for start, stop in regions(recompute, num_layers))]


def estimate(model: ModelSpec, parallel: ParallelSpec, recompute: RecomputeConfig | str, *, seq_len: int,
             micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
             documents=None) -> MemoryEstimate:
    """Memory per GPU of one training step (mixed-precision Adam: params and grads in ``dtype``, fp32 master
    weights and moments; float32 training keeps no master copy), for ``model.family``'s blocks, with the preset's
    modifiers (tiled loss and MLP, attention recompute, offload). ``device="cpu"`` describes the same layers run
    on CPU (how the model is held to measured bytes: only the megatron family's RMSNorm differs).
    ``documents`` (packed documents: None, a mean length or a list of lengths, :mod:`ctx_plugin.memory.flops`)
    change only the attention's FLOPs and so :attr:`MemoryEstimate.recompute_fraction`: every byte is per token
    (q, k, v, out, LSE; padding tokens count like real ones), so memory is the same with or without them."""
    recompute = RecomputeConfig.parse(recompute)
    check_layout(model, parallel, seq_len)
    documents = check_documents(documents)
    e = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    state = model_state(model, parallel, param_count(model, parallel.tp), dtype)
    per_layer = layer_activations(model, parallel, recompute, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                                  device=device)
    k = layer_terms(model, parallel, seq_len, micro_batch, dtype, device)
    t = micro_batch * seq_len // parallel.cp
    local = seq_len // parallel.cp
    mlp_chunk = _chunk(local, recompute.mlp_tokens, model.hidden) * micro_batch
    chunk_inner, chunk_temps = k.mlp_inner * mlp_chunk // t, k.mlp_temps * mlp_chunk // t
    chunks = -(-t // mlp_chunk)
    if chunks > 1:     # the last chunk's backward: the earlier chunks' input gradients (joined at the end), the MLP
        chunk_x = k.x * mlp_chunk // t        # weights' gradients summed over chunks (while the last projection's
        # and then the first's are summed: the chunk's gradient and the sum), strided chunks' copies
        chunk_temps = max(chunk_temps, 2 * k.last_weight, 2 * k.first_weight - chunk_inner) + \
            (chunks - 1) * chunk_x + k.mlp_weights
    copies = k.chunk_copies if micro_batch > 1 and chunks > 1 else 0     # two fewer in a recomputed layer
    chunk_temps = (chunk_temps + copies * chunk_x, chunk_temps + max(copies - 2, 0) * chunk_x) if chunks > 1 \
        else (chunk_temps, chunk_temps)
    offloaded = _offloaded(recompute, k, model.layers, device)
    gpu_layers = list(per_layer)
    for (start, _), (_, _, freed) in zip(regions(recompute, model.layers), offloaded):
        gpu_layers[start] -= freed
    host = [held for held, _, _ in offloaded]   # pinned blocks on CUDA
    sent = [sent for _, sent, _ in offloaded]   # in a region's backward: its copies back (its input only while the
    in_flight = [b - k.x + _input_kept(k, recompute) + (sent[j - 1] if j else 0)   # recomputation, unless a norm
                 for j, b in enumerate(sent)]                       # keeps it) and the previous region's, prefetched
    activations = sum(gpu_layers) + k.shared + k.head - (k.norm_drop if recompute.tile_mlp else 0)
    norm_bwd = k.norm_bwd
    if recompute.tile_mlp:     # a norm chunk's recomputed tensors (all but its input) and temporaries, and the
        norm_bwd = (k.norm_drop + k.x + k.norm_bwd) * mlp_chunk // t + (chunks - 1) * k.x * mlp_chunk // t
    backward, attention = _backward_peak(model, recompute, k, gpu_layers, chunk_inner, chunk_temps, in_flight,
                                         norm_bwd)
    spans = [stop - start for start, stop in regions(recompute, model.layers)]
    full_step, mlp, attn = layer_flops(model, parallel, t, seq_len, documents)
    vocab = ceil_div(model.vocab, parallel.tp)
    step = model.layers * (3 * full_step + (1 + BACKWARD) * attn) + 6 * t * model.hidden * vocab
    preset = recompute.preset
    extra = {Recompute.MLP: model.layers * mlp, Recompute.CORE_ATTN: model.layers * attn}.get(preset, 0.0)
    extra += sum(spans) * (full_step + (attn if recompute.recompute_attention else 0))
    if recompute.tile_mlp and preset not in (Recompute.MLP, *_REGIONS):
        extra += model.layers * mlp                 # each chunk's MLP forward runs again in backward
    loss_tokens = t
    if recompute.tile_loss:
        loss_tokens = min(t, recompute.loss_tokens or auto_tokens(vocab))
        extra += 2 * t * model.hidden * vocab      # the head's forward runs again, chunk by chunk, in backward
    logits = loss_tokens * vocab * 3 * acc
    if loss_tokens < t:     # chunks: their head-weight gradients summed (out of place) before accumulation, and
        head_grad, hidden_grad = vocab * model.hidden * e, model.hidden * e      # the chunks' hidden gradients
        logits = max(logits + head_grad + (t - loss_tokens) * hidden_grad, 3 * head_grad + t * hidden_grad)
    passes = 2 if preset == Recompute.CORE_ATTN or recompute.recompute_attention else 1
    return MemoryEstimate(params=state.params, grads=state.grads, optimizer=state.optimizer,
                          framework_buffers=state.extra, step_peak=state.step,
                          framework=parallel.runs_on, activations=activations,
                          per_layer=per_layer, recompute_peak=max(backward - activations, norm_bwd, 0),
                          attention_peak=attention - activations,
                          cp_buffers=cp_buffers(model, parallel, t, seq_len, micro_batch, e, acc, device),
                          logits_peak=logits, recompute_flops=extra, step_flops=step,
                          host=sum(host),
                          host_budget=None if recompute.offload_gib is None else int(recompute.offload_gib * GiB),
                          attention_passes=passes, family=model.family)


def resolve(recompute: RecomputeConfig | str, model: ModelSpec, parallel: ParallelSpec, *, seq_len: int,
            micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16, documents=None,
            reserved: int = 0) -> RecomputeConfig:
    """``budget:<GiB>`` → among the presets whose estimated peak fits, the one with the least estimated recompute
    (:attr:`MemoryEstimate.recompute_fraction`, extra FLOPs); ties go to the preset without elementwise recompute
    (``none`` before ``selective``, whose recomputed norms and activations the FLOP estimate counts as free), then
    to the smaller peak. Other presets are returned unchanged. ``documents``: packed documents, whose shorter
    attention makes ``core_attn`` cheaper (:func:`estimate`). ``reserved``: bytes the framework holds on the GPU
    through the step besides what the estimate counts (Megatron's dataloader mask), taken from the budget. Also
    ``ctx_plugin.recompute.resolve``."""
    recompute = RecomputeConfig.parse(recompute)
    if recompute.preset != Recompute.BUDGET:
        return recompute
    budget = recompute.budget_gib * GiB
    keep = {"tile_loss": recompute.tile_loss, "loss_tokens": recompute.loss_tokens, "tile_mlp": recompute.tile_mlp,
            "mlp_tokens": recompute.mlp_tokens}      # the only modifiers budget:<GiB> accepts; every candidate keeps them
    estimates = [(c, estimate(model, parallel, c, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                              documents=documents))
                 for c in (replace(c, **keep) for c in candidates(model.layers))]
    fits = [(c, est) for c, est in estimates if est.peak + reserved <= budget]
    if fits:     # min keeps the first of equal keys: candidates' order (none before attn_out)
        return min(fits, key=lambda ce: (ce[1].recompute_fraction, ce[0].preset == Recompute.SELECTIVE,
                                         ce[1].peak))[0]
    smallest, est = min(estimates, key=lambda ce: ce[1].peak)
    held = f" and {reserved / GiB:.1f} GiB the framework holds besides" if reserved else ""
    raise ValueError(f"no recompute preset fits {recompute.budget_gib:g} GiB per GPU: the smallest estimate is "
                     f"{est.peak / GiB:.1f} GiB ({smallest}){held}; raise the budget, the context-parallel size, "
                     f"tensor parallelism or the ZeRO stage, or shorten the sequence")
