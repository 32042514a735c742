"""SLURM launch: the checks before a job runs (Megatron, DeepSpeed), the job plan and its command.sh, the sbatch
line parser and ``ctx-plugin launch``, and the job scripts themselves (syntax, shellcheck, dry runs outside SLURM).

Nothing here submits anything: ``ctx-plugin launch`` runs only with ``--dry-run`` or on error paths, and its
``subprocess`` is replaced by one that fails the test if called.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ctx_plugin import cli
from ctx_plugin.megatron.options import DATA_OPTIONS, MODEL_OPTIONS
from ctx_plugin.slurm import job as slurm_job
from ctx_plugin.slurm import submit
from ctx_plugin.slurm.checks import check_deepspeed, check_megatron

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
FAKE_MEGATRON = REPO / "tests" / "integration" / "fake_megatron_lm"
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable

# Model arguments that pass every check with 2 ranks (CP 2, zigzag: the sequence must be a multiple of 4).
GOOD = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--ffn-hidden-size 128 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --vocab-size 128 "
        "--attention-dropout 0 --context-parallel-size 2").split()

TINY_LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64}
GOOD_DS = {"train_micro_batch_size_per_gpu": 2, "context_parallel": {"backend": "zigzag", "size": 2}}


def good(**replace: str | None) -> list[str]:
    """GOOD with some flags' values replaced (None drops the flag and its value)."""
    out, i = [], 0
    while i < len(GOOD):
        flag = GOOD[i]
        has_value = i + 1 < len(GOOD) and not GOOD[i + 1].startswith("--")
        key = flag[2:].replace("-", "_")
        if key in replace:
            if replace[key] is not None:
                out += [flag, replace[key]]
        else:
            out += GOOD[i:i + 1 + has_value]
        i += 1 + has_value
    return out


def megatron(argv, world=2, device="cpu", megatron_lm=FAKE_MEGATRON):
    return check_megatron(list(argv), world=world, device=device, megatron_lm=str(megatron_lm))


needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="needs transformers (checks train_hf's model): pip install 'ctx-plugin[hf]'")


@pytest.fixture
def model_json(tmp_path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


@pytest.fixture
def ds_config(tmp_path):
    def write(config, name="ds.json") -> Path:
        path = tmp_path / name
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        return path
    return write


def deepspeed(program, ds, world=2, device="cpu"):
    return check_deepspeed(list(program), world=world, device=device, ds_config=str(ds))


# --- check_megatron ------------------------------------------------------------------------------------------

def test_megatron_good_layout():
    summary = megatron(GOOD)
    assert "TP 1 × PP 1 × CP 2" in summary and "DP 1" in summary and "zigzag" in summary
    assert "DP 2" in megatron(GOOD, world=4)


def test_megatron_world_not_a_multiple_of_tp_pp_cp():
    with pytest.raises(ValueError, match=r"3 ranks .* TP × PP × CP = 1 × 1 × 2 = 2"):
        megatron(GOOD, world=3)
    with pytest.raises(ValueError, match=r"4 ranks .* = 1 × 1 × 8 = 8"):
        megatron(good(context_parallel_size="8"), world=4)


def test_megatron_missing_pretrain_gpt(tmp_path):
    with pytest.raises(ValueError, match=r"no pretrain_gpt\.py there"):
        megatron(GOOD, megatron_lm=tmp_path)


def test_megatron_cuda_only_pretrain_rejected_on_cpu(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("from megatron.training import get_args, pretrain\n")
    with pytest.raises(ValueError, match=r"pretrain\(\), which needs CUDA"):
        megatron(GOOD, device="cpu", megatron_lm=tmp_path)
    assert "CP 2" in megatron(GOOD, device="cuda", megatron_lm=tmp_path)


REAL_MEGATRON = REPO / "tests" / "fixtures" / "megatron_lm_imports"   # Megatron-LM's import layout


def test_megatron_real_pretrain_gpt_rejected_on_cpu():
    """Megatron-LM's script imports pretrain in a parenthesised block (core 0.17-0.20)."""
    with pytest.raises(ValueError, match=r"pretrain\(\), which needs CUDA"):
        megatron(GOOD, device="cpu", megatron_lm=REAL_MEGATRON)
    assert "CP 2" in megatron(GOOD, device="cuda", megatron_lm=REAL_MEGATRON)


@pytest.mark.parametrize("source, uses", [
    ("from megatron.training import (\n    get_args,\n    pretrain,\n    print_rank_0,\n)\n", True),
    ("from megatron.training import pretrain as train\n", True),
    ("from megatron.training.training import pretrain\n", True),
    ("from megatron.training import *\n", True),
    ("import megatron.training\nmegatron.training.pretrain(None)\n", True),
    ("from megatron.training import get_args  # pretrain\n# from megatron.training import pretrain\n", False),
    ("from mytrainer.training import pretrain\n", False),
])
def test_megatron_pretrain_import_forms(tmp_path, source, uses):
    from ctx_plugin.megatron.pretrain_gpt import uses_megatron_pretrain

    (tmp_path / "pretrain_gpt.py").write_text(source)
    assert uses_megatron_pretrain(tmp_path / "pretrain_gpt.py") is uses
    assert not uses_megatron_pretrain(FAKE_MEGATRON / "pretrain_gpt.py")      # the CPU stand-in trains itself


def test_megatron_recompute_presets_as_the_job():
    """The presets Megatron applies pass (the job used to crash on them), both ways of setting recompute do not,
    and budget:<GiB> resolves with the padded vocabulary and DP size the job uses."""
    assert megatron(GOOD + ["--cp-recompute", "mlp"]).endswith("recompute mlp")
    assert megatron(GOOD + ["--cp-recompute", "core_attn"]).endswith("recompute core_attn")
    with pytest.raises(ValueError, match="both set what to recompute"):
        megatron(GOOD + ["--cp-recompute", "mlp", "--recompute-granularity", "full"])
    with pytest.raises(ValueError, match="no recompute preset fits"):
        megatron(GOOD + ["--cp-recompute", "budget:0.000001"])
    assert megatron(GOOD + ["--cp-recompute", "budget:80"]).endswith("recompute none")
    unknown_vocab = megatron(good(vocab_size=None) + ["--cp-recompute", "budget:0.000001"])
    assert unknown_vocab.endswith("recompute budget:1e-06 (chosen when the job starts: the tokenizer gives the "
                                  "vocabulary size)")


def test_megatron_dataloader_mask_as_the_job():
    """The launcher refuses the dataloader's 4 GiB mask (64k tokens at micro batch 1) as the job would."""
    long = good(seq_length="65536", max_position_embeddings="65536", micro_batch_size="1")
    with pytest.raises(ValueError, match=r"mask of 4 GiB per micro batch .* add --no-create-attention-mask-in-"):
        megatron(long)
    assert "CP 2" in megatron(long + ["--no-create-attention-mask-in-dataloader"])


@pytest.mark.parametrize("flag", ["seq_length", "num_layers", "hidden_size", "num_attention_heads"])
def test_megatron_required_flags(flag):
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} is required"):
        megatron(good(**{flag: None}))


def test_megatron_global_batch_size():
    with pytest.raises(ValueError, match=r"--global-batch-size 6 must be a multiple of --micro-batch-size × DP = 2 × 2"):
        megatron(GOOD + ["--global-batch-size", "6"], world=4)
    assert "DP 2" in megatron(GOOD + ["--global-batch-size", "8"], world=4)


def test_megatron_heads_not_divisible_by_tp():
    with pytest.raises(ValueError, match="--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"):
        megatron(GOOD + ["--tensor-model-parallel-size", "3"], world=6)


def test_megatron_query_groups_tp_cannot_split():
    """megatron-core builds the model only when --num-query-groups divides by TP or divides it (each group then
    replicated on TP / groups ranks): the launcher refuses the rest, as the planner's rule says."""
    six = good(num_attention_heads="6", hidden_size="96", num_query_groups="3")
    with pytest.raises(ValueError, match=r"--num-query-groups 3 is neither divisible by --tensor-model-parallel-size "
                                         r"2 nor a divisor of it .*valid --tensor-model-parallel-size: \[1, 3, 6\]"):
        megatron(six + ["--tensor-model-parallel-size", "2"], world=4)
    assert "TP 3" in megatron(six + ["--tensor-model-parallel-size", "3"], world=6)
    assert "TP 4" in megatron(GOOD + ["--tensor-model-parallel-size", "4"], world=8)      # 2 groups, replicated
    no_gqa = good(group_query_attention=None, num_query_groups=None, num_attention_heads="6", hidden_size="96")
    assert "TP 3" in megatron(no_gqa + ["--tensor-model-parallel-size", "3"], world=6)    # groups = heads


def test_megatron_sequence_parallel_splits_each_cp_ranks_tokens_over_tp():
    """With --sequence-parallel Megatron scatters each CP rank's seq_length / CP tokens over the TP ranks (it
    asserts "First dimension of the tensor should be divisible by tensor parallel size")."""
    argv = good(seq_length="36", max_position_embeddings="64") + ["--tensor-model-parallel-size", "4"]
    assert "sequence 36" in megatron(argv, world=8)                              # without sequence parallelism
    with pytest.raises(ValueError, match=r"sequence parallelism splits each of the --context-parallel-size 2 ranks' "
                                         r"tokens over --tensor-model-parallel-size 4: --seq-length must be a positive "
                                         r"multiple of 8 .*got 36; pad the sequence to a multiple of 8 \(e.g. 32 or "
                                         r"40\)"):
        megatron(argv + ["--sequence-parallel"], world=8)
    assert "sequence 40" in megatron(good(seq_length="40", max_position_embeddings="64")
                                     + ["--tensor-model-parallel-size", "4", "--sequence-parallel"], world=8)


def test_megatron_weighted_data_path(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a.bin", "a.idx", "b.bin"):
        (data / name).write_bytes(b"")
    argv = GOOD + ["--data-path", "0.5", str(data / "a"), "0.5", str(data / "b")]
    with pytest.raises(ValueError, match=re.escape(str(data / "b.idx")) + ": no such file"):
        megatron(argv)
    (data / "b.idx").write_bytes(b"")
    assert "CP 2" in megatron(argv)
    (data / "a.bin").unlink()
    with pytest.raises(ValueError, match=re.escape(str(data / "a.bin"))):
        megatron(GOOD + ["--train-data-path", str(data / "a")])


def test_megatron_tokenizer_and_load(tmp_path):
    with pytest.raises(ValueError, match=r"--tokenizer-model .*tok\.model: no such file"):
        megatron(GOOD + ["--tokenizer-model", str(tmp_path / "tok.model")])
    (tmp_path / "tok.model").write_bytes(b"")
    assert "CP 2" in megatron(GOOD + ["--tokenizer-model", str(tmp_path / "tok.model")])
    with pytest.raises(ValueError, match=r"--load .*ckpt: no such checkpoint directory"):
        megatron(GOOD + ["--load", str(tmp_path / "ckpt")])
    (tmp_path / "ckpt").mkdir()
    assert "CP 2" in megatron(GOOD + ["--load", str(tmp_path / "ckpt")])


def test_megatron_stop_and_resume_flags(tmp_path):
    """Megatron saves on the warning through its own flags: the signal the job passes (SIGUSR1) and --save."""
    ckpt = str(tmp_path / "new")
    with pytest.raises(ValueError, match="listens for SIGTERM .* add --exit-signal SIGUSR1"):
        megatron(GOOD + ["--exit-signal-handler", "--save", ckpt])
    with pytest.raises(ValueError, match="listens for SIGINT"):
        megatron(GOOD + ["--exit-signal-handler", "--exit-signal", "SIGINT", "--save", ckpt])
    with pytest.raises(ValueError, match="without --save stops on the warning without saving"):
        megatron(GOOD + ["--exit-signal-handler", "--exit-signal", "SIGUSR1"])
    # the first attempt: --load is the --save directory, not there yet
    assert "CP 2" in megatron(GOOD + ["--exit-signal-handler", "--exit-signal", "SIGUSR1", "--save", ckpt, "--load",
                                      ckpt])
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        megatron(GOOD + ["--save", ckpt, "--load", str(tmp_path / "other")])
    assert "CP 2" in megatron(GOOD + ["--save", ckpt + "/", "--load", ckpt])     # the same directory, spelled apart


@pytest.mark.parametrize("argv,message", [
    (good(attention_dropout=None), r"no dropout; set --attention-dropout 0 \(got 0\.1\)"),
    (good(seq_length="30"), r"--seq-length must be a positive multiple of 4, got 30 \(zigzag over --context-parallel-size 2\)"),
    (good(context_parallel_size="8", seq_length="24"), "must be a positive multiple of 16, got 24"),
    (good(seq_length="30") + ["--cp-backend", "ring"], r"--seq-length must be a multiple of 2 × "
                                                       r"--context-parallel-size = 4, got 30: Megatron-LM's validate"),
    (GOOD + ["--cp-backend", "ulysses_ring", "--cp-ulysses-size", "3"], "must divide --context-parallel-size 2"),
    (GOOD + ["--cp-comm-type", "a2a"], "--cp-comm-type a2a conflicts"),
    (GOOD + ["--attention-backend", "flash"], "--attention-backend flash would replace"),
    (GOOD + ["--cp-recompute", "bogus"], "unknown recompute preset 'bogus'"),
    (GOOD + ["--cp-recompute", "full", "--recompute-granularity", "full"], "both set what to recompute"),
], ids=["dropout-default", "seq-unit", "seq-unit-cp8", "megatron-seq-unit",
        "ulysses-size", "comm-type", "attention-backend",
        "recompute-preset", "recompute-twice"])
def test_megatron_cp_checks_still_run(argv, message):
    with pytest.raises(ValueError, match=message):
        megatron(argv, world=8)


# Flags the job refuses at start with ctx_plugin's own check (settings_from_args): every option of the refused
# tables Megatron-LM's command line has (the valued ones with a value that is refused), and windows it reads two ways.
_REFUSED_VALUES = {"attention_dropout": "0.1", "experimental_attention_variant": "dsa", "flash_attention_version": "3",
                   "position_embedding_type": "mrope", "cuda_graph_impl": "local"}
JOB_REFUSES = [[o.flag] + ([_REFUSED_VALUES[o.field]] if o.field in _REFUSED_VALUES else [])
               for o in (*MODEL_OPTIONS, *DATA_OPTIONS)] + \
              [["--window-size", "(4,2)"], ["--window-size", "(8,-1)"], ["--window-size", "(4,0,1)"]]


@pytest.mark.parametrize("extra", JOB_REFUSES, ids=lambda e: " ".join(e))
def test_megatron_launcher_refuses_what_the_job_refuses(extra):
    """The flags parsed by Megatron-LM's own parser (plus ctx_plugin's) and checked as the job checks them
    (settings_from_args): the launcher's check raises the same message; the launcher used to pass these options
    through unread (its parser did not know them), and the job then stopped at start."""
    arguments = pytest.importorskip("megatron.training.arguments", reason="needs Megatron-LM's argument parser")
    import argparse

    from ctx_plugin.megatron.args import add_arguments, settings_from_args

    parser = add_arguments(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    if extra[0] not in parser._option_string_actions:
        with pytest.raises(ValueError, match="cannot honour"):     # not a flag of this Megatron-LM: refused anyway
            megatron(GOOD + extra)
        return
    job = parser.parse_args(GOOD + ["--max-position-embeddings", "32"] + extra)
    with pytest.raises(ValueError) as at_start:
        settings_from_args(job, resolve_budget=False)
    with pytest.raises(ValueError) as launcher:
        megatron(GOOD + extra)
    assert str(launcher.value) == str(at_start.value)


def test_megatron_window_and_softmax_flags_the_job_takes():
    """What the job honours passes (window and per-layer pattern, softmax offsets); what Megatron-LM's parser
    refuses is an error."""
    assert "CP 2" in megatron(GOOD + ["--window-size", "(4,0)", "--window-attn-skip-freq", "2", "--softmax-type",
                                      "learnable"])
    with pytest.raises(ValueError, match="--softmax-type: invalid choice: 'softmax1'"):
        megatron(GOOD + ["--softmax-type", "softmax1"])
    with pytest.raises(ValueError, match="--window-size: invalid"):
        megatron(GOOD + ["--window-size", "four"])


def test_megatron_bogus_cp_backend_is_an_error():
    with pytest.raises((ValueError, SystemExit)):
        megatron(GOOD + ["--cp-backend", "bogus"])


@pytest.mark.parametrize("extra", [["--cp-backend", "bogus"], ["--seq-length", "abc"]], ids=["choice", "type"])
def test_megatron_invalid_value_raises_value_error(extra):
    with pytest.raises(ValueError, match="--cp-backend|--seq-length"):
        megatron(GOOD + extra)


# --- check_deepspeed -----------------------------------------------------------------------------------------

@needs_hf
def test_deepspeed_good(ds_config, model_json):
    summary = deepspeed(["-m", "ctx_plugin.train_hf", "--model", str(model_json)], ds_config(GOOD_DS))
    assert "CP 2 (zigzag)" in summary and "DP 1" in summary and "ZeRO 0" in summary
    assert "DP 2" in deepspeed(["-m", "ctx_plugin.train_hf", "--model", str(model_json)], ds_config(GOOD_DS), world=4)


def test_deepspeed_script_program(tmp_path, ds_config):
    script = tmp_path / "train.py"
    with pytest.raises(ValueError, match=r"training script .*train\.py: no such file"):
        deepspeed([str(script), "--lr", "1"], ds_config(GOOD_DS))
    script.write_text("print(1)\n")
    assert "CP 2" in deepspeed([str(script), "--lr", "1"], ds_config(GOOD_DS))
    # a script's own model may call deepspeed.checkpointing.checkpoint: DeepSpeed's section passes
    config = {**GOOD_DS, "activation_checkpointing": {"cpu_checkpointing": True}}
    assert "CP 2" in deepspeed([str(script)], ds_config(config))


@pytest.mark.parametrize("config,message", [
    ("{not json", "not a valid DeepSpeed config file"),
    ('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4, "context_parallel": {"size": 2}}',
     r"key\(s\) \['train_micro_batch_size_per_gpu'\] more than once"),
    ({**GOOD_DS, "gradient_allreduce_op": "sum"}, "summed gradients would be scaled by the context-parallel ranks"),
    ({**GOOD_DS, "sequence_parallel_size": 4},
     r'"sequence_parallel_size" \(4\) disagrees with "context_parallel.size"'),
    ({**GOOD_DS, "compile": {"deepcompile": True}},
     r'"compile.deepcompile" cannot be combined with "context_parallel"'),
    ({**GOOD_DS, "tensor_parallel": {"autotp_size": 2}}, r'"tensor_parallel.autotp_size" 2 cannot be combined'),
    ({**GOOD_DS, "data_parallel_size": 2}, r'"data_parallel_size" \(2\) disagrees with the 1 data-parallel replica'),
    ({"train_micro_batch_size_per_gpu": 2}, 'has no "context_parallel" section'),
    ({"train_micro_batch_size_per_gpu": 2, "context_parallel": {"size": 2, "bakend": "ring"}},
     r"unknown key\(s\) \['bakend'\]"),
    ({"train_micro_batch_size_per_gpu": 2, "context_parallel": {"size": 4}},
     r'"context_parallel.size" \(4\) must divide the ranks \(nodes × processes per node\) \(2\)'),
    ({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2, "context_parallel": {"size": 2}},
     r'"train_batch_size" \(3\) must be .*: a multiple of train_micro_batch_size_per_gpu \(2\) × 1'),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
      "context_parallel": {"size": 2}}, r'"train_batch_size" is 8 \(it counts the context-parallel ranks\); give 4'),
    ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
      "context_parallel": {"size": 2}}, r'"train_batch_size" is 6; give 4'),
    ({"context_parallel": {"size": 2}}, "sets neither train_batch_size nor train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "context_parallel": {"size": 2}},
     r'"train_batch_size" \(4\) with "train_micro_batch_size_per_gpu" \(2\) and no "gradient_accumulation_steps" is '
     r'ambiguous'),
    ({**GOOD_DS, "data_efficiency": {"data_sampling": {"curriculum_learning": {"enabled": True}}}},
     r'"data_efficiency.data_sampling.curriculum_learning" cannot be combined with "context_parallel"'),
    ({**GOOD_DS, "activation_checkpointing": {"cpu_checkpointing": True}},
     r"\"activation_checkpointing\" \['cpu_checkpointing'\] has no effect on a Hugging Face model"),
], ids=["json", "key-twice", "summed", "sequence-parallel", "deepcompile", "autotp", "data-parallel-size",
        "no-section", "unknown-key", "world", "batch-3-1", "batch-gas", "batch-6-2", "no-batch", "ambiguous",
        "curriculum", "ds-checkpointing"])
def test_deepspeed_config_errors(config, message, ds_config, model_json):
    with pytest.raises(ValueError, match=message):
        deepspeed(["-m", "ctx_plugin.train_hf", "--model", str(model_json)], ds_config(config))


@needs_hf
def test_deepspeed_config_is_read_as_deepspeed_reads_it(ds_config, model_json):
    """hjson, as ctx_plugin.deepspeed.initialize and DeepSpeed read a config file: comments and trailing commas."""
    text = '{\n  // one replica\n  "train_micro_batch_size_per_gpu": 2,\n  "context_parallel": {"size": 2,},\n}\n'
    assert "CP 2" in deepspeed(["-m", "ctx_plugin.train_hf", "--model", str(model_json)], ds_config(text))


def test_deepspeed_missing_config(tmp_path, model_json):
    with pytest.raises(ValueError, match=r"--ds-config .*nope\.json: no such file"):
        deepspeed(["-m", "ctx_plugin.train_hf", "--model", str(model_json)], tmp_path / "nope.json")


@pytest.mark.parametrize("batch", [
    {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1},
    {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4},          # accumulation 1
    {"train_batch_size": 3},                                               # micro batch 3
    {"train_batch_size": 4, "gradient_accumulation_steps": 4},
], ids=["tb2-m2-g1", "tb4-m4", "tb3", "tb4-g4"])    # 2 ranks, CP 2: one data-parallel replica; each reads one way
@needs_hf
def test_deepspeed_consistent_batches(batch, ds_config, model_json):
    config = {**batch, "context_parallel": {"size": 2}}
    assert "CP 2" in deepspeed(["-m", "ctx_plugin.train_hf", "--model", str(model_json)], ds_config(config))


# ctx_plugin.train_hf jobs the job itself would stop at start (ctx_plugin.hf.enable's model checks, the batches'
# sharding): (model config changes, DeepSpeed "context_parallel" section, ranks, train_hf arguments, message)
TRAIN_HF_REFUSED = {
    "seq-len": ({}, {"backend": "zigzag", "size": 2}, 2, ["--seq-len", "30"],
                r'--seq-len must be a positive multiple of 4, got 30 \(zigzag over "context_parallel.size" 2\)'),
    "dropout": ({"attention_dropout": 0.1}, {"size": 2}, 2, [], "attention_dropout=0.1"),
    "heads": ({}, {"backend": "ulysses", "size": 8}, 8, ["--seq-len", "64"],
              r"Ulysses splits heads over 8 ranks, but there are 4 attention heads"),
}


@pytest.mark.parametrize("case", list(TRAIN_HF_REFUSED))
@needs_hf
def test_deepspeed_train_hf_job_refused_as_the_job_would(case, ds_config, tmp_path):
    """The launcher builds train_hf's model on the meta device and checks it as ctx_plugin.hf.enable does (the
    same message as on the model the job builds) and --seq-len as the sharding does; it used to accept these jobs,
    which then stopped at start (after DeepSpeed's initialisation)."""
    from ctx_plugin import CPConfig
    from ctx_plugin.hf import check_model
    from ctx_plugin.train_hf import load_model, parse_args

    changes, section, world, extra, message = TRAIN_HF_REFUSED[case]
    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps({**TINY_LLAMA, **changes}))
    program = ["-m", "ctx_plugin.train_hf", "--model", str(model_json), *extra]
    with pytest.raises(ValueError, match=message) as launcher:
        deepspeed(program, ds_config({"train_micro_batch_size_per_gpu": 1, "context_parallel": section}), world=world)
    if case != "seq-len":            # the job's own model, built for real, refused by enable's check alike
        cfg = CPConfig(**{k: v for k, v in section.items() if k != "size"})
        with pytest.raises(ValueError) as job:
            check_model(load_model(parse_args(program[2:])), cfg, section["size"])
        assert str(job.value) == str(launcher.value)
    if case != "dropout":            # the same model passes with a sequence and a CP size it can split
        assert "CP 2" in deepspeed(["-m", "ctx_plugin.train_hf", "--model", str(model_json), "--seq-len", "32"],
                                   ds_config(GOOD_DS))


@pytest.mark.parametrize("program,message", [
    ([], "give the training program after '--'"),
    (["-m", "ctx_plugin.train_hf", "--model", "MODEL", "--deepspeed_config", "x.json"], "drop --deepspeed_config "),
    (["-m", "ctx_plugin.train_hf", "--model", "MODEL", "--deepspeed-config", "x.json"], "drop --deepspeed-config "),
    (["-m", "ctx_plugin.train_hf", "--model", "MODEL", "--deepspeed_config=x.json"], "drop --deepspeed_config=x"),
    (["-m", "ctx_plugin.train_hf", "--model", "MODEL", "--deepspeed_conf", "x.json"], "drop --deepspeed_conf "),
    (["-m", "ctx_plugin.train_hf", "--model", "MODEL", "--deepscale_config=x.json"], "drop --deepscale_config"),
    (["-m"], "-m : no such module"),
    (["-m", "no_such_module_ctx_xyz"], "-m no_such_module_ctx_xyz: no such module"),
    (["-m", "ctx_plugin.train_hf", "--model", "MISSING"], r"--model .*missing\.json: neither a config\.json"),
    (["-m", "ctx_plugin.train_hf", "--model", "MODEL", "--steps", "0"], "--steps must be positive"),
    (["-m", "ctx_plugin.train_hf", "--model", "MODEL", "--data", "MISSING"], r"--data .*missing\.json: no such file"),
], ids=["empty", "ds-config", "ds-config-dash", "ds-config-eq", "ds-config-abbrev", "deepscale", "m-alone", "m-missing", "model-missing", "steps", "data-missing"])
def test_deepspeed_program_errors(program, message, ds_config, model_json, tmp_path):
    program = [str(model_json) if p == "MODEL" else str(tmp_path / "missing.json") if p == "MISSING" else p
               for p in program]
    with pytest.raises(ValueError, match=message):
        deepspeed(program, ds_config(GOOD_DS))


@pytest.mark.parametrize("program", [["-m", "ctx_plugin.train_hf"],
                                     ["-m", "ctx_plugin.train_hf", "--model", "MODEL", "--bogus"],
                                     ["-m", "no_such_pkg_ctx_xyz.sub"]], ids=["no-model", "unknown", "dotted"])
def test_deepspeed_program_errors_are_value_errors(program, ds_config, model_json):
    program = [str(model_json) if p == "MODEL" else p for p in program]
    try:
        deepspeed(program, ds_config(GOOD_DS))
    except SystemExit as e:
        raise AssertionError(f"SystemExit({e.code})") from None
    except ValueError:
        return
    except Exception as e:
        raise AssertionError(f"{type(e).__name__}: {e}") from None
    raise AssertionError("no error")


def test_deepspeed_non_object_config_is_reported(ds_config, model_json):
    # A JSON file that is not an object must be rejected (today: a TypeError with Python's own message).
    with pytest.raises((ValueError, TypeError)):
        deepspeed(["-m", "ctx_plugin.train_hf", "--model", str(model_json)], ds_config("5"))


# --- plan_job ------------------------------------------------------------------------------------------------

def in_job(tmp_path, **extra) -> dict:
    return {"SLURM_JOB_ID": "17", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_ON_NODE": "32",
            "SLURM_SUBMIT_DIR": str(tmp_path), **extra}


MEGATRON_CP8 = good(context_parallel_size="8")     # 2 nodes × 4 GPUs = 8 ranks; zigzag unit 16 divides 32


def plan_megatron(env, *job_options, program=MEGATRON_CP8):
    return slurm_job.plan_job("megatron", [*job_options, "--megatron-lm", str(FAKE_MEGATRON), "--", *program],
                              env=env)


def test_plan_outside_slurm_needs_dry_run():
    with pytest.raises(ValueError, match="submit it with sbatch"):
        plan_megatron({"SLURM_GPUS_ON_NODE": "0"}, "--nproc-per-node", "2", program=GOOD)


def test_plan_dry_run_on_cpu_needs_nproc():
    with pytest.raises(ValueError, match="--nproc-per-node"):
        plan_megatron({"SLURM_GPUS_ON_NODE": "0"}, "--dry-run", program=GOOD)


def test_plan_dry_run_outside_slurm(tmp_path):
    plan = plan_megatron({"SLURM_GPUS_ON_NODE": "0", "SLURM_SUBMIT_DIR": str(tmp_path)}, "--dry-run",
                         "--nproc-per-node", "2", program=GOOD)
    assert (plan.nodes, plan.nproc_per_node, plan.device, plan.port, plan.dry_run) == (1, 2, "cpu", 20000, True)
    assert plan.run_dir == tmp_path / "runs" / "megatron-dryrun"
    assert not plan.run_dir.exists()


def test_plan_inside_job(tmp_path):
    plan = plan_megatron(in_job(tmp_path))
    assert (plan.nodes, plan.nproc_per_node, plan.device, plan.threads, plan.port) == (2, 4, "cuda", 8, 20017)
    assert plan.run_dir == tmp_path / "runs" / "megatron-17"
    assert "× CP 8" in plan.summary and "DP 1" in plan.summary
    assert plan.program[:4] == ["-m", "ctx_plugin.megatron.pretrain_gpt", "--megatron-lm", str(FAKE_MEGATRON)]
    assert plan.program[4:] == MEGATRON_CP8
    assert not plan.dry_run


def test_plan_port_and_run_dir_options(tmp_path):
    plan = plan_megatron(in_job(tmp_path, SLURM_JOB_ID="123456"), "--master-port", "29500", "--run-dir",
                         str(tmp_path / "mine"))
    assert plan.port == 29500 and plan.run_dir == tmp_path / "mine"
    assert plan_megatron(in_job(tmp_path, SLURM_JOB_ID="123456")).port == 20000 + 123456 % 12000
    # every default, and the preflight's tries above it, stays below Linux's ephemeral ports (32768-60999)
    assert plan_megatron(in_job(tmp_path, SLURM_JOB_ID=str(11999))).port + 200 < 32768
    for bad in ("80", "70000", "x"):
        with pytest.raises(ValueError, match="port"):
            plan_megatron(in_job(tmp_path), "--master-port", bad)


def test_plan_ctx_runs_dir(tmp_path):
    plan = plan_megatron(in_job(tmp_path, CTX_RUNS_DIR=str(tmp_path / "elsewhere")))
    assert plan.run_dir == tmp_path / "elsewhere" / "megatron-17"


@pytest.mark.parametrize("env,options,message", [
    ({}, ["--nodes", "3"], r"--nodes 3 but the job has 2 nodes"),
    ({}, ["--nproc-per-node", "5"], r"--nproc-per-node 5 is more than the 4 GPUs"),
    ({"SLURM_GPUS_ON_NODE": "0"}, ["--device", "cuda"], r"--device cuda but the job's nodes have no GPU"),
    ({"SLURM_GPUS_ON_NODE": "0"}, [], r"no GPU on the node: give --nproc-per-node"),
    ({}, ["--nproc-per-node", "3"], r"6 ranks .* not a multiple of TP × PP × CP"),
    ({}, ["--device", "tpu"], r"argument --device: invalid choice"),
    ({}, ["--nodes", "x"], r"argument --nodes: invalid int value"),
    ({"SLURM_CPUS_ON_NODE": "1"}, [], r"the job has 1 CPU core\(s\) per node for 4 GPU processes .* submit with "
                                      r"--exclusive \(whole nodes\) or --cpus-per-task=<cores per node>"),
    ({}, ["--megatron", "/x"], r"unrecognized arguments: --megatron /x"),
    ({"SLURM_NTASKS_PER_NODE": "4"}, [], r"submitted with --ntasks-per-node 4: the job script runs one task per node"),
    ({"SLURM_GPUS_PER_TASK": "1"}, [], r"submitted with --gpus-per-task 1: .* --gpus-per-node N$"),
    ({"SLURM_GPUS": "8"}, [], r"submitted with --gpus 8 \(for the whole job\), .* unevenly over its 2 nodes .* "
                              r"--gpus-per-node N$"),
], ids=["nodes", "nproc", "device-cuda", "cpu-no-nproc", "world", "device-choice", "nodes-int", "one-core",
        "abbreviated", "tasks-per-node", "gpus-per-task", "gpus-per-job"])
def test_plan_inside_job_errors(tmp_path, env, options, message):
    with pytest.raises(ValueError, match=message):
        plan_megatron(in_job(tmp_path, **env), *options)


def test_plan_cpu_job_inside_slurm(tmp_path):
    plan = plan_megatron(in_job(tmp_path, SLURM_GPUS_ON_NODE="0"), "--nproc-per-node", "4")
    assert (plan.device, plan.nproc_per_node, plan.threads) == ("cpu", 4, 8)
    assert plan_megatron(in_job(tmp_path, SLURM_CPUS_ON_NODE="4")).threads == 1      # a core per GPU process: fine
    assert plan_megatron(in_job(tmp_path, SLURM_NTASKS_PER_NODE="1", SLURM_GPUS="8",     # the script's own shape
                                SLURM_GPUS_PER_NODE="4")).nproc_per_node == 4


def test_plan_unknown_framework():
    with pytest.raises(ValueError, match="unknown framework 'torchtitan'"):
        slurm_job.plan_job("torchtitan", [], env={})


# --- render --------------------------------------------------------------------------------------------------

def render_env(**extra) -> dict:
    return {"CTX_PY": "/opt/ctx/bin/python", **extra}


def bash_syntax_ok(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=10)


def srun_line(text: str) -> list[str]:
    line = next(l for l in text.splitlines() if l.startswith("exec srun "))
    return shlex.split(line.rstrip("\\"))


def test_render_cuda_megatron(tmp_path):
    plan = plan_megatron(in_job(tmp_path))
    text = slurm_job.render(plan, env=render_env())
    for piece in ('--node-rank="$SLURM_NODEID"', "--nnodes=2", "--nproc-per-node=4", "--master-port=20017",
                  "export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}",
                  "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}",
                  "srun --export=ALL --nodes=2 --ntasks=2 --ntasks-per-node=1",
                  f"--output={plan.run_dir}/attempt-1/logs/node-%n-%N.log", "scontrol show hostnames",
                  "/opt/ctx/bin/python -m torch.distributed.run", f"mkdir -p {plan.run_dir / 'attempt-1' / 'logs'}",
                  "# no site file (CTX_SITE)", "set -euo pipefail", f"export CTX_RUN_DIR={plan.run_dir}",
                  "export CTX_ATTEMPT=1", f"export CTX_ATTEMPT_DIR={plan.run_dir}/attempt-1 ", shlex.quote(f"trap '' USR1; echo $$ > {plan.run_dir}/attempt-1/pids/node-")[:-1],
                  f"mkdir -p {plan.run_dir}/attempt-1/logs {plan.run_dir}/attempt-1/pids"):
        assert piece in text, piece
    assert "DS_ACCELERATOR" not in text and "source " not in text
    assert text.startswith("#!/usr/bin/env bash\n")
    assert text.index("scontrol show hostnames") < text.index("exec srun")
    checked = bash_syntax_ok(text)
    assert checked.returncode == 0, checked.stderr


def test_render_rendezvous_host_survives_a_long_node_list(tmp_path):
    """The rendezvous line runs under ``set -euo pipefail``: reading only scontrol's first line (``head -n 1``) made
    scontrol die of SIGPIPE on a long node list and ended command.sh before srun; it must read the whole list."""
    plan = plan_megatron(in_job(tmp_path))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/usr/bin/env bash\nseq -f "node%05g" 1 200000\n')   # stdio, like scontrol
    (fake / "scontrol").chmod(0o755)
    lines = [line for line in slurm_job.render(plan, env=render_env()).splitlines()
             if line.startswith(("CTX_MASTER_ADDR=", "export CTX_MASTER_ADDR"))]
    assert len(lines) == 2
    script = "set -euo pipefail\n" + "\n".join(lines) + '\necho "addr=$CTX_MASTER_ADDR"\n'
    for _ in range(3):
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "x"})
        assert (out.returncode, out.stdout) == (0, "addr=node00001\n"), out.stderr


def test_render_site_prefix_and_srun_args(tmp_path):
    plan = plan_megatron(in_job(tmp_path))
    text = slurm_job.render(plan, env=render_env(CTX_SITE="/x/site.sh",
                                                 CTX_EXEC_PREFIX="apptainer exec --nv img.sif",
                                                 CTX_SRUN_ARGS="--container-image=/i/ctx.sqsh --mpi=pmix"))
    assert "source /x/site.sh" in text
    assert text.index("source /x/site.sh") < text.index("exec srun")
    assert "apptainer exec --nv img.sif /opt/ctx/bin/python -m torch.distributed.run" in text
    tokens = srun_line(text)
    assert tokens[:2] == ["exec", "srun"]
    assert "--container-image=/i/ctx.sqsh" in tokens and "--mpi=pmix" in tokens
    checked = bash_syntax_ok(text)
    assert checked.returncode == 0, checked.stderr


def test_render_quotes_paths_with_spaces(tmp_path):
    plan = plan_megatron(in_job(tmp_path), "--run-dir", str(tmp_path / "my runs" / "a"))
    text = slurm_job.render(plan, env=render_env(CTX_SITE="/x y/site.sh"))
    assert "source '/x y/site.sh'" in text
    assert f"--output={tmp_path}/my runs/a/attempt-1/logs/node-%n-%N.log" in srun_line(text)
    checked = bash_syntax_ok(text)
    assert checked.returncode == 0, checked.stderr


@needs_hf
def test_render_cpu_deepspeed(tmp_path, ds_config, model_json):
    ds = ds_config(GOOD_DS)
    plan = slurm_job.plan_job("deepspeed", ["--dry-run", "--nproc-per-node", "2", "--ds-config", str(ds), "--", "-m",
                                            "ctx_plugin.train_hf", "--model", str(model_json)],
                              env={"SLURM_GPUS_ON_NODE": "0", "SLURM_CPUS_ON_NODE": "8"})
    assert (plan.device, plan.threads) == ("cpu", 4)
    assert plan.program[-2:] == ["--deepspeed_config", str(ds.resolve())]
    assert plan.program[:4] == ["-m", "ctx_plugin.train_hf", "--model", str(model_json)]
    text = slurm_job.render(plan, env=render_env())
    assert "export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}" in text
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in text
    assert f"--deepspeed_config {ds.resolve()}'" in text      # the end of the program inside bash -c '...'
    checked = bash_syntax_ok(text)
    assert checked.returncode == 0, checked.stderr


def test_render_deepspeed_script_resolved(tmp_path, ds_config, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)\n")
    ds = ds_config(GOOD_DS)
    plan = slurm_job.plan_job("deepspeed", ["--dry-run", "--nproc-per-node", "2", "--ds-config", "ds.json", "--",
                                            "train.py", "--lr", "1"], env={"SLURM_GPUS_ON_NODE": "0"})
    assert plan.program == [str(tmp_path / "train.py"), "--lr", "1", "--deepspeed_config", str(ds)]


# --- main ----------------------------------------------------------------------------------------------------

@pytest.fixture
def job_environ(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "CTX_")):
            monkeypatch.delenv(name)
    for name, value in in_job(tmp_path, SLURM_JOB_NODELIST="localhost,node2").items():
        monkeypatch.setenv(name, value)
    fake = tmp_path / "bin"                      # scontrol show hostnames, without a cluster
    fake.mkdir()
    (fake / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1 $2" = "show hostnames" ] && echo "$3" | tr , "\\n"\n')
    (fake / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    return tmp_path


def test_main_failure_inside_job_writes_status(job_environ, capsys):
    rc = slurm_job.main(["megatron", "--megatron-lm", str(job_environ / "nowhere"), "--", *MEGATRON_CP8])
    assert rc == 2
    status = (job_environ / "runs" / "megatron-17" / "status").read_text().splitlines()
    assert status[0] == "failed"
    assert any(line.startswith("reason=") and "no pretrain_gpt.py" in line for line in status)
    assert "ctx_plugin launch: --megatron-lm" in capsys.readouterr().err
    assert not (job_environ / "runs" / "megatron-17" / "command.sh").exists()


def test_main_failure_status_goes_to_run_dir(job_environ):
    rc = slurm_job.main(["megatron", "--run-dir", str(job_environ / "mine"), "--megatron-lm", str(FAKE_MEGATRON),
                         "--", *GOOD])                                   # 8 ranks, CP 2: fine; heads ok
    assert rc == 0
    rc = slurm_job.main(["megatron", "--run-dir", str(job_environ / "bad"), "--nodes", "5", "--megatron-lm",
                         str(FAKE_MEGATRON), "--", *GOOD])
    assert rc == 2
    for status in (job_environ / "bad" / "status", job_environ / "bad" / "attempt-1" / "status"):
        assert status.read_text().startswith("failed\nreason=--nodes 5 but the job has 2")


def test_main_failure_status_run_dir_equals_form(job_environ):
    rc = slurm_job.main(["megatron", f"--run-dir={job_environ / 'mine'}", "--nodes", "5", "--megatron-lm",
                         str(FAKE_MEGATRON), "--", *GOOD])
    assert rc == 2
    assert (job_environ / "mine" / "status").is_file()


def test_main_missing_required_option_writes_status(job_environ):
    assert slurm_job.main(["megatron", "--", *GOOD]) == 2
    assert (job_environ / "runs" / "megatron-17" / "status").read_text().startswith("failed\n")


def test_main_success_inside_job_hands_off_run_dir(job_environ, capsys):
    read, write = os.pipe()
    try:
        rc = slurm_job.main(["megatron", "--handoff-fd", str(write), "--megatron-lm", str(FAKE_MEGATRON), "--",
                             *MEGATRON_CP8])
        os.close(write)
        write = None
        handed = os.read(read, 4096).decode()
    finally:
        os.close(read)
        if write is not None:
            os.close(write)
    run = job_environ / "runs" / "megatron-17"
    attempt = run / "attempt-1"
    assert rc == 0 and handed == f"{run}\n{attempt}\n0\n"
    assert (attempt / "logs").is_dir()
    assert "--nproc-per-node=4" in (attempt / "command.sh").read_text()
    assert not (run / "status").exists()
    assert "ctx_plugin: run directory" in capsys.readouterr().out
    records = {p.name: p.read_text() for p in attempt.iterdir() if p.is_file()}
    assert records["nodes.txt"] == "localhost\nnode2\n"
    assert "job_id=17\nattempt=1\n" in records["job.txt"] and "nodes=localhost,node2\nranks=8\n" in records["job.txt"]
    assert f"program=-m ctx_plugin.megatron.pretrain_gpt --megatron-lm {FAKE_MEGATRON}" in records["job.txt"]
    assert re.search(r"^torch \d", records["versions.txt"], re.M) and "ctx_plugin 0." in records["versions.txt"]
    assert re.match(r"ctx_plugin ([0-9a-f]{40}|not a git checkout)", records["git.txt"])
    assert "Megatron-LM " in records["git.txt"]
    assert records["batch.log"].startswith("ctx_plugin: Megatron: 8 ranks")


def test_main_requeued_attempt_and_busy_port(job_environ, monkeypatch):
    """The second attempt of a requeued job (SLURM_RESTART_COUNT=1) gets its own directory; a master port in use
    on the rendezvous host is replaced by the next free one, written into command.sh (so every node uses it)."""
    import socket
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = slurm_job.main(["megatron", "--master-port", str(port), "--megatron-lm", str(FAKE_MEGATRON), "--",
                             *MEGATRON_CP8])
    assert rc == 0
    attempt = job_environ / "runs" / "megatron-17" / "attempt-2"
    command = (attempt / "command.sh").read_text()
    chosen = int(re.search(r"--master-port=(\d+)", command).group(1))
    assert port < chosen < port + 200
    assert f"port {port} is in use" in (attempt / "batch.log").read_text()
    assert "attempt=2\n" in (attempt / "job.txt").read_text()


def test_a_requeued_job_must_resume(tmp_path, ds_config, model_json):
    """--requeue (or CTX_REQUEUE=1) without resuming would retrain every attempt from the start: Megatron needs the
    stop flags and --load equal to --save, ctx_plugin.train_hf needs --resume; a script of its own passes."""
    env = in_job(tmp_path)
    ck = str(tmp_path / "ck")
    stops = ["--exit-signal-handler", "--exit-signal", "SIGUSR1", "--save", ck]
    for program, message in (
            (MEGATRON_CP8, "must save when the time-limit warning comes"),
            ([*MEGATRON_CP8, *stops], "give --load .*ck .*not no --load"),
            ([*MEGATRON_CP8, *stops, "--load", str(tmp_path)], f"not --load {tmp_path}")):
        with pytest.raises(ValueError, match=f"--requeue: .*{message}"):
            plan_megatron(env, "--requeue", program=program)
        plan_megatron(env, program=program)                             # without requeue: fine
    assert plan_megatron(env, "--requeue", program=[*MEGATRON_CP8, *stops, "--load", ck]).requeue
    assert plan_megatron({**env, "CTX_REQUEUE": "1"}, program=[*MEGATRON_CP8, *stops, "--load", ck]).requeue
    with pytest.raises(ValueError, match="--requeue: .*must save"):
        plan_megatron({**env, "CTX_REQUEUE": "1"})
    pytest.importorskip("transformers")
    ds = ds_config(GOOD_DS)
    train = ["-m", "ctx_plugin.train_hf", "--model", str(model_json)]
    with pytest.raises(ValueError, match="--requeue: ctx_plugin.train_hf starts from step 0 without --resume"):
        slurm_job.plan_job("deepspeed", ["--requeue", "--ds-config", str(ds), "--", *train], env=env)
    assert slurm_job.plan_job("deepspeed", ["--requeue", "--ds-config", str(ds), "--", *train, "--resume"],
                              env=env).requeue
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    assert slurm_job.plan_job("deepspeed", ["--requeue", "--ds-config", str(ds), "--", str(script)], env=env).requeue


def test_main_rendezvous_host_must_resolve(job_environ, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "no-such-node-ctx.invalid,node2")
    rc = slurm_job.main(["megatron", "--megatron-lm", str(FAKE_MEGATRON), "--", *MEGATRON_CP8])
    assert rc == 2
    status = (job_environ / "runs" / "megatron-17" / "status").read_text()
    assert "the rendezvous host no-such-node-ctx.invalid (the job's first node) does not resolve" in status
    assert not (job_environ / "runs" / "megatron-17" / "attempt-1" / "command.sh").exists()


def test_main_usage():
    assert slurm_job.main([]) == 2
    assert slurm_job.main(["torchtitan"]) == 2


# --- parse_sbatch_line ---------------------------------------------------------------------------------------

MEGATRON_SBATCH = str(LAUNCH / "megatron.sbatch")
MEGATRON_SBATCH_TEXT = (LAUNCH / "megatron.sbatch").read_text()


@pytest.mark.parametrize("opts", [["-N", "2"], ["-N2"], ["--nodes=2"], ["--nodes", "2"]])
def test_sbatch_nodes(opts):
    assert submit.parse_sbatch_line(["sbatch", *opts, MEGATRON_SBATCH])[0].nodes == 2


@pytest.mark.parametrize("opts,gpus", [
    (["--gpus-per-node=8"], 8), (["--gpus-per-node", "8"], 8), (["--gres=gpu:8"], 8), (["--gres=gpu:h100:8"], 8),
    (["--gres", "gpu:4"], 4), (["--gres=shard:2"], 0), ([], 0), (["--gres-flags=enforce-binding"], 0),
])
def test_sbatch_gpus(opts, gpus):
    assert submit.parse_sbatch_line(["sbatch", *opts, MEGATRON_SBATCH])[0].gpus_on_node == gpus


@pytest.mark.parametrize("gres", ["--gres=gpu:2,shard:1", "--gres=shard:1,gpu:2"])
def test_sbatch_gres_lists(gres):
    assert submit.parse_sbatch_line(["sbatch", gres, MEGATRON_SBATCH])[0].gpus_on_node == 2


def test_sbatch_defaults_and_script_args():
    line = ["sbatch", "-N", "2", "--time", "1:00:00", "--nodelist=a,b", MEGATRON_SBATCH, "--megatron-lm", "/m",
            "--", "--num-layers", "2"]
    allocation, script, framework, args = submit.parse_sbatch_line(line)
    assert (allocation.nodes, allocation.gpus_on_node, script, framework) == (2, 0, Path(MEGATRON_SBATCH), "megatron")
    assert allocation.ntasks_per_node == 1                   # the job script's own #SBATCH --ntasks-per-node=1
    assert args == ["--megatron-lm", "/m", "--", "--num-layers", "2"]
    allocation, _, framework, _ = submit.parse_sbatch_line(["/usr/bin/sbatch", str(LAUNCH / "deepspeed.sbatch")])
    assert (allocation.nodes, framework) == (1, "deepspeed")


@pytest.mark.parametrize("opts,shape", [
    (["-G", "2"], (2, 2, None, None)), (["-G2"], (2, 2, None, None)), (["--gpus=h100:2"], (2, 2, None, None)),
    (["--gpus-per-task=2"], (2, None, 2, None)), (["--gpus-per-task", "2", "--ntasks-per-node", "2"], (4, None, 2, 2)),
    (["-N", "2", "--gpus", "3"], (2, 3, None, None)),
])
def test_sbatch_job_wide_and_per_task_gpus(opts, shape):
    allocation = submit.parse_sbatch_line(["sbatch", *opts, MEGATRON_SBATCH])[0]
    ntasks = allocation.ntasks_per_node if "--ntasks-per-node" in opts else None    # the script's own is 1
    assert (allocation.gpus_on_node, allocation.gpus, allocation.gpus_per_task, ntasks) == shape


def test_sbatch_directives_of_the_job_script(tmp_path):
    """sbatch reads the script's #SBATCH lines up to its first command; the command line's options override them."""
    script = tmp_path / "mine.sbatch"
    script.write_text("#!/usr/bin/env bash\n# my site's copy\n#SBATCH --nodes=2   # two nodes\n\n"
                      "#SBATCH --gpus-per-node=h100:4 --cpus-per-task 32\nset -eu\n#SBATCH --nodes=9\n"
                      "ctx_job megatron \"$@\"\n")
    allocation = submit.parse_sbatch_line(["sbatch", str(script)])[0]
    assert (allocation.nodes, allocation.gpus_on_node, allocation.cpus_per_task) == (2, 4, 32)
    allocation = submit.parse_sbatch_line(["sbatch", "-N", "3", "--exclusive", str(script)])[0]
    assert (allocation.nodes, allocation.gpus_on_node, allocation.exclusive) == (3, 4, True)
    assert "SLURM_CPUS_ON_NODE" not in allocation.environment()       # --exclusive: the node's cores


@pytest.mark.parametrize("line,message", [
    (["sbatch", "-N", "2-4", MEGATRON_SBATCH], "give one node count"),
    (["sbatch", "--nodes=1-2", MEGATRON_SBATCH], "give one node count"),
    (["sbatch", "-N", "2", "job.sh"], "no job script in the sbatch line"),
    (["srun", "-N", "2", MEGATRON_SBATCH], "give the sbatch command line"),
    ([], "give the sbatch command line"),
    (["sbatch", "missing.sbatch"], "missing.sbatch: no such file"),
    (["sbatch", "--gres=gpu:h100", MEGATRON_SBATCH], "cannot read a count from sbatch --gres 'gpu:h100'"),
    (["sbatch", "--ntasks-per-node=x", MEGATRON_SBATCH], "cannot read a count from sbatch --ntasks-per-node"),
    (["sbatch", "-N"], "no job script"),
], ids=["range", "range-eq", "no-script", "not-sbatch", "empty", "missing", "gres-no-count", "tasks-no-count",
        "dangling"])
def test_sbatch_line_errors(line, message):
    with pytest.raises(ValueError, match=message):
        submit.parse_sbatch_line(line)


def test_sbatch_script_without_ctx_job(tmp_path):
    script = tmp_path / "other.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH -N 1\nsrun hostname\n")
    with pytest.raises(ValueError, match="is not a ctx_plugin job script"):
        submit.parse_sbatch_line(["sbatch", str(script)])
    script.write_text("#!/bin/bash\nctx_job torchtitan \"$@\"\n")
    with pytest.raises(ValueError, match="is not a ctx_plugin job script"):
        submit.parse_sbatch_line(["sbatch", str(script)])


# --- ctx-plugin launch ---------------------------------------------------------------------------------------

@pytest.fixture
def no_submit(monkeypatch, tmp_path):
    """Fails the test if ctx-plugin launch would run the sbatch line; keeps dry runs out of the repo."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"ctx-plugin launch tried to run {args}")
    monkeypatch.setattr(submit, "subprocess", types.SimpleNamespace(run=refuse))
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith(("SLURM_", "CTX_")):
            monkeypatch.delenv(name)


def launch_line(*sbatch_opts, script=MEGATRON_SBATCH, job=("--megatron-lm", str(FAKE_MEGATRON)), program=GOOD):
    return ["sbatch", *sbatch_opts, script, *job, "--", *program]


def test_cli_launch_dry_run(no_submit, capsys):
    rc = cli.main(["launch", "--dry-run", *launch_line("-N", "1", "--gpus-per-node", "2")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "TP 1 × PP 1 × CP 2" in out and "(2 cuda processes per node)" in out
    assert "would run: sbatch -N 1 --gpus-per-node 2 " in out
    assert "--nproc-per-node=2" in out and "--nnodes=1" in out
    assert not (Path.cwd() / "runs").exists()


def test_cli_launch_dry_run_reads_the_site_file(no_submit, capsys, monkeypatch, tmp_path):
    """The printed command.sh is the job's: the site's Python, container prefix, run directory and requeue."""
    site = tmp_path / "site.sh"
    site.write_text(f'CTX_PY=/site/python\nCTX_EXEC_PREFIX="apptainer exec img.sif"\nCTX_RUNS_DIR={tmp_path}/r\n'
                    "CTX_REQUEUE=1\n")
    monkeypatch.setenv("CTX_SITE", str(site))
    resumes = [*GOOD, "--exit-signal-handler", "--exit-signal", "SIGUSR1", "--save", str(tmp_path / "ck"), "--load",
               str(tmp_path / "ck")]
    rc = cli.main(["launch", "--dry-run", *launch_line("-N", "1", "--gpus-per-node", "2", program=resumes)])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"source {site}" in out and "apptainer exec img.sif /site/python -m torch.distributed.run" in out
    assert f"{tmp_path}/r/megatron-dryrun/attempt-1/logs/node-%n-%N.log" in out
    assert "requeue on the time-limit warning: yes" in out


def test_cli_launch_dry_run_cpu_nodes(no_submit, capsys):
    rc = cli.main(["launch", "--dry-run", *launch_line("-N", "2", job=("--megatron-lm", str(FAKE_MEGATRON),
                                                                          "--nproc-per-node", "1"))])
    assert rc == 0
    out = capsys.readouterr().out
    assert "(1 cpu processes per node)" in out and "--nnodes=2" in out


@needs_hf
def test_cli_launch_deepspeed_dry_run(no_submit, capsys, ds_config, model_json):
    ds = ds_config(GOOD_DS)
    rc = cli.main(["launch", "--dry-run", *launch_line("--gres=gpu:2", script=str(LAUNCH / "deepspeed.sbatch"),
                                                       job=("--ds-config", str(ds)),
                                                       program=("-m", "ctx_plugin.train_hf", "--model",
                                                                str(model_json)))])
    assert rc == 0
    out = capsys.readouterr().out
    assert "DeepSpeed: 2 ranks = CP 2" in out and f"--deepspeed_config {ds}" in out


@pytest.mark.parametrize("line,message", [
    (launch_line("-N", "2-4"), "give one node count"),
    (["srun", *launch_line()[1:]], "give the sbatch command line"),
    (launch_line("-N", "1", "--gpus-per-node", "3"), r"3 ranks .* not a multiple of TP × PP × CP"),
    (launch_line("-N", "2", "--gpus-per-node", "2", job=("--megatron-lm", str(FAKE_MEGATRON), "--nodes", "3")),
     "--nodes 3 disagrees with sbatch's 2"),
    (launch_line("-N", "1", "--gpus-per-node", "2", program=good(attention_dropout=None)), "no dropout"),
    (launch_line("-N", "1"), "no GPU on the node: give --nproc-per-node"),
    (launch_line("-N", "1", "--ntasks-per-node", "2", "--gpus-per-node", "2"), "submitted with --ntasks-per-node 2"),
    (launch_line("-N", "1", "--gpus-per-task", "2"), "submitted with --gpus-per-task 2"),
    (launch_line("-N", "2", "-G", "4"), "submitted with --gpus 4 .for the whole job"),
    (launch_line("-N", "1", "--gpus-per-node", "2", "-c", "1"), "1 CPU core.s. per node for 2 GPU processes"),
], ids=["range", "not-sbatch", "world", "nodes", "dropout", "cpu-no-nproc", "tasks", "per-task", "job-wide",
        "cores"])
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry", "submit"])
def test_cli_launch_bad_line(no_submit, capsys, line, message, dry_run):
    with pytest.raises(SystemExit) as exited:
        cli.main(["launch", *(["--dry-run"] if dry_run else []), *line])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "ctx-plugin launch: error:" in err or "ctx-plugin: error:" in err


@pytest.mark.parametrize("sbatch_opts", [("-G", "2"), ("--gpus=2",), ("-N", "1", "--gpus-per-node", "2", "-c", "8"),
                                         ("--gpus-per-node", "2", "-c", "1", "--exclusive")])
def test_cli_launch_checks_gpus_as_the_job_finds_them(no_submit, capsys, sbatch_opts):
    """Job-wide GPUs on one node are that node's GPUs (the job runs 2 cuda processes); cores per task at least
    the processes' count pass, and --exclusive gives the node's cores."""
    assert cli.main(["launch", "--dry-run", *launch_line(*sbatch_opts)]) == 0
    assert "(2 cuda processes per node)" in capsys.readouterr().out


def test_cli_launch_reads_the_job_scripts_directives(no_submit, capsys, tmp_path):
    script = tmp_path / "site.sbatch"
    script.write_text(MEGATRON_SBATCH_TEXT.replace("#SBATCH --job-name", "#SBATCH --nodes=2\n#SBATCH --gpus-per-node=1"
                                                                         "\n#SBATCH --job-name"))
    (tmp_path / "slurm_common.sh").write_text((LAUNCH / "slurm_common.sh").read_text())
    assert cli.main(["launch", "--dry-run", *launch_line(script=str(script))]) == 0
    out = capsys.readouterr().out
    assert "(1 cuda processes per node)" in out and "--nnodes=2" in out


def test_cli_launch_nodes_equals_form(no_submit, capsys):
    with pytest.raises(SystemExit):
        cli.main(["launch", "--dry-run", *launch_line("-N", "2", "--gpus-per-node", "1",
                                                      job=("--megatron-lm", str(FAKE_MEGATRON), "--nodes=3"))])


def test_cli_launch_without_line(no_submit, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["launch", "--dry-run"])
    assert exited.value.code == 2 and "give the sbatch command line" in capsys.readouterr().err


# --- the job scripts -----------------------------------------------------------------------------------------

SHELL_FILES = sorted(p for p in LAUNCH.iterdir() if p.suffix in (".sh", ".sbatch"))


def test_launch_has_the_job_scripts():
    names = {p.name for p in SHELL_FILES}
    assert {"slurm_common.sh", "megatron.sbatch", "deepspeed.sbatch", "site.example.sh"} <= names


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_bash_syntax(path):
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=10)
    assert checked.returncode == 0, checked.stderr


def test_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed")
    files = [str(p.relative_to(REPO)) for p in SHELL_FILES]
    checked = subprocess.run(["shellcheck", "-x", *files], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("name", ["megatron.sbatch", "deepspeed.sbatch"])
def test_sbatch_headers(name):
    text = (LAUNCH / name).read_text()
    assert "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --ntasks-per-node=1" in text
    assert re.search(r"^ctx_job (\w+) ", text, re.M).group(1) == name.split(".")[0]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CTX_"))}
    env.update(extra)
    return env


def run_script(name, args, env, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH / name), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def site(tmp_path) -> Path:
    path = tmp_path / "site.sh"
    path.write_text(f"CTX_RUNS_DIR={tmp_path}/runs\n")
    return path


def test_megatron_sbatch_dry_run(tmp_path, site):
    done = run_script("megatron.sbatch", ["--dry-run", "--nproc-per-node", "2", "--megatron-lm", str(FAKE_MEGATRON),
                                          "--", *GOOD], clean_env(CTX_SITE=str(site)), tmp_path)
    assert done.returncode == 0, done.stderr
    for piece in ("[dry run]", "TP 1 × PP 1 × CP 2", "torch.distributed.run", f"source {site}",
                  f"[dry run] run directory: {tmp_path}/runs/megatron-dryrun", f"{PY} -m torch.distributed.run"):
        assert piece in done.stdout, piece
    assert not (tmp_path / "runs").exists()


def test_exec_prefix_split_alike_in_the_batch_script_and_command_sh(tmp_path):
    """CTX_EXEC_PREFIX with quoted words (a bind path with a space) and a glob character: the batch script runs its
    Python behind the same words command.sh's srun line gets (shlex), unglobbed."""
    runtime = tmp_path / "runtime"
    runtime.write_text(f'#!/usr/bin/env bash\nprintf "<%s>" "$1" "$2" "$3" >> {tmp_path}/prefix.txt\nshift 3\n'
                       f'exec "$@"\n')
    runtime.chmod(0o755)
    (tmp_path / "a1").touch()
    site = tmp_path / "site.sh"
    site.write_text(f'CTX_RUNS_DIR={tmp_path}/runs\nCTX_EXEC_PREFIX="{runtime} --bind \\"/scratch/my data:/d\\" a*"\n')
    done = run_script("megatron.sbatch", ["--dry-run", "--nproc-per-node", "2", "--megatron-lm", str(FAKE_MEGATRON),
                                          "--", *GOOD], clean_env(CTX_SITE=str(site)), tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "prefix.txt").read_text() == "<--bind></scratch/my data:/d><a*>"
    inner = shlex.split(srun_line(done.stdout.replace("\\\n", ""))[-1])
    assert inner[inner.index("exec") + 1:][:4] == [str(runtime), "--bind", "/scratch/my data:/d", "a*"]


def test_megatron_sbatch_world_mismatch(tmp_path, site):
    done = run_script("megatron.sbatch", ["--dry-run", "--nproc-per-node", "3", "--megatron-lm", str(FAKE_MEGATRON),
                                          "--", *GOOD], clean_env(CTX_SITE=str(site)), tmp_path)
    assert done.returncode == 2
    assert "3 ranks (nodes × processes per node) are not a multiple of TP × PP × CP = 1 × 1 × 2" in done.stderr
    assert "[dry run]" not in done.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ["megatron.sbatch", "deepspeed.sbatch"])
def test_sbatch_copy_finds_its_launch_folder(tmp_path, site, name):
    """slurmd runs a copy named slurm_script: the job script finds the original's launch/ from scontrol's Command=
    (the path, which may hold spaces and '.sbatch' in a folder name, then the arguments), or says what is wrong."""
    checkout = tmp_path / "my repo.sbatch x" / "launch"
    shutil.copytree(LAUNCH, checkout, ignore=shutil.ignore_patterns("site.sh"))
    (tmp_path / "spool").mkdir()
    copy = tmp_path / "spool" / "slurm_script"
    shutil.copy(LAUNCH / name, copy)
    fake = tmp_path / "bin"
    fake.mkdir()
    command = tmp_path / "command.txt"
    (fake / "scontrol").write_text(f'#!/usr/bin/env bash\n[ "$1 $2" = "show job" ] && printf "JobId=%s\\n   '
                                   f'Command=%s\\n   WorkDir=/w\\n" "$3" "$(cat {command})"\n')
    (fake / "scontrol").chmod(0o755)
    env = clean_env(CTX_SITE=str(site), PATH=f"{fake}:{os.environ['PATH']}", SLURM_JOB_ID="5",
                    SLURM_JOB_NUM_NODES="1", CTX_PY=sys.executable)     # the copy has no ../.venv beside it
    command.write_text(f"{checkout / name} --dry-run --nproc-per-node 2 -- a.sbatch b")
    done = subprocess.run(["bash", str(copy), "--dry-run", "--nproc-per-node", "2", "--device", "cpu", "--bad-flag"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--bad-flag" in done.stderr, done.stderr    # ran slurm_common.sh's ctx_job
    command.write_text(f"{tmp_path / 'gone' / name} --dry-run")
    done = subprocess.run(["bash", str(copy), "--dry-run"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert f"no slurm_common.sh beside the job script ({tmp_path}/gone)" in done.stderr


def test_sbatch_missing_site_file(tmp_path):
    done = run_script("megatron.sbatch", ["--dry-run", "--nproc-per-node", "2", "--megatron-lm", str(FAKE_MEGATRON),
                                          "--", *GOOD], clean_env(CTX_SITE=str(tmp_path / "nope.sh")), tmp_path)
    assert done.returncode != 0
    assert f"site file {tmp_path}/nope.sh (CTX_SITE) does not exist" in done.stderr
    assert "[dry run]" not in done.stdout


def test_deepspeed_sbatch_dry_run(tmp_path, site, ds_config, model_json):
    ds = ds_config(GOOD_DS)
    done = run_script("deepspeed.sbatch", ["--dry-run", "--nproc-per-node", "2", "--ds-config", str(ds), "--", "-m",
                                           "ctx_plugin.train_hf", "--model", str(model_json)],
                      clean_env(CTX_SITE=str(site)), tmp_path)
    assert done.returncode == 0, done.stderr
    for piece in ("[dry run] DeepSpeed: 2 ranks = CP 2 (zigzag) × DP 1", "torch.distributed.run", f"source {site}",
                  f"-m ctx_plugin.train_hf --model {model_json} --deepspeed_config {ds}'"):
        assert piece in done.stdout, piece
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flag", ["--nodes", "--nproc-per-node"])
def test_counts_must_be_positive(flag):
    with pytest.raises(ValueError, match=f"{flag} must be at least 1"):
        slurm_job.plan_job("megatron", ["--dry-run", flag, "0", "--megatron-lm", "x", "--"],
                           env={"SLURM_GPUS_ON_NODE": "0"})


def test_train_hf_checkpoint_dir(model_json, tmp_path):
    from ctx_plugin import train_hf

    args = train_hf.parse_args(["--model", str(model_json), "--resume"])
    with pytest.raises(ValueError, match="--resume needs --checkpoint-dir DIR"):
        train_hf.checkpoint_dir(args, env={})
    assert train_hf.checkpoint_dir(args, env={"CTX_RUN_DIR": str(tmp_path)}) == tmp_path / "checkpoints"
    given = train_hf.parse_args(["--model", str(model_json), "--checkpoint-dir", str(tmp_path / "c")])
    assert train_hf.checkpoint_dir(given, env={"CTX_RUN_DIR": "/elsewhere"}) == tmp_path / "c"
    assert train_hf.checkpoint_dir(train_hf.parse_args(["--model", str(model_json)]), env={}) is None
