"""Ranks agree before they communicate.

A rank that calls ``cp_attention`` or ``gather_sequence`` with another sequence length, dtype, backend, causal
flag, ... than its peers would hang, abort in the transport or return garbage. Before the first collective of
each call, every rank of the group therefore encodes what it is about to do as an int64 *signature* vector
(shapes, dtype, device type, backend, settings, and the outcome of its own argument checks) and reduces it to
a 126-bit digest ``d`` (two words). The ranks do one all-reduce(MAX) of ``[d, −d]`` (four int64) on a
CPU-side (gloo) group: the result is ``[max d, −min d]``, the same on every rank, and the ranks agree exactly
when ``max d == min d``. Only when they do not, the full vectors are all-gathered, decoded, and every rank
raises the same ``ValueError`` naming each differing field and each rank's value.

Codes are stable across processes (strings are packed as ASCII bytes, floats as their float64 bit pattern, the
digest is BLAKE2b; no Python ``hash()``, which differs per process). The signature is built from shapes, dtypes
and settings only: nothing waits for the GPU. ``CPConfig(check_ranks=False)`` turns the check off.
"""
from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import active_observers
from .groups import CPGroups

INT64_MAX = 2 ** 63 - 1
NONE = -INT64_MAX
"""The code of a field that does not apply (e.g. ``heads`` for a gather); ints are clamped into (NONE, 2⁶³). −0.0
is encoded as 0.0."""


@dataclass(frozen=True)
class Field:
    """One entry of the signature: ``kind`` is ``int``, ``bool``, ``float`` or ``str`` (``words`` × 8 ASCII bytes)."""

    name: str
    kind: type
    words: int = 1


FIELDS = (
    Field("op", str, 2),
    Field("batch", int), Field("local_seq", int), Field("heads", int), Field("kv_heads", int), Field("head_dim", int),
    Field("v_head_dim", int),
    Field("shape", str, 8), Field("dim", int),
    Field("dtype", str, 3), Field("device", str, 2), Field("requires_grad", bool),
    Field("backend", str, 2), Field("ulysses_size", int), Field("kernel", str, 2),
    Field("causal", bool), Field("softmax_scale", float),
    Field("window", str, 2), Field("softcap", float), Field("sinks", str, 2), Field("documents", str, 3),
    Field("input_check", str, 32),
)
"""The signature of every call, one schema for both operations (so the vectors have one length on every rank,
whatever each rank is doing). ``input_check`` is ``"ok"`` or the error this rank's own argument checks raised."""

LENGTH = sum(f.words for f in FIELDS)


_NAMES = frozenset(f.name for f in FIELDS)
_INT = struct.Struct("<q")


def _pack_str(value: str, words: int) -> bytes:
    raw = value.encode("utf-8")
    room = 8 * words
    if len(raw) > room:          # keep long values distinguishable: a prefix and the CRC-32 of the whole
        raw = raw[:room - 9] + b"~" + f"{zlib.crc32(raw):08x}".encode()
    return raw.ljust(room, b"\0")


def _unpack_str(codes: list[int]) -> str | None:
    raw = b"".join(c.to_bytes(8, "little", signed=True) for c in codes).rstrip(b"\0")
    return raw.decode("utf-8", "replace") if raw else None          # a shortened one may end inside a character


def _encode_scalar(kind: type, value) -> int:
    if value is None:
        return NONE
    if kind is float:
        value = float(value) or 0.0                                  # −0.0 → 0.0
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return max(-INT64_MAX + 1, min(INT64_MAX, int(value)))           # bool → 0/1


def _decode_scalar(kind: type, code: int):
    if code == NONE:
        return None
    if kind is float:
        return struct.unpack("<d", struct.pack("<q", code))[0]
    return bool(code) if kind is bool else code


def _pack(signature: dict) -> bytes:
    """The ``LENGTH`` little-endian int64 words of ``signature`` (field name → value; missing: not applicable)."""
    if not signature.keys() <= _NAMES:
        raise KeyError(f"not signature fields: {sorted(signature.keys() - _NAMES)}")
    parts = []
    for f in FIELDS:
        value = signature.get(f.name)
        if f.kind is str:
            parts.append(_pack_str("" if value is None else str(value), f.words))
        else:
            parts.append(_INT.pack(_encode_scalar(f.kind, value)))
    return b"".join(parts)


def encode(signature: dict) -> torch.Tensor:
    """The int64 vector (CPU, ``LENGTH`` words) of ``signature`` (field name → value; missing: not applicable)."""
    return torch.tensor(struct.unpack(f"<{LENGTH}q", _pack(signature)), dtype=torch.int64)


def digest(signature: dict) -> list[int]:
    """Two non-negative 63-bit words that differ, but for a 2⁻¹²⁶ chance, when the signatures' vectors differ."""
    raw = hashlib.blake2b(_pack(signature), digest_size=16).digest()
    return [int.from_bytes(raw[:8], "little") >> 1, int.from_bytes(raw[8:], "little") >> 1]


def decode(vector: torch.Tensor) -> dict:
    """The signature ``encode`` made ``vector`` from (strings longer than their field come back shortened)."""
    codes, out, i = vector.tolist(), {}, 0
    for f in FIELDS:
        part = codes[i:i + f.words]
        out[f.name] = _unpack_str(part) if f.kind is str else _decode_scalar(f.kind, part[0])
        i += f.words
    return out


def _dims(t, *index: int) -> list[int | None]:
    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else ()
    return [shape[i] if i < len(shape) else None for i in index]


def _sinks(sinks) -> str:
    """``"-"`` without sinks, else their dtype (ranks whose sinks round differently would compute different
    softmaxes)."""
    if sinks is None:
        return "-"
    return str(sinks.dtype) if isinstance(sinks, torch.Tensor) else type(sinks).__name__


def _common(x, groups: CPGroups, error: BaseException | None, tensors: tuple) -> dict:
    tensor = isinstance(x, torch.Tensor)
    return {"dtype": str(x.dtype) if tensor else type(x).__name__, "device": x.device.type if tensor else None,
            "requires_grad": torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                             for t in tensors),
            "backend": groups.config.backend.value, "ulysses_size": groups.config.ulysses_size,
            "input_check": "ok" if error is None else f"{type(error).__name__}: {error}"}


def attention_signature(q, k, v, *, groups: CPGroups, causal, softmax_scale, kernel: str | None,
                        error: BaseException | None, window=None, softcap=None, sinks=None,
                        documents: str = "-") -> dict:
    """What this rank's ``cp_attention`` call is about to do (any arguments: bad ones are described as they are;
    ``error`` is what this rank's own checks raised, ``kernel`` the selected local kernel's name; ``window`` as
    checked (:class:`ctx_plugin.core.mask.Mask`'s) when it was valid, ``documents``
    ``"-"`` without packed documents, else their count and :meth:`~ctx_plugin.core.documents.Documents.signature`;
    ``sinks`` the sinks as given (None without; their dtype is compared): whether they need a gradient counts like
    q's, k's and v's, since
    a backward on some ranks only would wait on the others' communication)."""
    batch, seq, heads, head_dim = _dims(q, 0, 1, 2, 3)
    scale = _number(softmax_scale)            # a bad value is None here (the input check names it)
    if softmax_scale is None and head_dim:
        scale = head_dim ** -0.5
    return {"op": "cp_attention", "batch": batch, "local_seq": seq, "heads": heads, "kv_heads": _dims(k, 2)[0],
            "head_dim": head_dim, "v_head_dim": _dims(v, 3)[0], "kernel": kernel,
            "causal": causal if isinstance(causal, bool) else None, "softmax_scale": scale, "window": _window(window),
            "sinks": _sinks(sinks), "documents": documents, "softcap": _number(softcap),
            **_common(q, groups, error, (q, k, v, sinks))}


def _number(value) -> float | None:
    """``value`` as a float when it is an int or float that has one (not a bool, not an int past float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _window(window) -> str:
    if isinstance(window, (tuple, list)):
        return ",".join("-" if side is None else repr(side) for side in window)
    return "-,-" if window is None else repr(window)


def gather_signature(x, *, dim, groups: CPGroups, error: BaseException | None, documents: str = "-") -> dict:
    """What this rank's ``gather_sequence`` call is about to do (``dim`` as given or normalised; ``documents`` as
    in :func:`attention_signature`)."""
    return {"op": "gather_sequence", "shape": str(tuple(x.shape)) if isinstance(x, torch.Tensor) else None,
            "dim": dim if isinstance(dim, int) else None, "documents": documents, **_common(x, groups, error, (x,))}


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"ranks 0-2, 5"``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {text}"


def _show(value) -> str:
    return "-" if value is None else repr(value) if isinstance(value, float) else str(value)


def disagreement(signatures: list[dict]) -> str:
    """The error text for the ranks' decoded signatures (in group rank order); the same on every rank."""
    differing = [f.name for f in FIELDS if len({_show(s[f.name]) for s in signatures}) > 1]
    if "op" in differing:                   # different operations: every other field differs for that reason
        differing = ["op"]
    lines = []
    for name in differing:
        by_value: dict[str, list[int]] = {}
        for rank, s in enumerate(signatures):
            by_value.setdefault(_show(s[name]), []).append(rank)
        lines.append(f"  {name}: " + "; ".join(f"{_ranks(r)}: {value}" for value, r in by_value.items()))
    what = "which call to make" if "op" in differing else f"this {signatures[0]['op']} call"
    return (f"the {len(signatures)} ranks of the context-parallel group disagree about {what}, which would hang or "
            f"compute garbage; no data was sent. Differences:\n" + "\n".join(lines) + "\n"
            f"Every rank of the group must make the same calls with the same shapes, dtype, device and settings "
            f"(CPConfig(check_ranks=False) turns this check off).")


def check(groups: CPGroups, signature: dict) -> None:
    """Raises the same ValueError on every rank of the group when their signatures differ. No-op without a
    check group (one rank, simulated ranks, or ``check_ranks=False``); otherwise every rank must call it."""
    group = groups.check_group
    if group is None:
        return
    d = digest(signature)
    both = torch.tensor([*d, *(-w for w in d)], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    active_observers().record("agree")
    if agreed(both.tolist()):
        return
    everyone = [torch.empty(LENGTH, dtype=torch.int64) for _ in range(groups.size)]
    dist.all_gather(everyone, encode(signature), group=group)
    raise ValueError(disagreement([decode(v) for v in everyone]))


def agreed(reduced: list[int]) -> bool:
    """Whether all ranks had the same words, from the all-reduce(MAX) of each rank's ``[w, −w]``: max == min."""
    n = len(reduced) // 2
    return all(hi == -neg_lo for hi, neg_lo in zip(reduced[:n], reduced[n:]))
