"""The Megatron entry point runs an unedited pretrain_gpt.py with ctx_plugin switched on.

Megatron's own ``pretrain`` needs CUDA, so the checkout here is a CPU stand-in (fake_megatron_lm/) that uses
the same hooks as Megatron-LM's script and feeds the dataloader's causal mask; the test runs it under torchrun
at CP = 2 (every backend but the hybrid) and compares the training losses with the script run without
ctx_plugin on one rank: Megatron's own model (local attention, its RoPE). Biases, GQA, init std 0.1."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

from ctx_plugin.names import Backend  # noqa: E402

CHECKOUT = Path(__file__).parent / "fake_megatron_lm"
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings",
         "32", "--micro-batch-size", "2", "--vocab-size", "128", "--position-embedding-type", "rope",
         "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer", "--add-qkv-bias", "--init-method-std", "0.1"]


def _run(tmp_path: Path, nproc: int, *flags: str, ctx_plugin: bool = True) -> dict:
    report = tmp_path / f"report-{nproc}-{'-'.join(flags)}.json"
    script = (["-m", "ctx_plugin.megatron.pretrain_gpt", "--megatron-lm", str(CHECKOUT), "--cp-kernel", "torch"]
              if ctx_plugin else [str(CHECKOUT / "pretrain_gpt.py")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *script,
           *MODEL, "--context-parallel-size", str(nproc), "--fake-report", str(report), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The script without ctx_plugin, on one rank: Megatron's own model."""
    got = _run(tmp_path_factory.mktemp("ref"), 1, ctx_plugin=False)
    assert got["model_class"] == "GPTModel" and got["core_attention"] == "DotProductAttention"
    assert got["rope_class"] == "RotaryEmbedding"
    return got


PRESETS = {Backend.ZIGZAG: "full", Backend.STRIPED: "core_attn"}     # core_attn: Megatron's own recompute
MEGATRON_FIELDS = {"core_attn": ["selective", ["core_attn"]], "mlp": ["selective", ["mlp"]]}


def _same_losses(got: dict, reference: dict) -> None:
    assert got["model_class"] == "CPGPTModel" and got["core_attention"] == "CPCoreAttention"
    assert got["rope_class"] == "LayoutRotaryEmbedding"
    for a, b in zip(got["losses"], reference["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], reference["losses"])


@pytest.mark.parametrize("backend", [b.value for b in Backend if b != Backend.ULYSSES_RING])
def test_entry_point_trains_like_megatron(tmp_path, reference, backend):
    preset = PRESETS.get(backend, "none")
    got = _run(tmp_path, 2, "--cp-backend", backend, "--cp-recompute", preset)
    _same_losses(got, reference)
    if preset in MEGATRON_FIELDS:                   # what Megatron's config applies (granularity, modules)
        assert got["recompute"] == MEGATRON_FIELDS[preset]
    else:                                           # ctx_plugin applies it; Megatron recomputes nothing
        assert got["recompute"][0] is None


def _mlp_budget() -> str:
    """A budget:<GiB> that resolves to mlp for MODEL with 3 layers at CP 2 (padded vocabulary 128, DP 1, fp32): mlp
    fits, every preset with less estimated recompute does not (with 2 layers full:block:1 beats mlp on both)."""
    import torch

    from ctx_plugin.memory import ModelSpec, ParallelSpec
    from ctx_plugin.memory.model import GiB, estimate
    from ctx_plugin.recompute import candidates, resolve

    model = ModelSpec(layers=3, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, gated=False, norm="layer",
                      family="megatron", attention_bias=True,          # --add-qkv-bias; what args.py describes
                      mlp_bias=False,                                  # --disable-bias-linear
                      tied_embeddings=True)                            # Megatron's default (no --untie-...)
    parallel = ParallelSpec(cp=2, backend="zigzag", tp=1, dp=1)
    peaks = sorted(estimate(model, parallel, c, seq_len=32, micro_batch=2, dtype=torch.float32).peak
                   for c in candidates(3))
    mlp = estimate(model, parallel, "mlp", seq_len=32, micro_batch=2, dtype=torch.float32).peak
    budget = f"budget:{(mlp + min(p for p in peaks if p > mlp)) / 2 / GiB:.9f}"
    assert str(resolve(budget, model, parallel, seq_len=32, micro_batch=2, dtype=torch.float32)) == "mlp"
    return budget


def test_entry_point_budget_resolves_once_to_megatrons_mlp(tmp_path):
    """budget:<GiB> is resolved once, with Megatron's padded vocabulary and DP size, to mlp, which Megatron's
    own recompute applies (it used to crash at model construction: the entry point validated its own output).
    Without linear biases: Megatron's mlp recompute hangs on CPU with them."""
    flags = ("--disable-bias-linear", "--num-layers", "3", "--hidden-dropout", "0")   # budget counts no dropout
    reference = _run(tmp_path, 1, *flags, ctx_plugin=False)
    got = _run(tmp_path, 2, *flags, "--cp-recompute", _mlp_budget())
    _same_losses(got, reference)
    assert got["recompute"] == MEGATRON_FIELDS["mlp"] and got["padded_vocab_size"] == 128


REAL_CHECKOUT = Path(__file__).parents[1] / "fixtures" / "megatron_lm_imports"    # Megatron-LM's import layout
ENTRY = [sys.executable, "-m", "ctx_plugin.megatron.pretrain_gpt"]
PREFIX = "python -m ctx_plugin.megatron.pretrain_gpt: error: "


def test_entry_point_rejects_bad_flags(tmp_path):
    proc = subprocess.run([*ENTRY, "--megatron-lm", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{PREFIX}--megatron-lm {tmp_path.resolve()}: no pretrain_gpt.py there" \
        in proc.stderr and "Traceback" not in proc.stderr


def test_flag_errors_print_once_without_traceback():
    """Under torchrun with 2 ranks: one argparse-style message (rank 0), every rank exits 2, no rank traceback."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *ENTRY[1:],
           "--megatron-lm", str(CHECKOUT), *MODEL, "--reset-attention-mask",
           "--no-create-attention-mask-in-dataloader"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and out.count(PREFIX) == 1, out[-4000:]
    assert "--reset-attention-mask (ctx_plugin packs its document masks into megatron-core's THD format) cannot be " \
           "honoured with:\n  --no-create-attention-mask-in-dataloader: Megatron's dataloader then builds no " \
           "document mask" in out
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-4000:]
    assert "exitcode  : 2" in out, out[-4000:]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_megatron_pretrain_needs_cuda(tmp_path):
    """Megatron-LM's own pretrain_gpt.py (pretrain imported in a parenthesised block) on a machine without CUDA:
    one clear message before Megatron starts (not its argument validation's driver traceback at CP > 1)."""
    proc = subprocess.run([*ENTRY, "--megatron-lm", str(REAL_CHECKOUT), *MODEL, "--context-parallel-size", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.startswith(PREFIX) and "pretrain() (megatron.training)" in proc.stderr
    assert "needs CUDA GPUs" in proc.stderr
