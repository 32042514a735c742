"""The rank-agreement signature: stable int64 codes that decode back to the values, every field telling ranks
apart, the error text; and the one switch on every surface (CPConfig, Megatron flag, DeepSpeed key)."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench.counting import CommCounter
from ctx_plugin.core.agreement import FIELDS, LENGTH, NONE, agreed, decode, digest, disagreement, encode

FULL = {"op": "cp_attention", "batch": 2, "local_seq": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
        "v_head_dim": 128, "shape": "(2, 4096, 32, 128)", "dim": 1, "dtype": "torch.bfloat16", "device": "cuda",
        "requires_grad": True, "backend": "ulysses_ring", "ulysses_size": 2, "kernel": "sdpa_cudnn", "causal": False,
        "softmax_scale": 128 ** -0.5, "window": "-,-", "softcap": 50.0, "sinks": "-", "documents": "-",
        "input_check": "ok"}
# A second value for every field, to check that each one tells two ranks apart.
OTHER = {"op": "gather_sequence", "batch": 1, "local_seq": 4095, "heads": 16, "kv_heads": 1, "head_dim": 64,
         "v_head_dim": 32, "shape": "(2, 4096, 32, 127)", "dim": -1, "dtype": "torch.float16", "device": "cpu",
         "requires_grad": False, "backend": "zigzag", "ulysses_size": 1, "kernel": "flash_attn", "causal": True,
         "softmax_scale": math.nextafter(128 ** -0.5, 1.0), "window": "4095,-", "softcap": 30.0, "sinks": "torch.float32",
         "documents": "1000:0123456789abcdef", "input_check": "ValueError: no"}


def test_schema_is_covered():
    assert set(FULL) == set(OTHER) == {f.name for f in FIELDS}
    assert LENGTH == sum(f.words for f in FIELDS) and encode(FULL).shape == (LENGTH,)


def test_roundtrip():
    assert decode(encode(FULL)) == FULL
    assert decode(encode(OTHER)) == OTHER
    gather = {"op": "gather_sequence", "shape": "(2, 8, 3)", "dim": 1, "dtype": "torch.int64"}
    assert decode(encode(gather)) == {**dict.fromkeys(FULL), **gather}      # fields that do not apply: None


@pytest.mark.parametrize("field", [f.name for f in FIELDS])
def test_each_field_tells_ranks_apart(field):
    for other in (OTHER[field], None):
        assert not torch.equal(encode(FULL), encode({**FULL, field: other}))
        assert digest(FULL) != digest({**FULL, field: other})


def test_digest_words_negate_safely():
    """The all-reduce compares max(d) with −max(−d): a word of −2⁶³ would negate to itself."""
    for sig in (FULL, OTHER, {}, {"softmax_scale": -0.0}, {"batch": -2 ** 70}, {"local_seq": 2 ** 70},
                {"input_check": "ValueError: 1 × 2 ≠ 3"}):
        d = digest(sig)
        assert len(d) == 2 and all(0 <= w < 2 ** 63 for w in d)
        assert encode(sig).dtype == torch.int64
    assert decode(encode({"softmax_scale": -0.0}))["softmax_scale"] == 0.0


def test_agreed_from_the_reduced_words():
    """The check's decision from the all-reduce(MAX) of every rank's [d, −d]: equal only when max == min."""
    def reduce(ds):
        return [max(col) for col in zip(*([*d, *(-w for w in d)] for d in ds))]
    a, b = digest(FULL), digest(OTHER)
    assert agreed(reduce([a, a, a]))
    assert not agreed(reduce([a, b, a])) and not agreed(reduce([b, a])) and not agreed(reduce([a, [a[0], b[1]]]))
    batch_word = sum(f.words for f in FIELDS[:[f.name for f in FIELDS].index("batch")])
    assert decode(encode({}))["batch"] is None and int(encode({})[batch_word]) == NONE


def test_long_and_non_ascii_strings_stay_distinct():
    a, b = "ValueError: " + "x" * 300 + "a", "ValueError: " + "x" * 300 + "b"
    da, db = decode(encode({"input_check": a}))["input_check"], decode(encode({"input_check": b}))["input_check"]
    assert da != db and da.startswith("ValueError: xxx") and len(da) == 8 * 32
    assert decode(encode({"input_check": "1 × 2 ≥ 0"}))["input_check"] == "1 × 2 ≥ 0"       # as written
    cut = decode(encode({"input_check": "×" * 200}))["input_check"]       # shortened inside a character: kept valid
    assert cut.startswith("××") and cut != decode(encode({"input_check": "×" * 201}))["input_check"]


def test_unknown_field_is_a_programming_error():
    with pytest.raises(KeyError, match="not signature fields"):
        encode({"heads": 1, "head": 2})


def test_codes_do_not_depend_on_the_process():
    """No Python hash(): another interpreter with another hash seed encodes the same words."""
    code = ("import json, sys; from ctx_plugin.core.agreement import digest, encode; s = json.loads(sys.argv[1]); "
            "print(json.dumps([encode(s).tolist(), digest(s)]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(FULL)], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert json.loads(out) == [encode(FULL).tolist(), digest(FULL)]


def test_message_names_fields_and_ranks():
    sigs = [dict(FULL) for _ in range(6)]
    sigs[2]["dtype"] = sigs[5]["dtype"] = "torch.float32"
    sigs[4]["local_seq"] = 2048
    text = disagreement([decode(encode(s)) for s in sigs])
    assert text.startswith("the 6 ranks of the context-parallel group disagree about this cp_attention call")
    assert "\n  local_seq: ranks 0-3, 5: 4096; rank 4: 2048\n" in text
    assert "\n  dtype: ranks 0-1, 3-4: torch.bfloat16; ranks 2, 5: torch.float32\n" in text
    assert text.count("\n  ") == 2 and "check_ranks=False" in text
    sigs[1] = dict(OTHER)           # another operation: only that is named
    text = disagreement(sigs)
    assert "disagree about which call to make" in text
    assert "\n  op: ranks 0, 2-5: cp_attention; rank 1: gather_sequence\n" in text and text.count("\n  ") == 1


def test_switch_on_every_surface():
    assert ctx_plugin.CPConfig().check_ranks is True
    with pytest.raises(TypeError, match="check_ranks must be a bool"):
        ctx_plugin.CPConfig(check_ranks=0)
    from ctx_plugin.deepspeed import parse_section
    assert parse_section({"size": 2, "check_ranks": False}).cp_config.check_ranks is False
    assert parse_section({"size": 2}).cp_config.check_ranks is True
    with pytest.raises(TypeError, match='"context_parallel.check_ranks" must be a bool'):
        parse_section({"size": 2, "check_ranks": 0})
    from ctx_plugin.megatron.args import add_arguments, settings_from_args
    for flags, want in (([], True), (["--cp-no-rank-check"], False)):
        args = add_arguments(argparse.ArgumentParser()).parse_args(flags)
        args.context_parallel_size, args.num_attention_heads, args.seq_length, args.num_layers = 2, 8, 64, 2
        assert settings_from_args(args).cp_config.check_ranks is want


def test_one_process_never_checks():
    groups = ctx_plugin.build_cp_groups(ctx_plugin.CPConfig(kernel="torch"))
    assert groups.check_group is None
    q = torch.randn(1, 4, 2, 8)
    with CommCounter().counting() as counter:
        ctx_plugin.cp_attention(q, q, q, config=groups.config, groups=groups)
    assert "agree" not in counter.counts
    with pytest.raises(ValueError, match="positive finite"):      # bad input still raises at once
        ctx_plugin.cp_attention(q, q, q, config=groups.config, groups=groups, softmax_scale=-1.0)
