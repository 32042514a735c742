"""An argument ctx_plugin's Hugging Face attention refuses (output_attentions=True), given on one rank only: every
rank raises the ranks' disagreement within seconds (the refusing rank used to raise alone while the others waited
in the attention's collectives until the timeout)."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_spawned


def test_a_refusal_on_one_rank_is_one_error_on_every_rank():
    pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")
    results = run_spawned("tests.distributed.hf_agreement_ranks:one_rank_refused", 2, {"odd": 1}, timeout_s=180)
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["error"].startswith("ValueError: "), (rank, r)
        assert r["seconds"] < 10 and r["probe"] == 2, (rank, r)
    assert len({r["error"] for r in results}) == 1, results
    message = results[0]["error"]
    assert "disagree" in message and "input_check: rank 0: ok; rank 1: ValueError: ctx_plugin's attention does not " \
        "implement" in message, message


def _input_check_error(payload: dict, start: str, ranks: list[int]) -> str:
    """The one error every rank raised for ``payload``'s inputs: it starts with ``start``, names ``ranks`` at its end
    and came within seconds."""
    pytest.importorskip("transformers", reason="needs transformers: pip install 'ctx-plugin[hf]'")
    results = run_spawned("tests.distributed.hf_agreement_ranks:one_rank_refused", 2, payload, timeout_s=180)
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["error"].startswith(f"ValueError: ctx_plugin: {start}"), (rank, r)
        assert r["error"].rstrip().endswith(f"(CP ranks {ranks})") and r["seconds"] < 10, (rank, r)
    assert len({r["error"] for r in results}) == 1, results
    return results[0]["error"]


def test_a_token_outside_the_vocabulary_on_one_rank_is_one_error_on_every_rank():
    """The embedding would raise an IndexError on that rank alone (on CUDA a device-side assert) while the others
    waited in the first attention's collectives: the input check refuses it on every rank, naming the rank."""
    _input_check_error({"odd": 0, "bad_token": True}, "input_ids outside the model's vocabulary", [0])


def test_packed_positions_without_documents_are_one_error_on_every_rank():
    """Documents of 6 and 10 tokens in the position_ids (restarting at 0), none passed to the attention: rank 1's
    shard holds the restart (zigzag: tokens 4-7 and 8-11), rank 0's positions are merely off; every rank raises the
    one message that names the documents, with the rank that saw the restart."""
    error = _input_check_error({"packed": True}, "position_ids restart at 0 inside the sequence", [1])
    assert "not this rank's share" not in error, error


def test_unsharded_inputs_are_named_on_every_rank():
    """Every rank given the whole sequence (16 tokens each, positions 0..15) instead of its shard: one message on
    every rank that says so and names shard_sequence (not the packed-documents or off-positions ones)."""
    error = _input_check_error({"unsharded": True}, "position_ids are 0..n-1 and the tokens the same on every rank",
                               [0, 1])
    assert "ctx_plugin.shard_sequence" in error, error
    assert "restart at 0" not in error and "not this rank's share" not in error, error
