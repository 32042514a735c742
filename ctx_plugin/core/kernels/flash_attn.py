"""flash-attn (Dao-AILab) as a local kernel: FlashAttention-2 (2.1 … 2.8; 2.0 is refused) and FlashAttention-3
(the hopper build, on sm90). Which builds can run which inputs on which GPU: :mod:`.flash_attn_support`.

Every dense flash-attn version shim lives in this file, the varlen ones (many blocks in one call) in
:mod:`.flash_attn_varlen`. We call the low-level ``_flash_attn_forward`` /
``_flash_attn_backward`` (not ``flash_attn_func``) because ring attention runs backward with an externally
merged ``out``/``lse``. Their signatures changed many times, so arguments are bound **by name** from the
function's signature, and outputs are picked by position 0 (``out``) and by shape (``lse`` is the only
``[B, H, Sq]`` tensor), never by arity.

Signatures verified from source (stored public copies, read with the search tool):

* 2.7.0–2.8.3, Dao-AILab/flash-attention ``flash_attn/flash_attn_interface.py`` @
  005300258a22e5fc6be621063c3d5704e82b89d9 and the v2.7.0/v2.8.3 tags: ``torch.library.custom_op``
  ``flash_attn::…`` (from v2.7.0); fwd ``(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
  window_size_right, softcap, alibi_slopes, return_softmax) -> (out_padded, softmax_lse, S_dmask, rng_state)``;
  bwd ``(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
  window_size_right, softcap, alibi_slopes, deterministic, rng_state=None) -> softmax_d`` (writes dq/dk/dv).
  ``flash_attn/__init__.py`` @ 06a9900d (2.8.3) swallows a missing CUDA module, so we import the interface module.
* 2.6.0–2.6.3 (window_size tuple + softcap, 8 outputs; the 2.7 form starts at v2.7.0) and 2.5.x
  (``window_size, alibi_slopes``; bwd ``…, window_size, alibi_slopes, deterministic, rng_state=None``):
  zhuzilin/ring-flash-attention ``ring_flash_attn/ring_flash_attn.py`` @ d4223db1da88e7b940516942eff8a7c06ccd6d10
  and the v2.5.0/v2.6.0/v2.6.3 tags.
* 2.0 (``(q, k, v, dropout_p, softmax_scale, causal, return_softmax)`` -> 7 outputs; refused: its causal
  mask is aligned top-left, ctx_plugin needs bottom-right), 2.1/2.2 (+ ``rng_state``,
  8 outputs), 2.3 (+ ``window_size``): vendored third-party copies of the 2.x interface.
* FA3 hopper, Dao-AILab ``hopper/flash_attn_interface.py`` @ c082294e0f6c01d46318694a6f3e0274225a9683 (plain
  functions, ~20 required varlen/paged/rotary/fp8 arguments that take None, ``window_size`` tuple,
  fwd -> ``(out, softmax_lse, *rest)``) and @ 01afd16d248c4c7d0f9aed1914084f16c490eaed (custom ops,
  ``window_size_left/right``, bwd takes ``is_causal``, fwd -> ``(out, softmax_lse, out_accum, lse_accum)``,
  bwd -> ``softmax_d``); the earlier ``flashattn_hopper_cuda`` beta (fwd ``(q, k, v, softmax_scale, causal,
  …, window_size=(-1, -1), …) -> (out, q, k, v, out_padded, softmax_lse)``) from a vendored copy, and the
  2024 builds (``hopper/`` @ 1feb711f, 2024-12-03: fwd ``(q, k, v, softmax_scale, causal, window_size, descale_q=None,
  …)`` -> 7 outputs, bwd ``(…, softmax_scale, causal, window_size, deterministic=False)``).
* ``flash_attn.cute`` is not used: its interface changes with nearly every commit.
* Varlen (:mod:`.flash_attn_varlen`, which lists signatures, LSE layouts and sources): FA2 >= 2.6.0's
  ``_flash_attn_varlen_forward/_backward`` (LSE ``[H, total_q]`` from v2.6.0, padded before: not bound) and FA3's
  functions above with ``cu_seqlens_q/k`` (2025 builds on); a build without gets no ``forward_varlen``.
* Windows: FlashAttention-3 from 2025 (``hopper/flash_api.cpp`` @ 7a802796 on) reads a left side ``>= Sk - 1``
  and a right side ``>= Sq - 1`` as unbounded (exact). FlashAttention-2 reads a side ``>= Sk`` as unbounded and
  sets an unbounded right side next to a bounded left one to Sk; the 2024 FA3 builds (``set_params_fprop`` @
  dff976a8 … 1feb711f) clamp each side to Sk and set an unbounded one to Sk. With the mask aligned bottom-right
  (row a sees keys up to ``a + Sk − Sq + right``) both hide keys from the first rows of a non-causal block with
  ``Sq > Sk + 1``, so on both such a block runs on the torch kernel (:func:`.base.fa2_window`, whose sides both
  readings apply exactly), and FA2's varlen calls get a ``max_seqlen_k`` that keeps it exact
  (:func:`.base.fa2_max_seqlen_k`).
* Builds not told apart (their low-level functions have the signatures of the next commits'): 7b4e68e0
  (2024-08-29, the first FA3 with windows) passes ``is_causal ? -1 : window_size_left``, dropping the window of
  causal calls (fixed by dff976a8 the next day); 7f67966c (the first FA3 release) refuses GQA with a RuntimeError
  ("We do not support MQA/GQA yet"), 74b0761f (three days later) accepts it.

Not run against a real GPU build here: binding and output picking are tested with stand-ins of these signatures.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch

from . import flash_attn_support as support
from .base import FULL, Window, accum_dtype, check_block, describe, fa2_window, is_windowed
from .head_chunks import by_head_chunks, fa2_head_chunk
from .torch_math import TorchKernel

_FA2_MODULES = ("flash_attn.flash_attn_interface",)
_FA3_MODULES = ("flash_attn_interface", "flash_attn_3.flash_attn_interface")
_FA3_DISTRIBUTIONS = ("flash_attn_3", "flashattn-hopper")
_INSTALL = ("pip install 'ctx-plugin[flash]' (or pip install flash-attn --no-build-isolation; FlashAttention-3 "
            "for Hopper is built from the hopper/ directory of github.com/Dao-AILab/flash-attention)")
# Required (no default) parameters of FA3's low-level functions that we leave unused by passing None.
_FA3_UNUSED = frozenset({
    "k_new", "v_new", "qv", "out", "out_", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new", "seqused_q",
    "seqused_k", "sequed_q", "sequed_k", "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx",
    "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale",
    "descale_q", "descale_k", "descale_v", "scheduler_metadata", "pack_gqa"})
_FWD_TENSORS = ("q", "k", "v")
_BWD_TENSORS = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv")
_NEEDED = (("softmax_scale",), ("causal", "is_causal"))


def _settings(scale: float, causal: bool, window: Window = FULL, softcap: float | None = None) -> dict[str, Any]:
    """Every non-tensor argument we know (both spellings of window/causal). flash-attn spells an unbounded window
    side -1 and no softcap 0.0; under causal the right side is 0 (what flash-attn sets itself, and exact: the
    causal mask already ends at the diagonal)."""
    left, right = -1, -1                    # exactly what plain (causal or full) attention always passed
    if window[0] is not None or (window[1] is not None and not causal):
        left = -1 if window[0] is None else int(window[0])
        right = 0 if causal else -1 if window[1] is None else int(window[1])
    return {"dropout_p": 0.0, "softmax_scale": float(scale), "causal": bool(causal), "is_causal": bool(causal),
            "window_size": (left, right), "window_size_left": left, "window_size_right": right,
            "softcap": 0.0 if softcap is None else float(softcap),
            "alibi_slopes": None, "return_softmax": False, "deterministic": False, "rng_state": None}


_SETTINGS = frozenset(_settings(1.0, False))
_WINDOW_NAMES = frozenset({"window_size", "window_size_left"})


@dataclass(frozen=True)
class FlashAttnInfo:
    """The flash-attn implementation found."""

    generation: int
    """2 (FlashAttention-2, ``flash_attn`` package) or 3 (FlashAttention-3 hopper build)."""
    module: str
    """The module whose ``_flash_attn_forward``/``_flash_attn_backward`` are called."""
    version: str
    """The package version, or ``"unknown"`` when it does not record one."""


def _import_first(names: tuple[str, ...]) -> tuple[ModuleType | None, str | None]:
    """The first importable module of ``names``, else ``(None, why an installed one failed to import)``."""
    broken = None
    for name in names:
        parts = name.split(".")
        try:
            return importlib.import_module(name), None
        except ModuleNotFoundError as e:  # the module itself absent = not installed; a dependency absent = broken
            if e.name not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
                broken = broken or f"{name}: {e}"
        except (ImportError, OSError) as e:  # e.g. an extension built against another torch (undefined symbol)
            broken = broken or f"{name}: {e}"
    return None, broken


def _is_hopper(device: torch.device) -> bool:
    # Only sm90: the hopper build targets sm_90a, whose wgmma/TMA code newer architectures cannot run.
    return (device.type == "cuda" and torch.version.hip is None and torch.cuda.is_available()
            and tuple(torch.cuda.get_device_capability(device)) == (9, 0))


def _version(generation: int) -> str:
    if generation == 2:
        return str(getattr(importlib.import_module("flash_attn"), "__version__", "unknown"))
    for dist in _FA3_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


@dataclass(frozen=True)
class _Found:
    """What :func:`_probe` found: the implementation, its module, and its bound functions (or why not)."""

    info: FlashAttnInfo
    module: ModuleType
    functions: tuple[Callable[..., Any], tuple[str, ...], Callable[..., Any], tuple[str, ...]] | None
    unsupported: str | None
    """Why the adapter cannot bind this build's functions (a TypeError's message), or None."""
    varlen: Any = None
    """Its varlen functions (:class:`.flash_attn_varlen.Binding`), or why it has none (a sentence)."""

    @property
    def features(self) -> frozenset[str]:
        """The mask features this build applies: a window from FA2 2.3 (FA3: all builds), softcap from FA2 2.6
        (FA3: builds after 2024 whose forward and backward both take it), each only if both functions take it."""
        if self.functions is None:
            return frozenset()
        names = set(self.functions[1]) & set(self.functions[3])
        v = support.version_tuple(self.info.version) or (2, 1, 0)   # unknown FA2: the oldest supported
        fa2 = self.info.generation == 2
        has = set()
        if names & _WINDOW_NAMES and (not fa2 or v >= (2, 3)):
            has.add("window")
        if "softcap" in names and (v >= (2, 6) if fa2 else not _legacy_fa3(self.module)):
            has.add("softcap")
        return frozenset(has)


@functools.cache
def _probe(prefer_fa3: bool) -> _Found | str:
    """FA3 first when ``prefer_fa3`` (Hopper), else FA2, the other generation when the preferred one is absent or
    broken; a reason string if neither. Imports only the generation it returns, and nothing when both register the
    same torch ops.

    Memoised: the installed packages do not change inside a process, and probing (failed imports, reading the
    interface sources, binding signatures) costs ~0.2 ms, which :func:`unavailable` would otherwise pay on every
    ``select_kernel`` call. Code that swaps installs or stand-ins in ``sys.modules`` (tests) calls
    :func:`forget_probe` afterwards."""
    clash = support.ops_clash(_FA2_MODULES, _FA3_MODULES)
    if clash is not None:
        return clash
    broken = None
    for generation in ((3, 2) if prefer_fa3 else (2, 3)):
        module, why = _import_first(_FA3_MODULES if generation == 3 else _FA2_MODULES)
        if module is not None:
            info = FlashAttnInfo(generation, module.__name__, _version(generation))
            try:
                functions = _functions(module, generation)
            except TypeError as e:
                return _Found(info, module, None, str(e))
            from . import flash_attn_varlen   # imports this module: bound here, not at import time
            return _Found(info, module, functions, None, flash_attn_varlen.bind(module, info, _legacy_fa3(module)))
        broken = broken or why
    if broken:
        return (f"flash-attn is installed but does not import ({broken}): reinstall it built against "
                f"torch {torch.__version__}: pip install --force-reinstall --no-build-isolation flash-attn")
    return f"flash-attn is not installed: {_INSTALL}"


def forget_probe() -> None:
    """Forget what :func:`_probe` found, so the next call imports again (for tests that swap installs)."""
    _probe.cache_clear()


def _load(device: torch.device) -> _Found | str:
    """The build the kernel uses on ``device`` (FA3 preferred on Hopper), or why none; see :func:`_probe`."""
    return _probe(_is_hopper(device))


def _too_old(info: FlashAttnInfo) -> str | None:
    """flash-attn 2.0 aligns causal masks top-left; ctx_plugin's blocks need bottom-right (2.1 and later)."""
    parts = info.version.split(".")
    if info.generation == 2 and parts[0] == "2" and len(parts) > 1 and parts[1] == "0":
        return (f"flash-attn {info.version} aligns causal masks top-left, ctx_plugin needs the bottom-right "
                f"alignment of flash-attn >= 2.1: pip install -U flash-attn --no-build-isolation")
    return None


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def version_info(device: torch.device | None = None) -> FlashAttnInfo | None:
    """The flash-attn implementation the kernel would use on ``device`` (default: current CUDA device), or None."""
    loaded = _load(_default_device() if device is None else device)
    return None if isinstance(loaded, str) else loaded.info


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params) and hasattr(fn, "_init_fn"):
        # flash-attn >= 2.7.0 and recent FA3 wrap these in torch.library.custom_op; the CustomOpDef shows only
        # (*args, **kwargs), while _init_fn is the decorated function, whose names are the op schema's.
        params = list(inspect.signature(fn._init_fn).parameters.values())
    return params


def _plan(fn: Callable[..., Any], tensors: tuple[str, ...], unused: frozenset[str]) -> tuple[str, ...]:
    """The parameter names to pass to ``fn``: all we know, plus unused required ones (passed None)."""
    known = _SETTINGS | set(tensors)
    names = []
    for p in _parameters(fn):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(f"{fn.__name__} has a parameter {p.name!r} that cannot be passed by name")
        if p.name in known or (p.default is p.empty and p.name in unused):
            names.append(p.name)
        elif p.default is p.empty:
            raise TypeError(f"{fn.__name__} requires {p.name!r}, which this adapter does not know")
    for group in (*((t,) for t in tensors), *_NEEDED):
        if not set(group) & set(names):
            raise TypeError(f"{fn.__name__} takes no {' or '.join(map(repr, group))}")
    return tuple(names)


def _functions(module: ModuleType, generation: int) -> tuple[Callable[..., Any], tuple[str, ...],
                                                              Callable[..., Any], tuple[str, ...]]:
    fwd, bwd = getattr(module, "_flash_attn_forward", None), getattr(module, "_flash_attn_backward", None)
    if fwd is None or bwd is None:
        raise TypeError(f"{module.__name__} has no _flash_attn_forward/_flash_attn_backward")
    unused = _FA3_UNUSED if generation == 3 else frozenset()
    return fwd, _plan(fwd, _FWD_TENSORS, unused), bwd, _plan(bwd, _BWD_TENSORS, unused)


def _lacks(info: FlashAttnInfo, missing: frozenset[str]) -> str:
    return (f"flash-attn {info.version} ({info.module}) applies no {describe(missing)} (sliding windows need "
            f"flash-attn >= 2.3 or FlashAttention-3, softcap >= 2.6 or a FlashAttention-3 build from 2025): "
            f"pip install -U flash-attn --no-build-isolation, or use kernel='torch' or 'auto'")


def unavailable(device: torch.device, dtype: torch.dtype, head_dim: int,
                features: frozenset[str] = frozenset()) -> str | None:
    """None when flash-attn can run these inputs on ``device`` and apply ``features``, else a sentence saying why
    not and the fix.

    Device type, dtype and head size are checked before the (memoised) import probe, so asking on a CPU or
    for float32 never imports anything."""
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, got {device}: run on a GPU or use the torch/reference kernel"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn computes in float16 or bfloat16 only, got {dtype}: cast q/k/v or use another kernel"
    if head_dim > 256 or head_dim % 8 != 0:
        return f"flash-attn needs head_dim <= 256 and a multiple of 8, got {head_dim}: use another kernel"
    found = _load(device)
    if isinstance(found, str):
        return found
    info = found.info
    if _too_old(info):
        return _too_old(info)
    reason = support.head_dim_reason(info.generation, _legacy_fa3(found.module), head_dim)
    if reason is not None:
        return reason
    if found.unsupported is not None:
        return (f"flash-attn {info.version} ({info.module}) is not supported by this adapter "
                f"({found.unsupported}): install FlashAttention 2.1-2.8 or the FA3 hopper build: {_INSTALL}")
    if features - found.features:
        return _lacks(info, features - found.features)
    if not torch.cuda.is_available():
        return "flash-attn needs CUDA, but torch.cuda.is_available() is False: install a CUDA build of torch"
    capability = tuple(torch.cuda.get_device_capability(device))
    return support.device_reason(info.generation, info.version, capability, head_dim, device)


def _legacy_fa3(module: ModuleType) -> bool:
    """A FlashAttention-3 build from 2024: its interface imports the ``flashattn_hopper_cuda`` extension."""
    return hasattr(module, "flashattn_hopper_cuda")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _pick(result: Any, q: torch.Tensor, lse_shape: tuple[int, ...] | None = None,
          what: str = "forward") -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` is element 0 in every version (q's shape but for a padded head size); ``lse`` is the only tensor of
    ``lse_shape`` (default ``[B, H, Sq]``; the varlen functions' ``[H, Tq]``) among the rest."""
    items = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if lse_shape is None else lse_shape
    lse = next((t for t in items[1:] if isinstance(t, torch.Tensor) and tuple(t.shape) == lse_shape), None)
    out = items[0]
    if lse is None or not isinstance(out, torch.Tensor) or out.shape[:-1] != q.shape[:-1]:
        raise RuntimeError(f"unexpected flash-attn {what} outputs: {[getattr(t, 'shape', t) for t in items]}")
    return out[..., :q.shape[-1]], lse


class FlashAttnKernel:
    """flash-attn forward/backward behind the :class:`~ctx_plugin.core.kernels.base.AttentionKernel` interface.

    Device and dtype limits are reported by :func:`unavailable`, not checked here. GQA is passed through:
    flash-attn handles fewer K/V heads itself and returns ``dk``/``dv`` with ``k``'s head count.
    """

    name = "flash_attn"

    def __init__(self, device: torch.device | None = None) -> None:
        found = _load(_default_device() if device is None else device)
        if isinstance(found, str):
            raise RuntimeError(found)
        self.info = found.info
        if _too_old(self.info):
            raise RuntimeError(_too_old(self.info))
        if found.functions is None:
            raise TypeError(found.unsupported)
        self._fwd, self._fwd_names, self._bwd, self._bwd_names = found.functions
        self.features = found.features
        """The mask features this build applies (see ``unavailable``)."""
        self._fa2_windows = self.info.generation == 2 or _legacy_fa3(found.module)
        # Whether windows are read like FlashAttention-2's (also the 2024 FA3 builds'; see the module docstring).
        self.varlen_unavailable = found.varlen if isinstance(found.varlen, str) else None
        """Why this build has no varlen entry point (then ``forward_varlen``/``backward_varlen`` are not defined,
        so :func:`.varlen.has_varlen` is False and block calls run one call per block), or None."""
        if self.varlen_unavailable is None:
            from .flash_attn_varlen import VarlenCalls
            calls = VarlenCalls(found.varlen, self.info, self.features)
            self.forward_varlen, self.backward_varlen = calls.forward, calls.backward

    def _check(self, q: torch.Tensor, k: torch.Tensor, causal: bool, window: Window,
               softcap: float | None) -> Window | None:
        """The window to pass, or None where FlashAttention-2 (or a 2024 FA3 build, which reads windows alike) cannot
        apply it to this block (:func:`.base.fa2_window`: the torch kernel runs it)."""
        check_block(q, k, causal, window, softcap)
        needed = frozenset({"window"} if is_windowed(window) else ()) | frozenset(
            {"softcap"} if softcap is not None else ())
        if needed - self.features:
            raise ValueError(_lacks(self.info, needed - self.features))
        if not self._fa2_windows:
            return window                   # FA3 from 2025 reads a side >= Sk - 1 (right: Sq - 1) as unbounded
        try:
            sides = fa2_window(q.shape[1], k.shape[1], causal, window)
        except LookupError:
            return None
        return FULL if sides is None else sides

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                window: Window = FULL, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        passed = self._check(q, k, causal, window, softcap)
        if passed is None:
            return TorchKernel().forward(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap)
        window = passed
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        values = {**_settings(scale, causal, window, softcap), "q": q, "k": k, "v": v}
        out, lse = _pick(self._fwd(**{n: values.get(n) for n in self._fwd_names}), q)
        return out.to(q.dtype), lse.to(accum_dtype(q.dtype))

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float, window: Window = FULL,
                 softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        passed = self._check(q, k, causal, window, softcap)
        if passed is None:
            return TorchKernel().backward(dout, q, k, v, out, lse, causal=causal, scale=scale, window=window,
                                          softcap=softcap)
        chunk = (fa2_head_chunk(q.shape[1], q.shape[2], k.shape[2], q.shape[3], batch=q.shape[0])
                 if self.info.generation == 2 else None)
        if chunk is not None:       # FlashAttention-2's int32 dQ offsets (head_chunks; wrap in every 2.x release)
            return by_head_chunks(lambda *t: self.backward(*t, causal=causal, scale=scale, window=window,
                                                           softcap=softcap), chunk, dout, q, k, v, out, lse,
                                  head_dim=2, lse_head_dim=1)
        window = passed
        dout, q, k, v, out = (_last_dim_contiguous(t) for t in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))
        # flash-attn 2.x requires the gradient buffers; 2.6.3+ and FA3 custom ops return only softmax_d.
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        values = {**_settings(scale, causal, window, softcap), "dout": dout, "q": q, "k": k, "v": v, "out": out,
                  "softmax_lse": lse.to(accum_dtype(q.dtype)).contiguous(), "dq": dq, "dk": dk, "dv": dv}
        self._bwd(**{n: values.get(n) for n in self._bwd_names})
        return dq, dk, dv
