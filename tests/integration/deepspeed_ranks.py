"""DeepSpeed (CPU, gloo) training of a tiny Qwen2 with a "context_parallel" section on spawned ranks, and its
reference: the same two steps in plain PyTorch (one process, no DeepSpeed, no ctx_plugin)."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings

import torch

SEQ, VOCAB, SAMPLES = 32, 128, 8
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OP_TIMEOUT_S = 600
QWEN_LAYERS = 3                     # sqrt and full:uniform:2 make a two-layer region and a one-layer region
OPTIM = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.0}
CLIP = 1.0                          # DeepSpeed's default "gradient_clipping"


def _dataset():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    return [{"input_ids": t, "labels": t.clone()} for t in tokens]


def qwen2():
    """A tiny Qwen2 (q/k/v biases, GQA), init std 0.1, biases and norm weights drawn too (HF starts them at 0/1)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=QWEN_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attention_dropout=0.0, use_cache=False, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(4321)
    model = Qwen2ForCausalLM(config).float().train()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def _adam(model) -> torch.optim.Adam:
    """The DeepSpeed config's optimizer (Adam, not AdamW) in plain PyTorch."""
    return torch.optim.Adam(model.parameters(), lr=OPTIM["lr"], betas=tuple(OPTIM["betas"]), eps=OPTIM["eps"],
                            weight_decay=OPTIM["weight_decay"])


def _step(model, opt, loss, losses: list, norms: list) -> None:
    """One optimizer step as DeepSpeed takes it (clipping to CLIP), recording the loss and the gradient norm."""
    opt.zero_grad()
    loss.backward()
    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
    opt.step()
    losses.append(loss.item())


@functools.cache
def plain_train(batch: int, steps: int = 2) -> dict:
    """The reference: one process, no DeepSpeed, no ctx_plugin: HF sdpa attention, torch.optim.Adam and gradient
    clipping as the DeepSpeed config has them, ``batch`` samples per step (computed once per process)."""
    model = qwen2()
    model.set_attn_implementation("sdpa")
    opt = _adam(model)
    data = torch.stack([s["input_ids"] for s in _dataset()])
    losses, norms = [], []
    for step in range(steps):
        ids = data[step * batch:(step + 1) * batch]
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        _step(model, opt, loss, losses, norms)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"losses": losses, "norms": norms, "params": params.tolist()}


PACKED = {"fit": [[8, 16, 8], [24, 8], [8, 8, 8, 8], [32]],          # multiples of 8: every layout at CP 2 and 4
          "ragged": [[5, 11, 16], [9, 1, 22], [3, 3, 26], [32]]}      # padded (pad_documents) or cut (ring)
"""Per packed sample (SEQ tokens), its documents' lengths."""


def _packed_dataset(mix: str):
    """Packed samples, one sequence of several documents each, as Hugging Face's DataCollatorWithFlattening packs
    them: ``position_ids`` restart at 0 in every document; ``labels`` are the tokens (shifted by the loader)."""
    g = torch.Generator().manual_seed(8)
    out = []
    for lengths in PACKED[mix]:
        tokens = torch.randint(0, VOCAB, (SEQ,), generator=g)
        out.append({"input_ids": tokens, "labels": tokens.clone(),
                    "position_ids": torch.cat([torch.arange(n) for n in lengths])})
    return out


@functools.cache
def plain_packed_train(mix: str, replicas: int, steps: int = 2) -> dict:
    """The reference for packed batches: plain PyTorch (HF sdpa, torch Adam, clipping) on every document of a step's
    samples on its own, unpacked; the loss is the token mean over all their targets."""
    model = qwen2()
    model.set_attn_implementation("sdpa")
    opt = _adam(model)
    data = _packed_dataset(mix)
    losses, norms = [], []
    for step in range(steps):
        total, count = 0.0, 0
        for index in range(step * replicas, (step + 1) * replicas):   # replica r takes sample step·replicas + r
            ids, start = data[index]["input_ids"], 0
            for n in PACKED[mix][index]:
                doc = ids[start:start + n][None]
                start += n
                if n == 1:
                    continue
                logits = model(input_ids=doc).logits
                total = total + torch.nn.functional.cross_entropy(logits[0, :-1], doc[0, 1:], reduction="sum")
                count += n - 1
        loss = total / count
        _step(model, opt, loss, losses, norms)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"losses": losses, "norms": norms, "params": params.tolist()}


def check_against_plain(got: list, key: str, want: dict) -> None:
    """Every rank's losses and gradient norms within 1e-5 relative of :func:`plain_train`'s, and rank 0's parameters
    within 1e-5 of the largest."""
    for rank in range(len(got)):
        for what in ("losses", "norms"):
            for a, b in zip(got[rank][key][what], want[what], strict=True):
                if a is not None:              # ZeRO 0 keeps no gradient norm
                    assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} {what}: {got[rank][key][what]} vs plain " \
                                                        f"PyTorch {want[what]}"
    have, ref = torch.tensor(got[0][key]["params"]), torch.tensor(want["params"])
    err = ((have - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-5, f"parameters differ by {err:.2e} of the largest"


@functools.cache
def _deepspeed_op() -> None:
    """``launch/deepspeed_ops.py``, once per test process: builds (or finds) the comm op DeepSpeed compiles at its
    first start on CPU, in bounded time, and removes a lock a killed build left, instead of every rank waiting on it
    forever."""
    ops = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "deepspeed_ops.py"),
                          "--timeout", str(OP_TIMEOUT_S)], capture_output=True, text=True, timeout=OP_TIMEOUT_S + 120)
    if ops.returncode != 0:
        raise RuntimeError(f"launch/deepspeed_ops.py failed:\n{ops.stderr.strip()}")


def spawn(target: str, world: int, payload: dict) -> list:
    """``run_spawned`` of a rank function of this module, DeepSpeed's comm op ready first (:func:`_deepspeed_op`)."""
    from tests.distributed.harness import run_spawned

    _deepspeed_op()
    return run_spawned(f"tests.integration.deepspeed_ranks:{target}", world, payload, timeout_s=900)


TILED = "tests.integration.tiled_loss_deepspeed_ranks:train"


@functools.cache
def launch(world: int) -> list:
    """Each rank's ``{rank function: result}`` of the DeepSpeed training cases of test_deepspeed.py,
    test_tiled_loss_deepspeed.py (2 ranks) and test_deepspeed_presets.py at ``world`` ranks, in one launch: a
    DeepSpeed launch spends ~25 s on 2 cores before its first case (spawn, imports, the first initialize), ~2-3 s per
    case after. The presets come last: their last case is the model whose first forward fails."""
    from tests.integration import test_deepspeed, test_deepspeed_packed, test_deepspeed_presets, test_tiled_loss_deepspeed

    tiled = {TILED: test_tiled_loss_deepspeed.payload()} if world == test_tiled_loss_deepspeed.WORLD else {}
    refused = {"refused_batch": {}} if world == 4 else {}
    return spawn("several", world, {"ds_train": test_deepspeed.payload(world), **tiled, **refused,
                                    "packed_train": test_deepspeed_packed.payload(world),
                                    "accumulated_train": test_deepspeed_packed.accumulated_payload(world),
                                    "presets_train": test_deepspeed_presets.payload(world)})


def several(rank: int, world: int, payload: dict) -> dict:
    """The rank functions named by ``payload``'s keys (of this module, or ``module:function``), one after the other,
    each on its payload."""
    import importlib

    out = {}
    for target, part in payload.items():
        module, _, name = target.rpartition(":")
        fn = getattr(importlib.import_module(module), name) if module else globals()[name]
        out[target] = fn(rank, world, part)
    return out


def _start(rank: int, world: int) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))   # what torchrun would set
    warnings.filterwarnings("ignore")


def _config(micro: int, zero: int, section: dict, extra: dict) -> dict:
    """The DeepSpeed config :func:`plain_train` reproduces: Adam (not AdamW), DeepSpeed's default clipping; ZeRO-3
    partitions every parameter (the tiny model's are all below its default persistence threshold of 1e5 elements,
    which would keep them whole on every rank: nothing gathered or released)."""
    return {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {**OPTIM, "torch_adam": True, "adam_w_mode": False}},
            "zero_optimization": {"stage": zero, **({"stage3_param_persistence_threshold": 0} if zero == 3 else {})},
            "context_parallel": {"kernel": "torch", **section}, **extra}


def _params(engine, zero: int, rank: int) -> list | None:
    """Rank 0's parameters, flattened (ZeRO-3's gathered first); None on the other ranks."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=zero == 3):
        flat = torch.cat([p.detach().flatten().clone() for p in params])
    return flat.tolist() if rank == 0 else None


def _two_steps(engine, loader, zero: int, rank: int, *, packed: bool = False) -> dict:
    """Two optimizer steps: the reported losses and DeepSpeed's gradient norms, and on rank 0 the parameters after."""
    import ctx_plugin.deepspeed as cpds

    losses, norms = [], []
    for _, batch in zip(range(2), loader):
        if packed:                                  # the documents reach the model's attention
            loss, report = cpds.lm_loss(engine, batch)
        else:
            logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss, report = cpds.causal_lm_loss(logits, batch["labels"], engine)
        engine.backward(loss)
        engine.step()
        losses.append(report)
        norm = engine.get_global_grad_norm()          # None at ZeRO 0 (it clips without keeping the norm)
        norms.append(None if norm is None else float(norm))
    return {"losses": losses, "norms": norms, "params": _params(engine, zero, rank)}


def ds_train(rank: int, world: int, payload: dict) -> dict:
    """Each case (backend, ulysses_size, CP size, ZeRO stage, micro batch[, torch.compile backend for
    ``engine.compile``]): two steps of :func:`qwen2` through ``ctx_plugin.deepspeed.initialize`` at DP world/size × CP
    size, no recompute (see :func:`_two_steps`)."""
    _start(rank, world)
    from deepspeed.accelerator import get_accelerator

    import ctx_plugin.deepspeed as cpds

    accelerator, build, events = get_accelerator(), cpds.build_cp_groups, []
    accelerator.set_device = lambda index: events.append(f"device {index}")    # the CPU accelerator's is a no-op
    cpds.build_cp_groups = lambda *a, **k: events.append("groups") or build(*a, **k)
    out = {}
    try:
        for backend, u, size, zero, micro, *compiler in payload["cases"]:
            model = qwen2()
            section = {"backend": backend, "size": size, "ulysses_size": u}
            engine, _, loader, _ = cpds.initialize(model=model, model_parameters=model.parameters(),
                                                   training_data=_dataset(), config=_config(micro, zero, section, {}))
            if compiler:                     # DeepSpeed's engine.compile(): torch.compile of the module
                engine.compile(backend=compiler[0])
            key = f"{backend}-u{u}-cp{size}-z{zero}-mb{micro}" + (f"-{compiler[0]}" if compiler else "")
            out[key] = _two_steps(engine, loader, zero, rank)
            engine.destroy()
            _restore_linear()
    finally:
        del accelerator.set_device
        cpds.build_cp_groups = build
    out["first events"] = events[:2]     # the engine's device, current before the groups' first collective
    return out


def packed_train(rank: int, world: int, payload: dict) -> dict:
    """Each case (backend, ulysses_size, CP size, ZeRO stage, document mix, pad_documents): two steps of :func:`qwen2`
    on packed samples (:func:`_packed_dataset`, one per micro batch) through ``ctx_plugin.deepspeed.initialize``."""
    _start(rank, world)
    import ctx_plugin.deepspeed as cpds

    out = {}
    for backend, u, size, zero, mix, pad in payload["cases"]:
        model = qwen2()
        section = {"backend": backend, "size": size, "ulysses_size": u, "pad_documents": pad}
        engine, _, loader, _ = cpds.initialize(model=model, model_parameters=model.parameters(),
                                               training_data=_packed_dataset(mix), config=_config(1, zero, section, {}))
        out[f"{backend}-u{u}-cp{size}-z{zero}-{mix}-pad{int(pad)}"] = _two_steps(engine, loader, zero, rank,
                                                                                 packed=True)
        engine.destroy()
        _restore_linear()
    return out


def accumulated_train(rank: int, world: int, payload: dict) -> dict:
    """Each case (backend, ulysses_size, CP size, ZeRO stage, document mix, pad_documents, steps, managed): ``steps``
    optimizer steps of :func:`qwen2` on packed samples with gradient accumulation 2 (micro batch 1) through
    ``ctx_plugin.train_hf.train_step`` (each micro batch's loss normalised by the whole step's tokens; ``managed``
    False: DeepSpeed's ``"managed_gradient_accumulation": false``): the step's reported loss, DeepSpeed's gradient
    norm, and rank 0's parameters after."""
    _start(rank, world)
    import ctx_plugin.deepspeed as cpds
    from ctx_plugin.train_hf import train_step

    out = {}
    for backend, u, size, zero, mix, pad, steps, managed in payload["cases"]:
        model = qwen2()
        section = {"backend": backend, "size": size, "ulysses_size": u, "pad_documents": pad}
        extra = {"gradient_accumulation_steps": 2, "managed_gradient_accumulation": managed}
        engine, _, loader, _ = cpds.initialize(model=model, model_parameters=model.parameters(),
                                               training_data=_packed_dataset(mix), config=_config(1, zero, section, extra))
        batches, losses, norms = iter(loader), [], []
        for _ in range(steps):
            losses.append(train_step(engine, [next(batches), next(batches)]))
            norms.append(float(engine.get_global_grad_norm()))
        out[f"{backend}-u{u}-cp{size}-z{zero}-{mix}-pad{int(pad)}-m{int(managed)}"] = {
            "losses": losses, "norms": norms, "params": _params(engine, zero, rank)}
        engine.destroy()
        _restore_linear()
    return out


def _restore_linear() -> None:
    """What a fresh process has: ZeRO-3's memory_efficient_linear replaces torch.nn.functional.linear for the whole
    process and DeepSpeed never puts it back (its own compile path does this)."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as init

    if hasattr(init, "linear_bk"):
        torch.nn.functional.linear = init.linear_bk


class Wrapped(torch.nn.Module):
    """A model that is not a Hugging Face model (no ``set_attn_implementation``) around the Qwen2."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, position_ids):
        return self.inner(input_ids=input_ids, position_ids=position_ids)


def presets_train(rank: int, world: int, payload: dict) -> dict:
    """Each case (model, backend, zero, preset, extra config): two steps through ``ctx_plugin.deepspeed.initialize``
    at CP 2 (and DP world/2); the losses and grad norms of every step, and on rank 0 the parameters afterwards.
    Models: ``hf`` (:func:`qwen2`), ``wrapped`` (:class:`Wrapped`, whose ``attention=`` callback switches the inner
    model to ctx_plugin's attention on the engine's groups), ``unwired`` (a callback that does nothing: the error
    of the first forward is returned)."""
    _start(rank, world)
    import ctx_plugin.deepspeed as cpds
    from ctx_plugin import hf

    micro, out = payload["micro"], {}
    for kind, backend, zero, preset, extra in payload["cases"]:
        model, attention = qwen2(), None
        if kind != "hf":
            model = Wrapped(model)
            attention = (lambda groups: None) if kind == "unwired" else \
                (lambda groups, inner=model.inner: hf.enable(inner, groups.config, groups))
        config = _config(micro, zero, {"backend": backend, "size": 2, "recompute": preset}, extra)
        engine, _, loader, _ = cpds.initialize(model=model, model_parameters=model.parameters(),
                                               training_data=_dataset(), config=config, attention=attention)
        key = f"{kind}-{backend}-z{zero}-{preset}"
        try:
            out[key] = _two_steps(engine, loader, zero, rank)
        except RuntimeError as e:
            if kind != "unwired":
                raise
            out[key] = {"error": str(e)}
        engine.destroy()
        _restore_linear()
    return out


def loader_shards(rank: int, world: int, payload) -> dict:
    """ShardedLoader at dp=2 × cp=2: which samples each rank sees, and its shards gathered back."""
    import torch.distributed as dist

    import ctx_plugin
    from ctx_plugin.deepspeed import ShardedLoader

    cp, _ = dist.new_subgroups(group_size=2)
    cfg = ctx_plugin.CPConfig(backend="zigzag")
    groups = ctx_plugin.build_cp_groups(cfg, group=cp)
    data = [{"input_ids": torch.arange(i * 100, i * 100 + 8), "labels": torch.arange(i * 100, i * 100 + 8),
             "loss_mask": torch.arange(i * 100, i * 100 + 8) % 3} for i in range(4)]
    loader = ShardedLoader(data, 2, groups, replicas=world // 2, replica=rank // 2)
    batch = next(iter(loader))
    full = {k: ctx_plugin.gather_sequence(v, config=cfg, groups=groups, dim=1).tolist() for k, v in batch.items()}
    return {"full": full, "local_len": batch["input_ids"].shape[1], "batches": len(loader)}


def refused_batch(rank: int, world: int, payload) -> dict:
    """DP 2 × CP 2: replica 1's first sample is padded (refused by shard_batch), replica 0's are not. Every rank's
    error from iterating the loader, how long it took, and an all-reduce afterwards (no rank left waiting)."""
    import time

    import ctx_plugin.deepspeed as cpds

    _start(rank, world)
    model = qwen2()
    data = [{"input_ids": torch.arange(SEQ) + i, "labels": torch.arange(SEQ) + i,
             "attention_mask": torch.tensor([1] * (SEQ - 2) + [0, 0] if i == 1 else [1] * SEQ)} for i in range(4)]
    engine, _, loader, _ = cpds.initialize(model=model, model_parameters=model.parameters(), training_data=data,
                                           config=_config(1, 3, {"backend": "zigzag", "size": 2}, {}))
    start, error = time.perf_counter(), None
    try:
        for batch in loader:
            engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    except ValueError as e:
        error = str(e)
    seconds = time.perf_counter() - start
    probe = torch.ones(1)
    torch.distributed.all_reduce(probe)
    engine.destroy()
    _restore_linear()
    return {"error": error, "seconds": seconds, "probe": probe.item()}


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


def io_loaders(rank: int, world: int, payload: dict) -> dict:
    """At CP 2 (one data-parallel replica), ``ctx_plugin.deepspeed.initialize(args=...)`` with the config in
    ``args.deepspeed_config`` (``payload["config"]``, which sets ``"dataloader_drop_last"``) on 5 samples, micro batch
    2: the training loader's and ``engine.deepspeed_io``'s batches (eval and training routes) gathered back, and
    what ``deepspeed_io`` refuses."""
    import argparse

    import ctx_plugin
    import ctx_plugin.deepspeed as cpds

    _start(rank, world)
    data = [{"input_ids": torch.arange(i * 100, i * 100 + 8), "labels": torch.arange(i * 100, i * 100 + 8)}
            for i in range(5)]
    model = qwen2()
    args = argparse.Namespace(deepspeed_config=payload["config"], local_rank=rank)
    engine, _, loader, _ = cpds.initialize(args=args, model=model, model_parameters=model.parameters(),
                                           training_data=data)
    groups = engine.ctx_plugin_groups

    def gathered(batches) -> list:
        return [ctx_plugin.gather_sequence(b["input_ids"], config=groups.config, groups=groups, dim=1).tolist()
                for b in batches]

    out = {"args_config": args.deepspeed_config, "train": gathered(loader),
           "eval": gathered(engine.deepspeed_io(data, route="eval", pin_memory=False)),
           "io_train": gathered(engine.deepspeed_io(data, batch_size=1, pin_memory=False)),
           "local_len": next(iter(loader))["input_ids"].shape[1]}
    for key, kwargs in {"sampler": {"data_sampler": torch.utils.data.SequentialSampler(data)},
                        "iterable": {"dataset": _Stream()}}.items():
        try:
            engine.deepspeed_io(**{"dataset": data, **kwargs})
        except ValueError as e:
            out[key] = str(e)
    engine.destroy()
    return out
