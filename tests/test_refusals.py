"""Refusals of commands whose own test files lie elsewhere: eval's image size, plot's
records, the all-reduce's polling variable, the kernels' BLAS and check-gpu's outputs.
Each is one line naming the problem and the fix, with exit status 2, nothing written and
no traceback."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from mpitrain.datasets.h5format import Writer
from mpitrain.nets import build_model
from test_checkpoint import command, environment
from test_export import CLASSES, write_checkpoint


def quick(*args, cwd=None, env=None, timeout=300):
    """One process, no mpiexec (MPI starts as a singleton)."""
    return subprocess.run([sys.executable, "-m", "mpitrain", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          env=env or environment(1), cwd=cwd)


def refused(r, *fragments):
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    for fragment in fragments:
        assert fragment in r.stderr, out
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(data file of 3 classes at 40x40, {model: its checkpoint}) for alexnet at 95x95 and
    resnet_small at 32x32."""
    root = tmp_path_factory.mktemp("eval")
    data = str(root / "tiny.h5")
    rng = np.random.default_rng(0)
    with Writer(data, CLASSES, storage="pixels") as w:
        for i in range(6):
            w.add(i % 3, rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))
        w.commit([120.0, 110.0, 100.0], [60.0, 55.0, 50.0])
    made = {}
    for name, size in (("alexnet", 95), ("resnet_small", 32)):
        cfg = {"model": name, "num_classes": len(CLASSES), "image_size": size, "data": data,
               "data_dir": "data", "batch_size": 4}
        made[name] = write_checkpoint(build_model(name, num_classes=len(CLASSES)), cfg,
                                      root / f"{name}.h5")
    return data, made


# ----- eval -----
def test_eval_refuses_an_image_size_the_network_cannot_take(checkpoints):
    """As train refuses it: AlexNet's feature maps vanish below 63x63 (it ended in a
    traceback of the first forward pass)."""
    data, made = checkpoints
    refused(quick("eval", "--checkpoint", made["alexnet"], "--data", data, "--image-size", "32"),
            "error: --image-size 32 is too small for alexnet: its feature maps shrink to "
            "nothing; the smallest size it takes is 63")


def test_eval_of_an_image_size_beyond_memory_names_it(checkpoints):
    data, made = checkpoints
    r = quick("eval", "--checkpoint", made["resnet_small"], "--data", data, "--image-size",
              "100000")
    refused(r, "error: out of memory: Unable to allocate", "; lower --image-size (the images")


# ----- plot -----
STEP = {"kind": "step", "epoch": 1, "step": 5, "global_step": 5, "loss": 2.1, "top1": 0.2,
        "lr": 0.1, "loss_scale": None, "images_per_s": 900.0, "skipped_records": 0,
        "time": {"data": 0.001, "forward": 0.01, "backward": 0.02}}


@pytest.mark.parametrize("line,problem", [
    ("[1, 2]", "list where a JSON object was expected"),
    (json.dumps({**STEP, "epoch": "x"}), "'epoch' of a step record is 'x', not a whole number"),
    (json.dumps({**STEP, "time": [1]}), "'time' of a step record is [1], not an object of "
                                        "phase times"),
    (json.dumps({k: v for k, v in STEP.items() if k != "lr"}), "a step record without 'lr'"),
    (json.dumps({"kind": "eval", "epoch": 1, "top1": "high"}),
     "'top1' of an eval record is 'high', not a number or null"),
])
def test_plot_refuses_a_record_naming_the_file_and_line(line, problem, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps(STEP) + "\n" + line + "\n")
    refused(quick("plot", tmp_path), f"error: {metrics}, line 2: {problem}; it is not a "
                                     f"record a training run writes: remove or mend that line")
    assert os.listdir(tmp_path) == ["metrics.jsonl"]


def test_plot_draws_the_records_a_run_writes_and_passes_over_a_torn_line(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps(STEP) + "\n" + json.dumps(STEP)[:30])
    r = quick("plot", tmp_path)
    assert r.returncode == 0 and (tmp_path / "loss.png").exists(), r.stderr


# ----- the all-reduce's polling -----
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.launches)])
def test_a_bad_poll_interval_is_named_with_what_it_takes(digits, tmp_path, ranks):
    """MPITRAIN_COMM_POLL=abc ended every rank in a ValueError at import."""
    run_dir = tmp_path / "run"
    env = dict(environment(ranks), MPITRAIN_COMM_POLL="abc")
    r = subprocess.run(command(ranks, "train", "--data-dir", str(digits), "--run-dir",
                               str(run_dir), "--epochs", "1"),
                       capture_output=True, text=True, timeout=180, env=env)
    refused(r, "error: MPITRAIN_COMM_POLL=abc: 'abc' is not a valid float; it takes the seconds "
               "between tests of a started all-reduce, a number >= 0 (0: blocking "
               "collectives): fix it, or unset it for 0.0002")
    assert not run_dir.exists()


# ----- the kernels' BLAS -----
def test_a_bad_blas_choice_is_named_by_every_command_that_computes(checkpoints, tmp_path):
    """MPITRAIN_BLAS=foo was taken by inspect and bench step for an image size too small
    (their checks' probe forward failed in a product), and ended eval and predict in a
    traceback."""
    data, made = checkpoints
    env = dict(environment(1), MPITRAIN_BLAS="foo")
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(image)
    for args in (("inspect", "--model", "resnet50"),
                 ("bench", "step", "--model", "resnet_small", "--image-size", "32", "--batch",
                  "8"),
                 ("eval", "--checkpoint", made["resnet_small"], "--data", data),
                 ("predict", "--checkpoint", made["resnet_small"], image),
                 ("preview", "--data", data, "--out", tmp_path / "p.png")):
        refused(quick(*args, env=env, cwd=tmp_path),
                f"mpitrain {args[0]}", "error: MPITRAIN_BLAS='foo': expected mkl or openblas "
                                      "(or unset)")
    assert sorted(os.listdir(tmp_path)) == ["a.png"]


# ----- check-gpu -----
def check_gpu(*args, cwd):
    return subprocess.run([sys.executable, "-m", "mpitrain", "check-gpu", "--dry-run", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def test_check_gpu_refuses_outputs_it_cannot_write_before_any_step(tmp_path):
    """A directory as --out and a file as --out-dir failed after every step (status 1)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "notes.txt").write_text("kept")
    for args, message in ((("--out", "data"), "gpu-check: --out data is a directory; name the "
                                              "file to write\n"),
                          (("--out-dir", "notes.txt"), "gpu-check: --out-dir notes.txt is a "
                                                       "file; give a directory for the report "
                                                       "and the steps' logs\n")):
        r = check_gpu(*args, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr == message and r.stdout == "", r.stdout + r.stderr
    assert sorted(os.listdir(tmp_path)) == ["data", "notes.txt"]
    assert os.listdir(tmp_path / "data") == [] and (tmp_path / "notes.txt").read_text() == "kept"


def test_check_gpu_says_that_nothing_ran_when_every_step_was_skipped(tmp_path):
    """--budget 0 skips every step: "all passed", status 0, said of a check that checked
    nothing."""
    r = check_gpu("--budget", "0", "--out-dir", "check", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "gpu-check: nothing ran: every step was skipped (--skip, or out of time under " \
           "--budget)\n" in r.stdout and "all passed" not in r.stdout, r.stdout
