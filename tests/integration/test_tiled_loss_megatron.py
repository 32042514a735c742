"""``+tile_loss`` on Megatron (megatron-core, CPU, gloo; tests/integration/tiled_loss_megatron_ranks.py): a GPTModel
built through ctx_plugin's spec with ``<preset>+tile_loss`` returns the per-token losses of Megatron's own untiled
output layer + vocab-parallel cross-entropy, and the same gradients, at CP 1, CP 2 and TP 2 (against Megatron's
untiled loss on the same TP ranks), own and shared embedding weights, also under sequence parallelism (TP 2:
chunks of each rank's positions, gathered over its TP ranks); its output layer runs on the predicted chunks;
settings the chunking cannot reproduce are refused; the flags map the layer part of the preset."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

import torch  # noqa: E402

from tests.distributed.harness import run_spawned  # noqa: E402
from tests.integration.megatron_ranks import BATCH, SEQ  # noqa: E402

# (tp, sequence parallel, cp, preset, shared embeddings): tiled models, each compared with Megatron's untiled model
# (same TP and sequence parallelism, CP 1)
TILED = [(1, False, 1, "none+tile_loss:7", False), (1, False, 1, "full+tile_loss:5", True),
         (1, False, 2, "none+tile_loss:7", False), (1, False, 2, "mlp+tile_loss", True),
         (1, False, 2, "full+tile_loss:1", False), (2, False, 1, "none+tile_loss:6", False),
         # selective under TP without sequence parallelism: RowParallelLinear all-reduces its saved matmul output in
         # place (its gradients were off by 30-70%: the recomputation reduced it again)
         (2, False, 1, "selective+tile_loss:6", True),
         # sequence parallelism: each TP rank's output layer gets its 16 positions, chunks gather the same positions
         # of both ranks (12 logits rows: 3 positions × batch 2 × TP 2)
         (2, True, 1, "none+tile_loss:12", False), (2, True, 1, "selective+tile_loss:12", True),
         (2, True, 1, "full+tile_loss:20", False)]
REFUSED = [({"mtp_num_layers": 1}, "multi-token prediction (--mtp-num-layers)"),
           ({"defer_embedding_wgrad_compute": True}, "--defer-embedding-wgrad-compute")]
_results: list = []


def results() -> dict:
    if not _results:     # one launch of 2 ranks: TP 1 × CP 1 (× DP 2), TP 1 × CP 2, TP 2 × CP 1 without and with SP
        runs = []
        for tp, sp, cp in ((1, False, 1), (1, False, 2), (2, False, 1), (2, True, 1)):
            cases = [("ctx_plugin", preset, share) for t, s, c, preset, share in TILED if (t, s, c) == (tp, sp, cp)]
            if cp == 1:
                cases += [("megatron", "-", share) for share in sorted({h for t, s, _, _, h in TILED
                                                                       if (t, s) == (tp, sp)})]
            runs.append({"tp": tp, "sp": sp, "cp": cp, "cases": cases,
                         "refused": [fields for fields, _ in REFUSED] if cp == 2 else []})
        _results.append(run_spawned("tests.integration.tiled_loss_megatron_ranks:run", 2, {"runs": runs},
                                    timeout_s=600))
    return _results[0]


def _rel(have, want) -> float:
    have, want = torch.tensor(have, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return ((have - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("tp,sp,cp,preset,share", TILED, ids=[f"tp{t}{'-sp' if s else ''}-cp{c}-{p}-"
                                                                f"{'shared' if h else 'own'}" for t, s, c, p, h in TILED])
def test_tiled_loss_matches_megatrons_untiled_loss(tp, sp, cp, preset, share):
    got_ranks = results()
    tag = f"tp{tp}{'-sp' if sp else ''}"
    want = got_ranks[0][f"{tag}-cp1-megatron---{'shared' if share else 'own'}"]
    key = f"{tag}-cp{cp}-ctx_plugin-{preset}-{'shared' if share else 'own'}"
    for rank in range(2):
        got = got_ranks[rank][key]
        # Megatron's cross-entropy runs in fp32 whatever the model's dtype: fp32-level agreement
        assert abs(got["loss"] - want["loss"]) <= 1e-6 * abs(want["loss"])
        assert got["shape"] == [BATCH, SEQ // cp]                     # Megatron's per-token losses [b, s]
        rows = BATCH * (tp if sp else 1)               # logits rows per position of a chunk on this rank
        size = int(preset.split(":")[1]) // rows if ":" in preset else None
        local = SEQ // cp // (tp if sp else 1)          # the positions this rank's output layer gets
        chunks = [local] if size is None else [min(max(size, 1), local - s) for s in range(0, local, max(size, 1))]
        assert got["calls"] == chunks, "the output layer runs once per chunk in forward"
    grads = got_ranks[0][key]["grads"]
    assert set(grads) == set(want["grads"])
    for name, w in want["grads"].items():
        assert _rel(grads[name], w) <= 1e-6, name
    assert want["calls"] == [SEQ // (tp if sp else 1)]          # the reference ran untiled


@pytest.mark.parametrize("tag", ["tp2", "tp2-sp"])
def test_tp2_untiled_matches_tp1(tag):
    """The TP 2 references are Megatron's model (with sequence parallelism: its norms built by
    tests.integration.megatron_ranks.sequence_parallel_norms): their loss is TP 1's."""
    r = results()[0]
    assert abs(r[f"{tag}-cp1-megatron---own"]["loss"] - r["tp1-cp1-megatron---own"]["loss"]) <= 1e-6


@pytest.mark.parametrize("fields,message", REFUSED, ids=[next(iter(f)) for f, _ in REFUSED])
def test_refused_settings(fields, message):
    for rank in range(2):
        text = results()[rank][repr(sorted(fields.items()))]
        assert "+tile_loss cannot compute this model's loss exactly" in text and message in text


def _parse(monkeypatch, *flags):
    from megatron.training.arguments import parse_args

    from ctx_plugin.megatron.args import add_arguments

    base = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "4096",
            "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--attention-dropout", "0"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *base, *flags])
    return parse_args(extra_args_provider=add_arguments)


@pytest.mark.parametrize("preset,megatron", [
    ("none+tile_loss", {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}),
    ("mlp+tile_loss:4096", {"recompute_granularity": "selective", "recompute_method": None,
                            "recompute_num_layers": None, "recompute_modules": ["mlp"]}),
    ("full+tile_loss", None), ("none+tile_loss+tile_mlp", None)])
def test_flags_map_the_layer_part(monkeypatch, preset, megatron):
    """Megatron applies the layer part of the preset where it can; ctx_plugin always applies +tile_loss."""
    from ctx_plugin.megatron.args import settings_from_args
    from ctx_plugin.recompute import to_megatron

    s = settings_from_args(_parse(monkeypatch, "--cp-recompute", preset))
    assert s.recompute.tile_loss and str(s.recompute) == preset
    if megatron is not None:
        assert s.megatron_recompute == to_megatron(s.recompute.for_layers, 4)
        assert {k: s.megatron_recompute[k] for k in megatron} == megatron
    else:
        assert s.megatron_recompute is None


def test_spec_alone_refuses_tile_loss(monkeypatch):
    """``--spec`` without the entry point never patches the model's loss: refused, not ignored."""
    from megatron.training import global_vars

    from ctx_plugin.megatron.spec import layer_spec

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", _parse(
        monkeypatch, "--transformer-impl", "local", "--context-parallel-size", "2", "--cp-backend", "zigzag",
        "--no-create-attention-mask-in-dataloader", "--cp-recompute", "none+tile_loss"))
    with pytest.raises(ValueError, match=r"--cp-recompute none\+tile_loss is applied by ctx_plugin's entry point"):
        layer_spec(None)
