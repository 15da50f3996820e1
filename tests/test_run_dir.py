"""Run directories that cannot be mixed: a lock held by the job writing into one (a
second job into it is refused, naming the holder), an earlier run's directory refused
to a fresh run without --resume, runs/latest pointing at the newest run."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest
from PIL import Image

from launcher import BackgroundJob, environment, mpitrain_command
from mpitrain.checkpoint import read_config
from mpitrain.config import RunDirInUse, RunLock, source_version

JOB = ("train", "--batch-size", "64", "--seed", "5")

HOLD = """
import sys, time
from mpitrain.config import RunLock
RunLock(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


def quick(*args, cwd=None):
    """One process, no mpiexec (MPI starts as a singleton)."""
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], capture_output=True,
                          text=True, timeout=300, env=environment(1), cwd=cwd)


def holding(run_dir):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_lock_refuses_while_its_holder_lives_and_not_after_it_is_killed(tmp_path):
    holder = holding(tmp_path)
    try:
        with pytest.raises(RunDirInUse, match=rf"in use by a running job \(host .*, pid "
                                              rf"{holder.pid}, started .*\)"):
            RunLock(str(tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert os.path.exists(tmp_path / RunLock.NAME)      # left by the killed holder
    lock = RunLock(str(tmp_path))                       # ... and holding nothing
    assert f"pid {os.getpid()}," in (tmp_path / RunLock.NAME).read_text()
    lock.release()
    assert not os.path.exists(tmp_path / RunLock.NAME)


def test_two_jobs_started_in_the_same_second_get_two_run_directories(tmp_path, monkeypatch):
    """A Slurm array starts its jobs together: each claims its own runs/<timestamp>, where
    both once chose the same name and the second was refused as "in use"."""
    import time
    from types import SimpleNamespace
    from mpitrain.checks import prepare_run_dir
    from mpitrain.comm.topology import Communicator
    from mpitrain.config import default_run_dir
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda *_: "20261129-120000")
    # two processes may both choose before either makes its directory: choosing makes it
    chosen = [default_run_dir() for _ in range(2)]
    assert chosen == ["runs/20261129-120000", "runs/20261129-120000-2"]
    assert all(os.path.isdir(d) for d in chosen)
    for d in chosen:
        os.rmdir(d)
    comm = Communicator()
    jobs = [SimpleNamespace(run_dir=None, resume=None) for _ in range(3)]
    held = [prepare_run_dir(cfg, comm) for cfg in jobs]
    assert [d for d, _ in held] == [os.path.join("runs", "20261129-120000" + tail)
                                    for tail in ("", "-2", "-3")]
    assert [cfg.run_dir for cfg in jobs] == [d for d, _ in held]
    for _, lock in held:        # each holds its own lock; refused runs leave nothing
        lock.release()
    assert os.listdir(tmp_path / "runs") == []


@pytest.mark.launches
def test_a_second_job_into_a_live_run_directory_is_refused(digits, tmp_path):
    run_dir = tmp_path / "run"
    first = BackgroundJob(mpitrain_command(2, *JOB, "--epochs", "30", "--data-dir", str(digits),
                                           "--run-dir", str(run_dir)),
                          run_dir, tmp_path / "first.log")
    try:
        first.running()
        config = (run_dir / "config.json").read_text()
        r = subprocess.run(mpitrain_command(2, *JOB, "--epochs", "3", "--data-dir", str(digits),
                                            "--run-dir", str(run_dir), "--resume", "auto"),
                           capture_output=True, text=True, timeout=180, env=environment(2))
        assert r.returncode == 2, r.stdout + r.stderr
        assert (f"--run-dir {run_dir} is in use by a running job (host "
                f"{first.board()[0]['host']}, pid {first.pid(0)}, started ") in r.stderr, r.stderr
        assert "epoch 1/" not in r.stdout, r.stdout
        assert (run_dir / "config.json").read_text() == config
        assert first.proc.poll() is None, first.output()
    finally:
        first.cleanup()


@pytest.fixture(scope="module")
def used(digits, tmp_path_factory):
    """The directory of a finished one-epoch run under runs/ of a working directory, that
    directory, and the run's output."""
    cwd = tmp_path_factory.mktemp("cwd")
    r = quick(*JOB, "--epochs", "1", "--data-dir", str(digits), cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    (run_dir,) = [p for p in (cwd / "runs").iterdir() if p.name != "latest"]
    return run_dir, cwd, r.stdout


def test_runs_latest_points_at_the_newest_run(used):
    run_dir, cwd, _ = used
    assert os.path.islink(cwd / "runs" / "latest")
    assert os.readlink(cwd / "runs" / "latest") == run_dir.name


def test_a_fresh_run_into_a_used_directory_is_refused(used, digits):
    run_dir, cwd, _ = used
    before = {p: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    r = quick(*JOB, "--epochs", "1", "--data-dir", str(digits), "--run-dir", str(run_dir))
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"--run-dir {run_dir} holds an earlier run (config.json, metrics.jsonl, "
            f"checkpoint-000000022.h5): continue it with --resume auto, or start afresh in "
            f"another --run-dir") in r.stderr, r.stderr
    assert {p: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    r = quick(*JOB, "--epochs", "1", "--data-dir", str(digits), "--run-dir", "runs/latest",
              "--resume", "auto", cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((run_dir / "config.json").read_text())["resume"] == "auto"
    assert os.readlink(cwd / "runs" / "latest") == run_dir.name      # the run it names


@pytest.mark.launches
def test_a_run_resumed_through_runs_latest_stays_in_the_run_it_named(digits, tmp_path):
    """runs/latest is resolved once, at the start: a run started later points the link
    at itself, and the resumed run's checkpoints must not follow the link into that run's
    directory (where its pruning would delete the other run's checkpoints)."""
    def fresh_run():
        r = quick(*JOB, "--epochs", "1", "--data-dir", str(digits), cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        return os.readlink(tmp_path / "runs" / "latest")
    first = tmp_path / "runs" / fresh_run()
    job = BackgroundJob(mpitrain_command(2, *JOB, "--epochs", "40", "--data-dir", str(digits),
                                         "--resume", str(tmp_path / "runs" / "latest")),
                        first, tmp_path / "resumed.log")
    try:
        job.running()
        second = tmp_path / "runs" / fresh_run()
        assert second != first
        os.kill(job.pid(1), signal.SIGUSR1)         # stop with a checkpoint
        status, _, out = job.finish()
    finally:
        job.cleanup()
    assert status == 0, out
    stop = re.search(r"SIGUSR1: stopped at .*; checkpoint (\S+); continue with --run-dir "
                     r"(\S+) --resume auto", out)
    assert stop and (os.path.dirname(stop[1]), stop[2]) == (str(first), str(first)), out
    assert os.path.exists(stop[1])
    assert [p.name for p in second.glob("checkpoint-*.h5")] == ["checkpoint-000000022.h5"]


def test_the_end_of_a_run_says_where_its_outputs_are(used):
    run_dir, _, out = used
    run_dir = os.path.relpath(run_dir, used[1])           # as the run named it: runs/<stamp>
    assert out.rstrip().splitlines()[-1] == (
        f"checkpoint {run_dir}/checkpoint-000000022.h5; metrics {run_dir}/metrics.jsonl; "
        f"plots: python -m mpitrain plot {run_dir}; eval and predict take --checkpoint "
        f"{run_dir}, export {run_dir}, for its newest checkpoint")


def test_the_end_of_a_run_without_a_checkpoint_sends_nobody_to_eval_it():
    """--checkpoint-every 0: the last line says there is nothing for eval, predict or
    export, and does not offer the run directory to them."""
    from mpitrain.train import say_where
    lines = []
    say_where(lambda line, flush: lines.append(line),
              dict(run_dir="runs/r", checkpoint=None, traces=None))
    assert lines == ["no checkpoint (--checkpoint-every 0: nothing for eval, predict or "
                     "export); metrics runs/r/metrics.jsonl; plots: python -m mpitrain plot "
                     "runs/r"]


def test_eval_of_a_run_that_saved_no_checkpoint_says_why(digits, tmp_path):
    r = quick(*JOB, "--epochs", "1", "--data-dir", str(digits), "--checkpoint-every", "0",
              "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    r = quick("eval", "--checkpoint", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.endswith(f"error: run directory {tmp_path / 'run'} holds no complete "
                             f"checkpoint: its run had --checkpoint-every 0, which saves one "
                             f"only on a stop signal: train it again without that "
                             f"option\n"), r.stderr


def test_eval_predict_and_export_take_a_run_directory(used, digits, tmp_path):
    run_dir, cwd, _ = used
    checkpoint = str(run_dir / "checkpoint-000000022.h5")
    val = str(digits / "digits_val.h5")
    by_file = quick("eval", "--checkpoint", checkpoint, "--data", val, "--json")
    by_dir = quick("eval", "--checkpoint", str(cwd / "runs" / "latest"), "--data", val, "--json")
    # without --data: the validation file of the checkpoint's run
    by_default = quick("eval", "--checkpoint", "runs/latest", "--json", cwd=cwd)
    assert by_file.returncode == by_dir.returncode == by_default.returncode == 0, \
        by_file.stderr + by_dir.stderr + by_default.stderr
    assert json.loads(by_dir.stdout) == json.loads(by_file.stdout) \
        == json.loads(by_default.stdout)
    assert json.loads(by_default.stdout)["data"] == val
    assert read_config(checkpoint)["start_dir"] == str(cwd)    # what its data paths are from
    image = tmp_path / "white.png"
    Image.new("RGB", (32, 32), (255, 255, 255)).save(image)
    r = quick("predict", "--checkpoint", str(run_dir), str(image), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["checkpoint"] == checkpoint
    r = quick("predict", "--checkpoint", str(run_dir), str(image))     # the text names it too
    assert r.returncode == 0 and r.stdout.startswith(f"{image}\n"), r.stdout + r.stderr
    assert r.stderr == (f"python -m mpitrain predict: {run_dir}: its newest complete "
                        f"checkpoint, checkpoint-000000022.h5\n"), r.stderr
    r = quick("export", str(run_dir), str(tmp_path / "m.safetensors"))    # format: its name's
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("as safetensors"), r.stdout
    assert (tmp_path / "m.safetensors").stat().st_size > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    r = quick("predict", "--checkpoint", str(empty), str(image))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == (f"python -m mpitrain predict: error: run directory {empty} holds no "
                        f"complete checkpoint: give a checkpoint file, or train (or --resume) "
                        f"the run to its first checkpoint\n")


def test_the_code_that_ran_is_its_commit_dirty_when_changed_or_the_package_version(tmp_path):
    """environment.json's `source`: a checkout's commit, "-dirty" once a tracked file
    differs from it; a folder that is no checkout (even inside one) gives the version."""
    from importlib.metadata import version
    repo = tmp_path / "checkout"
    repo.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "a.py"], ["commit", "-q", "-m", "a"]):
        subprocess.run(git + args, check=True, capture_output=True)
    head = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert source_version(str(repo)) == head
    (repo / "a.py").write_text("x = 2\n")
    assert source_version(str(repo)) == head + "-dirty"
    (repo / "inner").mkdir()
    assert source_version(str(repo / "inner")) == f"mpitrain {version('mpitrain')}"
    assert source_version(str(tmp_path)) == f"mpitrain {version('mpitrain')}"
