"""``ctx_plugin.train_hf``'s arguments that would otherwise be found wrong late or not at all: ``--report`` into a
folder that does not exist (training ran to the end, then rank 0 failed writing it), ``--samples`` with ``--data``
(ignored), and samples that do not split evenly over the data-parallel replicas (``DistributedSampler`` repeated
the first ones in every pass, shifting every later step's samples)."""
from __future__ import annotations

import json

import pytest

from ctx_plugin import train_hf


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    return str(tmp_path / "config.json")


def test_a_report_in_a_missing_folder_is_refused_before_training(model, tmp_path):
    with pytest.raises(ValueError, match=r"--report.*folder .*nowhere.* does not exist"):
        train_hf.parse_args(["--model", model, "--report", str(tmp_path / "nowhere" / "r.json")])
    assert train_hf.parse_args(["--model", model, "--report", str(tmp_path / "r.json")]).report.endswith("r.json")


def test_samples_with_data_is_refused(model, tmp_path):
    data = tmp_path / "tokens.npy"
    data.write_bytes(b"")
    with pytest.raises(ValueError, match=r"--samples 3 sets the number of synthetic samples; with --data every sample"):
        train_hf.parse_args(["--model", model, "--data", str(data), "--samples", "3"])
    assert train_hf.parse_args(["--model", model, "--data", str(data)]).data == str(data)
    assert train_hf.parse_args(["--model", model]).samples == 64
    assert train_hf.parse_args(["--model", model, "--samples", "8"]).samples == 8


@pytest.mark.parametrize("samples,replicas,ok", [(8, 2, True), (7, 2, False), (7, 1, True), (9, 4, False)])
def test_samples_split_evenly_over_the_replicas(samples, replicas, ok):
    if ok:
        train_hf.check_replicas(samples, replicas)
    else:
        with pytest.raises(ValueError, match=rf"{samples} samples do not split evenly over {replicas} data-parallel "
                                             rf"replicas: the sampler would repeat the first "
                                             rf"{replicas - samples % replicas} in every pass"):
            train_hf.check_replicas(samples, replicas)


def test_a_seed_torch_cannot_take_is_refused(model):
    with pytest.raises(ValueError, match=r"is not a seed: give a whole number in 0..2\^63-1"):
        train_hf.parse_args(["--model", model, "--seed", str(2**63)])
    assert train_hf.parse_args(["--model", model, "--seed", str(2**63 - 1)]).seed == 2**63 - 1


def _args(model, tmp_path, tokens, *extra):
    import numpy as np

    np.save(tmp_path / "tokens.npy", tokens)
    return train_hf.parse_args(["--model", model, "--data", str(tmp_path / "tokens.npy"), "--seq-len", "4", *extra])


@pytest.mark.parametrize("tokens,message", [
    ([[1.0, 2.0, 3.0, 4.0]], r"token ids must be integers, got float64"),
    ([[True, False, True, False]], r"token ids must be integers, got bool"),
    ([[1, 2, 64, 3]], r"token ids must lie in \[0, 64\) \(the model's vocab_size\), found 64"),
    ([[1, -5, 2, 3]], r"token ids must lie in \[0, 64\) .*found -5"),
    ([1, 2, 3, 4, 5, 6], r"6 tokens are not a whole number of --seq-len 4 windows"),
    ([[1, 2, 3]], r"shape \(1, 3\), expected \[samples, 4\]"),
], ids=["float", "bool", "past-vocab", "negative", "windows", "shape"])
def test_data_that_is_not_token_ids_of_the_model_is_refused(model, tmp_path, tokens, message):
    """Before, floats were truncated and ids outside the embedding reached it on every rank after initialize."""
    import numpy as np

    args = _args(model, tmp_path, np.array(tokens))
    with pytest.raises(ValueError, match=message):
        train_hf.load_data(args, 64)
    with pytest.raises(ValueError, match=message):
        train_hf.token_file(args, 64)                 # what the launcher's check_job reads


def test_good_data_and_its_digest(model, tmp_path):
    import numpy as np

    samples = train_hf.load_data(_args(model, tmp_path, np.arange(8, dtype=np.int16)), 64)
    assert [s["input_ids"].tolist() for s in samples] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert samples[0]["input_ids"].dtype == train_hf.torch.int64
    other = train_hf.load_data(_args(model, tmp_path, np.arange(8)[::-1].copy()), 64)
    assert train_hf.data_digest(samples) != train_hf.data_digest(other)
    assert train_hf.data_digest(samples) == train_hf.data_digest(train_hf.load_data(_args(model, tmp_path,
                                                                                          np.arange(8)), 64))


def test_pack_eos_outside_the_vocabulary_is_refused(model):
    args = train_hf.parse_args(["--model", model, "--pack-eos", "64"])
    with pytest.raises(ValueError, match=r"--pack-eos 64 is no token of the model's vocabulary \(vocab_size 64\)"):
        train_hf.load_data(args, 64)
    assert len(train_hf.load_data(train_hf.parse_args(["--model", model, "--pack-eos", "63", "--samples", "2"]), 64)) == 2


def test_synthetic_data_of_a_config_without_vocab_size(tmp_path):
    """transformers' default vocab_size (32000 for llama) is the model's: the synthetic data draws from it (a config
    without the key raised KeyError)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    args = train_hf.parse_args(["--model", str(tmp_path / "config.json"), "--samples", "2", "--seq-len", "8"])
    vocab = train_hf._model_config(args).vocab_size
    assert vocab == 32000 and len(train_hf.load_data(args, vocab)) == 2
