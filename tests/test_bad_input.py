"""Bad input: refused before any work with exit status 2 and a message that names the
problem and the fix; nothing written, nothing overwritten, no traceback."""
import json
import os
import re
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

from test_checkpoint import environment, run

BATCH = ("--batch-size", "64")


def quick(*args, timeout=120):
    """One process, no mpiexec (MPI starts as a singleton)."""
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], capture_output=True,
                          text=True, timeout=timeout, env=environment(1))


def refused(r, *fragments):
    """Exit 2, each fragment in the message, no traceback, no training."""
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    for fragment in fragments:
        assert fragment in r.stderr, out
    assert "Traceback" not in out and "epoch 1/" not in r.stdout, out


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """A small JPEG file of 4 classes and its validation file."""
    from mpitrain.datasets.convert import convert_synthetic
    path = tmp_path_factory.mktemp("synth")
    convert_synthetic(str(path / "s.h5"), 64, (40, 40), classes=4)
    convert_synthetic(str(path / "s_val.h5"), 16, (40, 40), classes=4)
    return path


def rename_classes(src, dst, names):
    with h5py.File(src, "r") as f, h5py.File(dst, "w") as g:
        for key in f:
            if key != "class_names":
                f.copy(key, g)
        g.attrs.update(f.attrs)
        g["class_names"] = np.array(names, dtype=object).astype(h5py.string_dtype())


# ----- data files -----
def test_validation_classes_must_be_the_training_classes(synth, tmp_path):
    other = tmp_path / "val.h5"
    rename_classes(synth / "s_val.h5", other, ["class0", "class1", "cat", "class3"])
    r = quick("train", "--data", str(synth / "s.h5"), "--val-data", str(other), "--batch-size", "16",
              "--run-dir", str(tmp_path / "run"))
    refused(r, f"validation file {other} does not have the classes of training file",
            "class 2 is 'cat' against 'class2'")
    three = tmp_path / "three.h5"
    rename_classes(synth / "s_val.h5", three, ["class0", "class1", "class2"])
    with h5py.File(three, "r+") as f:
        f["labels"][...] = f["labels"][...] % 3
    r = quick("train", "--data", str(synth / "s.h5"), "--val-data", str(three), "--batch-size", "16",
              "--run-dir", str(tmp_path / "run"))
    refused(r, "(3 classes against 4)")
    assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.parametrize("case", ["not hdf5", "other format", "missing dataset", "one class"])
def test_data_files_that_cannot_be_used(case, synth, tmp_path):
    bad = tmp_path / "bad.h5"
    if case == "not hdf5":
        bad.write_bytes(b"\x89PNG not an HDF5 file" * 50)
        expect = "cannot be opened as HDF5"
    elif case == "other format":
        with h5py.File(bad, "w") as f:
            f["x"] = np.zeros(3)
        expect = "not an mpitrain image file"
    elif case == "missing dataset":
        with h5py.File(synth / "s.h5", "r") as f, h5py.File(bad, "w") as g:
            g.attrs.update(f.attrs)
            for key in f:
                if key != "labels":
                    f.copy(key, g)
        expect = "dataset 'labels' is missing"
    else:
        rename_classes(synth / "s.h5", bad, ["only"])
        with h5py.File(bad, "r+") as f:
            f["labels"][...] = 0
        expect = "a classifier needs two or more"
    r = quick("train", "--data", str(bad), "--val-data", str(synth / "s_val.h5"),
              "--batch-size", "16", "--run-dir", str(tmp_path / "run"))
    refused(r, str(bad), expect)


def test_a_file_declaring_huge_images_is_refused_before_allocating(tmp_path):
    """9 KB on disk, 64 pixel records of 60000x60000 declared: the loader would ask for
    hundreds of GiB. Refused with the memory it would need."""
    huge = tmp_path / "huge.h5"
    with h5py.File(huge, "w") as f:
        f.attrs.update(format="mpitrain-images", version=1, storage="pixels")
        f.create_dataset("pixels", (64, 60000, 60000, 3), np.uint8, chunks=(1, 64, 64, 3))
        f["labels"] = np.arange(64) % 2
        f["class_names"] = np.array(["a", "b"], dtype=object).astype(h5py.string_dtype())
        f["mean"], f["std"] = np.full(3, 128.0), np.full(3, 64.0)
    assert os.path.getsize(huge) < 100_000
    r = quick("train", "--data", str(huge), "--val-data", str(huge), "--batch-size", "16",
              "--run-dir", str(tmp_path / "run"))
    refused(r, "224x224 images in batches of 16 need", "GiB of buffers, more than the",
            "it declares images of (60000, 60000, 3)")


def test_decode_errors_are_counted_and_reported_with_skip_bad_records(synth, tmp_path):
    data = tmp_path / "s.h5"
    data.write_bytes((synth / "s.h5").read_bytes())
    (tmp_path / "s_val.h5").write_bytes((synth / "s_val.h5").read_bytes())
    with h5py.File(data, "r+") as f:
        for i in (3, 17, 40):
            f["images"][f["offsets"][i]:f["offsets"][i + 1]] = 1
    r = quick("train", "--data", str(data), "--batch-size", "16", "--image-size", "32",
              "--epochs", "1", "--log-every", "2", "--skip-bad-records",
              "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 bad training record(s) skipped (--skip-bad-records)" in r.stdout
    assert re.search(r"step \d+/4 .* \d bad record\(s\) skipped", r.stdout), r.stdout
    records = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert sum(x.get("skipped_records", 0) for x in records if x["kind"] == "step") == 3


# ----- options -----
@pytest.mark.parametrize("flag,value", [("--lr", "nan"), ("--lr", "inf"), ("--momentum", "nan"),
                                        ("--weight-decay", "inf"), ("--warmup-epochs", "nan"),
                                        ("--label-smoothing", "nan"), ("--lars-eta", "inf")])
def test_non_finite_numbers_are_refused(flag, value):
    r = quick("train", flag, value)
    refused(r, f"argument {flag}: {value} is not a finite number")


def test_an_image_size_the_network_cannot_take(synth, tmp_path):
    r = quick("train", "--model", "alexnet", "--data", str(synth / "s.h5"), "--batch-size", "16",
              "--image-size", "32", "--run-dir", str(tmp_path / "run"))
    refused(r, "--image-size 32 is too small for alexnet", "the smallest size it takes is 63")


def test_argument_errors_are_said_once_per_job(digits):
    from test_checkpoint import command
    r = subprocess.run(command(2, "train", "--lr", "-1"), capture_output=True, text=True,
                       timeout=120, env=environment(2))
    assert r.returncode != 0
    assert r.stderr.count("argument --lr") == 1, r.stderr


def test_a_run_directory_that_is_a_file_or_read_only(digits, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = quick("train", "--data-dir", str(digits), *BATCH, "--run-dir", str(afile))
    refused(r, f"--run-dir {afile} is a file, not a directory")
    # a directory no process may write into, root included (os.access says so for root
    # only where the file system refuses; a chmod would not stop root)
    locked = "/proc/sys"
    if not os.path.isdir(locked) or os.access(locked, os.W_OK):
        pytest.skip("no read-only directory to try (Linux's /proc/sys)")
    r = quick("train", "--data-dir", str(digits), *BATCH, "--run-dir", locked)
    refused(r, f"--run-dir {locked} is not writable")


# ----- resuming -----
@pytest.fixture(scope="module")
def one_epoch(digits, tmp_path_factory):
    """A run directory holding the checkpoint of one epoch of SGD in fp32."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    r = run(2, "train", "--epochs", "1", *BATCH, "--data-dir", str(digits),
            "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir


@pytest.mark.parametrize("change", [("--optimizer", "lamb"), ("--precision", "fp16"),
                                    ("--model", "resnet18")])
def test_a_refused_resume_changes_nothing_in_the_run(one_epoch, digits, tmp_path, change):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("config.json", "environment.json", "checkpoint-000000022.h5"):
        (run_dir / name).write_bytes((one_epoch / name).read_bytes())
    before = {p: p.read_bytes() for p in run_dir.iterdir()}
    r = quick("train", "--epochs", "2", *BATCH, "--data-dir", str(digits),
              "--run-dir", str(run_dir), "--resume", "auto", *change)
    flag, value = change
    refused(r, f"was trained with {flag}", f"this run asks for {value}: a resumed run keeps it")
    assert {p: p.read_bytes() for p in run_dir.iterdir()} == before


def test_resume_auto_says_it_passes_over_an_unreadable_checkpoint(one_epoch, digits, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    good = run_dir / "checkpoint-000000022.h5"
    good.write_bytes((one_epoch / "checkpoint-000000022.h5").read_bytes())
    torn = run_dir / "checkpoint-000000030.h5"
    torn.write_bytes(good.read_bytes()[:2000])
    r = quick("train", "--epochs", "1", *BATCH, "--data-dir", str(digits),
              "--run-dir", str(run_dir), "--resume", "auto")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"--resume auto: passing over {torn}: cannot read checkpoint" in r.stdout
    assert f"resumed from {good}" in r.stdout


# ----- converting -----
SPOOLING = """
import sys, time
from mpitrain.datasets.h5format import Writer
w = Writer(sys.argv[1], ["a", "b"])
w.add(0, b"x" * 1000)
print("spooling", flush=True)
time.sleep(60)
"""


def test_a_killed_conversion_leaves_files_the_next_one_removes(tmp_path):
    from mpitrain.datasets.convert import convert_synthetic
    dst = tmp_path / "out.h5"
    p = subprocess.Popen([sys.executable, "-c", SPOOLING, str(dst)], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "spooling"
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = [n for n in os.listdir(tmp_path) if n.startswith(".out.h5.spool-")]
    assert left, os.listdir(tmp_path)
    convert_synthetic(str(dst), 8, (16, 16), classes=2)
    assert sorted(os.listdir(tmp_path)) == ["out.h5"]


def test_an_mpi_without_thread_multiple_is_refused(digits, tmp_path):
    """The communication, signal and watchdog threads call MPI beside the main thread."""
    args = ["train", "--data-dir", str(digits), *BATCH, "--run-dir", str(tmp_path / "run")]
    code = ("import mpi4py; mpi4py.rc.thread_level = 'serialized'\n"
            f"from mpitrain.cli import run; run({args!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=environment(1))
    refused(r, "the MPI library gives thread level SERIALIZED; mpitrain needs "
               "MPI_THREAD_MULTIPLE")


def test_bad_compression_options_are_refused():
    refused(quick("train", "--compress", "topk", "--density", "0"), "--density", "must be > 0.0")
    refused(quick("train", "--compress", "topk", "--density", "1.5"), "--density", "must be <= 1.0")
    refused(quick("train", "--compress", "topk", "--comm-dtype", "fp16"),
            "--compress topk", "cannot take --comm-dtype fp16")
    refused(quick("train", "--compress-warmup", "-1"), "--compress-warmup", "must be >= 0")
