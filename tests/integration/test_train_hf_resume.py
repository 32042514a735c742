"""``ctx_plugin.train_hf`` stopped and resumed (what a requeued job does) trains exactly what an uninterrupted run
trains — dropout included, whose masks come from each rank's RNG (saved with the checkpoint) — resumes from the
newest checkpoint whose save completed (not DeepSpeed's ``latest`` when that save was cut short), and refuses a
resume with another layout. 2 gloo ranks, CP 2, ZeRO 1 (DS_ACCELERATOR=cpu)."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'ctx-plugin[deepspeed]'")
pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.distributed.harness import run_spawned
    from tests.integration.deepspeed_ranks import _deepspeed_op

    _deepspeed_op()           # DeepSpeed's comm op built (or found) first, in bounded time
    ranks = run_spawned("tests.integration.train_hf_resume_ranks:runs", 2,
                        {"dir": str(tmp_path_factory.mktemp("train_hf"))}, timeout_s=900)
    return {**ranks[0], "seeds": [r["seed"] for r in ranks]}


def test_a_resumed_run_trains_what_an_uninterrupted_one_does(runs):
    full = runs["full"]
    assert len(full) == 5 and len(set(full)) == 5
    assert runs["resumed"] == full                      # stopped twice, resumed twice: the same losses, bit for bit


def test_a_save_cut_short_is_not_resumed(runs):
    assert runs["latest"] == "step4"                     # DeepSpeed's pointer names the checkpoint cut short
    assert runs["cut"] == runs["full"]                   # resumed from step2 instead, and trained on from there


def test_another_layout_is_refused(runs):
    assert "was saved by a run of another layout (accumulation 2 -> 1, micro_batch 1 -> 2, micro_batches 8 -> 4)" \
        in runs["layout"]
    assert re.search(r"was saved by a run of another layout \(data \w{16} -> \w{16}, seq_len 16 -> 32\)",
                     runs["seq_len"]), runs["seq_len"]
    assert re.search(r"was saved by a run of another layout \(data \w{16} -> \w{16}\)", runs["data"]), runs["data"]


def test_the_ranks_sharing_a_sequence_draw_their_own_dropout_masks(runs):
    """Every rank builds the same weights from --seed, then draws from its own stream: the two ranks of the CP group
    would otherwise apply the same dropout masks to their two shards of every sequence."""
    assert len(set(runs["seeds"])) == 2
