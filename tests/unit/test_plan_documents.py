"""Packed documents in the FLOPs model and the planner: exact pair counts against the ring's plans, padding to the
layout's document unit, step time falling with shorter documents, memory unchanged, the command's errors."""
from __future__ import annotations

import itertools

import pytest

from ctx_plugin.cli import main
from ctx_plugin.core.documents import Documents
from ctx_plugin.core.layouts import Contiguous, Striped, Zigzag, rank_work
from ctx_plugin.core.mask import Mask
from ctx_plugin.memory import ModelSpec, ParallelSpec, estimate
from ctx_plugin.memory.flops import contiguous_rank_pairs, document_pairs, pack
from ctx_plugin.plan import Cluster, predict


def test_pairs_by_hand():
    assert [document_pairs(n) for n in (1, 2, 3, 10)] == [1, 3, 6, 55]          # n(n+1)/2
    assert document_pairs(10, causal=False) == 100
    assert document_pairs(10, window=2) == 10 * 3 - 3 and document_pairs(3, window=5) == 6
    # 16 tokens: documents 5, 3 (then 5 cut to 5, 3 cut to 3: 5+3+5+3): 2·(15 + 6) = 42
    assert pack(16, [5, 3]) == pack(16, [5, 3])
    assert pack(16, [5, 3]).pairs == 42 and pack(16, [5, 3]).documents == 4
    assert pack(16, [5, 3]).pairs == 42
    # a mean of 6 over 16 tokens: 6, 6, 4 → 21 + 21 + 10
    assert pack(16, 6).pairs == 52 and pack(16, 6).real_tokens == 16
    assert pack(16).pairs == 136 == pack(16, 100).pairs                          # one document
    # unit 4: 5 → 8 (3 padding), 3 → 4 (1): 8 + 4 + 4 (the 5 cut to the 4 left): 15 + 6 + 10
    p = pack(16, [5, 3], unit=4)
    assert (p.pairs, p.real_tokens, p.padding, p.documents) == (31, 12, 4, 3)


MIXES = [[16], [4] * 4, [2, 6, 8], [1, 1, 14], [3, 5, 8]]


@pytest.mark.parametrize("lengths", MIXES)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_pairs_equal_the_ring_plans(lengths, size):
    docs = Documents(tuple(itertools.accumulate([0, *lengths])))
    mask = Mask(True, documents=docs)
    total = pack(16, lengths).pairs
    assert total == sum(n * (n + 1) // 2 for n in lengths)
    work = rank_work(Contiguous(), size, 16 // size, mask)
    assert sum(work) == total and contiguous_rank_pairs(16, size, lengths) == work
    for layout in (Zigzag(), Striped()):
        if all(n % layout.document_unit(size) == 0 for n in lengths):
            assert sum(rank_work(layout, size, 16 // size, mask)) == total


LLAMA = ModelSpec.preset("llama3-8b")


def test_step_time_falls_with_shorter_documents_and_memory_stays():
    c = Cluster(nodes=1)
    par = ParallelSpec(cp=8, backend="ulysses")
    kw = dict(seq_len=131072, cluster=c)
    steps = [predict(LLAMA, par, "full", documents=d, **kw) for d in (None, 32768, 4096, 512)]
    assert all(a.step_ms > b.step_ms for a, b in zip(steps, steps[1:]))
    assert len({p.memory_bytes for p in steps}) == 1
    one, short = steps[0], steps[-1]
    assert short.model_flops < one.model_flops
    for d in (None, 4096):
        e = estimate(LLAMA, par, "core_attn", seq_len=131072, documents=d)
        assert e.peak == estimate(LLAMA, par, "core_attn", seq_len=131072).peak
    assert estimate(LLAMA, par, "core_attn", seq_len=131072, documents=4096).recompute_fraction < \
        estimate(LLAMA, par, "core_attn", seq_len=131072).recompute_fraction


def test_padding_counts_in_time_not_in_throughput():
    c = Cluster(nodes=1)
    p = predict(LLAMA, ParallelSpec(cp=8), "full", seq_len=131072, cluster=c, documents=[17])   # unit 16: 15 pad
    assert p.real_share == pytest.approx(17 / 32)
    assert p.tokens_per_s_per_gpu == pytest.approx(p.tokens_per_gpu * 17 / 32 / (p.step_ms / 1e3))


@pytest.mark.parametrize("content,message", [("", "no document length"), ("[1, 0]", "length 2 is 0"),
                                             ("4096 8.5", "length 2 is 8.5"), ("[true]", "length 1 is true"),
                                             ("{\"a\": 1}", "length 1 is"), ("[1,", "not a JSON list")])
def test_cli_bad_doc_lengths(tmp_path, capsys, content, message):
    f = tmp_path / "lengths.txt"
    f.write_text(content)
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama3-8b", "--seq-len", "32k", "--nodes", "1", "--doc-lengths", str(f)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("ctx-plugin plan: error: ") and message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("extra,message", [(["--doc-len", "0"], "--doc-len"), (["--doc-len", "1.5"], "--doc-len"),
                                           (["--doc-len", "4k", "--doc-lengths", "x"], "--doc-lengths"),
                                           (["--doc-lengths", "/nonexistent/x"], "cannot read")])
def test_cli_bad_doc_len(capsys, extra, message):
    for command in (["plan", "--model", "llama3-8b", "--seq-len", "32k", "--nodes", "1"],
                    ["memory", "--model", "llama3-8b", "--seq-len", "4k"]):
        with pytest.raises(SystemExit) as e:
            main([*command, *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1


def test_cli_documents(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("# lengths\n4096\n1024 2048\n")
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "32k", "--nodes", "1", "--doc-lengths", str(f)]) == 0
    assert "documents: 3 document lengths" in capsys.readouterr().out
    assert main(["memory", "--model", "llama3-8b", "--seq-len", "4k", "--doc-len", "1k"]) == 0
    assert "documents: documents of 1,024 tokens" in capsys.readouterr().out
