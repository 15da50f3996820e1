"""`python -m mpitrain`: argparse refuses bad values with exit status 2; inspect and
bench step produce what they promise."""
import json
import os
import subprocess
import sys

import pytest

from mpitrain.cli import main


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mpitrain", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv,message", [
    (["train", "--epochs", "-1"], "argument --epochs: -1 must be >= 1"),
    (["train", "--epochs", "two"], "argument --epochs: 'two' is not a valid int"),
    (["train", "--batch-size", "0"], "argument --batch-size: 0 must be >= 1"),
    (["train", "--lr", "0"], "argument --lr: 0 must be > 0.0"),
    (["train", "--momentum", "1.5"], "argument --momentum: 1.5 must be < 1.0"),
    (["train", "--label-smoothing", "-0.1"], "argument --label-smoothing: -0.1 must be >= 0.0"),
    (["train", "--weight-decay=-1e-4"], "argument --weight-decay: -1e-4 must be >= 0.0"),
    (["train", "--data", "no/such/file.h5"], "training file no/such/file.h5 does not exist"),
    (["convert", "synthetic", "x.h5", "--size", "500"], "argument --size: '500' is not WIDTHxHEIGHT"),
    (["convert", "imagefolder", "src"], "the following arguments are required: dst"),
    (["train", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["train", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["inspect", "--image-size", "0"], "argument --image-size: 0 must be >= 1"),
    (["bench", "step", "--steps", "0"], "argument --steps: 0 must be >= 1"),
    (["bench", "step", "--reference", "jax"], "argument --reference: invalid choice: 'jax'"),
    (["bench"], "the following arguments are required: benchmark"),
    ([], "the following arguments are required: command"),
])
def test_bad_values_exit_2_with_argparse_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m mpitrain" in err
    assert message in err


def test_unknown_model_lists_the_choices():
    r = run("train", "--model", "resnet51")
    assert r.returncode == 2
    assert "argument --model: invalid choice: 'resnet51' (choose from" in r.stderr
    for name in ("alexnet", "alexnet_bn", "resnet18", "resnet50", "resnet152", "resnet_small"):
        assert f"'{name}'" in r.stderr or f" {name}" in r.stderr


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["inspect", "--help"],
                                  ["bench", "--help"], ["bench", "step", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    assert "usage: python -m mpitrain" in capsys.readouterr().out


def test_inspect_resnet50(capsys):
    main(["inspect", "--model", "resnet50", "--image-size", "224"])
    assert "25,557,032" in capsys.readouterr().out


def test_bench_step_json():
    r = run("bench", "step", "--model", "resnet_small", "--image-size", "32", "--batch", "8",
            "--steps", "2", "--warmup", "1", "--num-classes", "10", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)                      # one JSON object and nothing else
    ours = result["mpitrain"]
    assert ours["images_per_s"] > 0
    assert ours["step_ms"] == pytest.approx(8 / ours["images_per_s"] * 1e3)
    for phase in ("forward_loss_ms", "backward_ms", "update_ms"):
        assert ours[phase] > 0
    assert result["blas"]["threads"] >= 1


@pytest.mark.torch
def test_bench_step_against_torch():
    r = run("bench", "step", "--model", "resnet_small", "--image-size", "32", "--batch", "8",
            "--steps", "2", "--warmup", "1", "--num-classes", "10", "--reference", "torch",
            "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["torch"]["images_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["mpitrain"]["images_per_s"]
                                            / result["torch"]["images_per_s"])
    assert result["torch"]["threads"] == result["blas"]["threads"]


def test_native_openblas_runs_without_the_forcing_variables():
    # the environment as it is: where OPENBLAS_CORETYPE/_L2_SIZE are set the command
    # re-runs itself without them and says so; either way the benchmark sees neither
    r = run("bench", "step", "--model", "resnet_small", "--image-size", "32", "--batch", "4",
            "--steps", "1", "--warmup", "0", "--num-classes", "10", "--native-openblas", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["blas"]["forced"] == {}
    forced = [k for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ]
    removed = result["native_openblas"]["removed"]
    if forced:
        assert "--native-openblas: re-running without" in r.stderr
        assert all(f"{k}=" in removed for k in forced)
    else:
        assert removed == "nothing was set"


def test_convert_then_bench_data(tmp_path):
    """convert digits and synthetic JPEGs through the CLI, then time the loader on each."""
    r = run("convert", "digits", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "train: 1438 images" in r.stdout and "val: 359 images" in r.stdout
    jpegs = tmp_path / "synthetic.h5"
    r = run("convert", "synthetic", str(jpegs), "--count", "8", "--size", "96x64", "--classes", "2")
    assert r.returncode == 0, r.stderr
    assert "train: 8 images" in r.stdout
    for path, size in ((tmp_path / "digits_val.h5", "32"), (jpegs, "48")):
        r = run("bench", "data", "--data", str(path), "--image-size", size, "--batch", "4",
                "--workers", "1", "--batches", "2", "--json")
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout)
        assert result["mpitrain"]["images_per_s"] > 0
