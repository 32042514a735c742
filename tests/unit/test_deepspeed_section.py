"""The "context_parallel" DeepSpeed section: validation messages, batch sharding, early errors of initialize."""
from __future__ import annotations

import pytest
import torch

import ctx_plugin
from ctx_plugin.deepspeed import parse_section, shard_batch


def test_valid_section():
    s = parse_section({"backend": "ulysses_ring", "size": 4, "ulysses_size": 2, "kernel": "torch",
                       "recompute": "selective"})
    assert (s.cp_config.backend, s.size, s.cp_config.ulysses_size, str(s.recompute)) == \
        ("ulysses_ring", 4, 2, "selective")
    assert parse_section({"size": 2}).cp_config.backend == "zigzag"


@pytest.mark.parametrize("section,error,message", [
    ({"size": 2, "backnd": "ring"}, ValueError, r"unknown key\(s\) \['backnd'\] in \"context_parallel\""),
    ({"size": "2"}, TypeError, r"\"context_parallel.size\" must be a int"),
    ({"size": True}, TypeError, r"\"context_parallel.size\" must be a int"),
    ({}, ValueError, r"\"context_parallel.size\" \(ranks sharing each sequence\) must be a positive int"),
    ({"size": 0}, ValueError, "must be a positive int"),
    ({"size": 2, "backend": "rng"}, ValueError, r"\"context_parallel\": unknown backend 'rng'"),
    ({"size": 2, "recompute": "fulll"}, ValueError, r"\"context_parallel\": unknown recompute preset"),
    ({"size": 4, "recompute": "budget:60"}, ValueError, r"\"context_parallel.recompute\": \"budget:60\" cannot be "
     r"resolved .* choose the preset with `ctx-plugin memory --model <config.json> --seq-len <tokens> --cp 4 "
     r"--budget 60`"),
    ({"size": 6, "backend": "ulysses_ring", "ulysses_size": 4}, ValueError, r"must divide \"context_parallel.size\""),
    ({"size": 2, "ulysses_size": 2}, ValueError, "applies to backend='ulysses_ring' only"),
    ([2], TypeError, "must be a JSON object"),
])
def test_malformed_sections(section, error, message):
    with pytest.raises(error, match=message):
        parse_section(section)


def test_shard_batch_shifts_labels_before_sharding():
    groups = ctx_plugin.build_cp_groups(ctx_plugin.CPConfig())
    ids = torch.arange(8).view(1, 8)
    out = shard_batch({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(1, 8),
                       "loss_mask": torch.arange(8.0).view(1, 8), "weight": torch.ones(1)}, groups)
    assert out["labels"].tolist() == [[1, 2, 3, 4, 5, 6, 7, -100]]
    assert out["loss_mask"].tolist() == [list(map(float, range(8)))] and out["weight"].tolist() == [1.0]
    assert out["position_ids"].tolist() == [list(range(8))] and "attention_mask" not in out
    with pytest.raises(ValueError, match="padded batches are not supported"):
        shard_batch({"input_ids": ids, "attention_mask": torch.tensor([[1] * 6 + [0] * 2])}, groups)


def test_initialize_rejects_conflicts_before_starting_anything():
    pytest.importorskip("deepspeed")
    from ctx_plugin.deepspeed import initialize

    model = torch.nn.Linear(2, 2)
    base = {"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}}
    with pytest.raises(ValueError, match="disagrees with \"context_parallel.size\""):
        initialize(model=model, config={**base, "sequence_parallel_size": 4})
    with pytest.raises(ValueError, match="do not pass mpu="):
        initialize(model=model, config=base, mpu=object())
    with pytest.raises(TypeError, match="config= as a dict or a JSON path"):
        initialize(model=model, config=3)


def test_a_key_given_twice_in_the_config_file_is_refused(tmp_path):
    from ctx_plugin.deepspeed.config import _load_config

    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2, "recompute": "full", '
                    '"recompute": "none"}, "steps_per_print": 1, "steps_per_print": 2}')
    with pytest.raises(ValueError, match=r"gives key\(s\) \['recompute'\] more than once in one object"):
        _load_config(str(path), None)
    path.write_text('{"steps_per_print": 1, "context_parallel": {"size": 2}, "zero_optimization": {"size": 2}}')
    assert _load_config(path, None) == {"steps_per_print": 1, "context_parallel": {"size": 2},
                                        "zero_optimization": {"size": 2}}          # the same key in two objects


def test_a_config_in_args_reaches_deepspeed_once(tmp_path, monkeypatch):
    """``--deepspeed_config``: ctx_plugin reads it and hands DeepSpeed the config and a copy of args without it
    (deepspeed.initialize asserts when it gets a config in both); the caller's args stay as they were."""
    import argparse
    import json

    deepspeed = pytest.importorskip("deepspeed")
    from ctx_plugin.deepspeed import initialize

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    seen = []
    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: seen.append(kw) or "engine")
    model = torch.nn.Linear(2, 2)
    for key in ("deepspeed_config", "deepscale_config"):
        args = argparse.Namespace(**{key: str(path)}, local_rank=0)
        assert initialize(args=args, model=model) == "engine"
        assert seen[-1]["config"] == {"train_micro_batch_size_per_gpu": 1}
        assert getattr(seen[-1]["args"], key) is None and seen[-1]["args"].local_rank == 0
        assert getattr(args, key) == str(path)
    with pytest.raises(ValueError, match=r"a config in both config= and args .*: give one of them"):
        initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=model, config={})
    with pytest.raises(ValueError, match="args has both deepspeed_config and deepscale_config"):
        initialize(args=argparse.Namespace(deepspeed_config=str(path), deepscale_config=str(path)), model=model)


@pytest.mark.parametrize("path,why", [
    (("data_efficiency", "data_sampling", "curriculum_learning"), "DeepSpeed's curriculum sampler"),
    (("data_efficiency", "data_routing", "random_ltd"), "random layerwise token dropping"),
], ids=["curriculum", "random_ltd"])
def test_data_efficiency_that_changes_a_ranks_tokens_is_refused_with_the_section(path, why):
    """Curriculum sampling gives the ranks sharing a sequence different samples; random-LTD drops different tokens of
    each rank's shard."""
    pytest.importorskip("deepspeed")
    from ctx_plugin.deepspeed import initialize

    model = torch.nn.Linear(2, 2)
    base = {"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}}
    feature = {"enabled": True}
    config = {path[0]: {path[1]: {path[2]: feature}}}
    with pytest.raises(ValueError, match=rf'"{".".join(path)}" cannot be combined with "context_parallel": {why} '
                                         r'.*set its "enabled" to false'):
        initialize(model=model, config={**base, **config})
    feature["enabled"] = False
    with pytest.raises(ValueError, match="do not pass mpu="):         # disabled: initialize goes on to the next check
        initialize(model=model, config={**base, **config}, mpu=object())


@pytest.mark.parametrize("passes,why", [(None, "it rewrites the compiled graphs"),
                                        (["z3", "autosp"], "its autosp pass would split the sequence"),
                                        (["autosp", "autotp"], "its autosp and autotp passes would split")])
def test_deepcompile_is_refused_with_the_section(passes, why):
    pytest.importorskip("deepspeed")
    from ctx_plugin.deepspeed import initialize

    base = {"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}}
    compile_config = {"deepcompile": True, **({"passes": passes} if passes else {})}
    with pytest.raises(ValueError, match=rf'"compile.deepcompile" cannot be combined with "context_parallel": {why}'
                                         r'.*set "deepcompile" to false'):
        initialize(model=torch.nn.Linear(2, 2), config={**base, "compile": compile_config})
    compile_config["deepcompile"] = False
    with pytest.raises(ValueError, match="do not pass mpu="):         # off: initialize goes on to the next check
        initialize(model=torch.nn.Linear(2, 2), config={**base, "compile": compile_config}, mpu=object())


def test_deepspeed_tensor_and_pipeline_parallelism_are_refused_with_the_section():
    pytest.importorskip("deepspeed")
    from deepspeed.pipe import PipelineModule

    from ctx_plugin.deepspeed import initialize

    base = {"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}}
    with pytest.raises(ValueError, match=r'"tensor_parallel.autotp_size" 2 cannot be combined with "context_parallel"'
                                         r": .* data × context parallelism only"):
        initialize(model=torch.nn.Linear(2, 2), config={**base, "tensor_parallel": {"autotp_size": 2}})
    with pytest.raises(ValueError, match="do not pass mpu="):        # autotp_size 1 (or 0: off) goes on
        initialize(model=torch.nn.Linear(2, 2), config={**base, "tensor_parallel": {"autotp_size": 1}}, mpu=object())
    pipe = PipelineModule.__new__(PipelineModule)       # isinstance is what is checked; no process groups built
    with pytest.raises(ValueError, match=r'a DeepSpeed PipelineModule cannot be combined with "context_parallel"'):
        initialize(model=pipe, config=base)


@pytest.mark.parametrize("required", [None, False, True])
def test_dist_init_required_reaches_deepspeed(monkeypatch, required):
    """initialize's dist_init_required goes to deepspeed.init_distributed as DeepSpeed's own initialize passes it
    (False with torch.distributed not started is DeepSpeed's error, not a silent start)."""
    deepspeed = pytest.importorskip("deepspeed")
    from ctx_plugin.deepspeed import initialize

    class Reached(Exception):
        pass

    def init_distributed(**kwargs):
        raise Reached(kwargs)

    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(Reached) as seen:
        initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 1}},
                   dist_init_required=required, attention=lambda groups: None)
    assert seen.value.args[0] == {"dist_init_required": required}


def test_sharded_loader_drops_the_last_incomplete_batch_when_asked():
    from ctx_plugin.deepspeed import ShardedLoader

    groups = ctx_plugin.build_cp_groups(ctx_plugin.CPConfig())
    data = [{"input_ids": torch.arange(8) + i} for i in range(5)]
    kept = ShardedLoader(data, 2, groups, replicas=1, replica=0)
    dropped = ShardedLoader(data, 2, groups, replicas=1, replica=0, drop_last=True)
    assert (len(kept), len(list(kept)), len(dropped), len(list(dropped))) == (3, 3, 2, 2)


def test_deepspeed_activation_checkpointing_is_refused_for_hugging_face_models():
    """DeepSpeed applies "activation_checkpointing" only inside deepspeed.checkpointing.checkpoint, which Hugging Face
    models never call: a non-default setting there would do nothing, so it is refused; defaults pass, and so does
    a custom model (attention=fn) that may call DeepSpeed's checkpoint itself."""
    pytest.importorskip("deepspeed")
    from ctx_plugin.deepspeed import initialize

    class Hf(torch.nn.Linear):
        def set_attn_implementation(self, name):
            pass

    base = {"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}}
    for setting in ({"cpu_checkpointing": True}, {"partition_activations": True}, {"number_checkpoints": 4}):
        with pytest.raises(ValueError, match=rf'"activation_checkpointing" \[{next(iter(setting))!r}\] has no effect '
                                             r'on a Hugging Face model: .*"full\+offload:<GiB>"'):
            initialize(model=Hf(2, 2), config={**base, "activation_checkpointing": setting})
    with pytest.raises(TypeError, match='"activation_checkpointing" must be a JSON object'):
        initialize(model=Hf(2, 2), config={**base, "activation_checkpointing": True})
    defaults = {"partition_activations": False, "cpu_checkpointing": False, "number_checkpoints": None}
    for model, attention in ((Hf(2, 2), None), (torch.nn.Linear(2, 2), lambda groups: None),
                             (Hf(2, 2), lambda groups: None)):
        checkpointing = defaults if attention is None else {"cpu_checkpointing": True}
        full = {**base, "context_parallel": {"size": 2, "recompute": "full"}, "activation_checkpointing": checkpointing}
        with pytest.raises(ValueError, match="cannot find the model's decoder layers"):   # passed: the next check
            initialize(model=model, config=full, attention=attention)


def test_tp_model_init_is_refused_with_the_section(monkeypatch):
    """deepspeed.tp_model_init records automatic tensor parallelism that initialize would merge into the config."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.tensor_parallel import init_utils

    from ctx_plugin.deepspeed import initialize

    base = {"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}}
    monkeypatch.setattr(init_utils, "_TP_MODEL_INIT_ARGS", {"tp_size": 2, "dtype": torch.bfloat16, "tp_group": None})
    with pytest.raises(ValueError, match=r"deepspeed.tp_model_init\(tp_size=2\) cannot be combined with "
                                         r'"context_parallel"'):
        initialize(model=torch.nn.Linear(2, 2), config=base)
    monkeypatch.setattr(init_utils, "_TP_MODEL_INIT_ARGS", None)
    with pytest.raises(ValueError, match="do not pass mpu="):
        initialize(model=torch.nn.Linear(2, 2), config=base, mpu=object())


def test_data_parallel_size_must_be_the_sections_replicas():
    from ctx_plugin.deepspeed.config import check_data_parallel_size

    config = {"data_parallel_size": 2, "train_micro_batch_size_per_gpu": 1}
    check_data_parallel_size(config, 2)
    assert config == {"train_micro_batch_size_per_gpu": 1}             # agreed: dropped (DeepSpeed would ignore it)
    with pytest.raises(ValueError, match=r'"data_parallel_size" \(4\) disagrees with the 2 data-parallel replica'):
        check_data_parallel_size({"data_parallel_size": 4}, 2)


def test_set_train_batch_size_takes_the_sections_units():
    """engine.set_train_batch_size(n): n as the config's train_batch_size (context-parallel ranks not counted)."""
    from ctx_plugin.deepspeed import _SetTrainBatchSize

    seen = []
    setter = _SetTrainBatchSize(seen.append, 4)
    setter(6)
    assert seen == [24]
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="set_train_batch_size takes a positive int"):
            setter(bad)


def test_lm_loss_refuses_a_router_loss_it_would_drop():
    """A mixture-of-experts model with output_router_logits: its aux_loss would be dropped (refused before the
    forward)."""
    transformers = pytest.importorskip("transformers")
    from ctx_plugin.deepspeed import lm_loss

    config = transformers.MixtralConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                        output_router_logits=True)
    model = transformers.MixtralForCausalLM(config)
    forwards = []
    engine = type("Engine", (), {"module": model, "__call__": lambda self, **kw: forwards.append(kw)})()
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "position_ids": torch.arange(4)[None],
             "labels": torch.zeros(1, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"output_router_logits=True: its router load-balancing loss \(aux_loss\) "
                                         r"would be dropped"):
        lm_loss(engine, batch)
    assert forwards == []


def test_config_strings_are_read_as_deepspeed_reads_them(tmp_path):
    """A file with comments and trailing commas (hjson) and base64-encoded JSON, as deepspeed.initialize takes them;
    anything else is a ValueError naming the forms."""
    pytest.importorskip("deepspeed")
    import base64
    import json

    from ctx_plugin.deepspeed.config import _load_config

    path = tmp_path / "ds.json"
    path.write_text('{\n  // the section\n  "context_parallel": {"size": 2,},\n  "steps_per_print": 3,\n}\n')
    assert _load_config(str(path), None) == {"context_parallel": {"size": 2}, "steps_per_print": 3}
    encoded = base64.urlsafe_b64encode(json.dumps({"context_parallel": {"size": 4}}).encode()).decode()
    assert _load_config(encoded, None) == {"context_parallel": {"size": 4}}
    twice = base64.urlsafe_b64encode(b'{"a": 1, "a": 2}').decode()
    with pytest.raises(ValueError, match=r"gives key\(s\) \['a'\] more than once"):
        _load_config(twice, None)
    for missing in (str(tmp_path / "missing.json"), tmp_path / "missing.json", "zero3"):
        with pytest.raises(ValueError, match="is neither a file nor base64-encoded JSON"):
            _load_config(missing, None)


def test_config_and_config_params_together_are_refused():
    pytest.importorskip("deepspeed")
    from ctx_plugin.deepspeed import initialize

    with pytest.raises(ValueError, match="config= and config_params= both given"):
        initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1},
                   config_params={"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}})


def test_summed_gradients_are_refused_with_the_section():
    """Summed over every data × context rank, ctx_plugin's token-mean losses would give size × the gradient."""
    pytest.importorskip("deepspeed")
    from ctx_plugin.deepspeed import initialize

    base = {"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}}
    for op in ("sum", "SUM"):
        with pytest.raises(ValueError, match=r'"gradient_allreduce_op": "sum" cannot be combined with'):
            initialize(model=torch.nn.Linear(2, 2), config={**base, "gradient_allreduce_op": op})
    with pytest.raises(ValueError, match="do not pass mpu="):       # "mean" (DeepSpeed's default) goes on
        initialize(model=torch.nn.Linear(2, 2), config={**base, "gradient_allreduce_op": "mean"}, mpu=object())


@pytest.mark.parametrize("size", ["2", 2.0])
def test_autotp_size_is_read_as_deepspeed_reads_it(size):
    pytest.importorskip("deepspeed")
    from ctx_plugin.deepspeed import initialize

    base = {"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}}
    with pytest.raises(ValueError, match=r'"tensor_parallel.autotp_size" 2 cannot be combined'):
        initialize(model=torch.nn.Linear(2, 2), config={**base, "tensor_parallel": {"autotp_size": size}})


@pytest.mark.parametrize("stage", ["3", 3.0])
def test_zero_stage_is_read_as_deepspeed_reads_it(stage):
    """Stage "3" is ZeRO-3 to DeepSpeed: its memory_efficient_linear is turned off under selective there too."""
    pytest.importorskip("deepspeed")
    from ctx_plugin.deepspeed.config import _zero_config
    from ctx_plugin.recompute import RecomputeConfig

    config = {"zero_optimization": {"stage": stage}}
    assert _zero_config(config, RecomputeConfig.parse("selective"))["zero_optimization"] == \
        {"stage": stage, "memory_efficient_linear": False}


@pytest.mark.parametrize("key,value", [("data_parallel_size", True), ("data_parallel_size", 2.0),
                                       ("sequence_parallel_size", True), ("sequence_parallel_size", 2.0)])
def test_parallel_sizes_must_be_ints(key, value):
    pytest.importorskip("deepspeed")
    from ctx_plugin.deepspeed.config import check_data_parallel_size

    if key == "data_parallel_size":
        with pytest.raises(ValueError, match=r'"data_parallel_size" \((True|2.0)\) disagrees'):
            check_data_parallel_size({key: value}, 1 if value is True else 2)
        return
    from ctx_plugin.deepspeed import initialize

    with pytest.raises(ValueError, match=r'"sequence_parallel_size" \((True|2.0)\) disagrees'):
        initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1, key: value,
                                                        "context_parallel": {"size": 2 if value == 2.0 else 1}})
