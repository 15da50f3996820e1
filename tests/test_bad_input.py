"""Bad input: refused before any work with exit status 2 and a message that names the
problem and the fix; nothing written, nothing overwritten, no traceback."""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

from test_checkpoint import environment, held_open, run

BATCH = ("--batch-size", "64")


def quick(*args, timeout=120, cwd=None):
    """One process, no mpiexec (MPI starts as a singleton)."""
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], capture_output=True,
                          text=True, timeout=timeout, env=environment(1), cwd=cwd)


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
def test_a_missing_data_file_is_refused_with_the_fix_for_how_it_was_named(synth, tmp_path):
    import shutil
    lone = tmp_path / "lone.h5"                     # no lone_val.h5 beside it
    shutil.copy(synth / "s.h5", lone)
    run_dir = ("--run-dir", str(tmp_path / "run"))
    r = quick("train", "--data", str(lone), *run_dir)
    refused(r, f"validation file {tmp_path / 'lone_val.h5'} does not exist; name one with "
               "--val-data, or make it with `python -m mpitrain convert imagefolder ... "
               "--val-fraction F`")
    r = quick("train", "--data", str(lone), "--val-data", str(tmp_path / "v.h5"), *run_dir)
    refused(r, f"validation file {tmp_path / 'v.h5'} does not exist; check --val-data, or make "
               "it with `python -m mpitrain convert ...`")
    r = quick("train", "--data", str(tmp_path / "t.h5"), *run_dir)
    refused(r, f"training file {tmp_path / 't.h5'} does not exist; check --data, or make it")
    r = quick("train", "--data", "digit", *run_dir)             # a name, not a file
    refused(r, "training file digit does not exist; check --data, or make it with `python -m "
               "mpitrain convert ...` (the named data sets: digits, fashion-mnist)")
    assert sorted(os.listdir(tmp_path)) == ["lone.h5"]


def test_a_named_data_set_validates_on_val_data_when_given(synth, digits, tmp_path):
    """--data digits --val-data FILE validates on FILE: one of other classes is refused, a
    missing one named; a copy of the digits' own scores as they do."""
    run_dir = ("--run-dir", str(tmp_path / "run"))
    refused(quick("train", "--data-dir", str(digits), "--val-data", str(synth / "s_val.h5"),
                  *run_dir), f"validation file {synth / 's_val.h5'} does not have the classes "
                             f"of training file {digits / 'digits_train.h5'}")
    refused(quick("train", "--data-dir", str(digits), "--val-data", str(tmp_path / "v.h5"),
                  *run_dir), f"validation file {tmp_path / 'v.h5'} does not exist; check "
                             f"--val-data")
    assert not (tmp_path / "run").exists()
    from mpitrain.checks import resolve_data
    from mpitrain.options import Config
    copy = tmp_path / "copy.h5"
    shutil.copy(digits / "digits_val.h5", copy)
    assert resolve_data(Config(data_dir=str(digits), val_data=str(copy)))[:2] == \
        (str(digits / "digits_train.h5"), str(copy))


def test_a_folder_or_a_data_file_in_the_wrong_place_is_answered_with_the_fix(one_epoch, digits,
                                                                            tmp_path):
    images = tmp_path / "shapes"
    (images / "circle").mkdir(parents=True)
    convert = (f"{images} is a folder, and mpitrain reads HDF5 files made by `convert`: "
               f"`python -m mpitrain convert imagefolder {images} data/shapes.h5 "
               f"--val-fraction 0.1` makes data/shapes.h5 and data/shapes_val.h5 from its "
               f"class folders")
    refused(quick("train", "--data", str(images), "--run-dir", str(tmp_path / "run")), convert)
    refused(quick("eval", "--checkpoint", str(one_epoch), "--data", str(images)), convert)
    refused(quick("bench", "data", "--data", str(images)), convert)
    none = tmp_path / "none.h5"
    refused(quick("bench", "data", "--data", str(none)),
            f"{none} does not exist; make it with `python -m mpitrain convert ...`")
    assert sorted(os.listdir(tmp_path)) == ["shapes"]
    data = digits / "digits_val.h5"                  # a data file given as the checkpoint
    refused(quick("eval", "--checkpoint", str(data)),
            f"cannot read checkpoint {data}: an HDF5 file without a checkpoint's parts (a data "
            f"file?); give a checkpoint-*.h5 that train wrote, or its run directory (its newest "
            f"complete one)")


def test_a_checkpoint_cut_short_is_refused_as_incomplete_with_the_fix(one_epoch, tmp_path):
    """A checkpoint whose write was cut short (a copy of a killed job's .tmp file, or one
    without its 'complete' mark) is named so, with what to give instead, not taken for a
    data file or shown as HDF5's words alone."""
    whole = (one_epoch / "checkpoint-000000022.h5").read_bytes()
    cut, unmarked = tmp_path / "cut.h5", tmp_path / "unmarked.h5"
    cut.write_bytes(whole[:len(whole) // 2])
    unmarked.write_bytes(whole)
    with h5py.File(unmarked, "r+") as f:
        f.attrs["complete"] = False
    fix = "give a checkpoint-*.h5 that train wrote, or its run directory (its newest complete one)"
    refused(quick("eval", "--checkpoint", str(cut)),
            f"cannot read checkpoint {cut}: incomplete (its write was cut short): ", fix)
    refused(quick("eval", "--checkpoint", str(unmarked)),
            f"{unmarked} is incomplete (its write was cut short); {fix}")


def test_validation_classes_must_be_the_training_classes(synth, tmp_path):
    other = tmp_path / "val.h5"
    rename_classes(synth / "s_val.h5", other, ["class0", "class1", "cat", "class3"])
    r = quick("train", "--data", str(synth / "s.h5"), "--val-data", str(other),
              "--batch-size", "16", "--run-dir", str(tmp_path / "run"))
    refused(r, f"validation file {other} does not have the classes of training file",
            "class 2 is 'cat' against 'class2'")
    three = tmp_path / "three.h5"
    rename_classes(synth / "s_val.h5", three, ["class0", "class1", "class2"])
    with h5py.File(three, "r+") as f:
        f["labels"][...] = f["labels"][...] % 3
    r = quick("train", "--data", str(synth / "s.h5"), "--val-data", str(three),
              "--batch-size", "16", "--run-dir", str(tmp_path / "run"))
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


@pytest.mark.parametrize("content", [b"# notes, not images\n", b""])
@pytest.mark.parametrize("command", ["train", "preview"])
def test_a_training_file_of_another_kind_is_named_before_a_missing_validation_file(
        content, command, tmp_path):
    """--data naming a file that is not mpitrain's, with no FILE_val.h5 beside it: the
    refusal is about the file the user named, and says what reads it."""
    bad = tmp_path / "notes.h5"
    bad.write_bytes(content)
    r = quick(command, "--data", str(bad), *(["--run-dir", str(tmp_path / "run")]
                                             if command == "train" else
                                             ["--out", str(tmp_path / "batch.png")]))
    refused(r, f"{bad}: cannot be opened as HDF5", "the files that `python -m mpitrain convert` "
            "makes")
    assert "validation file" not in r.stderr
    assert os.listdir(tmp_path) == ["notes.h5"]            # no run directory, no image


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
    shutil.copy(huge, tmp_path / "huge_val.h5")
    r = quick("train", "--data", str(huge), "--val-data", str(tmp_path / "huge_val.h5"),
              "--batch-size", "16", "--run-dir", str(tmp_path / "run"))
    refused(r, "224x224 images in batches of 16 need", "GiB of buffers, more than the",
            "it declares images of (60000, 60000, 3)")
    # an encoded file, 4 records of 64 GiB declared: each worker would read one whole
    records = 64 << 30
    with h5py.File(huge, "w") as f:
        f.attrs.update(format="mpitrain-images", version=1, storage="encoded")
        f.create_dataset("images", (4 * records,), np.uint8, chunks=(1 << 20,))
        f["offsets"] = np.arange(5, dtype=np.int64) * records
        f["labels"] = np.arange(4) % 2
        f["class_names"] = np.array(["a", "b"], dtype=object).astype(h5py.string_dtype())
        f["mean"], f["std"] = np.full(3, 128.0), np.full(3, 64.0)
    assert os.path.getsize(huge) < 100_000
    r = quick("train", "--data", str(huge), "--val-data", str(tmp_path / "huge_val.h5"),
              "--batch-size", "2", "--run-dir", str(tmp_path / "run"))
    refused(r, "GiB of buffers, more than the", "it declares records of up to 68,719,476,736 "
                                                "bytes")
    assert sorted(os.listdir(tmp_path)) == ["huge.h5", "huge_val.h5"]


def with_bad_records(synth, tmp_path):
    """A copy of the synthetic training file (and its validation file beside it) in
    tmp_path, whose records 3, 17 and 40 are bytes that decode nowhere."""
    data = tmp_path / "s.h5"
    data.write_bytes((synth / "s.h5").read_bytes())
    (tmp_path / "s_val.h5").write_bytes((synth / "s_val.h5").read_bytes())
    with h5py.File(data, "r+") as f:
        for i in (3, 17, 40):
            f["images"][f["offsets"][i]:f["offsets"][i + 1]] = 1
    return data


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.launches)])
def test_decode_errors_are_counted_and_reported_with_skip_bad_records(synth, tmp_path, ranks):
    """Every rank's skips are counted: summed over the ranks in the progress lines,
    metrics.jsonl and the summary, whichever rank read the bad records."""
    data = with_bad_records(synth, tmp_path)
    args = ("train", "--data", str(data), "--batch-size", "16", "--image-size", "32",
            "--epochs", "1", "--log-every", "2", "--skip-bad-records",
            "--run-dir", str(tmp_path / "run"))
    r = quick(*args) if ranks == 1 else run(ranks, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 bad training record(s) skipped (--skip-bad-records)" in r.stdout
    shown = re.findall(r"step \d+/4 .* (\d) bad record\(s\) skipped", r.stdout)
    assert sum(map(int, shown)) == 3, r.stdout
    records = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert sum(x.get("skipped_records", 0) for x in records if x["kind"] == "step") == 3


def test_bad_records_skipped_before_a_resume_are_still_counted(synth, tmp_path):
    """A run resumed after its first epoch counts the bad records of both epochs, as an
    uninterrupted run does (the loaders' counts start again at 0)."""
    data = with_bad_records(synth, tmp_path)
    args = ("train", "--data", str(data), "--batch-size", "16", "--image-size", "32",
            "--skip-bad-records", "--workers", "1")
    straight = quick(*args, "--epochs", "2", "--run-dir", str(tmp_path / "straight"))
    first = quick(*args, "--epochs", "1", "--run-dir", str(tmp_path / "run"))
    resumed = quick(*args, "--epochs", "2", "--run-dir", str(tmp_path / "run"),
                    "--resume", "auto")
    for r in (straight, first, resumed):
        assert r.returncode == 0, r.stdout + r.stderr
    assert "3 bad training record(s) skipped (--skip-bad-records)" in first.stdout
    for r in (straight, resumed):
        assert "6 bad training record(s) skipped (--skip-bad-records)" in r.stdout, r.stdout


# ----- options -----
@pytest.mark.parametrize("flag,value", [("--lr", "nan"), ("--lr", "inf"), ("--momentum", "nan"),
                                        ("--weight-decay", "inf"), ("--warmup-epochs", "nan"),
                                        ("--label-smoothing", "nan"), ("--lars-eta", "inf")])
def test_non_finite_numbers_are_refused(flag, value):
    r = quick("train", flag, value)
    refused(r, f"argument {flag}: {value} is not a finite number")


def test_an_image_size_the_network_cannot_take(synth, tmp_path):
    """Given by --image-size, the option is named; taken from the data (40x40), the file is,
    and the option that changes it."""
    train = ("train", "--model", "alexnet", "--data", str(synth / "s.h5"), "--batch-size", "16",
             "--run-dir", str(tmp_path / "run"))
    refused(quick(*train, "--image-size", "32"), "--image-size 32 is too small for alexnet",
            "the smallest size it takes is 63")
    refused(quick(*train), f"40x40, the image size of {synth / 's.h5'}, is too small for "
            f"alexnet: its feature maps shrink to nothing; give --image-size 63 or more (the "
            f"images are resized to it)")
    assert not (tmp_path / "run" / "config.json").exists()


def test_one_value_per_channel_for_a_batchnorm_is_refused_before_any_work(digits, tmp_path):
    """One image a rank at 1x1 leaves resnet_small's BatchNorm layers one value per channel
    in training (PyTorch refuses it at its forward): refused before the run directory is
    made. On several ranks --bn-group, whose statistics take several ranks' images, is
    named, and a group of the ranks left over counts as small as it is."""
    from mpitrain.checks import ConfigError, check_batchnorm_values, leaf_shapes
    from mpitrain.nets import build_model
    run_dir = tmp_path / "run"
    r = quick("train", "--data-dir", str(digits), "--batch-size", "1", "--image-size", "1",
              "--run-dir", str(run_dir))
    refused(r, "--batch-size 1 over 1 rank(s) gives each 1 image(s), and at 1x1 the smallest "
               "map a BatchNorm layer of resnet_small normalises is 1 pixel(s): one value per "
               "channel in training, whose variance is nothing; give a --batch-size of two "
               "images a rank or more, a larger --image-size\n")
    assert not run_dir.exists()
    shapes = leaf_shapes(build_model("resnet_small", num_classes=10), 1)
    with pytest.raises(ConfigError, match="or --bn-group to share the statistics across ranks"):
        check_batchnorm_values(shapes, "resnet_small", 1, 2, 2, 1)
    check_batchnorm_values(shapes, "resnet_small", 1, 2, 2, 2)
    with pytest.raises(ConfigError, match="or a --bn-group that divides the 3 ranks"):
        check_batchnorm_values(shapes, "resnet_small", 1, 3, 3, 2)    # rank 2 alone


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.launches)])
def test_bench_step_refuses_an_image_size_the_network_cannot_take(synth, ranks):
    """As train does, on random data and on a file, in one process and in a job of two
    ranks (which ends, with one line, rather than wait for the rank that stopped)."""
    message = ("error: --image-size 32 is too small for alexnet: its feature maps shrink to "
               "nothing; the smallest size it takes is 63\n")
    bench = ("bench", "step", "--model", "alexnet", "--image-size", "32", "--batch", "4",
             "--steps", "1", "--warmup", "0")
    for data in [(), ("--data", str(synth / "s.h5"))][:3 - ranks]:     # --data: one process
        r = quick(*bench, *data) if ranks == 1 else run(ranks, *bench, timeout=120)
        assert r.returncode == 2 and message in r.stderr, r.stdout + r.stderr
        assert "Traceback" not in r.stderr, r.stderr


def test_argument_errors_are_said_once_per_job(digits):
    from test_checkpoint import command
    r = subprocess.run(command(2, "train", "--lr", "-1"), capture_output=True, text=True,
                       timeout=120, env=environment(2))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("argument --lr") == 1, r.stderr
    # the reason is the last thing printed: no launcher's help text after it (Open MPI
    # runs with --quiet)
    assert "argument --lr" in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.launches
@pytest.mark.parametrize("argv, said", [(("eval", "--help"), "usage: python -m mpitrain eval"),
                                        (("--version",), "mpitrain ")])
def test_help_and_version_are_said_once_per_job(argv, said):
    from test_checkpoint import command
    r = subprocess.run(command(2, *argv), capture_output=True, text=True,
                       timeout=120, env=environment(2))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(said) == 1, r.stdout


def test_a_run_directory_that_is_a_file_or_read_only(digits, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = quick("train", "--data-dir", str(digits), *BATCH, "--run-dir", str(afile))
    refused(r, f"--run-dir {afile} is a file, not a directory")
    # a directory no process may write into, root included (os.access says so for root
    # only where the file system refuses; a chmod would not stop root)
    locked = "/proc/sys"
    if not os.path.isdir(locked) or os.access(locked, os.W_OK):
        pytest.skip("NOT TESTED: a read-only --run-dir (the file case above passed): no "
                    "directory here refuses writes to root as Linux's /proc/sys does")
    r = quick("train", "--data-dir", str(digits), *BATCH, "--run-dir", locked)
    refused(r, f"--run-dir {locked} is not writable")


def test_a_file_given_as_the_data_dir_of_a_named_set_is_refused(tmp_path):
    """The set would be converted into it (it ended in 'File exists', status 1)."""
    afile = tmp_path / "digits_val.h5"
    afile.write_text("x")
    r = quick("train", "--data-dir", str(afile), "--run-dir", str(tmp_path / "run"))
    refused(r, f"--data-dir {afile} cannot hold the digits files: {afile} is a file, so "
               f"{afile / 'digits_train.h5'} cannot be written; choose another path")
    assert sorted(os.listdir(tmp_path)) == ["digits_val.h5"]


def test_a_trace_that_cannot_be_written_is_refused_before_the_run(digits, tmp_path):
    """Traces are written when the run ends: a path under a file was found only then,
    after the whole run (status 1, the run directory left locked)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = quick("train", "--data-dir", str(digits), *BATCH, "--trace", f"{afile}/",
              "--run-dir", str(tmp_path / "run"))
    refused(r, f"--trace {afile}/: {afile} is a file, so {afile / 'trace.rank0.json'} cannot "
               f"be written; choose another path")
    assert sorted(os.listdir(tmp_path)) == ["afile"]


@pytest.mark.parametrize("options,message", [
    (("--nesterov", "--momentum", "0"), "--nesterov looks ahead along the momentum, and "
                                        "--momentum is 0: drop --nesterov"),
    (("--compress", "topk", "--compress-warmup", "2", "--epochs", "2"),
     "--compress-warmup 2 keeps the sums dense for the whole run of --epochs 2, so top-k "
     "never starts"),
    # the default --epochs 8 and --warmup-epochs 1 leave it room; one epoch did not
    (("--optimizer", "neumann", "--epochs", "1"),
     "--optimizer neumann runs plain SGD through its warm-up, and --warmup-epochs 1 covers "
     "the whole run of --epochs 1, so Neumann's update never runs: lower --warmup-epochs, "
     "or raise --epochs"),
    (("--bn-group", "2"), "--bn-group 2 exceeds the 1 rank(s): give at most --bn-group 1, "
                          "or drop it"),
])
def test_options_that_would_do_nothing_are_refused(options, message, digits, tmp_path):
    r = quick("train", "--data-dir", str(digits), *BATCH, *options,
              "--run-dir", str(tmp_path / "run"))
    refused(r, message)
    assert not (tmp_path / "run").exists()


def test_the_training_file_as_validation_file_is_refused(synth, tmp_path):
    """Its accuracy would be on the images trained on, reported as validation."""
    data = str(synth / "s.h5")
    r = quick("train", "--data", data, "--val-data", data, *BATCH, "--image-size", "32",
              "--run-dir", str(tmp_path / "run"))
    refused(r, f"validation file {data} is the training file {data}: accuracy on the images "
               f"trained on is no validation; give --val-data a file of other images")
    assert not (tmp_path / "run").exists()


# ----- resuming -----
@pytest.fixture(scope="module")
def one_epoch(digits, tmp_path_factory):
    """A run directory holding the checkpoint of one epoch of SGD in fp32."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    r = run(2, "train", "--epochs", "1", *BATCH, "--data-dir", str(digits),
            "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir


def copy_of(one_epoch, tmp_path):
    """A copy of the one-epoch run, and its files' bytes, to hold a refusal to leaving it
    as it was."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("config.json", "environment.json", "checkpoint-000000022.h5"):
        (run_dir / name).write_bytes((one_epoch / name).read_bytes())
    return run_dir, {p: p.read_bytes() for p in run_dir.iterdir()}


@pytest.mark.parametrize("change", [("--optimizer", "lamb"), ("--precision", "fp16"),
                                    ("--model", "resnet18")])
def test_a_refused_resume_changes_nothing_in_the_run(one_epoch, digits, tmp_path, change):
    run_dir, before = copy_of(one_epoch, tmp_path)
    r = quick("train", "--epochs", "2", *BATCH, "--data-dir", str(digits),
              "--run-dir", str(run_dir), "--resume", "auto", *change)
    flag, value = change
    refused(r, f"was trained with {flag}", f"this run asks for {value}: a resumed run keeps it")
    assert {p: p.read_bytes() for p in run_dir.iterdir()} == before


def test_a_resume_that_saves_no_checkpoint_names_none_as_the_final_model(one_epoch, digits,
                                                                      tmp_path):
    """--checkpoint-every 0 after a resume: the run named the checkpoint it resumed from as
    its own, and eval scored that older model; then --epochs short of the epochs a
    checkpoint has trained is refused, where it reported them as fewer."""
    run_dir, _ = copy_of(one_epoch, tmp_path)
    resume = ("train", *BATCH, "--data-dir", str(digits), "--run-dir", str(run_dir),
              "--resume", "auto")
    r = quick(*resume, "--epochs", "2", "--checkpoint-every", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (f"no checkpoint of the final model (--checkpoint-every 0): eval, predict and "
            f"export of {run_dir} take {run_dir}/checkpoint-000000022.h5, from before this "
            f"job's steps; metrics ") in r.stdout, r.stdout
    r = quick(*resume, "--epochs", "2")
    assert r.returncode == 0 and f"checkpoint {run_dir}/checkpoint-000000044.h5; " in r.stdout
    r = quick(*resume, "--epochs", "2")     # at its end: said so, where "epoch 3" was
    assert r.returncode == 0, r.stdout + r.stderr
    assert (f"resumed from {run_dir}/checkpoint-000000044.h5: the end of its 2 epochs, "
            f"nothing more to train (written by 1 rank(s))" in r.stdout), r.stdout
    assert re.search(r"\(359 images, 2 epochs, [0-9.]+ s since the resume at the run's "
                     r"end\)", r.stdout), r.stdout
    before = {p: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    refused(quick(*resume, "--epochs", "1"),
            f"--resume: {run_dir}/checkpoint-000000044.h5 has trained 2 epochs, past --epochs "
            f"1: give --epochs 2 (nothing more to train) or more")
    assert {p: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_a_fresh_run_into_a_directory_without_a_checkpoint_is_told_what_resume_would_do(
        one_epoch, digits, tmp_path):
    """An earlier run that saved no checkpoint: --resume auto starts afresh over its
    records, which the refusal said nothing of when it offered it as continuing."""
    run_dir, _ = copy_of(one_epoch, tmp_path)
    (run_dir / "checkpoint-000000022.h5").unlink()
    refused(quick("train", *BATCH, "--data-dir", str(digits), "--run-dir", str(run_dir)),
            f"--run-dir {run_dir} holds an earlier run (config.json) with no checkpoint to "
            f"continue from: start in another --run-dir (without --run-dir each run gets a "
            f"new runs/<timestamp>), or with --resume auto here, which replaces its records")


def test_a_top_k_run_resumed_without_top_k_says_its_residuals_are_dropped(digits, tmp_path):
    """The other way round (residuals starting from zero) was said; this way was silent."""
    run_dir = tmp_path / "run"
    args = ("train", *BATCH, "--data-dir", str(digits), "--run-dir", str(run_dir))
    r = quick(*args, "--epochs", "1", "--compress", "topk")
    assert r.returncode == 0, r.stdout + r.stderr
    r = quick(*args, "--epochs", "2", "--resume", "auto")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (f"warning: the top-k residuals of {run_dir}/checkpoint-000000022.h5 are dropped: "
            f"this run sums its gradients densely (it was written with --compress topk)"
            in r.stdout), r.stdout


def test_a_refused_resume_into_a_new_run_directory_leaves_none_behind(one_epoch, digits,
                                                                       tmp_path):
    """The directory is made (and locked) before the checkpoint is checked: a refusal
    then removes it, as it found no directory there."""
    new = tmp_path / "runs" / "new"
    r = quick("train", "--epochs", "2", *BATCH, "--data-dir", str(digits), "--run-dir",
              str(new), "--resume", str(one_epoch / "checkpoint-000000022.h5"),
              "--model", "resnet18")
    refused(r, "was trained with --model resnet_small, this run asks for resnet18")
    assert not new.exists() and (tmp_path / "runs").is_dir()


def test_a_resume_that_leaves_out_the_runs_recipe_is_refused_naming_it(one_epoch, digits,
                                                                       tmp_path):
    """Flags left out (or changed) on --resume would train on with other values: every
    option of the recipe that differs is named, as the run had it and as asked for, and
    the run directory is left as it was. --epochs may change."""
    run_dir, before = copy_of(one_epoch, tmp_path)
    r = quick("train", "--epochs", "3", *BATCH, "--data-dir", str(digits), "--run-dir",
              str(run_dir), "--resume", "auto", "--lr", "0.05", "--seed", "3", "--nesterov")
    refused(r, f"{run_dir / 'checkpoint-000000022.h5'} was trained with --seed 0, --lr 0.1, no "
               f"--nesterov, this run has --seed 3, --lr 0.05, --nesterov: a resumed run keeps "
               f"its recipe; give these options as the run had them")
    assert {p: p.read_bytes() for p in run_dir.iterdir()} == before


def test_a_resume_on_other_data_is_refused_naming_it(one_epoch, digits, tmp_path):
    """Other classes, or images of another mean and std (another data set with the same
    class count): the run trained on until the loss exploded, blamed on the learning
    rate. Refused, the run directory as it was."""
    run_dir, before = copy_of(one_epoch, tmp_path)
    train, val = tmp_path / "other.h5", tmp_path / "other_val.h5"
    shutil.copy(digits / "digits_train.h5", train)
    shutil.copy(digits / "digits_val.h5", val)
    with h5py.File(train, "r+") as f:
        f["mean"][...] = f["mean"][:] * 1.5
    r = quick("train", "--epochs", "2", *BATCH, "--data", str(train), "--run-dir",
              str(run_dir), "--resume", "auto")
    refused(r, f"{run_dir / 'checkpoint-000000022.h5'} was trained on --data digits, and "
               f"--data {train} holds images of another mean and std", "a resumed run keeps "
               f"its data; give the run's --data, or start a new run in another --run-dir")
    for name, path in (("digits_train.h5", train), ("digits_val.h5", val)):
        rename_classes(digits / name, path, [f"L{i}" for i in range(10)])
    r = quick("train", "--epochs", "2", *BATCH, "--data", str(train), "--val-data", str(val),
              "--run-dir", str(run_dir), "--resume", "auto")
    refused(r, f"--data {train} holds other classes (class 0 is '0' against 'L0')")
    assert {p: p.read_bytes() for p in run_dir.iterdir()} == before


def test_a_resume_whose_wire_would_change_the_default_loss_scale_is_refused(one_epoch, digits,
                                                                           tmp_path):
    """Left at its default, the loss scale is 1 with fp32 gradients on the wire and dynamic
    with fp16 ones: a resume that changes --comm-dtype would load the saved static scaler
    into a dynamic one (it ended in a traceback). Refused naming the option, the run
    directory as it was."""
    run_dir, before = copy_of(one_epoch, tmp_path)
    r = quick("train", "--epochs", "2", *BATCH, "--data-dir", str(digits), "--run-dir",
              str(run_dir), "--resume", "auto", "--comm-dtype", "fp16")
    refused(r, f"{run_dir / 'checkpoint-000000022.h5'} was trained with --comm-dtype fp32 and "
               f"its default loss scale, 1; this run's --comm-dtype fp16 would make it "
               f"dynamic: a resumed run keeps its loss scale; pass --comm-dtype fp32")
    assert {p: p.read_bytes() for p in run_dir.iterdir()} == before


def test_a_resume_that_names_the_loss_scale_its_run_had_by_default_goes_on(one_epoch, digits,
                                                                         tmp_path):
    """--loss-scale given as the one the run's default meant (1 with fp32 on the wire) is
    the same recipe: the resume goes on."""
    run_dir, _ = copy_of(one_epoch, tmp_path)
    r = quick("train", "--epochs", "2", *BATCH, "--data-dir", str(digits), "--run-dir",
              str(run_dir), "--resume", "auto", "--loss-scale", "1")
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stdout + r.stderr


def test_a_resume_from_before_the_run_directorys_newest_checkpoint_is_refused(one_epoch, digits,
                                                                             tmp_path):
    """The run would go on beside the later history it abandons, whose checkpoints
    --resume auto and the pruning would take for its own: refused, the directory as it
    was."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    older, later = run_dir / "checkpoint-000000022.h5", run_dir / "checkpoint-000000044.h5"
    for path in (older, later):
        path.write_bytes((one_epoch / "checkpoint-000000022.h5").read_bytes())
    with h5py.File(later, "r+") as f:
        f.attrs["global_step"] = 44
    before = {p: p.read_bytes() for p in run_dir.iterdir()}
    r = quick("train", "--epochs", "2", *BATCH, "--data-dir", str(digits), "--run-dir",
              str(run_dir), "--resume", str(older))
    refused(r, f"--resume {older}: the run directory {run_dir} holds a later checkpoint, "
               f"{later}, of a run that went on from there; resume into another --run-dir")
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
    # a run directory given to --resume: its newest complete checkpoint, into another run
    r = quick("train", "--epochs", "2", *BATCH, "--data-dir", str(digits),
              "--run-dir", str(tmp_path / "next"), "--resume", str(one_epoch))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from {one_epoch / 'checkpoint-000000022.h5'}: epoch 2" in r.stdout, r.stdout
    # without --run-dir, the run goes on in the directory given to --resume
    again = tmp_path / "again"
    shutil.copytree(one_epoch, again)
    r = quick("train", "--epochs", "2", *BATCH, "--data-dir", str(digits), "--resume", str(again),
              cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (again / "checkpoint-000000044.h5").exists() and not (tmp_path / "config.json").exists()


def test_resume_auto_refuses_to_pass_over_a_checkpoint_held_open_or_every_one(one_epoch, digits,
                                                                            tmp_path):
    """A newest checkpoint another process held open for writing (an HDF5 viewer) was
    passed over as torn: the run resumed the one before and wrote over it with its own.
    A directory whose every checkpoint failed to read started afresh, over them. Both are
    refused, the directory as it was."""
    run_dir = tmp_path / "run"
    shutil.copytree(one_epoch, run_dir)
    newest = run_dir / "checkpoint-000000044.h5"
    newest.write_bytes((run_dir / "checkpoint-000000022.h5").read_bytes())
    with h5py.File(newest, "r+") as f:
        f.attrs["global_step"], f.attrs["epoch"] = 44, 2
    with held_open(newest):
        before = {p: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
        r = quick("train", "--epochs", "3", *BATCH, "--data-dir", str(digits), "--run-dir",
                  str(run_dir), "--resume", "auto")
        after = {p: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    refused(r, f"cannot read checkpoint {newest}: another process holds it open for writing "
               f"(HDF5 locks the file): close it there, then run again (passed over, an older "
               f"checkpoint would be resumed, and this one written over)")
    assert after == before
    # every checkpoint torn
    for path in run_dir.glob("checkpoint-*.h5"):
        path.write_bytes(path.read_bytes()[:2000])
    before = {p: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    r = quick("train", "--epochs", "3", *BATCH, "--data-dir", str(digits), "--run-dir",
              str(run_dir), "--resume", "auto")
    refused(r, f"--resume auto: no checkpoint in {run_dir} reads back (each one is named "
               f"above), and a run started afresh would write over them: move them aside to "
               f"start afresh, or name one with --resume FILE")
    assert f"--resume auto: passing over {newest}: cannot read checkpoint" in r.stdout, r.stdout
    assert {p: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(quick("train", "--epochs", "2", *BATCH, "--data-dir", str(digits), "--run-dir",
                  str(tmp_path / "other"), "--resume", str(empty)),
            f"--resume {empty}: the run directory holds no complete checkpoint; name a "
            f"checkpoint file")


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


def test_an_option_of_another_optimizer_is_refused_not_ignored():
    refused(quick("train", "--optimizer", "lamb", "--nesterov"),
            "--nesterov is an option of --optimizer sgd and lars; --optimizer lamb would "
            "ignore it: drop --nesterov")
    refused(quick("train", "--optimizer", "sgd", "--lars-eta", "0.01"),
            "--lars-eta is an option of --optimizer lars; --optimizer sgd would ignore it")
    for optimizer in ("neumann", "nlcg"):
        refused(quick("train", "--optimizer", optimizer, "--nesterov"), "drop --nesterov")
    refused(quick("train", "--optimizer", "lamb", "--momentum", "0.8"),
            "--momentum is an option of --optimizer sgd, lars and neumann; --optimizer lamb "
            "would ignore it: drop --momentum")


def test_an_option_of_another_schedule_or_compression_is_refused_not_ignored():
    refused(quick("train", "--milestones", "3"),
            "--milestones is an option of --schedule step; --schedule cosine would ignore it: "
            "drop --milestones (or add --schedule step)")
    refused(quick("train", "--schedule", "step", "--poly-power", "1"),
            "--poly-power is an option of --schedule poly; --schedule step would ignore it")
    refused(quick("train", "--density", "0.1"),
            "--density is an option of --compress topk; --compress none would ignore it")
    refused(quick("bench", "step", "--density", "0.1"), "--density is an option of --compress topk")
    refused(quick("train", "--compress-warmup", "1"), "drop --compress-warmup")


def test_a_step_schedule_needs_milestones_the_run_reaches():
    refused(quick("train", "--schedule", "step"),
            "--schedule step multiplies the learning rate by 0.1 at each of --milestones, and "
            "none is given: add --milestones")
    refused(quick("train", "--schedule", "step", "--milestones", "2", "9.5", "--epochs", "8"),
            "--milestones 9.5 would never apply: the run ends after --epochs 8; drop it or "
            "raise --epochs")
    # a milestone at the run's end applies from the step that reaches it: the last one
    refused(quick("train", "--schedule", "step", "--milestones", "2", "8", "9.5", "--epochs", "8"),
            "--milestones 8 would apply to the run's last step only and 9.5 would never apply: "
            "the run ends after --epochs 8; drop them or raise --epochs")


def test_crop_options_without_augmentation_are_refused_not_ignored(digits):
    """The digits train without augmentation unless --augment is given."""
    refused(quick("train", "--data-dir", str(digits), "--crop-scale", "0.5", "1"),
            "--crop-scale shapes augmentation's training crops, and augmentation is off "
            "(the default for digits): drop --crop-scale or add --augment")
    refused(quick("train", "--data-dir", str(digits), "--augment", "--no-augment",
                  "--crop-ratio", "0.5", "2"), "augmentation is off (--no-augment)")


def test_ranks_per_gpu_is_refused_without_a_gpu_to_share(digits, tmp_path):
    run_dir = tmp_path / "run"
    r = quick("train", "--data-dir", str(digits), *BATCH, "--device", "cpu", "--ranks-per-gpu", "2",
              "--run-dir", str(run_dir))
    refused(r, "--ranks-per-gpu 2 shares GPUs among ranks, but this run is on the CPU "
               "(--device cpu or MPITRAIN_DEVICE=cpu); drop --ranks-per-gpu")
    assert not run_dir.exists()
    refused(quick("train", "--ranks-per-gpu", "0"), "argument --ranks-per-gpu")


# ----- empty and exhausted inputs -----
def empty_copy(src, dst):
    """`src`'s classes and statistics with no records."""
    with h5py.File(src, "r") as f, h5py.File(dst, "w") as g:
        g.attrs.update(f.attrs)
        for key in ("class_names", "mean", "std"):
            f.copy(key, g)
        g["labels"] = np.zeros(0, np.int64)
        g["offsets"] = np.zeros(1, np.int64)
        g["images"] = np.zeros(0, np.uint8)
        g["filenames"] = np.zeros(0, h5py.string_dtype())


@pytest.mark.parametrize("which", ["training", "validation"])
def test_an_empty_data_file_is_refused_before_any_work(synth, tmp_path, which):
    empty = tmp_path / "empty.h5"
    empty_copy(synth / "s.h5", empty)
    files = (empty, synth / "s_val.h5") if which == "training" else (synth / "s.h5", empty)
    r = quick("train", "--data", str(files[0]), "--val-data", str(files[1]), "--batch-size", "16",
              "--run-dir", str(tmp_path / "run"))
    refused(r, f"{which} file {empty} holds no images")
    assert not (tmp_path / "run").exists()


def test_images_of_zero_pixels_are_refused(synth, tmp_path):
    flat = tmp_path / "flat.h5"
    with h5py.File(flat, "w") as f:
        f.attrs.update(format="mpitrain-images", version=1, storage="pixels")
        f["pixels"] = np.zeros((32, 0, 0, 3), np.uint8)
        f["labels"] = np.arange(32) % 4
        f["class_names"] = np.array([f"class{c}" for c in range(4)],
                                    dtype=object).astype(h5py.string_dtype())
        f["mean"], f["std"] = np.full(3, 128.0), np.full(3, 64.0)
    r = quick("train", "--data", str(flat), "--val-data", str(synth / "s_val.h5"),
              "--batch-size", "16", "--run-dir", str(tmp_path / "run"))
    refused(r, f"{flat}: its images are 0x0 pixels")


def test_eval_of_an_empty_file_is_refused(one_epoch, digits, tmp_path):
    empty = tmp_path / "empty.h5"
    with h5py.File(digits / "digits_val.h5", "r") as f, h5py.File(empty, "w") as g:
        g.attrs.update(f.attrs)
        for key in ("class_names", "mean", "std"):
            f.copy(key, g)
        g["labels"] = np.zeros(0, np.int64)
        g["pixels"] = np.zeros((0, 32, 32, 3), np.uint16)
    r = quick("eval", "--checkpoint", str(one_epoch / "checkpoint-000000022.h5"),
              "--data", str(empty))
    refused(r, f"data file {empty} holds no images")


@pytest.mark.launches
def test_eval_on_ranks_that_do_not_divide_the_training_batch_rounds_it_up(one_epoch, digits):
    """The run trained at batch 64; eval of 3 ranks takes 66 unless told otherwise."""
    val = str(digits / "digits_val.h5")
    alone = quick("eval", "--checkpoint", str(one_epoch), "--data", val, "--json")
    three = run(3, "eval", "--checkpoint", str(one_epoch), "--data", val, "--json")
    assert alone.returncode == three.returncode == 0, alone.stderr + three.stderr
    assert json.loads(three.stdout)["top1"] == json.loads(alone.stdout)["top1"]
    refused(run(3, "eval", "--checkpoint", str(one_epoch), "--data", val, *BATCH),
            "--batch-size 64, the global batch, does not divide by the 3 MPI ranks")


def test_eval_without_data_takes_its_runs_validation_file_or_says_it_is_not_here(digits,
                                                                                tmp_path):
    from mpitrain.tools.evaluate import EvalError, run_validation_file
    assert run_validation_file(dict(data="digits", data_dir=str(digits))) \
        == os.path.join(str(digits), "digits_val.h5")
    assert run_validation_file(dict(data="x.h5", val_data=str(digits / "digits_val.h5"))) \
        == str(digits / "digits_val.h5")
    with pytest.raises(EvalError) as e:
        run_validation_file(dict(data=str(tmp_path / "x.h5"), val_data=None))
    assert str(e.value) == (f"the checkpoint's run validated on {tmp_path / 'x_val.h5'}, which "
                            f"is not here (its paths are relative to where it ran): name a "
                            f"data file with --data FILE")
    # a relative path is taken from the directory the run started in
    start = tmp_path / "start"
    (start / "d").mkdir(parents=True)
    (start / "d" / "x_val.h5").write_bytes(b"")
    assert run_validation_file(dict(data="d/x.h5", start_dir=str(start))) \
        == str(start / "d" / "x_val.h5")
    with pytest.raises(EvalError) as e:
        run_validation_file(dict(data="d/y.h5", start_dir=str(start)))
    assert str(e.value) == (f"the checkpoint's run validated on d/y_val.h5, which is neither "
                            f"in {start}, where the run started, nor here: name a data file "
                            f"with --data FILE")


def test_eval_of_a_named_data_set_scores_its_validation_file(one_epoch, digits, tmp_path):
    """--data digits, as train takes it: the validation file under the run's --data-dir,
    or under --data-dir (which without --data takes the run's set); a folder without it is
    refused with the command that makes it, and --data-dir beside a file."""
    named = quick("eval", "--checkpoint", str(one_epoch), "--data", "digits", "--json")
    given = quick("eval", "--checkpoint", str(one_epoch), "--data",
                  str(digits / "digits_val.h5"), "--json")
    assert named.returncode == given.returncode == 0, named.stderr + given.stderr
    assert json.loads(named.stdout) == json.loads(given.stdout)
    assert json.loads(named.stdout)["data"] == str(digits / "digits_val.h5")
    there = quick("eval", "--checkpoint", str(one_epoch), "--data", "digits", "--data-dir",
                  str(digits), "--json")
    assert json.loads(there.stdout) == json.loads(given.stdout), there.stderr
    # without --data, the run's named set under --data-dir
    run_set = quick("eval", "--checkpoint", str(one_epoch), "--data-dir", str(digits), "--json")
    assert json.loads(run_set.stdout) == json.loads(given.stdout), run_set.stderr
    refused(quick("eval", "--checkpoint", str(one_epoch), "--data", "digits", "--data-dir",
                  str(tmp_path)),
            f"the validation file of digits, {tmp_path / 'digits_val.h5'}, does not exist: "
            f"make it with `python -m mpitrain convert digits {tmp_path}`, or give --data-dir "
            f"where it is")
    refused(quick("eval", "--checkpoint", str(one_epoch), "--data", str(digits / "digits_val.h5"),
                  "--data-dir", str(digits)),
            f"--data-dir is where a named data set's files are (digits, fashion-mnist); "
            f"{digits / 'digits_val.h5'} is a file: drop --data-dir")


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.launches)])
def test_an_empty_record_ends_the_run_in_one_line_with_status_2(synth, tmp_path, ranks):
    data = tmp_path / "s.h5"
    data.write_bytes((synth / "s.h5").read_bytes())
    with h5py.File(data, "r+") as f:
        f["offsets"][4] = f["offsets"][3]          # record 3: no bytes
    args = ("train", "--data", str(data), "--val-data", str(synth / "s_val.h5"),
            "--batch-size", "16", "--image-size", "32", "--epochs", "1",
            "--run-dir", str(tmp_path / "run"))
    r = quick(*args) if ranks == 1 else run(ranks, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "record 3 cannot be decoded" in errors[0], r.stderr
    assert "--skip-bad-records" in errors[0] and "Traceback" not in r.stderr, r.stderr


def test_too_many_workers_are_refused_with_the_reason():
    from mpitrain.launcher import cores
    refused(quick("train", "--workers", "1000"),
            f"argument --workers: 1000 exceeds the {cores()} core(s) this process may run on")
    refused(quick("eval", "--checkpoint", "c.h5", "--data", "d.h5", "--workers", "1000"),
            "argument --workers: 1000 exceeds")
    # bench step --data times train's step fed by its loader: the same limit
    refused(quick("bench", "step", "--data", "d.h5", "--workers", "1000"),
            "argument --workers: 1000 exceeds")


def test_inspect_refuses_an_image_size_the_network_cannot_take(synth):
    refused(quick("inspect", "--model", "alexnet", "--image-size", "32"),
            "--image-size 32 is too small for alexnet", "the smallest size it takes is 63")
    refused(quick("inspect", "--model", "alexnet", "--data", str(synth / "s.h5")),
            f"40x40, the image size of {synth / 's.h5'}, is too small for alexnet",
            "give --image-size 63 or more")


# ----- converting folders -----
def png(path, value=100):
    from PIL import Image
    Image.fromarray(np.full((12, 12, 3), value, np.uint8)).save(path)


def test_a_named_data_set_converts_into_a_folder_which_as_data_is_answered_with_its_files(
        tmp_path):
    """`convert digits data/digits.h5` (imagefolder's way of naming its output) and a
    DST_DIR that is a file are refused, nothing written; a folder of data files given as
    --data is answered with the files in it."""
    refused(quick("convert", "digits", "data/digits.h5", cwd=tmp_path),
            "DST_DIR data/digits.h5 names an HDF5 file, and `convert digits` writes "
            "digits_train.h5 and its other files into a folder: give the folder (for "
            "example data)")
    refused(quick("convert", "fashion-mnist", "f.HDF5", cwd=tmp_path),
            "(for example data)")
    (tmp_path / "afile").write_text("")
    refused(quick("convert", "digits", "afile", cwd=tmp_path),
            f"{tmp_path / 'afile'} is a file, so afile/digits_train.h5 cannot be written")
    assert sorted(os.listdir(tmp_path)) == ["afile"]
    (tmp_path / "folder.h5").mkdir()                   # a folder, whatever its name
    r = quick("convert", "digits", "folder.h5", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    refused(quick("train", "--data", "folder.h5", "--run-dir", "run", cwd=tmp_path),
            "folder.h5 is a folder of data files (digits_train.h5, digits_val.h5): name one, "
            "for example folder.h5/digits_train.h5")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["no class folders", "one class folder", "no images",
                                  "a class without images", "a class's images a level down",
                                  "a class without training images", "no validation image"])
def test_converting_a_folder_without_images_is_refused(tmp_path, case):
    """Before any work, nothing written: a folder with no class folders, one, or no
    images, a class folder without images (a class the network would never see; what it holds
    instead named), a --val-fraction that takes all of a class's images, or none of any."""
    src = tmp_path / "src"
    src.mkdir()
    options = ()
    if case == "no images":
        (src / "cat").mkdir()
        (src / "dog").mkdir()
        expect = f"{src}: its 2 class folder(s) hold no image files"
    elif case == "no class folders":
        png(src / "loose.png")
        expect = f"{src}: no class folders (expected SRC/<class>/<image>)"
    elif case == "one class folder":
        (src / "cat").mkdir()
        png(src / "cat" / "0.png")
        expect = f"{src}: one class folder (cat), and a classifier needs two or more"
    else:
        empty = case in ("a class without images", "a class's images a level down")
        for c, count in (("cat", 5), ("dog", 7), ("empty", 0 if empty else 5)):
            (src / c).mkdir()
            for i in range(count):
                png(src / c / f"{i}.png", 20 * i)
        deep = src / "empty" / "2024"
        if case == "a class's images a level down":
            deep.mkdir()
            png(deep / "0.png")
        options, expect = {
            "a class without images": ((), f"{src}: class folder(s) empty hold no image file, "
                                           f"so the network would have a class it never sees"),
            "a class's images a level down": (
                (), f"{src}: class folder(s) empty hold no image file: empty{os.sep}2024 is "
                    f"a folder (images are read one level below SRC only), so the network "
                    f"would have a class it never sees"),
            "a class without training images": (
                ("--val-fraction", "0.95"), "--val-fraction 0.95 takes every image of class cat "
                                            "(5) into the validation split, leaving it none to "
                                            "train on; give a smaller --val-fraction"),
            "no validation image": (
                ("--val-fraction", "0.05"), "--val-fraction 0.05 of 17 images in 3 class(es) "
                                            "rounds to no validation image in any class")}[case]
    r = quick("convert", "imagefolder", str(src), str(tmp_path / "out.h5"), *options)
    refused(r, expect)
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.launches
def test_convert_makes_the_directory_of_its_file_or_says_why_it_cannot(tmp_path):
    """The five-minute tour's conversion into data/ where there is none yet, as an MPI job
    of 2 ranks; a path through a file, or a directory, refused before any work."""
    from test_checkpoint import command
    src = tmp_path / "src"
    for c in ("cat", "dog"):
        (src / c).mkdir(parents=True)
        for i in range(3):
            png(src / c / f"{i}.png", 40 * i + (c == "dog"))   # no copies: they would be skipped
    out = tmp_path / "data" / "new" / "pets.h5"
    r = subprocess.run(command(2, "convert", "imagefolder", str(src), str(out), "--val-fraction",
                               "0.34"), capture_output=True, text=True, timeout=120,
                       env=environment(2))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"train: 4 images -> {out}" in r.stdout and (out.parent / "pets_val.h5").exists()
    (tmp_path / "afile").write_text("x")
    r = quick("convert", "synthetic", str(tmp_path / "afile" / "more" / "s.h5"), "--count", "2")
    refused(r, f"{tmp_path / 'afile'} is a file, so {tmp_path}/afile/more/s.h5 cannot be "
               "written; choose another path")
    r = quick("convert", "imagefolder", str(src), str(out.parent))
    refused(r, f"{out.parent} is a directory; name the file to write")
    r = quick("convert", "imagefolder", str(src), str(src / "cat" / "pets.h5"))
    refused(r, f"{src / 'cat' / 'pets.h5'} lies inside SRC {src}, among the images it converts")
    assert sorted(os.listdir(tmp_path)) == ["afile", "data", "src"]
    assert sorted(os.listdir(out.parent)) == ["pets.h5", "pets.h5.skipped.txt", "pets_val.h5"]


def test_links_that_lead_nowhere_and_files_that_are_no_images_are_listed_as_skipped(tmp_path):
    src = tmp_path / "src"
    for c in ("cat", "dog"):
        (src / c).mkdir(parents=True)
        for i in range(3):
            png(src / c / f"{i}.png", 40 * i + (c == "dog"))   # no copies: they would be skipped
    os.symlink("loop", src / "cat" / "loop")              # a link to itself
    os.symlink("nowhere.png", src / "dog" / "gone.png")   # a broken link
    (src / "dog" / "notes.txt").write_text("not an image")
    (src / "dog" / "empty.jpg").write_bytes(b"")
    r = quick("convert", "imagefolder", str(src), str(tmp_path / "out.h5"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "train: 6 images" in r.stdout and "4 file(s) skipped" in r.stdout
    report = (tmp_path / "out.h5.skipped.txt").read_text()
    assert "dog/notes.txt\tnot an image (no format Pillow reads)\n" in report, report
    assert "dog/empty.jpg\tan empty file\n" in report, report
    assert "cat/loop\ta symbolic link that leads nowhere (Too many levels of symbolic links)" \
        in report, report
    assert "dog/gone.png\ta symbolic link that leads nowhere (No such file or directory)" \
        in report, report


# ----- a full file system -----
@pytest.fixture
def small_fs(tmp_path):
    """mount(kib): a tmpfs of that size (skipped, saying why, where none can be mounted)."""
    mounted = []

    def mount(kib):
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        try:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs",
                                str(point)], capture_output=True, text=True)
            why = r.stderr.strip() if r.returncode else None
        except FileNotFoundError as e:
            why = str(e)
        if why:
            pytest.skip(f"NOT TESTED: a full file system needs a small tmpfs, and none can be "
                        f"mounted here ({why}); run the tests as root with mount rights")
        mounted.append(point)
        return point
    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


def test_a_run_directory_without_room_for_a_checkpoint_is_refused(small_fs, digits):
    fs = small_fs(512)
    r = quick("train", "--data-dir", str(digits), *BATCH, "--run-dir", str(fs / "run"))
    refused(r, f"--run-dir {fs / 'run'} has 0.5 MiB free, but one checkpoint of this run "
               f"takes about", "free space there or choose another --run-dir")
    assert not (fs / "run" / "config.json").exists()


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.launches)])
def test_a_file_system_that_fills_up_stops_the_run_cleanly(small_fs, digits, ranks):
    """Room for one checkpoint and a half: the second is not begun, the run stops (status 1)
    saying so on every rank, and the first checkpoint, config.json and nothing else
    half-written remain."""
    from mpitrain import checkpoint
    fs = small_fs(1100)
    args = ("train", "--data-dir", str(digits), *BATCH, "--epochs", "3", "--workers", "1",
            "--run-dir", str(fs / "run"))
    r = quick(*args, timeout=300) if ranks == 1 else run(ranks, *args, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    first = fs / "run" / "checkpoint-000000022.h5"
    assert (f"the file system of --run-dir {fs / 'run'} cannot hold the checkpoint of step 44"
            in r.stderr), r.stderr
    assert f"the last checkpoint is {first}" in r.stderr and "Traceback" not in r.stderr
    assert sorted(os.listdir(fs / "run")) == ["checkpoint-000000022.h5", "config.json",
                                              "environment.json", "heartbeat", "metrics.jsonl"]
    assert checkpoint.read(str(first))["global_step"] == 22
    assert json.loads((fs / "run" / "config.json").read_text())["batch_size"] == 64


FILL_UP = """
import os, sys
from mpitrain import checkpoint
state, fs = checkpoint.read(sys.argv[1]), sys.argv[2]
stat = os.statvfs(fs)
free, size = stat.f_bavail * stat.f_frsize, os.path.getsize(sys.argv[1])
for n in range(free - size - 16384, free, 2048):   # the checkpoint's last bytes find no room
    with open(os.path.join(fs, "filler"), "wb") as f:
        f.write(b"x" * n)
    try:
        checkpoint.write(os.path.join(fs, "c.h5"), state)
    except OSError as e:
        print(e.errno, sorted(os.listdir(fs)))
    for name in os.listdir(fs):
        os.remove(os.path.join(fs, name))
"""


def test_a_checkpoint_that_fills_the_file_system_fails_as_one_oserror(small_fs, one_epoch):
    """However near the end of the file the room runs out, the write is an OSError (no
    space left), its temporary file removed: HDF5 writing the file itself failed in its
    flush at close, a RuntimeError that train did not take for a full disk, with pages of
    HDF5 errors and a crash at the process's exit."""
    fs = small_fs(3000)
    r = subprocess.run([sys.executable, "-c", FILL_UP,
                        str(one_epoch / "checkpoint-000000022.h5"), str(fs)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    failures = r.stdout.splitlines()
    assert len(failures) >= 8 and set(failures) == {f"{errno.ENOSPC} ['filler']"}, r.stdout


def test_reports_are_written_whole_or_not_at_all(small_fs):
    from mpitrain.files import save_json
    fs = small_fs(64)
    (fs / "filler").write_bytes(b"x" * (60 << 10))
    with pytest.raises(OSError):
        save_json(str(fs / "config.json"), {"text": "y" * (16 << 10)})
    assert sorted(os.listdir(fs)) == ["filler"]


def test_a_full_disk_or_a_path_that_cannot_be_made_is_one_line_with_nothing_half_written(
        small_fs, one_epoch, tmp_path):
    """plot and convert writing into a full file system, and plot into a directory whose
    name is too long for it: exit 1 with one line that says why, no traceback, and no
    file half-written (each PNG whole or absent, no HDF5 file)."""
    fs = small_fs(40)
    for args, named in ((("plot", str(one_epoch), "--out", str(fs / "plots")),
                         rf" \({fs / 'plots'}/\w+\.png\)"),
                        (("export", str(one_epoch), str(fs / "m.safetensors")),
                         rf" \({fs / 'm.safetensors'}\)"),
                        (("convert", "synthetic", str(fs / "s.h5"), "--count", "50"), "")):
        r = quick(*args)
        assert r.returncode == 1 and re.fullmatch(
            rf"mpitrain: error: No space left on device{named}: free space on the file system "
            rf"being written, or write elsewhere\n", r.stderr), r.stdout + r.stderr
    assert os.listdir(fs) == ["plots"]
    assert all(png.read_bytes().endswith(b"IEND\xaeB`\x82") for png in (fs / "plots").iterdir())
    long = tmp_path / ("x" * 300)
    r = quick("plot", str(one_epoch), "--out", str(long))
    assert r.returncode == 1 and r.stderr == f"mpitrain: error: {long}: File name too long\n", \
        r.stderr


def test_metrics_records_without_room_are_left_out_whole(small_fs):
    import io
    from mpitrain.metrics import MetricsLog, read_metrics
    fs = small_fs(64)
    (fs / "filler").write_bytes(b"x" * (56 << 10))
    said = io.StringIO()
    log = MetricsLog(str(fs / "metrics.jsonl"), stream=said)
    for i in range(20):                                  # 1.5 KiB each: room for about 5
        log.write({"kind": "step", "global_step": i, "text": "y" * 1500})
    log.close()
    text = (fs / "metrics.jsonl").read_text()
    kept = read_metrics(str(fs / "metrics.jsonl"))
    assert 0 < len(kept) < 20 and text.endswith("\n")
    assert [r["global_step"] for r in kept] == list(range(len(kept)))
    assert text.count("\n") == len(kept)                  # no torn line
    assert said.getvalue().count("cannot write (No space left on device)") == 1
