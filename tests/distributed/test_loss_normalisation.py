"""``ctx_plugin.deepspeed``'s loss normalisation on 3 gloo ranks (one launch; tests/distributed/loss_ranks.py): with
``step_tokens`` each micro batch backpropagates its token sum × ranks × accumulation steps ÷ the whole step's
tokens (DeepSpeed averages over the ranks and divides by the steps), and reports its part of the step's token mean;
without, its own token mean. Float64 stand-in logits, reference sums computed here from each rank's local sums.
Ranks that pass different step_tokens, or an invalid one, get the same error, and no rank is left waiting. And the
gradient, backpropagated and averaged as DeepSpeed does, against the gradient of the token mean computed directly."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_spawned

WORLD, STEPS = 3, 2
# labels ignored per rank and micro batch (6 per shard): micro batch 1 holds no label on any rank
IGNORED = [[0, 6], [2, 6], [5, 6]]
REFUSED = {"different": [4, 8, 6], "none on one rank": [None, 13, 13], "not an int": ["13", "13", "13"],
           "zero": [0, 0, 0]}
_results: list = []


def results() -> list:
    if not _results:
        _results.append(run_spawned("tests.distributed.loss_ranks:losses", WORLD,
                                    {"ignored": IGNORED, "refused": REFUSED}, timeout_s=120))
    return _results[0]


def test_the_gradient_is_the_whole_steps_token_mean_as_deepspeed_scales_it():
    """Against the gradient of the token mean computed directly on all ranks' micro batches (micro batches of 11
    and 10 targets): exact with step_tokens; the mean of the micro batches' means without."""
    got = run_spawned("tests.distributed.loss_ranks:gradients", WORLD, {"ignored": [[0, 3], [2, 1], [5, 4]]},
                      timeout_s=120)
    for r in got:
        assert r["step"] < 1e-13, r
        assert r["micro"] > 1e-3, r


def test_step_tokens_counts_the_whole_step_on_every_rank():
    assert [r["count"] for r in results()] == [6 + 4 + 1] * WORLD


def test_the_loss_is_the_token_mean_over_the_whole_step():
    r = results()
    count = r[0]["count"]
    for m in range(STEPS):
        total = sum(r[k]["sums"][m] for k in range(WORLD))
        for k in range(WORLD):
            loss, report = r[k]["step"][m]
            assert loss == pytest.approx(r[k]["sums"][m] * WORLD * STEPS / count, rel=1e-12, abs=0)
            assert report == pytest.approx(total / count, rel=1e-12, abs=0)
    step_loss = sum(r[0]["step"][m][1] for m in range(STEPS))
    assert step_loss == pytest.approx(sum(sum(x["sums"]) for x in r) / count, rel=1e-12)


def test_without_step_tokens_each_micro_batch_is_its_own_token_mean():
    r = results()
    tokens = sum(6 - IGNORED[k][0] for k in range(WORLD))
    total = sum(r[k]["sums"][0] for k in range(WORLD))
    for k in range(WORLD):
        loss, report = r[k]["micro"][0]
        assert loss == pytest.approx(r[k]["sums"][0] * WORLD / tokens, rel=1e-12, abs=0)
        assert report == pytest.approx(total / tokens, rel=1e-12, abs=0)
        assert "holds no label other than -100 on any rank" in r[k]["micro"][1]


@pytest.mark.parametrize("name, message", [
    ("different", "ValueError: the ranks passed different step_tokens"),
    ("none on one rank", "ValueError: the ranks passed different step_tokens (or some none)"),
    ("not an int", "TypeError: step_tokens must be a positive int"),
    ("zero", "TypeError: step_tokens must be a positive int"),
])
def test_refused_step_tokens_are_one_error_on_every_rank(name, message):
    for r in results():
        assert r["refused"][name] is not None and r["refused"][name].startswith(message), r["refused"][name]
        assert r["probe"] == WORLD


def test_a_step_without_labels_is_refused_on_every_rank():
    for r in results():
        assert "hold no label other than -100" in r["refused"]["empty step"]
