"""Checkpoints: the file format, atomic writes, resume, and end to end under mpirun:
an interrupted (SIGTERM) and resumed run equals an uninterrupted one bit for bit,
its trace and metrics, and the `eval` command on its checkpoint."""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpitrain import checkpoint
from mpitrain.control import read_heartbeats
from mpitrain.launcher import mpi_family
import launcher

# the small fast job every end-to-end test here runs: 2 epochs of 22 steps on the digits
JOB = ("--epochs", "2", "--batch-size", "64", "--seed", "3")


# ----- helpers -----
def command(ranks, *args):
    """`mpiexec -np ranks python -m mpitrain args`, with the options the MPI needs."""
    return launcher.mpitrain_command(ranks, *args)


def environment(ranks):
    """The job's environment: no launch variables, each rank's share of the cores."""
    return launcher.environment(ranks)


def run(ranks, *args, timeout=180):
    return subprocess.run(command(ranks, *args), capture_output=True, text=True,
                          timeout=timeout, env=environment(ranks))


def start(ranks, *args, log):
    return subprocess.Popen(command(ranks, *args), stdout=log, stderr=subprocess.STDOUT,
                            env=environment(ranks))


def wait_for(path, proc, timeout=120):
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, f"the job ended ({proc.returncode}) before {path} appeared"
        assert time.monotonic() < end, f"{path} did not appear in {timeout} s"
        time.sleep(0.05)


def heartbeats(run_dir, ranks, proc, timeout=60):
    """{rank: dict(pid, ...)} from the run's heartbeat files, once every rank has one."""
    end = time.monotonic() + timeout
    while True:
        board = read_heartbeats(os.path.join(run_dir, "heartbeat"), ranks)
        if all(board.values()):
            return board
        assert proc.poll() is None, f"the job ended ({proc.returncode}) before its heartbeats"
        assert time.monotonic() < end, f"no heartbeat files in {run_dir} after {timeout} s"
        time.sleep(0.05)


@contextlib.contextmanager
def held_open(path):
    """`path` held open for writing by another process, as an HDF5 viewer holds it (HDF5
    locks the file), for the `with` block."""
    holder = subprocess.Popen([sys.executable, "-c", "import h5py, time\n"
                               f"f = h5py.File({str(path)!r}, 'r+')\n"
                               "print('open', flush=True)\ntime.sleep(120)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"
        yield
    finally:
        holder.kill()
        holder.wait()


def tiny_model(classes=3, seed=0, dropout=True):
    """Linear -> Dropout -> Linear -> BatchNorm-free, bound in fp32."""
    from mpitrain.nets.activation import Dropout
    from mpitrain.nets.linear import Linear
    from mpitrain.nets.module import Sequential
    layers = [Linear(4, 5), Dropout(0.5, seed=7), Linear(5, classes)] if dropout \
        else [Linear(4, 5), Linear(5, classes)]
    return Sequential(*layers).bind(np.float32, seed=seed)


_solo = []


def solo():
    """The Communicator of a one-process run (made once)."""
    if not _solo:
        from mpi4py import MPI

        from mpitrain.comm import Communicator
        _solo.append(Communicator(MPI.COMM_SELF))
    return _solo[0]


def state_of(model, **extra):
    meta = dict(epoch=1, step=2, global_step=9, config={"model": "tiny", "batch_size": 4})
    meta.update(extra)
    return checkpoint.collect(model, solo(), meta["epoch"], meta["step"],
                              meta["global_step"], meta["config"])


# ----- the file -----
def test_write_read_restore_round_trip(tmp_path):
    model = tiny_model()
    for p in model.arena.params:
        p.momentum[...] = np.arange(p.size).reshape(p.shape) + p.offset
    dropout = model.layers[1]
    dropout.rng.random(5)                           # a generator that has moved on
    path = checkpoint.write(str(tmp_path / "checkpoint-000000009.h5"), state_of(model))
    expected_next = dropout.rng.random(3)

    other = tiny_model(seed=1)
    assert not np.array_equal(other.arena.master, model.arena.master)
    meta = checkpoint.restore(path, other, solo())
    np.testing.assert_array_equal(other.arena.master, model.arena.master)
    np.testing.assert_array_equal(other.arena.momentum, model.arena.momentum)
    np.testing.assert_array_equal(other.layers[1].rng.random(3), expected_next)
    assert (meta["epoch"], meta["step"], meta["global_step"]) == (1, 2, 9)
    assert meta["config"] == {"model": "tiny", "batch_size": 4}
    with open(path, "rb") as f:
        assert b"pickle" not in f.read()            # plain HDF5 datasets and JSON attributes
    # the parameters one after another, without the arena's alignment padding
    stored = checkpoint.read(path)
    assert stored["master"].size == model.num_params() < model.arena.size
    np.testing.assert_array_equal(
        stored["master"], np.concatenate([p.master.ravel() for p in model.arena.params]))


def test_a_checkpoint_changed_after_its_write_is_refused_as_corrupt(tmp_path):
    """One byte of the weights flipped (a disk's or a copy's error) loaded silently as other
    weights; each array's checksum now refuses it, naming the file."""
    import h5py
    path = checkpoint.write(str(tmp_path / "checkpoint-000000009.h5"), state_of(tiny_model()))
    with h5py.File(path, "r") as f:
        arrays = []
        f.visititems(lambda name, item: arrays.append(item) if isinstance(item, h5py.Dataset)
                     and item.dtype.kind in "fiu" and item.size else None)
        assert {a.name for a in arrays} >= {"/master", "/momentum", "/params/offset"}
        assert all(a.fletcher32 for a in arrays), [a.name for a in arrays if not a.fletcher32]
        dataset = f["master"]
        where = (dataset.id.get_chunk_info(0).byte_offset if dataset.chunks else
                 dataset.id.get_offset()) + 5
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(checkpoint.CheckpointError, match=rf"cannot read checkpoint {path}: "
                                                         r"corrupt: its data no longer match "
                                                         r"their checksums"):
        checkpoint.read(path)
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        checkpoint.restore(path, tiny_model(), solo())


@pytest.mark.parametrize("ranks", [1, 16])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_free_space_asked_for_a_checkpoint_covers_its_file(ranks, dtype):
    """The estimate made before a run (checkpoint.expected_size) against the bytes of a real
    checkpoint of resnet_small with BatchNorm statistics per rank, and a top-k residual
    (fp32) or float64 arrays (--precision fp64, which has no top-k): it must cover the
    chunks' index entries and padding, or a run that passed the check at its start could
    fail at its first checkpoint (the arrays' own bytes and a fixed headroom fell short
    for ResNet-50 at 64 ranks)."""
    from mpitrain.nets import build_model
    model = build_model("resnet_small", num_classes=10, dtype=dtype)
    state = state_of(model)
    state["buffers"] = np.tile(state["buffers"], (ranks, 1))
    residuals = ranks if dtype == np.float32 else 0
    if residuals:
        state["residual"] = np.ones((ranks, state["master"].size), np.float32)
    size = len(checkpoint.file_image(state))
    estimate = checkpoint.expected_size(model, ranks, 2 + residuals)   # master, momentum
    assert size <= estimate <= size + checkpoint.HEADROOM, (size, estimate)


def test_epochs_short_of_a_checkpoints_position_are_refused(tmp_path):
    """--epochs below what a checkpoint has trained: on an epoch's end, and mid-epoch
    (after a stop signal), where --epochs equal to its whole epochs passed."""
    from types import SimpleNamespace
    from mpitrain.checks import ConfigError, check_epochs_ahead
    for epoch, step, refused, fine, least in ((2, 0, 1, 2, "2 (nothing more to train)"),
                                              (1, 2, 1, 2, "2, which finishes the epoch it "
                                                           "stopped in,")):
        path = checkpoint.write(str(tmp_path / f"checkpoint-{epoch}{step}.h5"),
                                state_of(tiny_model(), epoch=epoch, step=step))
        trained = f"{epoch} epochs" + (f" and {step} steps" if step else "")
        with pytest.raises(ConfigError, match=re.escape(f"has trained {trained}, past "
                                                        f"--epochs {refused}: give --epochs "
                                                        f"{least} or more")):
            check_epochs_ahead(SimpleNamespace(epochs=refused), path)
        check_epochs_ahead(SimpleNamespace(epochs=fine), path)


def test_mismatched_classes_are_named(tmp_path):
    path = checkpoint.write(str(tmp_path / "checkpoint-000000009.h5"), state_of(tiny_model(3)))
    with pytest.raises(checkpoint.CheckpointError, match=r"parameter 2\.bias has shape \(3,\) in "
                                                         r"the checkpoint, the model has 2\.bias "
                                                         r"\(4,\) \(a different model or number "
                                                         r"of classes\?\)"):
        checkpoint.restore(path, tiny_model(4), solo())


def test_failed_write_leaves_the_previous_checkpoint(tmp_path):
    model = tiny_model()
    old = checkpoint.write(str(tmp_path / "checkpoint-000000009.h5"), state_of(model))
    before = checkpoint.read(old)["master"].copy()
    model.arena.master[...] += 1.0

    def crash(tmp):                                  # the process dies after the data is written
        assert os.path.getsize(tmp) > 0
        raise KeyboardInterrupt("killed before the rename")

    for name in ("checkpoint-000000009.h5", "checkpoint-000000012.h5"):
        with pytest.raises(KeyboardInterrupt):
            checkpoint.write(str(tmp_path / name), state_of(model, global_step=12), crash)
    assert checkpoint.latest(str(tmp_path)) == old
    np.testing.assert_array_equal(checkpoint.read(old)["master"], before)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000000009.h5"]


KILLED_WRITER = """
import os, signal, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_checkpoint import state_of, tiny_model
from mpitrain import checkpoint
model = tiny_model()
model.arena.master[...] = 7.0
checkpoint.write({path!r}, state_of(model, global_step=12),
                 lambda tmp: os.kill(os.getpid(), signal.SIGKILL))
"""


def test_kill_9_between_write_and_rename(tmp_path):
    old = checkpoint.write(str(tmp_path / "checkpoint-000000009.h5"), state_of(tiny_model()))
    before = checkpoint.read(old)["master"].copy()
    new = str(tmp_path / "checkpoint-000000012.h5")
    script = KILLED_WRITER.format(tests=os.path.dirname(__file__), path=new)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert os.path.exists(tmp_path / ".checkpoint-000000012.h5.tmp")    # the write was complete
    assert not os.path.exists(new)
    assert checkpoint.latest(str(tmp_path)) == old
    np.testing.assert_array_equal(checkpoint.read(old)["master"], before)
    checkpoint.prune(str(tmp_path), keep=3)                     # the next write cleans up
    assert os.listdir(tmp_path) == ["checkpoint-000000009.h5"]


@pytest.mark.parametrize("part,value,message", [
    ("config", "{not json", "its config is not the JSON train writes"),
    ("scaler", b"\xff", "its scaler is not the JSON train writes"),
    ("step", -5, "its attribute step is -5, not a whole number >= 0"),
    ("global_step", 1.5, "its attribute global_step is 1.5, not a whole number >= 0"),
    ("format_version", "1", "its attribute format_version is '1', not a whole number >= 0"),
    ("/master", np.arange(23, dtype=np.int32), "its /master holds int32 of shape (23,), "
                                                "where its tables give 43 values of float32 "
                                                "or float64"),
    ("/momentum", np.zeros(37, np.float32), "its /momentum holds float32 of shape (37,), "
                                             "where its tables give 43 values of float32"),
    ("/buffers", np.zeros(4, np.float32), "its /buffers holds float32 of shape (4,), where "
                                           "its tables give rows of 0 values"),
])
def test_a_part_that_is_not_what_train_writes_is_refused_as_corrupt(part, value, message,
                                                                     tmp_path):
    """The checksums cover the arrays' bytes, not the attributes nor what the arrays are:
    a JSON attribute that no longer parses ended eval, export, predict and --resume in a
    traceback, and a master of integers was scored as weights. Refused, and passed over
    by latest() for the checkpoint before it."""
    import h5py
    model = tiny_model(dropout=False)
    older = checkpoint.write(str(tmp_path / "checkpoint-000000006.h5"),
                             state_of(model, global_step=6))
    path = checkpoint.write(str(tmp_path / "checkpoint-000000009.h5"), state_of(model))
    with h5py.File(path, "r+") as f:
        if part.startswith("/"):
            del f[part]
            f[part] = value
        else:
            f.attrs[part] = value
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.read(path)
    assert str(e.value).startswith(f"cannot read checkpoint {path}: corrupt: {message}"), e.value
    passed = []
    assert checkpoint.latest(str(tmp_path), lambda *a: passed.append(a)) == older
    assert [p for p, _ in passed] == [path] and message in str(passed[0][1])


def test_a_checkpoint_complete_only_in_name_is_incomplete(tmp_path):
    """complete = "no" (a string, not train's boolean) read as complete."""
    import h5py
    path = checkpoint.write(str(tmp_path / "checkpoint-000000009.h5"), state_of(tiny_model()))
    with h5py.File(path, "r+") as f:
        f.attrs["complete"] = "no"
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        checkpoint.read(path)
    assert checkpoint.latest(str(tmp_path)) is None


def test_a_checkpoint_that_cannot_be_read_now_is_held_not_torn(tmp_path):
    """Locked by a process that has it open for writing (an HDF5 viewer), or not readable
    by this user: it may be whole, so it is a CheckpointHeld, which --resume auto refuses
    to pass over (tests/test_bad_input.py) rather than resume an older one and write over
    it."""
    import errno
    path = checkpoint.write(str(tmp_path / "checkpoint-000000009.h5"), state_of(tiny_model()))
    passed = []
    with held_open(path):
        assert checkpoint.latest(str(tmp_path), lambda *a: passed.append(a)) is None
    (_, error), = passed
    assert isinstance(error, checkpoint.CheckpointHeld) and str(error) == (
        f"cannot read checkpoint {path}: another process holds it open for writing (HDF5 "
        f"locks the file): close it there, then run again"), error
    # root reads any file: the refusal of a file this user may not read, from its error
    denied = checkpoint.unreadable(path, PermissionError(errno.EACCES, "Permission denied"))
    assert isinstance(denied, checkpoint.CheckpointHeld) and "this user may not read it" \
        in str(denied)
    assert checkpoint.latest(str(tmp_path)) == path


def test_latest_skips_a_torn_file_and_prune_keeps_k(tmp_path):
    model = tiny_model()
    paths = [checkpoint.write(str(tmp_path / checkpoint.PATTERN.format(global_step=g)),
                              state_of(model, global_step=g)) for g in (3, 6, 9)]
    torn = tmp_path / "checkpoint-000000012.h5"      # e.g. copied by hand, cut short
    torn.write_bytes(Path(paths[-1]).read_bytes()[:1000])
    (tmp_path / ".checkpoint-000000015.h5.tmp").write_bytes(b"partial")
    assert checkpoint.latest(str(tmp_path)) == paths[-1]
    with pytest.raises(checkpoint.CheckpointError, match="cannot read"):
        checkpoint.read(str(torn))
    checkpoint.prune(str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000000009.h5", "checkpoint-000000012.h5"]


# ----- end to end -----
@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The job uninterrupted, with a trace: (run dir, data dir, completed process)."""
    base = tmp_path_factory.mktemp("straight")
    data, run_dir = base / "data", base / "run"
    r = run(2, "train", *JOB, "--data-dir", str(data), "--run-dir", str(run_dir),
            "--trace", str(run_dir / "trace.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir, data, r


@pytest.mark.launches
def test_sigterm_then_resume_is_bitwise_exact(straight_run, tmp_path):
    run_dir0, data, _ = straight_run
    run_dir = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        job = start(2, "train", *JOB, "--data-dir", str(data), "--run-dir", str(run_dir),
                    log=log)
        try:
            wait_for(run_dir / "checkpoint-000000022.h5", job)  # epoch 1 is complete
            # SIGTERM to every rank, as Slurm's scancel sends it (Open MPI's mpirun does
            # not pass SIGTERM on: it kills the job; the ranks are found by their heartbeats)
            for rank in heartbeats(run_dir, 2, job).values():
                os.kill(rank["pid"], signal.SIGTERM)
            rc = job.wait(timeout=60)
        finally:
            if job.poll() is None:
                job.kill()
    out = (tmp_path / "log").read_text()
    assert rc == 143, out             # every rank exits 143: mpiexec and mpirun report 143
    stopped = re.findall(r"SIGTERM: stopped at epoch (\d), step (\d+); checkpoint ([^;\s]+);", out)
    assert len(stopped) == 1, out                               # said once, by rank 0
    assert os.path.exists(stopped[0][2])

    r = run(2, "train", *JOB, "--data-dir", str(data), "--run-dir", str(run_dir),
            "--resume", "auto")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from {stopped[0][2]}" in r.stdout
    final = "checkpoint-000000044.h5"
    a, b = checkpoint.read(str(run_dir0 / final)), checkpoint.read(str(run_dir / final))
    for key in ("master", "momentum", "buffers"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.launches
def test_topk_resume_is_bitwise_exact(tmp_path):
    """A top-k run resumed from its epoch-1 checkpoint ends with the uninterrupted run's
    weights, momentum, statistics and every rank's residual, bit for bit."""
    topk = ("--compress", "topk", "--density", "0.05")
    data, straight, resumed = tmp_path / "data", tmp_path / "straight", tmp_path / "resumed"
    r = run(2, "train", *JOB, *topk, "--data-dir", str(data), "--run-dir", str(straight))
    assert r.returncode == 0, r.stdout + r.stderr
    resumed.mkdir()
    shutil.copy(straight / "checkpoint-000000022.h5", resumed)
    r = run(2, "train", *JOB, *topk, "--data-dir", str(data), "--run-dir", str(resumed),
            "--resume", "auto")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and "start from zero" not in r.stdout, r.stdout
    final = "checkpoint-000000044.h5"
    a, b = checkpoint.read(str(straight / final)), checkpoint.read(str(resumed / final))
    assert a["residual"].shape[0] == 2 and np.any(a["residual"])
    for key in ("master", "momentum", "buffers", "residual"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.launches
def test_resume_on_one_rank_keeps_the_global_batch(straight_run, tmp_path):
    run_dir0, data, _ = straight_run
    mid = tmp_path / "checkpoint-000000022.h5"
    shutil.copy(run_dir0 / "checkpoint-000000022.h5", mid)
    r = run(1, "train", *JOB, "--data-dir", str(data), "--resume", str(mid))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "written by 2 rank(s)" in r.stdout and "epoch 2, step 0" in r.stdout
    # the same global batches in the same order; BatchNorm now normalises over 64 images per
    # replica instead of 32, so the weights differ from the 2-rank run's (not compared)
    end = checkpoint.read(str(tmp_path / "checkpoint-000000044.h5"))
    assert (end["epoch"], end["step"], end["world_size"]) == (2, 0, 1)
    r = run(1, "train", "--epochs", "2", "--batch-size", "32", "--data-dir", str(data),
            "--resume", str(mid))
    assert r.returncode == 2 and "keeps the global batch (pass --batch-size 64" in r.stderr


@pytest.mark.launches
def test_trace_has_every_rank_and_each_phase(straight_run):
    run_dir, _, r = straight_run
    assert r.stdout.rstrip().endswith(
        f"\ntimelines {run_dir}/trace.rank0.json to {run_dir}/trace.rank1.json, one a rank: "
        f"open in https://ui.perfetto.dev or chrome://tracing"), r.stdout
    assert not [p for p in os.listdir(run_dir) if ".tmp-" in p]     # each written whole
    pids = set()
    for rank in (0, 1):
        with open(run_dir / f"trace.rank{rank}.json") as f:
            events = json.load(f)["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        assert {e["name"] for e in spans} >= {"forward", "backward", "update", "data wait",
                                             "all-reduce", "evaluate"}
        steps = sorted((e for e in spans if e["name"] == "forward"), key=lambda e: e["ts"])
        assert len(steps) == 44                                          # one per step
        # one rank's forward passes follow one another: each ends before the next begins
        assert all(a["dur"] > 0 and a["ts"] + a["dur"] <= b["ts"] for a, b in zip(steps, steps[1:]))
        groups = {e["name"] for e in spans if e["cat"] == "layers"}       # resnet_small's groups
        assert groups >= {"backward conv1", "backward layer1", "backward layer3", "backward fc",
                          "forward layer2"}, groups
        pids |= {e["pid"] for e in events}
    assert pids == {0, 1}


@pytest.mark.launches
def test_metrics_config_and_environment(straight_run):
    run_dir, _, r = straight_run
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    steps = [x for x in records if x["kind"] == "step"]
    evals = [x for x in records if x["kind"] == "eval"]
    assert [x["global_step"] for x in steps] == [22, 44]
    assert {"loss", "lr", "images_per_s", "time"} <= set(steps[0])
    assert {"data", "forward", "backward", "comm", "update"} <= set(steps[0]["time"])
    assert [x["epoch"] for x in evals] == [1, 2] and 0 <= evals[-1]["top5"] <= 1
    final = float(re.search(r"final validation accuracy: ([\d.]+)%", r.stdout).group(1))
    assert abs(100 * evals[-1]["top1"] - final) < 0.01
    config = json.load(open(run_dir / "config.json"))
    assert config["batch_size"] == 64 and config["seed"] == 3
    env = json.load(open(run_dir / "environment.json"))
    assert env["world_size"] == 2 and env["device"] == "cpu" and env["ranks_per_host"] == [2]
    assert mpi_family(env["mpi_library"]) == launcher.family(), env    # the venv's MPI
    root = Path(checkpoint.__file__).parents[1]
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode == 0:                    # a checkout: the commit that ran
        assert head.stdout.strip() in env["source"], env
    else:
        assert env["source"].startswith("mpitrain "), env


@pytest.mark.launches
def test_eval_command_reproduces_the_final_accuracy(straight_run):
    run_dir, data, _ = straight_run
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    final = [x for x in records if x["kind"] == "eval"][-1]
    # the run's validation file, named and by default (rank 0 finds it for every rank)
    for named in (("--data", str(data / "digits_val.h5")), ()):
        r = run(2, "eval", "--checkpoint", str(run_dir / "checkpoint-000000044.h5"), *named,
                "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        result = json.loads(r.stdout)               # one line: rank 0 alone prints
        assert result["top1"] == final["top1"] and result["top5"] == final["top5"]
        assert result["images"] == 359 and result["data"] == str(data / "digits_val.h5")
