"""Augmentation's options (--crop-scale, --crop-ratio, --crop-fraction) and `preview`, which
writes one batch as the loader gives it: its tiles are the loader's own pixels, the
options reach the loader, bad values are refused with nothing written, and `train`
takes the same options."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from launcher import environment
from mpitrain.datasets.convert import convert_synthetic
from mpitrain.datasets.loader import Loader
from mpitrain.tools.preview import LABEL_HEIGHT, MIN_TILE


def mpitrain(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], capture_output=True,
                          text=True, timeout=timeout, env=environment(1), cwd=cwd)


@pytest.fixture(scope="module")
def square(tmp_path_factory):
    """12 square 48x48 JPEGs of 3 classes."""
    path = tmp_path_factory.mktemp("square") / "sq.h5"
    convert_synthetic(str(path), 12, (48, 48), classes=3)
    return path


def tiles(png, n, size):
    """The n tiles (size x size, enlarged to MIN_TILE) of a preview grid, as uint8 arrays."""
    zoom = max(1, -(-MIN_TILE // size))
    t = size * zoom
    sheet = np.asarray(Image.open(png).convert("RGB"))
    cols = min(n, 8)
    out = []
    for i in range(n):
        left, top = (i % cols) * (t + 2) + 1, (i // cols) * (t + LABEL_HEIGHT + 2) + 1
        out.append(sheet[top:top + t:zoom, left:left + t:zoom])
    return out


def test_the_preview_shows_the_loaders_first_batch_pixel_for_pixel(square, tmp_path):
    out = tmp_path / "b.png"
    r = mpitrain("preview", "--data", str(square), "--image-size", "32", "--batch", "5",
                 "--crop-scale", "0.3", "0.6", "--seed", "4", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5 train images" in r.stdout and "crops of 0.3-0.6 of the area" in r.stdout
    with Loader(str(square), 5, train=True, image_size=32, workers=0, seed=4,
                scale=(0.3, 0.6)) as loader:
        x, _ = next(iter(loader))
        want = np.round(np.clip((x * loader.std + loader.mean) / 255, 0, 1) * 255)
    for got, expect in zip(tiles(out, 5, 32), want):
        np.testing.assert_array_equal(got, expect.astype(np.uint8))


def test_a_whole_square_crop_is_the_validation_image_or_its_mirror(square, tmp_path):
    """--crop-scale 1 1 --crop-ratio 1 1 of a square image keeps all of it: each training
    tile is the validation tile at --crop-fraction 1, or that flipped."""
    common = ("--data", str(square), "--val-data", str(square), "--image-size", "24",
              "--batch", "12")
    train, val = tmp_path / "t.png", tmp_path / "new" / "v.png"     # its directory made
    r = mpitrain("preview", *common, "--crop-scale", "1", "1", "--crop-ratio", "1", "1",
                 "--out", str(train))
    assert r.returncode == 0, r.stdout + r.stderr
    r = mpitrain("preview", *common, "--split", "val", "--crop-fraction", "1", "--out", str(val))
    assert r.returncode == 0, r.stdout + r.stderr
    # the training batch is shuffled: match each tile to one of the validation tiles
    val_tiles = [v.astype(int) for v in tiles(val, 12, 24)]
    flips = 0
    for t in tiles(train, 12, 24):
        t = t.astype(int)
        same = min(np.abs(t - v).max() for v in val_tiles)
        mirror = min(np.abs(t[:, ::-1] - v).max() for v in val_tiles)
        # training decodes with libjpeg-turbo's fast IDCT: a few grey levels off
        assert min(same, mirror) <= 4, (same, mirror)
        flips += mirror < same
    assert 0 < flips < 12


def test_validation_images_are_shown_at_the_training_files_size(square, tmp_path):
    """Without --image-size train and eval take the training file's size for both splits,
    and so does the preview of the validation split, whose own file stores larger images."""
    val, out = tmp_path / "large_val.h5", tmp_path / "v.png"
    convert_synthetic(str(val), 6, (64, 64), classes=3)
    r = mpitrain("preview", "--data", str(square), "--val-data", str(val), "--split", "val",
                 "--batch", "6", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"6 val images of {val} at 48x48" in r.stdout, r.stdout
    with Loader(str(val), 6, train=False, image_size=48, workers=0) as loader:
        x, _ = next(iter(loader))
        want = np.round(np.clip((x * loader.std + loader.mean) / 255, 0, 1) * 255)
    for got, expect in zip(tiles(out, 6, 48), want):
        np.testing.assert_array_equal(got, expect.astype(np.uint8))


@pytest.mark.parametrize("option,values,message", [
    ("--crop-scale", ("0.5", "2"), "0 < MIN <= MAX <= 1"),
    ("--crop-scale", ("0.6", "0.3"), "0 < MIN <= MAX <= 1"),
    ("--crop-ratio", ("0", "1"), "0 < MIN <= MAX"),
    ("--crop-ratio", ("1", "inf"), "inf is not a finite number"),   # the crops failed later
    ("--crop-scale", ("0.5", "nan"), "nan is not a finite number"),
    ("--crop-fraction", ("1.5",), "in (0, 1]"),
])
def test_bad_crop_options_are_refused_by_name_with_nothing_written(square, tmp_path, option,
                                                                   values, message):
    out = tmp_path / "b.png"
    r = mpitrain("preview", "--data", str(square), option, *values, "--out", str(out))
    assert r.returncode == 2 and message in r.stderr and option in r.stderr, r.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_an_out_that_cannot_be_written_is_refused_with_nothing_written(square, tmp_path):
    (tmp_path / "afile").write_text("x")
    for out, message in ((tmp_path / "afile" / "b.png", f"--out {tmp_path / 'afile'} is a "
                          f"file, so {tmp_path / 'afile' / 'b.png'} cannot be written"),
                         (tmp_path, f"--out {tmp_path} is a directory; name the file"),
                         (tmp_path / "b.jpg", f"--out {tmp_path / 'b.jpg'} does not end in "
                          f".png, the format written; name it {tmp_path / 'b.png'}")):
        r = mpitrain("preview", "--data", str(square), "--out", str(out))
        assert r.returncode == 2 and message in r.stderr, r.stderr
    assert os.listdir(tmp_path) == ["afile"]


def test_an_image_size_beyond_memory_is_refused_with_nothing_written(square, tmp_path):
    out = tmp_path / "b.png"
    r = mpitrain("preview", "--data", str(square), "--image-size", "100000", "--out", str(out))
    assert r.returncode == 2 and "error: out of memory: Unable to allocate" in r.stderr \
        and "; lower --image-size (" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(tmp_path) == []


def test_train_takes_the_crop_options_and_records_them(square, tmp_path):
    run_dir, val = tmp_path / "run", tmp_path / "sq_val.h5"
    val.write_bytes(square.read_bytes())
    r = mpitrain("train", "--data", str(square), "--val-data", str(val), "--batch-size", "4",
                 "--epochs", "1", "--crop-scale", "0.5", "1", "--crop-fraction", "0.9",
                 "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["crop_scale"] == [0.5, 1.0] and cfg["crop_fraction"] == 0.9
    assert cfg["crop_ratio"] is None                    # the loader's own, 3/4 to 4/3
    r = mpitrain("train", "--data", str(square), "--val-data", str(square), "--crop-ratio",
                 "2", "1", "--run-dir", str(tmp_path / "bad"))
    assert r.returncode == 2 and "--crop-ratio MIN MAX" in r.stderr, r.stderr


def test_the_options_of_the_other_split_are_refused(square, tmp_path):
    out = tmp_path / "v.png"
    for options, given in ((("--crop-scale", "0.5", "1"), "--crop-scale"),
                           (("--no-augment", "--crop-ratio", "1", "1"),
                            "--no-augment and --crop-ratio")):
        r = mpitrain("preview", "--data", str(square), "--val-data", str(square), "--split",
                     "val", *options, "--out", str(out))
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.endswith(f"error: --split val shows validation images (a centre crop of "
                                 f"--crop-fraction), which take no augmentation: drop {given}, "
                                 f"or show --split train\n"), r.stderr
    assert not out.exists()
    r = mpitrain("preview", "--data", str(square), "--val-data", str(square), "--split", "val",
                 "--crop-fraction", "1", "--out", str(out))
    assert r.returncode == 0 and out.exists(), r.stdout + r.stderr
    r = mpitrain("preview", "--data", str(square), "--crop-fraction", "1", "--out", str(out))
    assert r.returncode == 2 and r.stderr.endswith(
        "error: --crop-fraction sets the validation images' centre crop, and --split train "
        "shows augmented training images (random crops), which do not use it: drop "
        "--crop-fraction, or show --split val\n"), r.stderr
