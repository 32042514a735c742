"""Which flash-attn installs can run which inputs where: the rules
:func:`ctx_plugin.core.kernels.flash_attn.unavailable` applies, each read from Dao-AILab/flash-attention's sources
(``csrc/flash_attn/flash_api.cpp`` at the v2.x tags, ``hopper/flash_api.cpp`` and ``hopper/flash_attn_interface.py``
along their history):

* FlashAttention-2 before 2.7.3 checks ``is_sm8x || is_sm90`` (major 8, or exactly 9.0): no Blackwell or later;
  2.7.3+ accepts any major >= 8.
* FlashAttention-2 backward with head_dim > 192 needs sm80 or sm90 exactly (so not sm86/sm87/sm89) in 2.1–2.5.4;
  for head_dim 193–224 in 2.5.5–2.6.1; from 2.6.2 only with dropout, which ctx_plugin never uses.
* FlashAttention-3 builds from 2024 (``flashattn_hopper_cuda``, until the 2025-01-07 refactor) run forward with
  head_dim 64, 128 or 256 and backward with head_dim <= 128, so training needs 64 or 128; they run on sm90 only.
  Later builds also compile sm80 kernels (unless built with FLASH_ATTENTION_DISABLE_SM80), but their sm90a
  kernels run on sm90 only; ctx_plugin uses FlashAttention-3 on sm90 only and FlashAttention-2 elsewhere.
* flash-attn >= 2.7.0 registers its functions as the torch ops ``flash_attn::_flash_attn_forward`` /
  ``_flash_attn_backward``; FlashAttention-3 builds from 2025-07-16 to 2025-08-19 registered the same names
  (then renamed to ``flash_attn_3::``). torch keeps the last registration, so importing both breaks the one
  imported first for the whole process (checked on torch 2.13: the first one's calls run the second one's
  kernel with the wrong schema). That is detected from the installed sources, before importing either.

Facts that could not be checked against a GPU here are applied conservatively (refuse when unsure: an unknown
FlashAttention-2 version is treated as the oldest supported one).
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

_SHARED_OP = re.compile(r"""["']flash_attn::_flash_attn_(?:forward|backward)["']""")
_FIX = "use kernel='auto' (it falls back to torch's kernels) or another kernel"


def version_tuple(version: str) -> tuple[int, int, int] | None:
    """``"2.5.9.post1"`` → ``(2, 5, 9)``; None when the version is unknown or unparsable."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if m is None else (int(m[1]), int(m[2]), int(m[3] or 0))


def _read(path: str | None) -> str | None:
    try:
        return Path(path).read_text(errors="replace") if path else None
    except OSError:
        return None


def interface_source(name: str) -> str | None:
    """The source text of module ``name`` (``pkg.mod`` or ``mod``), found without importing it or its package
    (importing a flash-attn interface registers its torch ops). None when absent or not a readable file."""
    if name in sys.modules:
        module = sys.modules[name]
        return None if module is None else _read(getattr(module, "__file__", None))
    parent, _, leaf = name.rpartition(".")
    if not parent:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        return None if spec is None else _read(spec.origin)
    if parent in sys.modules:
        locations = getattr(sys.modules[parent], "__path__", None) or []
    else:
        try:
            spec = importlib.util.find_spec(parent)
        except (ImportError, ValueError):
            return None
        locations = [] if spec is None else spec.submodule_search_locations or []
    return next((text for loc in locations if (text := _read(str(Path(loc) / f"{leaf}.py"))) is not None), None)


def ops_clash(fa2_modules: tuple[str, ...], fa3_modules: tuple[str, ...]) -> str | None:
    """Why flash-attn must not be imported at all (both generations register the same torch op names), or None."""
    def registers_shared(names: tuple[str, ...]) -> bool:
        return any(text is not None and _SHARED_OP.search(text) for text in map(interface_source, names))

    if registers_shared(fa2_modules) and registers_shared(fa3_modules):
        return ("flash-attn 2 (>= 2.7) and a FlashAttention-3 build from 2025-07/08 are both installed and both "
                "register the torch ops flash_attn::_flash_attn_forward/_flash_attn_backward: importing both breaks "
                "the one imported first for the whole process, so ctx_plugin imports neither. Rebuild "
                "FlashAttention-3 from a newer hopper/ (its ops are flash_attn_3:: since 2025-08-19) or uninstall "
                "one of them; meanwhile " + _FIX)
    return None


def head_dim_reason(generation: int, legacy_fa3: bool, head_dim: int) -> str | None:
    """Head sizes the build cannot train with, whatever the GPU (None when it can)."""
    if generation == 3 and legacy_fa3 and head_dim not in (64, 128):
        return (f"this FlashAttention-3 build (flashattn_hopper_cuda, 2024) runs forward with head_dim 64/128/256 "
                f"and backward with head_dim <= 128 only, got {head_dim}: rebuild FlashAttention-3 from a current "
                f"hopper/ or {_FIX}")
    return None


def device_reason(generation: int, version: str, capability: tuple[int, int], head_dim: int,
                  device: object) -> str | None:
    """Why this build cannot train ``head_dim`` on a GPU of ``capability`` (None when it can)."""
    sm = f"sm{capability[0]}{capability[1]}"
    if generation == 3:
        if capability != (9, 0):
            return (f"FlashAttention-3 (the hopper build) is used on Hopper (sm90) GPUs only, {device} is {sm}: "
                    f"install FlashAttention-2 (pip install flash-attn --no-build-isolation) or {_FIX}")
        return None
    v = version_tuple(version) or (2, 1, 0)
    if capability[0] < 8:
        return f"flash-attn needs an Ampere (sm80) or newer GPU, {device} is {sm}: {_FIX}"
    if v < (2, 7, 3) and capability[0] != 8 and capability != (9, 0):
        return (f"flash-attn {version} runs on sm8x and sm90 GPUs only ({device} is {sm}); flash-attn >= 2.7.3 "
                f"runs on newer ones: pip install -U flash-attn --no-build-isolation, or {_FIX}")
    if head_dim > 192 and capability not in ((8, 0), (9, 0)) and (v < (2, 5, 5) or (v < (2, 6, 2) and head_dim <= 224)):
        return (f"flash-attn {version} has no backward for head_dim {head_dim} on {sm} (only on sm80/sm90 GPUs); "
                f"flash-attn >= 2.6.2 has: pip install -U flash-attn --no-build-isolation, or {_FIX}")
    return None
