"""Failure handling: a killed rank ends the whole job, the stall watchdog, a diverged
run, and each invalid input refused before any work with a message that names it."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mpitrain import checkpoint
import launcher
from test_checkpoint import command, environment, heartbeats, solo, wait_for

# every test here starts mpitrain as a job (under mpiexec, or as an MPI singleton)
pytestmark = pytest.mark.launches

# 22 steps an epoch, under a second an epoch on a fast host: the tests interrupt the job
# in epoch 2, and 30 epochs keep it running well past then
JOB = ("train", "--epochs", "30", "--batch-size", "64")


@pytest.fixture(scope="module")
def five_classes(tmp_path_factory):
    """A 32x32 file with 5 classes, and a checkpoint of resnet_small for the digits' 10."""
    from mpitrain.datasets.convert import convert_synthetic
    from mpitrain.nets import build_model
    path = tmp_path_factory.mktemp("five")
    data = str(path / "five.h5")
    convert_synthetic(data, 40, (32, 32), classes=5)
    model = build_model("resnet_small", num_classes=10)
    config = dict(model="resnet_small", batch_size=8, data="digits", num_classes=10,
                  image_size=32)
    ckpt = checkpoint.write(str(path / "checkpoint-000000001.h5"),
                            checkpoint.collect(model, solo(), 0, 1, 1, config))
    return data, ckpt


def launch(ranks, *args, log):
    return subprocess.Popen(command(ranks, *args), stdout=log, stderr=subprocess.STDOUT,
                            env=environment(ranks))


def rank_pid(job, run_dir, rank):
    """The pid of MPI rank `rank` of `job`, from the run's heartbeat files (any MPI)."""
    return heartbeats(run_dir, 2, job)[rank]["pid"]


def run_quick(*args, timeout=120):
    """One process, no mpiexec (MPI starts as a singleton)."""
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], capture_output=True,
                          text=True, timeout=timeout, env=environment(1))


# ----- a rank dies or stalls -----
def test_kill_9_of_rank_1_ends_the_job_and_the_checkpoint_loads(digits, tmp_path):
    run_dir = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        job = launch(2, *JOB, "--data-dir", str(digits), "--run-dir", str(run_dir), log=log)
        try:
            wait_for(run_dir / "checkpoint-000000022.h5", job)
            time.sleep(1.0)                                 # into epoch 2
            os.kill(rank_pid(job, run_dir, 1), signal.SIGKILL)
            killed = time.monotonic()
            rc = job.wait(timeout=30)
            took = time.monotonic() - killed
        finally:
            if job.poll() is None:
                job.kill()
    assert rc != 0 and took < 30, (tmp_path / "log").read_text()
    last = checkpoint.latest(str(run_dir))
    state = checkpoint.read(last)
    assert state["global_step"] >= 22 and np.isfinite(state["master"]).all()


def test_stall_watchdog_ends_the_job(digits, tmp_path):
    run_dir = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        job = launch(2, *JOB, "--data-dir", str(digits), "--run-dir", str(run_dir),
                     "--collective-timeout", "6", log=log)
        stalled = None
        try:
            wait_for(run_dir / "checkpoint-000000022.h5", job)
            stalled = rank_pid(job, run_dir, 1)
            os.kill(stalled, signal.SIGSTOP)                # rank 1 stops arriving
            rc = job.wait(timeout=40)
        finally:
            if job.poll() is None:
                job.kill()
            if stalled is not None:
                try:
                    os.kill(stalled, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    out = f"exit status {rc}\n" + (tmp_path / "log").read_text()
    assert rc != 0, out
    assert "no progress for" in out and "(--collective-timeout 6)" in out, out
    assert "rank 0 of 2" in out, out                        # the rank left waiting says so
    assert "; rank 1: no sign of life for" in out, out     # and names the stalled one


def test_heartbeat_counts_agree_when_a_rank_has_no_validation_images_in_a_step(digits,
                                                                              tmp_path):
    """The watchdog takes a rank whose count of phases entered is behind the others' as
    the one that did not arrive, so the counts must agree at the same point of the run.
    Under --trace the layers of forward and backward are spans too: 359 validation images
    in global batches of 32 leave rank 1 none in the last one, so it runs fewer layers;
    its count is the others' all the same."""
    from mpitrain.control import read_heartbeats
    run_dir = tmp_path / "run"
    r = subprocess.run(command(2, "train", "--epochs", "2", "--batch-size", "32",
                               "--data-dir", str(digits), "--run-dir", str(run_dir),
                               "--trace", str(tmp_path / "trace/")),
                       capture_output=True, text=True, timeout=300, env=environment(2))
    assert r.returncode == 0, r.stdout + r.stderr
    board = read_heartbeats(str(run_dir / "heartbeat"), 2)
    assert board[0]["count"] == board[1]["count"] > 0, board


FAILING = textwrap.dedent("""
    import numpy as np
    from mpi4py import MPI
    from mpitrain.comm import Communicator
    from mpitrain.comm.buckets import Reducer
    from mpitrain.nets.conv import Conv2d
    from mpitrain.nets.linear import Linear
    from mpitrain.nets.module import Sequential
    from mpitrain.nets.pool import GlobalAvgPool2d
    from mpitrain.nets.losses import softmax_cross_entropy

    comm = Communicator(MPI.COMM_WORLD)
    conv = Conv2d(3, 4, 3, padding=1)
    model = Sequential(conv, GlobalAvgPool2d(), Linear(4, 3)).bind()
    reducer = Reducer(model.arena, comm, threshold=16)
    if comm.rank == 1:                       # fails after the first buckets went out
        def broken(dy):
            raise RuntimeError("rank 1 fails in backward")
        conv.backward = broken
    x = np.ones((2, 4, 4, 3), np.float32)
    loss, dlogits = softmax_cross_entropy(model.forward(x), np.array([0, 1]))
    reducer.begin()
    model.backward(dlogits)
    reducer.finish()
    print("rank", comm.rank, "finished: the failure went unnoticed")
""")


def test_a_rank_that_raises_during_the_gradient_sum_ends_the_job(tmp_path):
    """A rank that raises during an overlapped gradient sum ends the whole job instead of
    leaving the others waiting in the collective."""
    script = tmp_path / "fail.py"
    script.write_text(FAILING)
    t = time.perf_counter()
    done = subprocess.run(launcher.command(2, sys.executable, "-m", "mpi4py", str(script)),
                          capture_output=True, text=True, timeout=60, env=environment(2))
    took = time.perf_counter() - t
    assert done.returncode != 0, done.stdout + done.stderr
    assert "rank 1 fails in backward" in done.stderr
    assert "unnoticed" not in done.stdout
    assert took < 30


def test_non_finite_loss_stops_and_saves_nothing(digits, tmp_path):
    run_dir = tmp_path / "run"
    r = run_quick("train", "--epochs", "1", "--batch-size", "64", "--lr", "1e30",
                  "--warmup-epochs", "0", "--data-dir", str(digits), "--run-dir", str(run_dir))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "the training loss is not finite" in r.stderr and "rank(s) [0]" in r.stderr
    assert "the last good checkpoint is none" in r.stderr
    assert not [p for p in os.listdir(run_dir) if "checkpoint" in p]
    assert "Traceback" not in r.stderr
    assert_diverged_for_the_study(run_dir, r, since=2)


def assert_diverged_for_the_study(run_dir, r, since):
    """metrics.jsonl ends in the divergence's record, which the study reads as diverged."""
    from mpitrain.metrics import read_metrics
    from mpitrain.tools.study import read_result
    last = read_metrics(str(run_dir / "metrics.jsonl"))[-1]
    assert (last["kind"], last["since"]) == ("diverged", since), last
    log = run_dir / "log.txt"
    log.write_text(r.stdout + r.stderr)
    assert read_result(str(run_dir), str(log), r.returncode) == dict(diverged=True)


def test_checkpoints_of_a_model_diverged_unseen_by_the_loss_are_set_aside(digits, tmp_path):
    """Two divergences the training loss does not show at once: under fp16 the gradients
    overflow step after step until the loss scale gives up, and in fp32 an update wrecks
    the weights on an epoch's last step (the next loss is NaN, the evaluation before it
    saw only non-finite logits). The checkpoints written since are set aside as
    diverged-*, never named as the last good one, nor taken by --resume auto."""
    base = ("train", "--lr", "1e30", "--warmup-epochs", "0", "--schedule", "constant",
            "--image-size", "8", "--data-dir", str(digits))
    fp16 = tmp_path / "fp16"
    r = run_quick(*base, "--epochs", "4", "--batch-size", "64", "--precision", "fp16",
                  "--run-dir", str(fp16))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "in a row at the smallest loss scale 1" in r.stderr
    assert "Nothing was saved after the overflows began (step 2); the last good checkpoint " \
           "is none" in r.stderr
    assert sorted(p for p in os.listdir(fp16) if "checkpoint" in p) \
        == ["diverged-checkpoint-000000022.h5"]
    assert_diverged_for_the_study(fp16, r, since=2)
    # stopped during the overflows and resumed: the resumed run knows where they began
    resumed = tmp_path / "resumed"
    r = run_quick(*base, "--epochs", "1", "--batch-size", "256", "--precision", "fp16",
                  "--loss-scale", "1e9", "--run-dir", str(resumed))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_quick(*base, "--epochs", "2", "--batch-size", "256", "--precision", "fp16",
                  "--loss-scale", "1e9", "--run-dir", str(resumed), "--resume", "auto")
    assert "Nothing was saved after the overflows began (step 1); the last good checkpoint " \
           "is none" in r.stderr, r.stdout + r.stderr
    assert sorted(p for p in os.listdir(resumed) if "checkpoint" in p) \
        == ["diverged-checkpoint-000000005.h5"]
    from mpitrain.metrics import read_metrics                 # a static scale too large for
    assert read_metrics(str(resumed / "metrics.jsonl"))[-1]["kind"] != "diverged"  # them
    fp32 = tmp_path / "fp32"
    r = run_quick(*base, "--epochs", "3", "--batch-size", "1438", "--run-dir", str(fp32))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "the training loss is not finite at epoch 2, step 1" in r.stderr
    assert "the last good checkpoint is none" in r.stderr
    assert sorted(p for p in os.listdir(fp32) if "checkpoint" in p) \
        == ["diverged-checkpoint-000000001.h5"]
    assert_diverged_for_the_study(fp32, r, since=1)


# ----- invalid inputs, refused before any work -----
def test_global_batch_not_divisible_by_the_ranks(digits, tmp_path):
    # rank count 2 is the point, so under mpiexec
    r = subprocess.run(command(2, "train", "--batch-size", "63", "--data-dir", str(digits),
                               "--run-dir", str(tmp_path)),
                       capture_output=True, text=True, timeout=120, env=environment(2))
    assert r.returncode == 2
    assert "--batch-size 63, the global batch, does not divide by the 2 MPI ranks" in r.stderr
    assert "epoch" not in r.stdout


def test_data_smaller_than_one_global_batch(digits, tmp_path):
    r = run_quick("train", "--batch-size", "2000", "--data-dir", str(digits),
                  "--run-dir", str(tmp_path))
    assert r.returncode == 2
    assert "--batch-size 2000, the global batch, exceeds the 1438 training images" in r.stderr
    assert "epoch" not in r.stdout


def test_resume_with_other_classes_is_refused(five_classes, tmp_path):
    data, ckpt = five_classes
    val = str(tmp_path / "val.h5")
    shutil.copy(data, val)
    r = run_quick("train", "--data", data, "--val-data", val, "--batch-size", "8",
                  "--resume", ckpt, "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("does not fit the model: parameter fc.bias has shape (10,) in the checkpoint, "
            "the model has fc.bias (5,)") in r.stderr
    assert "epoch 1" not in r.stdout


def test_eval_with_other_classes_is_refused(five_classes):
    data, ckpt = five_classes
    r = run_quick("eval", "--checkpoint", ckpt, "--data", data)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"{data} has 5 classes, but the checkpoint's model resnet_small was trained on 10"
            in r.stderr)


def test_resume_from_a_missing_file(digits, tmp_path):
    """Refused before the run directory, which a resume without --run-dir goes on in (the
    missing file's folder was made, and left behind)."""
    missing = tmp_path / "typo" / "nope.h5"
    r = run_quick("train", "--data-dir", str(digits), "--resume", str(missing))
    assert r.returncode == 2
    assert f"--resume {missing}: no such checkpoint file or run directory" in r.stderr
    assert os.listdir(tmp_path) == []


def test_plot_without_metrics(tmp_path):
    r = run_quick("plot", str(tmp_path))
    assert r.returncode == 2 and "metrics.jsonl does not exist" in r.stderr
