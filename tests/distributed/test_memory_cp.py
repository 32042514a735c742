"""The memory model's hf family at CP 2 (one launch of 2 gloo ranks): what Hugging Face Llama layers keep for
backward on each rank under the ring family (zigzag, ring), all-gather and Ulysses (head-sharded attention
tensors), exact."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_spawned

CASES = [("zigzag", "none", "bf16"), ("zigzag", "full", "bf16"), ("ring", "sqrt", "bf16"),
         ("allgather", "none", "fp32"), ("ulysses", "none", "bf16"), ("ulysses", "full", "fp32"),
         ("ulysses", "selective", "bf16")]


@pytest.fixture(scope="module")
def results():
    return run_spawned("tests.distributed.memory_cp_ranks:kept", 2, {"cases": CASES})


@pytest.mark.parametrize("case", ["-".join(c) for c in CASES])
def test_hf_layers_kept_per_rank(results, case):
    for rank, res in enumerate(results):
        got = res[case]
        assert got["kept"] == got["model"], f"rank {rank} {case}: model {got['model']} vs measured {got['kept']}"
