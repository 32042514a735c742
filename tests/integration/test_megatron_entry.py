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


@pytest.mark.parametrize("backend", [b.value for b in Backend if b != Backend.ULYSSES_RING])
def test_entry_point_trains_like_megatron(tmp_path, reference, backend):
    got = _run(tmp_path, 2, "--cp-backend", backend, "--cp-recompute", "full" if backend == "zigzag" else "none")
    assert got["model_class"] == "CPGPTModel" and got["core_attention"] == "CPCoreAttention"
    assert got["rope_class"] == "LayoutRotaryEmbedding"
    for a, b in zip(got["losses"], reference["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], reference["losses"])


def test_entry_point_rejects_bad_flags(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ctx_plugin.megatron.pretrain_gpt", "--megatron-lm", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no pretrain_gpt.py there" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ctx_plugin.megatron.pretrain_gpt", "--megatron-lm", str(CHECKOUT),
                           *MODEL, "--reset-attention-mask"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "reset_attention_mask=True (--reset-attention-mask): document masks" in proc.stderr
