"""Runs as users stop them, under a real MPI launcher: Ctrl-C and other signals to any
rank, a rank blocked in a collective, a stop that lands on an epoch's last step, a
rank that raises under the installed `mpitrain` script, a loss that explodes.

Ranks are found through their heartbeat files (RUN_DIR/heartbeat/rank<N>: pid and
position), whatever the MPI library.
"""
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from mpitrain import checkpoint
from launcher import BackgroundJob, JobEnded, environment, signal_as_step_starts
from test_checkpoint import command, run

# every test here starts its own MPI job (CI runs them under MPICH and Open MPI)
pytestmark = pytest.mark.launches

# 22 steps per epoch of the digits at a global batch of 64
JOB = ("train", "--batch-size", "64", "--seed", "5")


class Job(BackgroundJob):
    """A training job of JOB and `args` in the background, in tmp_path (run/, log)."""

    def __init__(self, tmp_path, *args, ranks=2, argv0=None):
        cmd = command(ranks, *JOB, "--run-dir", str(tmp_path / "run"), *args)
        if argv0:                                  # the installed script instead of -m
            i = cmd.index("-m")
            cmd[i - 1:i + 2] = [argv0]
        super().__init__(cmd, tmp_path / "run", tmp_path / "log", ranks)


@pytest.fixture
def job(tmp_path, digits):
    jobs = []

    def start(*args, **kw):
        jobs.append(Job(tmp_path, "--data-dir", str(digits), *args, **kw))
        return jobs[-1]
    yield start
    for j in jobs:
        j.cleanup()


def stopped_at(out, name):
    found = re.findall(rf"{name}: stopped at epoch (\d+), step (\d+); checkpoint ([^;\s]+);", out)
    assert len(found) == 1, out                   # said once, by rank 0
    return found[0]


# ----- signals -----
def catches(pid, signum):
    """Whether process pid has a handler of its own for signal signum (/proc: SigCgt)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def test_sigusr1_before_the_first_step_stops_at_it(tmp_path, digits):
    """A SIGUSR1 that comes while `train` is still importing and setting up (before its run
    directory exists), as Slurm's --signal may: the run stops at its first step with a
    checkpoint and exits 0. (Before, such a signal ended the process, or once MPI had
    started was lost and the run went on.)"""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "mpitrain", *JOB, "--data-dir", str(digits),
                             "--epochs", "2", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=environment(1))
    try:
        end = time.monotonic() + 60
        while not catches(proc.pid, signal.SIGUSR1):
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()[0]
            time.sleep(0.002)
        assert not run_dir.exists()                  # still setting up
        proc.send_signal(signal.SIGUSR1)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    epoch, step, path = stopped_at(out, "SIGUSR1")
    assert (epoch, step) == ("1", "1") and checkpoint.read(path)["step"] == 1, out


@pytest.mark.parametrize("entry", ["python -m mpitrain", "the installed script"])
def test_train_keeps_a_sigusr1_before_it_imports_the_command_line(entry):
    """`mpitrain train`, run either way, sets its SIGUSR1 handler (control.record_early)
    before it imports mpitrain.cli, whose imports (the networks, Numba) take about a second
    in which the signal's default action would end the process."""
    script = os.path.join(sysconfig.get_path("scripts"), "mpitrain")
    start = ["-m", "mpitrain"] if entry == "python -m mpitrain" else [script]
    r = subprocess.run([sys.executable, "-X", "importtime", *start, "train", "--help"],
                       capture_output=True, text=True, timeout=120, env=environment(1))
    assert r.returncode == 0, r.stdout + r.stderr
    loaded = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()
              if line.startswith("import time:")]
    assert loaded.index("mpitrain.control") < loaded.index("mpitrain.cli"), loaded


@pytest.mark.parametrize("to", ["one rank", "every rank"])
def test_ctrl_c_checkpoints_and_exits_130(job, to):
    """SIGINT, to one rank or (as a launcher forwards Ctrl-C) to all, is a stop request:
    the ranks agree after the step, write a checkpoint and exit with 130."""
    j = job("--epochs", "20")
    j.running()
    for rank in ((1,) if to == "one rank" else (0, 1)):
        os.kill(j.pid(rank), signal.SIGINT)
    status, took, out = j.finish(timeout=60)
    _, _, path = stopped_at(out, "SIGINT")
    assert os.path.exists(path), out
    assert status == 130, out
    assert took < 30, out


def test_a_second_ctrl_c_ends_the_job_at_once(job):
    """When the ranks cannot agree (rank 0 is stopped), a second SIGINT to a rank ends
    the whole job now, non-zero, without a checkpoint."""
    j = job("--epochs", "20")
    j.running()
    os.kill(j.pid(0), signal.SIGSTOP)
    os.kill(j.pid(1), signal.SIGINT)
    time.sleep(0.5)
    os.kill(j.pid(1), signal.SIGINT)
    status, took, out = j.finish(timeout=60)
    assert status != 0, out
    assert "a second SIGINT: stopping now, without a checkpoint" in out, out
    assert took < 15, out


def test_a_stop_signal_to_a_rank_blocked_in_a_collective_still_ends_the_job(job):
    """Rank 1 stalls (SIGSTOP); rank 0 waits for it in the next collective, where Python
    cannot run its signal handler: SIGTERM must still end the job within the grace."""
    j = job("--epochs", "20", "--stop-grace", "3")
    j.running()
    os.kill(j.pid(1), signal.SIGSTOP)
    time.sleep(1)
    os.kill(j.pid(0), signal.SIGTERM)
    status, took, out = j.finish(timeout=60)
    assert "SIGTERM arrived 3 s ago, but this rank has not reached the next step" in out, out
    assert status != 0 and took < 15, out


BUSY = """
import os, signal, sys, time
from mpi4py import MPI
from mpitrain.comm import Communicator
from mpitrain.control import StopSignals
stop = StopSignals(Communicator(MPI.COMM_SELF), grace=1.0)
with stop.busy() if sys.argv[1] == "busy" else open(os.devnull):
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(3)                   # an evaluation three times the grace
time.sleep(0.3)                     # then the next step boundary, within the grace
stop.acted()
print("stopped at the step boundary", flush=True)
stop.restore()
"""


@pytest.mark.parametrize("work", ["busy", "not busy"])
def test_a_stop_signal_waits_out_an_evaluation_longer_than_its_grace(work):
    """A stop signal that comes during the end of an epoch's evaluation or checkpoint
    (StopSignals.busy) is acted on at the next step: its grace starts when that work ends
    (a first evaluation longer than 30 s ended healthy jobs without a checkpoint). The
    same wait outside busy() is a rank that cannot reach the step boundary."""
    r = subprocess.run([sys.executable, "-c", BUSY, work], capture_output=True, text=True,
                       timeout=60, env=environment(1))
    if work == "busy":
        assert r.returncode == 0 and "stopped at the step boundary" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode != 0 and "SIGUSR1 arrived 1 s ago, but this rank has not reached " \
            "the next step boundary" in r.stderr, r.stdout + r.stderr


def test_the_watchdog_names_a_rank_frozen_inside_the_collective(job):
    """Rank 0 frozen: the others wait for it; its heartbeat stops, and the message says so."""
    j = job("--epochs", "20", "--collective-timeout", "4")
    j.running()
    os.kill(j.pid(0), signal.SIGSTOP)
    status, took, out = j.finish(timeout=60)
    assert re.search(r"rank 0: no sign of life for \d+ s, .*frozen, stopped or dead \(pid",
                     out), out
    assert status != 0 and took < 20, out


def test_a_stop_on_an_epochs_last_step_resumes_bitwise_with_its_evaluation(job, tmp_path, digits):
    """SIGUSR1 taken on step 22, the last of epoch 1: the epoch's BatchNorm averaging,
    evaluation and metrics happen before the checkpoint, and the resumed run equals the
    uninterrupted one: weights, statistics and every metrics record but the timings."""
    straight = tmp_path / "straight"
    r = run(2, *JOB, "--epochs", "2", "--log-every", "5", "--data-dir", str(digits),
            "--run-dir", str(straight))
    assert r.returncode == 0, r.stdout + r.stderr
    for attempt in range(3):                       # a step may slip past the stop
        (tmp_path / f"stopped{attempt}").mkdir()
        j = Job(tmp_path / f"stopped{attempt}", "--epochs", "2", "--log-every", "5",
                "--data-dir", str(digits))
        try:
            status, _, out = signal_as_step_starts(j, 22)    # rank 0 takes it in step 22
        except JobEnded:                           # the polls missed step 22's start
            continue
        finally:
            j.cleanup()
        assert status == 0, out
        if stopped_at(out, "SIGUSR1")[2].endswith("checkpoint-000000022.h5"):
            break
    else:
        pytest.fail("the signal never landed on step 22")
    assert "val top1" in out                        # epoch 1 was evaluated before stopping
    r = run(2, *JOB, "--epochs", "2", "--log-every", "5", "--data-dir", str(digits),
            "--run-dir", str(j.run_dir), "--resume", "auto")
    assert r.returncode == 0, r.stdout + r.stderr
    final = "checkpoint-000000044.h5"
    a, b = checkpoint.read(str(straight / final)), checkpoint.read(str(j.run_dir / final))
    for key in ("master", "momentum", "buffers"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)

    def records(run_dir):
        out = []
        for line in open(run_dir / "metrics.jsonl"):
            rec = json.loads(line)
            out.append({k: v for k, v in rec.items() if k not in ("time", "images_per_s")})
        return out
    assert records(straight) == records(j.run_dir)


def test_the_installed_script_ends_the_job_when_one_rank_raises(tmp_path):
    """A record only rank 1 reads in the first step cannot be decoded: under the installed
    `mpitrain` script (as under python -m mpitrain) the whole job ends, and the message
    names the record and the flag that skips such records."""
    from mpitrain.datasets.convert import convert_synthetic
    from mpitrain.datasets.loader import ShardedSampler
    import h5py
    data = tmp_path / "synth.h5"
    convert_synthetic(str(data), 64, (40, 40), classes=4)
    convert_synthetic(str(tmp_path / "synth_val.h5"), 16, (40, 40), classes=4)
    first = ShardedSampler(64, 16, rank=1, size=2, seed=5).epoch_indices(0)[0]
    with h5py.File(data, "r+") as f:
        for i in first:
            a, b = f["offsets"][i], f["offsets"][i + 1]
            f["images"][a:b] = 7                     # not a JPEG any more
    script = str(Path(sys.executable).parent / "mpitrain")
    j = Job(tmp_path, "--data", str(data), "--batch-size", "16", "--image-size", "32",
            "--epochs", "1", argv0=script)
    try:
        status, took, out = j.finish(timeout=90)
    finally:
        j.cleanup()
    assert status != 0, out
    assert re.search(r"record \d+ cannot be decoded .*--skip-bad-records", out), out
    assert took < 60, out


def test_an_exploding_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, digits):
    """--lr 100 never turns the loss into inf or NaN here, but it explodes far above its
    running median: the run stops with status 1, names the last good checkpoint, and
    renames the ones written since the divergence began, so `--resume auto` skips them."""
    run_dir = tmp_path / "run"
    r = run(2, *JOB, "--epochs", "8", "--lr", "100", "--warmup-epochs", "6",
            "--data-dir", str(digits), "--run-dir", str(run_dir))
    assert r.returncode == 1, r.stdout + r.stderr
    m = re.search(r"the training loss has exploded \([\d.e+]+\) at epoch \d+, step \d+ "
                  r"\(the mean over the ranks; above 4 x its running median since step (\d+)\)"
                  r".* the last good checkpoint is (\S+)", r.stderr)
    assert m, r.stderr
    since, last = int(m.group(1)), m.group(2)
    kept = [checkpoint.step_of(os.path.basename(p)) for p in checkpoint.checkpoints(str(run_dir))]
    assert kept and max(kept) < since, (kept, since)
    assert last == checkpoint.latest(str(run_dir))
