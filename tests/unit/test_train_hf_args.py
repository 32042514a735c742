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
