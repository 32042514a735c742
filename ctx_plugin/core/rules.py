"""How a sequence and its heads split over context-parallel ranks: one function per rule.

Every surface checks its settings with these functions, once, naming its own settings in the messages
(:class:`SettingNames`): the attention API (``cp_attention``, ``shard_sequence``, ...), Megatron's flags, the DeepSpeed
section, the demo, the benchmark, the memory model and the planner. The rules:

* **Ulysses size** — the all-to-all axis of ``ulysses_ring`` (``ulysses_size`` ranks) must divide the
  context-parallel size; other backends take ``ulysses_size = 1`` (``CPConfig`` checks that).
* **Sequence unit** — the global sequence length is a positive multiple of the layout's unit
  (:meth:`ctx_plugin.core.layouts.Layout.unit`: P for contiguous, striped and Ulysses, 2·P for zigzag and the all-gather
  backend, P/u·lcm(2, u) for the hybrid); nothing is padded.
* **Head split** — over an all-to-all axis of u > 1 ranks, u divides the query heads, and the K/V heads either divide
  by u or divide u (each rank then gets a replicated K/V head).
* **Sequence parallelism** — under Megatron's sequence parallelism over TP ranks, each CP rank's ``seq_len / cp``
  tokens split evenly over its TP ranks: the sequence unit with ``tp`` (:func:`sequence_unit`) is a multiple of cp·tp.
* **Tensor-parallel heads** — TP ranks split the query heads evenly, and the K/V heads either evenly or (megatron-core
  replicating each K/V head) by dividing TP.
* **Document unit** — with packed documents, every document's length is a multiple of the layout's document unit
  (:meth:`ctx_plugin.core.layouts.Layout.document_unit`: 2·P for zigzag and the all-gather backend, P for striped, 2·P/u
  for the hybrid, 1 for contiguous shards and Ulysses); :func:`ctx_plugin.core.documents.pad_documents` pads to it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..names import Backend
from .config import CPConfig
from .documents import Documents
from .layouts import shard_layout


@dataclass(frozen=True)
class SettingNames:
    """What a surface calls each setting, for its error messages (e.g. ``seq_len="--seq-length"``)."""

    seq_len: str = "seq_len"
    documents: str = "documents"
    cp: str = "context-parallel size"
    ulysses_size: str = "ulysses_size"
    heads: str = "query heads"
    kv_heads: str = "kv_heads"
    tp: str = "tensor-parallel size"
    backend: str = "backend"
    sequence_parallel: str = "sequence_parallel"


API = SettingNames()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ulysses_ranks(config: CPConfig, cp: int) -> int:
    """Ranks of the all-to-all axis: the whole group for ``ulysses``, ``ulysses_size`` for the hybrid, else 1."""
    return cp if config.backend == Backend.ULYSSES else config.ulysses_size


def check_ulysses_size(config: CPConfig, cp: int, names: SettingNames = API) -> None:
    """ValueError naming the valid sizes when ``config.ulysses_size`` does not divide ``cp``."""
    if cp % config.ulysses_size:
        raise ValueError(f"{names.ulysses_size} {config.ulysses_size} must divide {names.cp} {cp}; valid "
                         f"{names.ulysses_size} values: {_divisors(cp)}")


def sequence_unit(config: CPConfig, cp: int, tp: int = 1) -> int:
    """The global sequence length must be a positive multiple of this (after :func:`check_ulysses_size`). ``tp``:
    the tensor-parallel size under Megatron's sequence parallelism (1 without it), which splits each CP rank's
    ``seq_len / cp`` tokens over ``tp`` ranks, so the unit is also a multiple of cp·tp."""
    return math.lcm(shard_layout(config).unit(cp), cp * tp)


def check_seq_len(config: CPConfig, seq_len: int, cp: int, names: SettingNames = API) -> None:
    """ValueError naming the fix when a global sequence of ``seq_len`` tokens cannot be split over ``cp`` ranks."""
    unit = sequence_unit(config, cp)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0 or seq_len % unit:
        alone = ", or use backend ring, which splits nothing over one rank" if cp == 1 else ""
        raise ValueError(f"{names.seq_len} must be a positive multiple of {unit}, got {seq_len!r} ({config.backend} "
                         f"over {names.cp} {cp}); pad the sequence (and mask the padding out of the loss) to a "
                         f"multiple of {unit}{alone}")


def check_sequence_parallel(config: CPConfig, seq_len: int, cp: int, tp: int, names: SettingNames = API) -> None:
    """ValueError naming the fix when Megatron's sequence parallelism cannot split each CP rank's ``seq_len / cp``
    tokens over ``tp`` ranks (it asserts "First dimension of the tensor should be divisible by tensor parallel
    size"); call it only where sequence parallelism is on (:func:`check_seq_len` checks the layout's unit alone)."""
    unit = sequence_unit(config, cp, tp)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0 or seq_len % unit:
        near = f" (e.g. {seq_len // unit * unit} or {(seq_len // unit + 1) * unit})" if isinstance(seq_len, int) \
            and not isinstance(seq_len, bool) and seq_len > unit else ""
        raise ValueError(f"sequence parallelism splits each of the {names.cp} {cp} ranks' tokens over {names.tp} "
                         f"{tp}: {names.seq_len} must be a positive multiple of {unit} ({config.backend}'s unit and "
                         f"{names.cp} × {names.tp} = {cp * tp}), got {seq_len!r}; pad the sequence to a multiple of "
                         f"{unit}{near}, or change {names.tp}")


def check_tp_heads(heads: int, kv_heads: int, tp: int, names: SettingNames = API, *,
                   replicate_kv: bool = True) -> None:
    """ValueError naming the valid sizes when ``tp`` tensor-parallel ranks cannot split ``heads`` query and
    ``kv_heads`` K/V heads as megatron-core (0.19) splits them: ``tp`` divides the query heads, and the K/V heads
    divide by ``tp`` or (each K/V head then replicated on tp/kv_heads ranks, the QKV output all-gathered over TP)
    divide ``tp``; megatron-core refuses anything else when it builds the model. ``replicate_kv=False`` refuses the
    replication too: for the memory model and the planner, which count the K/V heads split ``tp`` ways and not the
    gathered QKV output."""
    def valid() -> list[int]:
        return [k for k in _divisors(heads) if kv_heads % k == 0 or (replicate_kv and k % kv_heads == 0)]
    if heads % tp:
        raise ValueError(f"{names.heads} {heads} is not divisible by {names.tp} {tp} (tensor parallelism splits the "
                         f"query heads evenly); valid {names.tp}: {valid()}")
    if kv_heads % tp == 0 or (replicate_kv and tp % kv_heads == 0):
        return
    if tp % kv_heads:
        raise ValueError(f"{names.kv_heads} {kv_heads} is neither divisible by {names.tp} {tp} nor a divisor of it "
                         f"(megatron-core refuses it when it builds the model); valid {names.tp}: {valid()}")
    raise ValueError(f"{names.kv_heads} {kv_heads} is not divisible by {names.tp} {tp}: the memory model splits the "
                     f"K/V heads over the tensor-parallel ranks and does not model Megatron's replication of K/V "
                     f"heads over them (its all-gathered QKV output); valid {names.tp}: {valid()}")


def document_unit(config: CPConfig, cp: int) -> int:
    """With packed documents, every document's length must be a multiple of this."""
    return shard_layout(config).document_unit(cp)


def padding_units(config: CPConfig, cp: int) -> tuple[int, int]:
    """``(document unit, sequence unit)``: what :func:`ctx_plugin.core.documents.pad_documents` pads each document and
    the whole packed sequence to (the sequence unit is always a multiple of the document unit)."""
    return document_unit(config, cp), sequence_unit(config, cp)


def check_documents_fit(config: CPConfig, documents: Documents, cp: int, names: SettingNames = API) -> None:
    """ValueError naming the first document whose length the layout cannot split over ``cp`` ranks, and the fix."""
    unit = document_unit(config, cp)
    if unit == 1:
        return
    for d, length in enumerate(documents.lengths):
        if length % unit:
            doc_unit, seq_unit = padding_units(config, cp)
            raise ValueError(
                f"{names.documents}: document {d} holds {length} tokens, not a multiple of {unit}: {config.backend} "
                f"over {names.cp} {cp} splits every document over the ranks ({shard_layout(config).name} layout); "
                f"pad each document to a multiple of {unit} with ctx_plugin.core.documents.pad_documents(lengths, "
                f"{doc_unit}, total_unit={seq_unit}) and pad_tokens (labels -100 on the padding), or use a backend "
                f"that cuts documents anywhere (ring, ulysses)" + (" (over one rank ring splits nothing)" if cp == 1
                                                                   else ""))


def check_heads(config: CPConfig, heads: int, kv_heads: int, cp: int, names: SettingNames = API) -> None:
    """ValueError naming valid sizes when ``heads`` query and ``kv_heads`` K/V heads (per tensor-parallel rank)
    cannot be split over the Ulysses axis."""
    u = ulysses_ranks(config, cp)
    if u == 1:
        return
    what = names.cp if config.backend == Backend.ULYSSES else names.ulysses_size
    if heads % u:
        raise ValueError(f"Ulysses splits heads over {u} ranks, but there are {heads} {names.heads}; use a {what} "
                         f"that divides {heads}: {_divisors(heads)}")
    if kv_heads % u and u % kv_heads:
        raise ValueError(f"Ulysses over {u} ranks needs {names.kv_heads} ({kv_heads}) to divide {u} or be divisible "
                         f"by it; use a {what} that is a multiple or a divisor of {kv_heads}")


def check_split(config: CPConfig, cp: int, *, seq_len: int | None = None, heads: int | None = None,
                kv_heads: int | None = None, names: SettingNames = API) -> None:
    """All three rules, in order (Ulysses size, then sequence unit, then heads); ``None`` skips a rule's input."""
    check_ulysses_size(config, cp, names)
    if seq_len is not None:
        check_seq_len(config, seq_len, cp, names)
    if heads is not None:
        check_heads(config, heads, heads if kv_heads is None else kv_heads, cp, names)
