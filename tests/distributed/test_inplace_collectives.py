"""A collective that writes into a saved matrix product's output, inside the selective preset (2 gloo ranks;
tests/distributed/inplace_ranks.py): Megatron's RowParallelLinear without sequence parallelism all-reduces its
matmul's output in place, which PyTorch's check for mutated saved tensors does not see. The recomputation used to
all-reduce the already reduced output again (gradients off by 30-70% under TP 2); the collective's result is now
saved with it (gradients equal to those without recompute), and a recomputed read of the output before the collective
changed it is an error."""
from __future__ import annotations

from tests.distributed.harness import run_spawned


def test_an_in_place_all_reduce_of_a_saved_output_is_exact_or_refused():
    for rank, r in enumerate(run_spawned("tests.distributed.inplace_ranks:run", 2, None, timeout_s=180)):
        assert r["read_before=False"] < 1e-12, (rank, r)
        assert r["read_before=True"].startswith("selective recompute: c10d.allreduce_.default writes into a saved "
                                                "matrix product's output that an operator recomputed in backward "
                                                "read before"), (rank, r)
