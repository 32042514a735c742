"""Megatron's ``--reset-attention-mask`` / ``--reset-position-ids`` batches (documents split at end-of-document tokens)
through ctx_plugin (CPU, gloo).

Parity (tests/integration/megatron_reset_ranks.py, one launch at CP 2): batches built by megatron-core's own
``_get_ltor_masks_and_position_ids`` (two samples with different documents, ``--eod-mask-loss``), sharded by
ctx_plugin's sharder (packed into THD from the block-diagonal mask), give the loss and every gradient of Megatron's
own model at CP 1 fed the same batch with its mask (its local attention applies the mask). RoPE with and without
restarted position ids (THD RoPE restarts them; scores depend only on distances inside a document), YaRN (its
frequencies and attention factor, applied per document by megatron-core's THD RoPE, padded and not), learned
absolute embeddings (which read the position ids as the dataset made them), zigzag, allgather, ring, ulysses and
striped, mixture-of-experts layers with their auxiliary losses; ``--reset-position-ids`` alone (causal
attention); documents padded to the layout's unit (``--cp-pad-documents``); at TP 2 × CP 2 with sequence
parallelism (the packed sequence padded to CP × TP) against Megatron's TP 2 model. Refusals: documents the layout
cannot split, RoPE or YaRN on a layout megatron-core's THD RoPE cannot follow, masks that are not the documents'
causal mask; every rank raises the same message. The entry point carries the flags through Megatron's parser to a
CPU stand-in of pretrain_gpt.py (fake_megatron_lm/) and trains with the losses of that script run without
ctx_plugin; a script that drops ``cu_seqlens`` is stopped."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

from tests.distributed.harness import run_spawned  # noqa: E402
from tests.integration.megatron_reset_ranks import case_key  # noqa: E402

# (backend, position embedding, mix, --reset-attention-mask, --reset-position-ids, mask, --cp-pad-documents)
PARITY = [("zigzag", "rope", "fit", True, True, "dataset", False),
          ("zigzag", "rope", "fit", True, False, "dataset", False),
          ("allgather", "rope", "fit", True, True, "dataset", False),
          ("zigzag", "learned_absolute", "fit", True, False, "dataset", False),
          ("ring", "learned_absolute", "uneven", True, True, "dataset", False),
          ("ring", "learned_absolute", "uneven", True, False, "dataset", False),
          ("ulysses", "learned_absolute", "uneven", True, False, "dataset", False),
          ("striped", "learned_absolute", "fit", True, True, "dataset", False),
          ("ring", "learned_absolute", "uneven", False, True, "dataset", False),        # --reset-position-ids alone
          ("zigzag", "learned_absolute", "uneven", False, True, "dataset", False),
          ("zigzag", "rope", "uneven", True, True, "dataset", True),                   # documents padded to 4
          ("allgather", "rope", "uneven", True, False, "dataset", True),
          ("striped", "learned_absolute", "uneven", True, False, "dataset", True),      # ... to 2
          ("zigzag", "yarn", "fit", True, True, "dataset", False),                      # YaRN: attention factor too
          ("allgather", "yarn", "uneven", True, False, "dataset", True),
          # mixture of experts (tests/integration/megatron_ranks.py's "moe": the load-balancing and z losses): the
          # router sees the packed sequence, its losses over all tokens of the micro batch as in Megatron's own run
          ("zigzag", "rope", "fit", True, True, "dataset", False, "moe"),
          ("ring", "learned_absolute", "uneven", True, False, "dataset", False, "moe"),
          ("striped", "learned_absolute", "fit", True, True, "dataset", False, "moe")]
# TP 2 × CP 2 (4 ranks) with Megatron's sequence parallelism, against Megatron's own TP 2 model with it (norms by
# tests/integration/megatron_ranks.py:sequence_parallel_norms): each TP rank holds half of its CP rank's packed tokens
SEQUENCE_PARALLEL = [("zigzag", "rope", "fit", True, True, "dataset", False),
                     ("zigzag", "rope", "uneven", True, True, "dataset", True),
                     # documents 5, 11, 16, 10, 22 padded to 2 (the layout's unit): 66 tokens, then to 68 (CP × TP)
                     ("striped", "learned_absolute", "odd", True, False, "dataset", True),
                     ("ulysses", "learned_absolute", "uneven", True, False, "dataset", False),
                     ("allgather", "yarn", "uneven", True, False, "dataset", True),
                     ("zigzag", "rope", "fit", True, True, "dataset", False, "moe")]
PADDED = {"zigzag": [0, 12, 24, 36, 44, 72], "allgather": [0, 12, 24, 36, 44, 72], "striped": [0, 10, 22, 34, 40, 68]}
REFUSED = [(("zigzag", "learned_absolute", "uneven", True, True, "dataset", False),
            "--reset-attention-mask: the document at token 0 of sample 0 holds 10 tokens, not a multiple of 4"),
           (("ring", "rope", "uneven", True, True, "dataset", False), "need --cp-backend zigzag or allgather"),
           (("ring", "yarn", "uneven", True, False, "dataset", False), "need --cp-backend zigzag or allgather"),
           (("ring", "learned_absolute", "uneven", True, True, "padding", False),
            "attention_mask row 1 is neither Megatron's causal mask nor its block-diagonal causal mask")]
_results: dict[int, list] = {}


def results(tp: int = 1) -> list:
    if tp not in _results:
        payload = {"cases": PARITY + [c for c, _ in REFUSED]} if tp == 1 else {"cases": SEQUENCE_PARALLEL, "tp": tp}
        _results[tp] = run_spawned("tests.integration.megatron_reset_ranks:reset_step", 2 * tp, payload,
                                   timeout_s=300)
    return _results[tp]


@pytest.mark.parametrize("case", PARITY, ids=[case_key(*c) for c in PARITY])
def test_reset_batches_match_megatron_with_its_document_mask(case):
    got = results()[0][case_key(*case)]
    assert "error" not in got, got.get("error")
    assert got["packed"] == case[3]
    if case[6]:     # documents 10, 11, 11, 5, 27 (real lengths in cu_seqlens), each padded at its end
        assert got["cu_seqlens"] == [[0, 10, 21, 32, 37, 64]] and got["cu_seqlens_padded"] == [PADDED[case[0]]]
        assert got["local_tokens"] == PADDED[case[0]][-1] // 2
    else:
        assert got["cu_seqlens_padded"] is None and got["local_tokens"] == (32 if case[3] else 16)   # [1, 64], [2, 32]
    _check_errors(case, got)


def _check_errors(case, got) -> None:
    # megatron-core computes RoPE/YaRN frequencies in float32: THD RoPE restarts positions in each document, the
    # reference's counts them over the sample, so their cos/sin round differently (the same scores)
    tol = 1e-6 if case[1] in ("rope", "yarn") else 1e-9
    assert got["loss_err"] <= tol / 10 and got["grad_err"] <= tol, got


@pytest.mark.parametrize("case", SEQUENCE_PARALLEL, ids=[case_key(*c) for c in SEQUENCE_PARALLEL])
def test_reset_batches_under_sequence_parallelism(case):
    """The packed sequence (THD) split over TP 2 × CP 2: with --cp-pad-documents also padded to a multiple of CP × TP
    (the "odd" mix: 66 tokens after the documents' padding, 68 then); loss and whole gradients as Megatron's."""
    got = results(tp=2)[0][case_key(*case)]
    assert "error" not in got, got.get("error")
    assert got["packed"]
    if case[2] == "odd":
        assert got["cu_seqlens_padded"] == [[0, 6, 18, 34, 44, 68]] and got["local_tokens"] == 34
    elif case[6]:
        assert got["cu_seqlens_padded"] == [PADDED[case[0]]]
    _check_errors(case, got)


@pytest.mark.parametrize("case,message", REFUSED, ids=[case_key(*c) for c, _ in REFUSED])
def test_reset_refusals_are_the_same_on_every_rank(case, message):
    errors = [rank[case_key(*case)].get("error", "") for rank in results()]
    assert message in errors[0], errors[0]
    assert errors[0] == errors[1]


CHECKOUT = Path(__file__).parent / "fake_megatron_lm"
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings",
         "32", "--micro-batch-size", "2", "--vocab-size", "128", "--attention-dropout", "0", "--tokenizer-type",
         "NullTokenizer", "--add-qkv-bias", "--init-method-std", "0.1", "--position-embedding-type",
         "learned_absolute", "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
         "--fake-eod-at", "9,20/4"]


def _run(tmp_path, nproc: int, *flags: str, ctx_plugin: bool = True, check: bool = True):
    report = tmp_path / f"report-{nproc}-{ctx_plugin}-{len(flags)}.json"
    script = (["-m", "ctx_plugin.megatron.pretrain_gpt", "--megatron-lm", str(CHECKOUT), "--cp-kernel", "torch"]
              if ctx_plugin else [str(CHECKOUT / "pretrain_gpt.py")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *script,
           *MODEL, "--context-parallel-size", str(nproc), "--fake-report", str(report), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if not check:
        return proc
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(report.read_text())


def test_entry_point_trains_reset_batches_like_megatron(tmp_path):
    """zigzag at CP 2 with --cp-pad-documents (the documents, 10, 11, 11 and 5, 27 tokens, fall anywhere) against the
    script without ctx_plugin on one rank (Megatron's local attention with the dataloader's document mask)."""
    reference = _run(tmp_path, 1, ctx_plugin=False)
    got = _run(tmp_path, 2, "--cp-backend", "zigzag", "--cp-pad-documents")
    assert reference["core_attention"] == "DotProductAttention" and not reference["packed"]
    assert got["core_attention"] == "CPCoreAttention" and got["packed"]
    for a, b in zip(got["losses"], reference["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], reference["losses"])


def test_entry_point_stops_a_script_that_drops_cu_seqlens(tmp_path):
    proc = _run(tmp_path, 1, "--cp-backend", "ring", "--fake-ignore-cu-seqlens", check=False)
    assert proc.returncode != 0
    assert "the model was called without packed_seq_params: it would attend across documents and samples" \
        in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--attention-dropout", "0", "--context-parallel-size", "2"]


def test_launcher_checks_the_reset_flags_as_the_job_does():
    """ctx-plugin launch's own check reads the flags check_reset_data reads (it used to drop them as unknown, so
    --cp-pad-documents looked like a flag without --reset-attention-mask)."""
    from ctx_plugin.slurm.checks import check_megatron

    def check(*flags):
        return check_megatron([*BASE, *flags], world=2, device="cpu", megatron_lm=str(CHECKOUT))

    check("--reset-attention-mask", "--reset-position-ids", "--cp-pad-documents", "--position-embedding-type", "rope")
    check("--reset-attention-mask", "--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss")
    for flags, message in ((["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"],
                            "--no-create-attention-mask-in-dataloader: Megatron's dataloader then builds no"),
                           (["--reset-attention-mask", "--num-experts", "4", "--moe-router-load-balancing-type",
                             "aux_loss", "seq_aux_loss"], "seq_aux_loss: megatron-core's router sees the packed"),
                           (["--reset-attention-mask", "--num-experts", "4", "--cp-pad-documents"],
                            "--num-experts with --cp-pad-documents: the padding tokens"),
                           (["--cp-pad-documents"], "--cp-pad-documents pads the documents"),
                           (["--reset-attention-mask", "--cp-pad-documents", "--cuda-graph-impl", "local"],
                            "a captured CUDA graph replays"),
                           (["--reset-attention-mask", "--cp-backend", "ring", "--position-embedding-type", "rope"],
                            "which --cp-backend ring does not hold")):
        with pytest.raises(ValueError, match=message):
            check(*flags)
