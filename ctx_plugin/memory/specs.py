"""What the memory model is asked about: the model's shape and how it is parallelised."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.config import CPConfig
from ..core.rules import SettingNames, check_ulysses_size
from ..names import Backend, Framework, parse_enum

_NAMES = SettingNames(cp="cp", tp="tp")

FAMILIES = ("ctx_plugin", "hf", "megatron")


def _positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer (Llama-style: pre-norm, RoPE, GQA, gated or plain MLP)."""

    layers: int
    """Decoder blocks L."""
    hidden: int
    """Width h."""
    heads: int
    """Query heads a."""
    kv_heads: int
    """K/V heads (GQA when fewer than heads)."""
    ffn: int
    """MLP inner width f."""
    vocab: int
    """Vocabulary size V."""
    gated: bool = True
    """SwiGLU MLP (three projections) when True, else a plain two-projection MLP with biases."""
    norm: str = "rms"
    """``"rms"`` or ``"layer"``."""
    tied_embeddings: bool = False
    """Input embedding and LM head share one matrix."""
    family: str = "ctx_plugin"
    """Which implementation of the block runs, as it decides the tensors kept for backward
    (:mod:`ctx_plugin.memory.blocks`): ``"ctx_plugin"`` (``ctx_plugin.models``), ``"hf"`` (Hugging Face
    Llama/Mistral/Qwen2-style layers) or ``"megatron"`` (megatron-core's GPT layers, local spec)."""
    attention_bias: bool = False
    """Biases on the q/k/v projections (Qwen2); counted in the parameters."""
    output_bias: bool = False
    """A bias on the attention's output projection (Llama-family ``attention_bias``, Megatron's
    ``add_bias_linear``); counted in the parameters."""
    mlp_bias: bool | None = None
    """Biases on the MLP's projections (Llama's ``mlp_bias``, Megatron's ``add_bias_linear``); counted in the
    parameters. None: as ``ctx_plugin.models`` builds them, none on a gated MLP and biases on a plain one."""
    qk_norm: bool = False
    """``hf`` family: an RMSNorm over each head of q and of k before RoPE (Qwen3's ``q_norm``/``k_norm``); its kept
    tensors (an fp32 copy, the reciprocal RMS per head, the normalised q and k) are counted, its weights too."""
    bias_activation_fusion: bool = True
    """``megatron`` family: Megatron's fused bias-activation (``bias_swiglu_fusion``/``bias_gelu_fusion``, on by
    default; its fused SwiGLU keeps only its input). False (``--no-bias-swiglu-fusion``): the unfused GLU keeps
    the SiLU output and ``x_linear + glu_linear_offset`` too. Other families have no such switch."""
    position_embeddings: int = 0
    """Rows of a learned absolute position-embedding table (Megatron's ``--position-embedding-type learned_absolute``:
    ``--max-position-embeddings`` rows, whole on every tensor-parallel rank); 0 with RoPE or no position embedding.
    Counted in the parameters."""
    name: str = "custom"

    def __post_init__(self) -> None:
        _positive(self, "layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
        if self.position_embeddings < 0:
            raise ValueError(f"position_embeddings must be >= 0, got {self.position_embeddings}")
        if self.mlp_bias is None:
            object.__setattr__(self, "mlp_bias", not self.gated)
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden ({self.hidden}) must divide into heads ({self.heads}), which must divide into "
                             f"kv_heads ({self.kv_heads})")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm must be 'rms' or 'layer', got {self.norm!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if not self.bias_activation_fusion and self.family != "megatron":
            raise ValueError("bias_activation_fusion=False describes Megatron's unfused GLU (family='megatron'); "
                             f"the {self.family} family has no such switch")
        if self.family == "hf" and (self.norm != "rms" or not self.gated):
            raise ValueError("the hf family describes Llama/Mistral/Qwen2-style layers (RMSNorm, SwiGLU); this "
                             "model has " + ("LayerNorm" if self.norm != "rms" else "a plain MLP") +
                             ": describe it with family='ctx_plugin'")
        if self.qk_norm and self.family != "hf":
            raise ValueError(f"qk_norm=True describes Hugging Face layers with q_norm/k_norm (family='hf'); the "
                             f"{self.family} family has no such norms")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_hf_config(cls, config: dict | str | Path) -> ModelSpec:
        """From a Hugging Face ``config.json`` (a path or its parsed dict) of a dense decoder whose ``model_type`` is
        in :data:`HF_MODEL_TYPES`: the types whose decoder layers keep, tensor by tensor, what the ``hf`` block family
        counts (measured, ``tests/unit/test_memory_blocks.py``), with ``qk_norm`` for Qwen3's q/k norms.
        Biases as each type builds them (:data:`_HF_ATTENTION_BIAS`, :data:`_HF_MLP_BIAS`; Qwen2's q/k/v always),
        and a missing ``head_dim`` as transformers takes it (:data:`_HF_HEAD_DIM`). Refused:
        other model types (their layers keep other tensors: extra or post norms, fused projections, LayerNorm,
        other MLPs; measured, the estimate was off by 0.4–110%), mixture-of-experts configs, an explicit
        ``head_dim`` other than ``hidden_size / num_attention_heads`` (the model sizes the attention projections
        ``hidden_size`` wide) and a ``num_key_value_heads`` that is not a positive divisor of
        ``num_attention_heads`` (a missing key means multi-head attention)."""
        if isinstance(config, (str, Path)):
            config = json.loads(Path(config).read_text())
        if not isinstance(config, dict):
            raise ValueError(f"a Hugging Face config is a JSON object ({{\"num_hidden_layers\": ...}}), got a "
                             f"{type(config).__name__}")
        for key in MOE_KEYS:
            if config.get(key) not in (None, 0):
                raise ValueError(f"the config sets {key!r} ({config[key]!r}): a mixture-of-experts model, but the "
                                 f"memory model covers dense decoders only (no expert parameters, gradients, "
                                 f"optimizer state or routing) and cannot estimate it: choose its recompute preset "
                                 f"from measured memory")
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one whose decoder layers the memory model counts "
                             f"exactly (measured: {', '.join(sorted(HF_MODEL_TYPES))}); other layers keep other "
                             f"tensors (extra or post norms, fused projections, LayerNorm, other MLPs), which an "
                             f"estimate of Llama layers would miss. Use a preset ({_PRESET_HINT}), or, knowing it "
                             f"under-counts what its layers add, ModelSpec(layers=..., hidden=..., heads=..., "
                             f"kv_heads=..., ffn=..., vocab=..., family='hf') with its shape (from the CLI: a copy "
                             f"of the config.json with \"model_type\": \"llama\")")
        qk_norm = HF_MODEL_TYPES[model_type]
        try:
            layers, hidden, heads, ffn, vocab = (_hf_int(config, key) for key in (
                "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"))
        except KeyError as e:
            raise ValueError(f"the config has no {e.args[0]!r}: not a decoder-only transformer config") from None
        kv_heads = config.get("num_key_value_heads", heads)       # only a missing key means multi-head attention
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"num_key_value_heads must be a positive int dividing num_attention_heads ({heads}), got "
                             f"{kv_heads!r}; leave the key out for multi-head attention")
        head_dim = config.get("head_dim", _HF_HEAD_DIM.get(model_type))     # what transformers takes when it is missing
        if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int)
                                     or heads * head_dim != hidden):
            raise ValueError(f"head_dim {head_dim!r} × {heads} heads is not hidden_size ({hidden}): the memory model "
                             f"sizes q/k/v/o, their bytes and FLOPs with head_dim = hidden_size / heads, so configs "
                             f"with their own head_dim (Mistral-NeMo, Gemma) are not supported; the nearest estimate "
                             f"is a preset of similar size ({_PRESET_HINT})")
        _refuse_window(config, model_type)
        bias = model_type == "qwen2" or (model_type in _HF_ATTENTION_BIAS and _hf_bool(config, "attention_bias"))
        return cls(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                   family="hf", qk_norm=qk_norm, attention_bias=bias, output_bias=bias and model_type != "qwen2",
                   mlp_bias=model_type in _HF_MLP_BIAS and _hf_bool(config, "mlp_bias"),
                   tied_embeddings=_hf_bool(config, "tie_word_embeddings"),
                   name=str(config.get("_name_or_path") or model_type))

    @classmethod
    def preset(cls, name: str, family: str = "ctx_plugin") -> ModelSpec:
        """A named model shape (``ctx-plugin memory --model NAME``, see :data:`MODEL_PRESETS`) run as ``family``'s
        blocks (``"hf"`` for the Hugging Face model of that name)."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)} or give a "
                             f"Hugging Face config.json")
        bias = family == "hf" and name.startswith("qwen2")
        return cls(name=name, family=family, attention_bias=bias, **MODEL_PRESETS[name])


MODEL_PRESETS: dict[str, dict] = {
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "llama3-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
    "llama2-7b": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    "mistral-7b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000),
    "qwen2-7b": dict(layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, vocab=152064),
}


# model_type → qk_norm: the types whose decoder layers (transformers 5.24) keep exactly the tensors of the hf block
# family — separate q/k/v projections, LlamaRMSNorm, a SwiGLU MLP; Qwen3's and Hunyuan's with per-head q/k norms —
# each held to measured bytes (tests/unit/test_memory_blocks.py). Not among them, measured off by 0.4–110% as Llama
# layers: Gemma (fp32 norms with 1 + w), Gemma-2/3 and OLMo-2/3 (post norms), Phi-3 and GLM (fused projections,
# partial RoPE), GLM-4, Exaone-4, Helium, Seed-OSS, ERNIE-4.5, and the LayerNorm or plain-MLP types (OLMo, Cohere,
# StableLM, Arcee, Apertus, GPT-NeoX, Phi, Starcoder2, Nemotron).
HF_MODEL_TYPES: dict[str, bool] = {
    **dict.fromkeys(("llama", "mistral", "ministral", "qwen2", "granite", "smollm3"), False),
    **dict.fromkeys(("qwen3", "hunyuan_v1_dense"), True),
}

# Which of them read attention_bias (biases on q, k, v and o; Qwen2's q/k/v always have one, its o none; Mistral's
# and Ministral's have none whatever the config says) and mlp_bias (gate, up and down), and the head_dim transformers
# takes when config.json gives none (Qwen3: 128; the others: hidden_size / num_attention_heads).
_HF_ATTENTION_BIAS = frozenset({"llama", "granite", "smollm3", "qwen3", "hunyuan_v1_dense"})
_HF_MLP_BIAS = frozenset({"llama", "granite", "smollm3"})
_HF_HEAD_DIM = {"qwen3": 128}

MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")
"""Config keys giving a mixture-of-experts model's experts (Mixtral, Qwen-MoE/OLMoE, DeepSeek, ERNIE-MoE, routing)."""

_PRESET_HINT = f"--model {next(iter(MODEL_PRESETS))}; presets: {', '.join(MODEL_PRESETS)}"


# Sliding-window attention as transformers 5.24 reads it: Mistral and Ministral take sliding_window (4096 when the key
# is missing; Ministral's layer_types, when given, say which layers use it), Qwen2/Qwen3/SmolLM3 only with
# use_sliding_window true. The memory model's FLOPs and the planner's times count full causal attention.
_HF_DEFAULT_WINDOW = {"mistral": 4096, "ministral": 4096}
_HF_WINDOW_SWITCHED = frozenset({"qwen2", "qwen3", "smollm3"})


def _hf_bool(config: dict, key: str) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"the config's {key!r} must be true or false, got {value!r}")
    return value


def _refuse_window(config: dict, model_type: str) -> None:
    switched = model_type in _HF_WINDOW_SWITCHED
    if model_type not in _HF_DEFAULT_WINDOW and not switched:     # Llama, Granite, Hunyuan: no window read
        return
    window = config.get("sliding_window", _HF_DEFAULT_WINDOW.get(model_type))
    if window is None or (switched and not _hf_bool(config, "use_sliding_window")):
        return
    layer_types = config.get("layer_types")
    if model_type != "mistral" and isinstance(layer_types, list) and "sliding_attention" not in layer_types:
        return
    where = ("sliding_window with use_sliding_window" if switched else "sliding_window" if "sliding_window" in config
             else f"transformers' default sliding_window for {model_type} when config.json has none")
    raise ValueError(f"the config gives its layers a sliding window of {window!r} tokens ({where}), but the memory "
                     f"model's FLOPs and the planner's step times count full causal attention, so times and MFU "
                     f"would be off; to plan with full attention (an upper bound on attention time; memory is the "
                     f"same), give a copy with \"sliding_window\": null")


def _hf_int(config: dict, key: str) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the config's {key!r} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class ZeroSettings:
    """DeepSpeed's zero_optimization settings that size its buffers (elements; its defaults, DeepSpeed 0.19.8):
    :func:`ctx_plugin.memory.state.deepspeed_state`."""

    reduce_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_param_persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():      # DeepSpeed configs write 5e8
                object.__setattr__(self, name, value := int(value))
            size = name.endswith("size")
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if size else 0):
                raise ValueError(f"zero_optimization.{name} must be a {'positive' if size else 'non-negative'} "
                                 f"number of elements, got {value!r}")

    @classmethod
    def from_config(cls, config: dict) -> "ZeroSettings":
        """The settings of a DeepSpeed config (its ``zero_optimization`` section, read by DeepSpeed's own parser:
        :func:`ctx_plugin.memory.zero_config.zero_config`; missing keys keep DeepSpeed's defaults)."""
        from .zero_config import zero_config
        return cls.from_parsed(zero_config(config))

    @classmethod
    def from_parsed(cls, parsed) -> "ZeroSettings":
        """The settings of DeepSpeed's parsed ``DeepSpeedZeroConfig``."""
        return cls(reduce_bucket_size=parsed.reduce_bucket_size,
                   stage3_prefetch_bucket_size=parsed.prefetch_bucket_size,
                   stage3_max_reuse_distance=parsed.max_reuse_distance,
                   stage3_param_persistence_threshold=parsed.param_persistence_threshold,
                   sub_group_size=parsed.sub_group_size)


def check_parallel(backend: Backend, ulysses_size: int, cp: int, tp: int, sequence_parallel: bool,
                   names: SettingNames = _NAMES) -> None:
    """ValueError for a layout whose settings do not go together, named as ``names`` says (:class:`ParallelSpec`'s
    fields, or a command line's flags): sequence parallelism without tensor parallelism, a Ulysses size off the
    hybrid backend or not dividing the CP size."""
    if sequence_parallel and tp == 1:
        raise ValueError(f"{names.sequence_parallel} needs {names.tp} > 1 (it splits the sequence over the "
                         f"tensor-parallel ranks)")
    if backend == Backend.ULYSSES_RING:
        check_ulysses_size(CPConfig(backend=backend, ulysses_size=ulysses_size), cp, names)
    elif ulysses_size != 1:
        raise ValueError(f"{names.ulysses_size} applies to {names.backend} ulysses_ring only (got {names.backend} "
                         f"{backend.value})")


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    """How one training step is spread over GPUs."""

    cp: int = 1
    """Context-parallel size (ranks sharing one sequence)."""
    backend: Backend = Backend.ZIGZAG
    """Context-parallel backend (decides which tensors attention keeps and its communication buffers)."""
    ulysses_size: int = 1
    """Ulysses group size of ``ulysses_ring`` (the whole CP group for ``ulysses``)."""
    tp: int = 1
    """Tensor-parallel size t (heads and MLP width split t ways)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms/residuals split t ways too (needs tp > 1)."""
    dp: int = 1
    """Data-parallel size."""
    zero_stage: int = 0
    """0 (replicated), 1 (optimizer state sharded over dp×cp), 2 (+ gradients), 3 (+ parameters)."""
    framework: Framework | None = None
    """The framework whose model state is counted (:mod:`ctx_plugin.memory.state`); None: :attr:`runs_on`."""
    zero_settings: ZeroSettings = ZeroSettings()
    """DeepSpeed's bucket sizes (its defaults unless given; Megatron's buffers do not depend on them)."""
    grad_dtype: torch.dtype | None = None
    """The gradient buffer's dtype; None: the framework's default for the training dtype (Megatron: fp32 for bf16
    training; DeepSpeed: the training dtype). Megatron takes fp32 or the training dtype (``--grad-reduce-in-bf16``);
    DeepSpeed only the training dtype."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", parse_enum(Backend, self.backend, "backend"))
        _positive(self, "cp", "ulysses_size", "tp", "dp")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        check_parallel(self.backend, self.ulysses_size, self.cp, self.tp, self.sequence_parallel)
        if self.framework is not None:
            object.__setattr__(self, "framework", parse_enum(Framework, self.framework, "framework"))
        if self.framework == Framework.MEGATRON and self.zero_stage > 1:
            raise ValueError(f"framework megatron with zero_stage {self.zero_stage}: Megatron's distributed "
                             f"optimizer is ZeRO-1 (zero_stage 0 or 1); ZeRO-2/3 are DeepSpeed's (framework "
                             f"deepspeed)")
        if self.framework == Framework.DEEPSPEED and self.tp > 1:
            raise ValueError(f"framework deepspeed with tp={self.tp}: DeepSpeed's context_parallel section has no "
                             f"tensor parallelism; use tp 1, or framework megatron (ZeRO 0 or 1)")
        if self.grad_dtype is not None and self.grad_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"grad_dtype must be torch.float32, torch.bfloat16, torch.float16 or None, got "
                            f"{self.grad_dtype!r}")

    @property
    def cp_config(self) -> CPConfig:
        """The attention configuration of this layout (what the split rules of :mod:`ctx_plugin.core.rules` check)."""
        return CPConfig(backend=self.backend, ulysses_size=self.ulysses_size)

    @property
    def ulysses(self) -> int:
        """Ranks of the all-to-all axis."""
        return self.cp if self.backend == Backend.ULYSSES else self.ulysses_size

    @property
    def runs_on(self) -> Framework:
        """:attr:`framework`, else the framework the layout needs: DeepSpeed for ZeRO-2/3, else Megatron (which
        runs tensor parallelism; where both run a layout, its fp32 gradients outweigh DeepSpeed's 2 GB of buckets
        from about a billion parameters)."""
        if self.framework is not None:
            return self.framework
        return Framework.DEEPSPEED if self.zero_stage >= 2 else Framework.MEGATRON

    @property
    def shard_degree(self) -> int:
        """Ranks over which ZeRO shards (data × context parallel)."""
        return self.dp * self.cp


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def sqrt_group(layers: int) -> int:
    return math.ceil(math.sqrt(layers))
