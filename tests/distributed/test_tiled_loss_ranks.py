"""``+tile_loss`` on ctx_plugin's own model under CP (gloo, one launch of 2 ranks; tests/distributed/tiled_loss_ranks.py):
DecoderLM.loss(tile=True) over each rank's shard, with the preset's layer part applied to the blocks, gives the
float64 dense whole-sequence reference's loss and every gradient (1e-10); the head runs on the predicted chunks of
the rank's tokens, once in forward and once more in backward."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_spawned
from tests.distributed.tiled_loss_ranks import BATCH, SEQ

WORLD = 2
CASES = [("zigzag", "none+tile_loss:7"), ("zigzag", "full+tile_loss:5"), ("ulysses", "selective+tile_loss:13"),
         ("allgather", "sqrt+tile_loss")]
_results: list = []


def results() -> list:
    if not _results:
        _results.append(run_spawned("tests.distributed.tiled_loss_ranks:run", WORLD, {"cases": CASES}, timeout_s=300))
    return _results[0]


@pytest.mark.parametrize("backend,preset", CASES, ids=[f"{b}-{p}" for b, p in CASES])
def test_tiled_loss_under_cp_matches_dense_reference(backend, preset):
    tokens = BATCH * SEQ // WORLD
    size = int(preset.split(":")[1]) if ":" in preset else tokens        # automatic: one chunk at this vocabulary
    chunks = [min(size, tokens - s) for s in range(0, tokens, size)]
    for rank in range(WORLD):
        r = results()[rank][f"{backend}-{preset}"]
        bad = {k: v for k, v in r["errors"].items() if not v <= 1e-10}
        assert not bad, bad
        assert r["forward_calls"] == chunks and r["all_calls"] == 2 * len(chunks)
