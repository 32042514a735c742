"""Random combinations of a recompute preset, its modifiers and the run around it, against the same model without
one (float64, simulated ranks).

The preset matrices vary one thing at a time; here every case draws all at once, from a seeded generator (the same
cases every run): the preset (every region kind, N, sqrt) with ``+tile_mlp[:<tokens>]``, ``+recompute_attn``,
``+offload:<GiB>``/``+offload_attn:<GiB>`` in any order, the backend and CP size, heads and query groups, depth,
gated or plain MLP, RMSNorm or LayerNorm, packed documents, the tiled loss, and two backward passes accumulating
into the same gradients. Loss and every parameter's gradient (summed over the ranks) must be those of the model
without a preset; a combination the presets refuse must be one of the documented refusals.
"""
from __future__ import annotations

import random
import warnings

import pytest
import torch

import ctx_plugin
from ctx_plugin import recompute
from ctx_plugin.bench.simulated import run_threaded, simulated_groups
from ctx_plugin.core.documents import pad_documents
from ctx_plugin.core.rules import check_heads, padding_units, sequence_unit
from ctx_plugin.models import DecoderConfig, DecoderLM
from ctx_plugin.names import Backend

CASES = 48
REGIONS = ["full", "full:uniform:2", "full:uniform:3", "full:block:1", "full:block:2", "sqrt"]
REFUSED = ("counts {n} layers, but the stack has", "nothing is pinned; use +offload")


def draw(seed: int) -> dict:
    rng = random.Random(seed)
    base = rng.choice(["none", "attn_out", "selective", "core_attn", "mlp", *REGIONS])
    modifiers = []
    if rng.random() < 0.4:
        modifiers.append(rng.choice(["tile_mlp", "tile_mlp:1", "tile_mlp:3", "tile_mlp:7"]))
    if base in REGIONS and rng.random() < 0.4:
        modifiers.append("recompute_attn")
    if base in REGIONS and rng.random() < 0.4:
        modifiers.append(rng.choice(["offload:1", "offload_attn:1"]))
    rng.shuffle(modifiers)
    backend = rng.choice(list(Backend))
    u = 2 if backend == Backend.ULYSSES_RING else 1
    return {"preset": "+".join([base, *modifiers]), "backend": backend, "u": u,
            "size": u * rng.choice([1, 2]) if u > 1 else rng.choice([1, 2, 3, 4]),
            "heads": rng.choice([4, 8]), "kv_heads": rng.choice([1, 2, 4]), "layers": rng.choice([1, 2, 3, 4, 5]),
            "gated": rng.random() < 0.5, "norm": rng.choice(["rms", "layer"]), "documents": rng.random() < 0.4,
            "tile_loss": rng.random() < 0.3, "twice": rng.random() < 0.3, "batch": rng.choice([1, 2]),
            "seed": rng.randrange(1 << 30)}


def run(case: dict, preset: str):
    """Loss and every parameter's gradient (summed over the ranks) of one step under ``preset``."""
    config = ctx_plugin.CPConfig(backend=case["backend"], ulysses_size=case["u"], kernel="torch")
    size = case["size"]
    shape = DecoderConfig(hidden=32, ffn=48, heads=case["heads"], kv_heads=case["kv_heads"], layers=case["layers"],
                          gated=case["gated"], norm=case["norm"], vocab=50)
    rng = random.Random(case["seed"])
    docs = None
    if case["documents"]:
        unit, total = padding_units(config, size)
        docs = pad_documents([rng.randint(1, 15) for _ in range(3)], unit, total_unit=total)[0]
    seq = docs.seq_len if docs is not None else sequence_unit(config, size) * 6
    tokens = torch.randint(0, shape.vocab, (case["batch"], seq + 1), generator=torch.Generator().manual_seed(1))

    def rank_work(rank: int, world):
        groups = simulated_groups(config, rank, size, world, "cpu")
        model = DecoderLM(shape, config, groups).double()
        g = torch.Generator().manual_seed(case["seed"])       # the same weights on every rank, whatever the threads
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")         # core_attn warns by design
            recompute.apply(model.blocks, preset)
        shard = lambda t: ctx_plugin.shard_sequence(t, config=config, groups=groups, dim=1,  # noqa: E731
                                                    documents=docs)
        positions = ctx_plugin.sequence_positions(seq, config=config, groups=groups, documents=docs)
        for _ in range(2 if case["twice"] else 1):
            loss = model.loss(shard(tokens[:, :-1]), positions, shard(tokens[:, 1:]), tile=case["tile_loss"],
                              documents=docs)
            loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    results = run_threaded(size, rank_work)
    return sum(r[0] for r in results), {name: sum(r[1][name] for r in results) for name in results[0][1]}


@pytest.mark.parametrize("seed", range(CASES))
def test_random_recompute_combinations_change_nothing(seed):
    case = draw(seed)
    if case["heads"] % case["kv_heads"]:
        return
    try:
        check_heads(ctx_plugin.CPConfig(backend=case["backend"], ulysses_size=case["u"]), case["heads"],
                    case["kv_heads"], case["size"])
    except ValueError:
        return
    want = run(case, "none")
    try:
        got = run(case, case["preset"])
    except ValueError as e:
        n = next((int(part.split(":")[2]) for part in case["preset"].split("+") if part.count(":") == 2), None)
        assert any(r.format(n=n) in str(e) for r in REFUSED), (case, e)
        return
    assert abs(got[0] - want[0]) <= 1e-12 * abs(want[0]), case
    for name, w in want[1].items():
        err = ((got[1][name] - w).abs().max() / w.abs().max().clamp_min(1e-300)).item()
        assert err <= 1e-9, f"{name}: relative error {err:.2e} in {case}"
