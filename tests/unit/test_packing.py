"""ctx_plugin.packing: documents read from packed batches (restarting position_ids, cu_seq_lens, a documents entry),
their conflicts refused, next-token labels that stop at every document's end and skip padding, padding to a unit,
and the DeepSpeed loader's sharding of packed batches on one rank."""
from __future__ import annotations

import pytest
import torch

import ctx_plugin
from ctx_plugin.core.documents import Documents
from ctx_plugin.deepspeed.data import shard_batch
from ctx_plugin.packing import documents_from_positions, documents_of_batch, pad_packed_batch, shift_labels


def test_documents_from_restarting_positions():
    assert documents_from_positions(torch.tensor([0, 1, 2, 0, 1, 0])) == Documents((0, 3, 5, 6))
    assert documents_from_positions(torch.tensor([[0, 1, 0, 1], [0, 1, 0, 1]])) == Documents((0, 2, 4))
    assert documents_from_positions(torch.arange(5)) is None
    for bad, text in ((torch.tensor([1, 2, 3]), "position 0 holds 1"), (torch.tensor([0, 1, 3]), "position 2 holds 3"),
                      (torch.tensor([[0, 1, 0], [0, 1, 2]]), "identically in every row")):
        with pytest.raises(ValueError, match=text):
            documents_from_positions(bad)


def test_documents_of_batch_reads_every_source_and_refuses_conflicts():
    ids = torch.zeros(1, 6, dtype=torch.long)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    want = Documents((0, 3, 6))
    assert documents_of_batch({"input_ids": ids, "position_ids": pos}) == want
    assert documents_of_batch({"input_ids": ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}) == want
    assert documents_of_batch({"input_ids": ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": [0, 3, 6]}) == want
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k differ"):
        documents_of_batch({"input_ids": ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": [0, 2, 6]})
    assert documents_of_batch({"input_ids": ids, "documents": [0, 3, 6], "position_ids": pos}) == want
    assert documents_of_batch({"input_ids": ids, "position_ids": torch.arange(6)[None]}) is None
    assert documents_of_batch({"input_ids": ids}) is None
    with pytest.raises(ValueError, match="position_ids describe different documents"):
        documents_of_batch({"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 2, 6]),
                            "cu_seq_lens_k": torch.tensor([0, 2, 6]), "position_ids": pos})
    with pytest.raises(ValueError, match="together"):
        documents_of_batch({"input_ids": ids, "cu_seq_lens_q": cu})


def test_documents_from_seq_idx_as_hugging_faces_collator_writes_it():
    """DataCollatorWithFlattening(return_position_ids=False, return_seq_idx=True) marks documents only by seq_idx:
    read from it (equal to what its position ids would say), never silently one document."""
    transformers = pytest.importorskip("transformers")
    collator = transformers.DataCollatorWithFlattening(return_position_ids=False, return_seq_idx=True)
    batch = collator([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [4, 3, 2, 1]}])
    assert "position_ids" not in batch and "seq_idx" in batch
    assert documents_of_batch(batch) == Documents((0, 3, 5, 9))
    with_positions = transformers.DataCollatorWithFlattening(return_seq_idx=True)(
        [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [4, 3, 2, 1]}])
    assert documents_of_batch(with_positions) == Documents((0, 3, 5, 9))        # both sources, agreeing
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="position_ids and seq_idx describe different documents"):
        documents_of_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
                            "seq_idx": torch.tensor([[0, 0, 1, 1, 1, 1]])})
    with pytest.raises(ValueError, match="falls back at position 4"):
        documents_of_batch({"input_ids": ids, "seq_idx": torch.tensor([[0, 0, 1, 1, 0, 0]])})
    with pytest.raises(ValueError, match="rows of seq_idx differ"):
        documents_of_batch({"input_ids": ids.expand(2, 6), "seq_idx": torch.tensor([[0, 0, 1, 1, 1, 1],
                                                                                    [0, 1, 1, 1, 1, 1]])})
    assert documents_of_batch({"input_ids": ids, "seq_idx": torch.zeros(1, 6, dtype=torch.int32)}) is None
    groups = ctx_plugin.build_cp_groups(ctx_plugin.CPConfig(backend="ring", kernel="torch"))
    out = shard_batch({**batch, "labels": batch["input_ids"]}, groups)
    assert out["documents"] == Documents((0, 3, 5, 9)) and "seq_idx" not in out
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


def test_lm_loss_refuses_per_token_entries_it_would_ignore():
    from ctx_plugin.deepspeed.data import lm_loss

    batch = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": torch.arange(6)[None],
             "labels": torch.zeros(1, 6, dtype=torch.long), "loss_mask": torch.ones(1, 6), "sample_id": torch.ones(1)}
    with pytest.raises(ValueError, match=r"its per-token \['loss_mask'\] would be ignored: fold a loss mask into the "
                                         r"labels"):
        lm_loss(None, batch)


def test_shift_labels_stop_at_document_ends_and_skip_padding():
    labels = torch.tensor([[10, 11, 12, 20, 21, 30]])
    assert shift_labels(labels, None).tolist() == [[11, 12, 20, 21, 30, -100]]
    assert shift_labels(labels, Documents((0, 3, 5, 6))).tolist() == [[11, 12, -100, 21, -100, -100]]
    padded = Documents((0, 4, 6), (3, 2))       # tokens 3 is padding of the first document
    labels = torch.tensor([[10, 11, 12, -100, 20, 21]])
    assert shift_labels(labels, padded).tolist() == [[11, 12, -100, -100, 21, -100]]


def test_pad_packed_batch():
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "labels": torch.tensor([[5, 6, 7, 8, 9]]),
             "loss_mask": torch.ones(1, 5), "position_ids": torch.tensor([[0, 1, 2, 0, 1]]), "meta": "kept"}
    out, docs = pad_packed_batch(batch, Documents((0, 3, 5)), 2, 4)
    assert docs == Documents((0, 4, 8), (3, 2))
    assert out["input_ids"].tolist() == [[5, 6, 7, 0, 8, 9, 0, 0]]
    assert out["labels"].tolist() == [[5, 6, 7, -100, 8, 9, -100, -100]]
    assert out["loss_mask"].tolist() == [[1, 1, 1, 0, 1, 1, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]] and out["meta"] == "kept"
    with pytest.raises(ValueError, match="padded already"):
        pad_packed_batch(out, docs, 2, 4)


def test_loader_shards_packed_batches_per_document():
    """One rank (zigzag at CP 1: unit 2): documents that do not fit are refused unless padding is asked for."""
    cfg = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 4]]), "labels": torch.tensor([[5, 6, 7, 8, 9, 4]]),
             "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
    with pytest.raises(ValueError, match="document 0 holds 3 tokens, not a multiple of 2"):
        shard_batch(batch, groups)
    out = shard_batch(batch, groups, pad_documents=True)
    assert out["documents"] == Documents((0, 4, 8), (3, 3))
    assert out["input_ids"].tolist() == [[5, 6, 7, 0, 8, 9, 4, 0]]
    assert out["labels"].tolist() == [[6, 7, -100, -100, 9, 4, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    fits = {**batch, "position_ids": torch.tensor([[0, 1, 0, 1, 2, 3]])}
    out = shard_batch(fits, groups)
    assert out["documents"] == Documents((0, 2, 6)) and out["labels"].tolist() == [[6, -100, 8, 9, 4, -100]]
    assert "documents" not in shard_batch({**batch, "position_ids": torch.arange(6)[None]}, groups)


def test_deepspeed_section_pad_documents():
    from ctx_plugin.deepspeed.config import parse_section

    assert parse_section({"size": 2}).pad_documents is False
    assert parse_section({"size": 2, "pad_documents": True}).pad_documents is True
    with pytest.raises(TypeError, match="pad_documents.* must be a bool"):
        parse_section({"size": 2, "pad_documents": "yes"})


def test_train_hf_pack_eos_positions_and_refusals(tmp_path):
    from ctx_plugin.train_hf import eos_positions, parse_args

    config = tmp_path / "config.json"
    config.write_text("{}")
    tokens = torch.tensor([5, 9, 3, 9, 9, 4, 4])
    assert eos_positions(tokens, 9).tolist() == [0, 1, 0, 1, 0, 0, 1]
    assert eos_positions(tokens, 7).tolist() == list(range(7))
    assert documents_from_positions(eos_positions(tokens, 9)) == Documents((0, 2, 4, 5, 7))
    with pytest.raises(ValueError, match="--pack-eos must be a token id"):
        parse_args(["--model", str(config), "--pack-eos", "-1"])
    assert parse_args(["--model", str(config), "--pack-eos", "2"]).pack_eos == 2


def test_loader_error_names_the_section_switch():
    cfg = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    batch = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
    with pytest.raises(ValueError, match=r'the packed batch\'s documents: document 0 holds 3 tokens.*"pad_documents": '
                                         r'true'):
        shard_batch(batch, ctx_plugin.build_cp_groups(cfg))
