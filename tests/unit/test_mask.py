"""Mask: argument checks, the band of allowed offsets, kernel features, and band_block's trimmed blocks against
the definition (global query i sees key j iff i − left ≤ j ≤ i + right, and j ≤ i when causal)."""
from __future__ import annotations

import itertools

import pytest

from ctx_plugin.core.layouts import band_block
from ctx_plugin.core.mask import Mask

WINDOWS = [(None, None), (0, 0), (1, 0), (2, None), (3, 0), (7, 0), (100, 0), (None, 0), (2, 3), (0, 5), (None, 2),
           (5, 1)]


def allowed(i: int, j: int, causal: bool, window) -> bool:
    """The definition, written out independently of Mask.band."""
    left, right = window
    if causal and j > i:
        return False
    return (left is None or j >= i - left) and (right is None or j <= i + right)


def kernel_sees(a: int, b: int, sq: int, sk: int, causal: bool, window) -> bool:
    """flash-attn's bottom-right convention, written out."""
    left, right = window
    d = sk - sq
    return (left is None or b >= a + d - left) and (right is None or b <= a + d + right) and (not causal or b <= a + d)


@pytest.mark.parametrize("bad,error", [
    ((-1, 0), ValueError), ((0, -2), ValueError), ((1, 2, 3), ValueError), ((1,), ValueError), (5, TypeError),
    ((True, 0), TypeError), ((1.0, 0), TypeError), (("1", None), TypeError), ("ab", TypeError)])
def test_bad_windows_are_refused(bad, error):
    with pytest.raises(error, match="window"):
        Mask(True, bad)


@pytest.mark.parametrize("bad,error", [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                                       (float("nan"), ValueError), (True, TypeError), ("30", TypeError)])
def test_bad_softcaps_are_refused(bad, error):
    with pytest.raises(error, match="softcap"):
        Mask(False, softcap=bad)


def test_none_window_is_unlimited_and_features():
    assert Mask(True, None) == Mask(True, (None, None)) == Mask(True)
    assert Mask(True, [3, 0]) == Mask(True, (3, 0))
    assert Mask(True).features == frozenset() and Mask(False, (None, None), 50).features == {"softcap"}
    assert Mask(True, (4, None)).features == {"window"}
    assert Mask(True, (None, 3)).features == frozenset()          # under causal the right side changes nothing
    assert Mask(False, (None, 3), 2.0).features == {"window", "softcap"}
    assert Mask(True, (4, 7)).band() == (-4, 0) and Mask(False, (4, 7)).band() == (-4, 7)
    assert Mask(False).band() == (None, None)
    with pytest.raises(TypeError, match="causal"):
        Mask(1)
    # sides reaching past the sequence are no window at all (a kernel without windows can run it)
    assert Mask(False, (15, 16), 3.0).within(16) == Mask(False, None, 3.0)
    assert Mask(False, (14, 3)).within(16) == Mask(False, (14, 3))
    assert Mask(True, (100, 0)).within(16).features == frozenset()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_band_blocks_are_the_mask_trimmed(causal, window):
    """For arithmetic progressions of query and key positions: the block's kernel mask, at the block's rows and
    keys, is exactly the global mask, every allowed pair lies inside the block, and no row or key is empty."""
    mask = Mask(causal, window)
    for stride, sq, sk, q0, k0 in itertools.product((1, 3), (1, 2, 5), (1, 4), (0, 6, 13), (0, 5, 12, 20)):
        qpos = [q0 + stride * a for a in range(sq)]
        kpos = [k0 + stride * b for b in range(sk)]
        want = {(a, b) for a in range(sq) for b in range(sk) if allowed(qpos[a], kpos[b], causal, window)}
        base_q, base_k = 2, 1                                # rows/keys at an offset inside the local tensors
        blk = band_block(mask, q0, k0, stride, slice(base_q, base_q + sq), slice(base_k, base_k + sk))
        if not want:
            assert blk is None
            continue
        rows, keys = range(blk.q.start - base_q, blk.q.stop - base_q), range(blk.k.start - base_k, blk.k.stop - base_k)
        assert all(side is None or side >= 0 for side in blk.window)
        assert not (blk.causal and blk.window[1] is not None)
        got = {(rows[a], keys[b]) for a in range(len(rows)) for b in range(len(keys))
               if kernel_sees(a, b, len(rows), len(keys), blk.causal, blk.window)}
        assert got == want
        assert {a for a, _ in got} == set(rows) and {b for _, b in got} == set(keys)   # trimmed
