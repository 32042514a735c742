"""The fused Triton merge against the torch merge, on CPU tensors under Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before triton kernels are defined, so the interpreted runs happen in one
child process (``_report``) that measures every case and prints the measurements as one JSON line; the
tests below assert on them. Shapes are small (the interpreter runs each program in numpy).

Tolerances. Both merges compute in fp32 with the same formulas (logaddexp = max + log1p(exp(min − max)),
weights exp(lse_side − lse_new)); they differ only in the last bits of exp/log1p (≤ 1 ulp each) and the order
of the final multiply-add. The stored fp32 lse is itself off the float64 value by up to half an ulp
(|lse| ≲ 16 here: 4.8e-7), which moves both weights by as much relative, so the torch fp32 merge is ~4.4e-7
norm-wise off the float64 reference math on these data (measured, 20 seeds) and the fused one ~3.6e-7.
``ONE_MERGE`` = 1.5e-6 allows three times that; errors add up over a ring's seven merges (``RING`` = 3e-6,
measured 6.3e-7), and ``LSE_ABS`` = 1.5e-6 is ~3 ulp of |lse|. Rows that pass through (one side −inf) must be
bit-exact: their weights are exp(0) = 1 and exp(−inf) = 0.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ctx_plugin.core import merge
from ctx_plugin.core.merge import merge_into, merge_into_fused, merge_into_torch
from tests.reference import rel_err

ROOT = Path(__file__).resolve().parents[2]
B, S, H = 2, 37, 3
LEAD, TAIL = 5, 8                 # accumulator rows before/after the merged slice out_full[:, 5:42]
ONE_MERGE, RING = 1.5e-6, 3e-6    # see the module docstring
LSE_ABS = 1.5e-6                  # ~3 ulp of |lse| ≲ 16
# (batch, head, row of the slice) with no keys yet in the accumulator / in the block / in both.
OLD_EMPTY = [(0, 0, 3), (1, 2, 36)]
BLOCK_EMPTY = [(0, 1, 10), (1, 0, 0)]
BOTH_EMPTY = [(0, 2, 20), (1, 1, 5)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# block_out memory layouts: "bhsd" is a transposed [B, H, S, D] buffer (what torch's SDPA ops return).
SINGLE = {f"d{d}-{name}-{layout}": (d, name, layout)
          for d in (64, 80, 128) for name, layout in (("bf16", "bhsd"), ("fp16", "bsdh"), ("fp32", "bsdh"))}
SINGLE["d64-fp32-dstride2"] = (64, "fp32", "dstride2")
RING_STEPS = [(slice(0, 40),), (slice(0, 20), slice(20, 40)), (slice(20, 40),), (slice(0, 20), slice(20, 40))]


def _block(d: int, dtype: torch.dtype, layout: str, s: int, g: torch.Generator):
    if layout == "bhsd":
        out = torch.randn(B, H, s, d, generator=g).to(dtype).transpose(1, 2)
    elif layout == "dstride2":
        out = torch.randn(B, s, H, 2 * d, generator=g).to(dtype)[..., ::2]
    else:
        out = torch.randn(B, s, H, d, generator=g).to(dtype)
    return out, torch.randn(B, H, s, generator=g) * 4


def _merge_f64(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """The torch merge in float64 on copies: the reference math."""
    out64, lse64 = out.double(), lse.double()
    merge_into_torch(out64, lse64, block_out.double(), block_lse.double())
    return out64, lse64


def _lse_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        return float("inf")
    finite = torch.isfinite(want)
    return (got.double() - want.double())[finite].abs().max().item()


def _single_case(d: int, dtype_name: str, layout: str) -> dict:
    g = torch.Generator().manual_seed(d)
    out_full = torch.randn(B, LEAD + S + TAIL, H, d, generator=g)
    lse_full = torch.randn(B, H, LEAD + S + TAIL, generator=g) * 4
    block_out, block_lse = _block(d, DTYPES[dtype_name], layout, S, g)
    rows = slice(LEAD, LEAD + S)
    for b, h, s in OLD_EMPTY + BOTH_EMPTY:
        out_full[b, LEAD + s, h] = 0.0
        lse_full[b, h, LEAD + s] = float("-inf")
    for b, h, s in BLOCK_EMPTY + BOTH_EMPTY:      # block_out rows stay random: their weight must be 0
        block_lse[b, h, s] = float("-inf")
    before_out, before_lse = out_full.clone(), lse_full.clone()
    want_out, want_lse = _merge_f64(out_full[:, rows], lse_full[:, :, rows], block_out, block_lse)
    torch_out, torch_lse = out_full.clone(), lse_full.clone()
    merge_into_torch(torch_out[:, rows], torch_lse[:, :, rows], block_out, block_lse)

    merge_into_fused(out_full[:, rows], lse_full[:, :, rows], block_out, block_lse)
    out, lse = out_full[:, rows], lse_full[:, :, rows]
    old_out, old_lse = before_out[:, rows], before_lse[:, :, rows]
    outside = torch.ones(LEAD + S + TAIL, dtype=torch.bool)
    outside[rows] = False
    return {
        "out_vs_f64": rel_err(out, want_out),
        "lse_vs_f64": _lse_err(lse, want_lse),
        "out_vs_torch": rel_err(out, torch_out[:, rows]),
        "lse_vs_torch": _lse_err(lse, torch_lse[:, :, rows]),
        "outside_untouched": torch.equal(out_full[:, outside], before_out[:, outside])
        and torch.equal(lse_full[:, :, outside], before_lse[:, :, outside]),
        "nan": bool(out.isnan().any() or lse.isnan().any()),
        "both_empty_stay_empty": all(out[b, s, h].eq(0).all() and lse[b, h, s] == float("-inf")
                                     for b, h, s in BOTH_EMPTY),
        "old_empty_take_block": all(torch.equal(out[b, s, h], block_out[b, s, h].float())
                                    and lse[b, h, s] == block_lse[b, h, s] for b, h, s in OLD_EMPTY),
        "block_empty_keep_old": all(torch.equal(out[b, s, h], old_out[b, s, h]) and lse[b, h, s] == old_lse[b, h, s]
                                    for b, h, s in BLOCK_EMPTY),
    }


def _ring_case() -> dict:
    """Four ring steps of one or two blocks each (zigzag-like halves), from empty accumulators as the ring
    starts them, with bf16 blocks in SDPA's transposed layout; a few block rows have no keys."""
    g = torch.Generator().manual_seed(4)
    n, d = 40, 80
    out = torch.zeros(B, n, H, d)
    lse = torch.full((B, H, n), float("-inf"))
    torch_out, torch_lse = out.clone(), lse.clone()
    out64, lse64 = out.double(), lse.double()
    for step, blocks in enumerate(RING_STEPS):
        for q in blocks:
            block_out, block_lse = _block(d, torch.bfloat16, "bhsd", q.stop - q.start, g)
            block_lse[step % B, step % H, : step + 1] = float("-inf")
            merge_into_fused(out[:, q], lse[:, :, q], block_out, block_lse)
            merge_into_torch(torch_out[:, q], torch_lse[:, :, q], block_out, block_lse)
            merge_into_torch(out64[:, q], lse64[:, :, q], block_out.double(), block_lse.double())
    return {"out_vs_f64": rel_err(out, out64), "lse_vs_f64": _lse_err(lse, lse64),
            "out_vs_torch": rel_err(out, torch_out), "lse_vs_torch": _lse_err(lse, torch_lse),
            "nan": bool(out.isnan().any() or lse.isnan().any())}


def _report() -> None:
    """Child process entry (TRITON_INTERPRET=1): every case's measurements as one JSON line."""
    cases = {name: _single_case(*args) for name, args in SINGLE.items()}
    cases["ring4"] = _ring_case()
    print(json.dumps(cases))


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, "-c", "from tests.unit.test_merge_triton import _report; _report()"],
                            capture_output=True, text=True, timeout=240, cwd=ROOT,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", SINGLE)
def test_fused_merge_matches_reference_on_strided_views(interpreted, case):
    got = interpreted[case]
    assert got["out_vs_f64"] < ONE_MERGE and got["out_vs_torch"] < ONE_MERGE, got
    assert got["lse_vs_f64"] < LSE_ABS and got["lse_vs_torch"] < LSE_ABS, got
    assert got["outside_untouched"] and not got["nan"], got


@pytest.mark.parametrize("case", SINGLE)
def test_fused_merge_empty_rows(interpreted, case):
    """No keys on both sides: zero and −inf. No keys on one side: the other side passes through bit-exact."""
    got = interpreted[case]
    assert got["both_empty_stay_empty"] and got["old_empty_take_block"] and got["block_empty_keep_old"], got


def test_fused_merge_sequence_of_a_ring(interpreted):
    got = interpreted["ring4"]
    assert got["out_vs_f64"] < RING and got["out_vs_torch"] < RING, got
    assert got["lse_vs_f64"] < LSE_ABS and got["lse_vs_torch"] < LSE_ABS, got
    assert not got["nan"], got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_merge_into_on_cpu_is_the_torch_merge(monkeypatch, dtype):
    def refuse(*args):
        raise AssertionError("the fused merge must not run on CPU tensors")

    monkeypatch.setattr(merge, "merge_into_fused", refuse)
    g = torch.Generator().manual_seed(1)
    out_full = torch.randn(B, LEAD + S + TAIL, H, 8, generator=g, dtype=dtype)
    lse_full = torch.randn(B, H, LEAD + S + TAIL, generator=g, dtype=dtype)
    lse_full[0, 1, LEAD + 2] = float("-inf")
    block_out, block_lse = _block(8, torch.bfloat16, "bhsd", S, g)
    block_lse[0, 1, 2] = float("-inf")
    rows = slice(LEAD, LEAD + S)
    want_out, want_lse = out_full.clone(), lse_full.clone()
    merge_into_torch(want_out[:, rows], want_lse[:, :, rows], block_out, block_lse.to(dtype))
    merge_into(out_full[:, rows], lse_full[:, :, rows], block_out, block_lse.to(dtype))
    assert torch.equal(out_full, want_out) and torch.equal(lse_full, want_lse)


def test_fused_merge_rejects_what_it_cannot_merge():
    pytest.importorskip("triton")
    out, lse = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="float32"):
        merge_into_fused(out.double(), lse.double(), out, lse)
    with pytest.raises(ValueError, match="same sizes"):
        merge_into_fused(out, lse, out[:, :3], lse[:, :, :3])


def test_importing_the_package_does_not_import_triton():
    code = "import sys, ctx_plugin, ctx_plugin.core.merge, ctx_plugin.core.ring\nassert 'triton' not in sys.modules\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
