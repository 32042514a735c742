"""``pad_documents`` (vectorised) against a straightforward per-token reference, on random document lengths: one-token
documents, lengths already multiples of the unit, a single document, total units above the unit; every input form
it takes (list, tuple, integer tensor). It pads one packed sequence; lengths of 0 are refused."""
from __future__ import annotations

import random

import pytest
import torch

from ctx_plugin.core.documents import Documents, pad_documents, pad_tokens


def reference(lengths: list[int], unit: int, total_unit: int) -> tuple[Documents, torch.Tensor]:
    """Each document padded at its end to a multiple of ``unit``, the last one further until the sequence is a
    multiple of ``total_unit``; position by position, which original token each padded position holds."""
    padded = [(n + unit - 1) // unit * unit for n in lengths]
    while sum(padded) % total_unit:
        padded[-1] += unit
    bounds, index, source = [0], [], 0
    for n, p in zip(lengths, padded):
        bounds.append(bounds[-1] + p)
        for j in range(p):
            if j < n:
                index.append(source)
                source += 1
            else:
                index.append(-1)
    return Documents(tuple(bounds), tuple(lengths)), torch.tensor(index, dtype=torch.int64)


def _lengths(rng: random.Random, unit: int) -> list[int]:
    kinds = [lambda: 1, lambda: unit * rng.randint(1, 4), lambda: rng.randint(1, 5 * unit + 3),
             lambda: unit * rng.randint(1, 3) + rng.choice((-1, 1)) if unit > 1 else 2]
    return [max(1, rng.choice(kinds)()) for _ in range(rng.randint(1, 12))]


@pytest.mark.parametrize("seed", range(40))
def test_pad_documents_matches_the_reference(seed):
    rng = random.Random(seed)
    unit = rng.choice((1, 2, 3, 4, 8, 16))
    total_unit = unit * rng.choice((1, 1, 2, 3, 8))
    lengths = _lengths(rng, unit)
    want_docs, want_index = reference(lengths, unit, total_unit)
    for given in (lengths, tuple(lengths), torch.tensor(lengths), torch.tensor(lengths, dtype=torch.int32)):
        docs, index = pad_documents(given, unit, total_unit=total_unit)
        assert docs == want_docs and docs.bounds == want_docs.bounds and docs.valid == want_docs.valid
        assert index.dtype == torch.int64 and index.shape == want_index.shape and torch.equal(index, want_index)
    # the default total unit is the unit
    docs, index = pad_documents(lengths, unit)
    ref_docs, ref_index = reference(lengths, unit, unit)
    assert docs == ref_docs and torch.equal(index, ref_index)
    # and the tokens it builds are the real ones in order, fill on padding
    tokens = torch.arange(100, 100 + sum(lengths))
    out = pad_tokens(tokens, index, fill=-7)
    assert out[index >= 0].tolist() == tokens.tolist() and (out[index < 0] == -7).all()


@pytest.mark.parametrize("lengths, unit, total_unit", [
    ([1], 1, 1), ([1], 8, 8), ([1], 4, 32), ([1] * 17, 1, 1), ([1] * 17, 2, 8), ([8, 8, 8], 8, 8), ([8, 8, 8], 8, 32),
    ([7, 9, 1, 16], 8, 16), ([5], 1, 7), ([3, 5, 1], 4, 8),
])
def test_pad_documents_edge_cases(lengths, unit, total_unit):
    docs, index = pad_documents(lengths, unit, total_unit=total_unit)
    want_docs, want_index = reference(lengths, unit, total_unit)
    assert docs == want_docs and torch.equal(index, want_index)


def test_a_long_sequence_matches_the_reference():
    rng = random.Random(7)
    lengths = [rng.choice((1, 2, 63, 64, 65, rng.randint(1, 3000))) for _ in range(400)]
    docs, index = pad_documents(lengths, 64, total_unit=512)
    want_docs, want_index = reference(lengths, 64, 512)
    assert docs == want_docs and torch.equal(index, want_index)


def test_empty_documents_are_refused():
    for bad in ([], [3, 0, 2], [0], torch.tensor([2, 0])):
        with pytest.raises(ValueError, match="positive document lengths"):
            pad_documents(bad, 4)
