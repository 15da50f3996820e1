"""The image size from the data: `convert` records the median size of the stored
images, and train, eval, study and bench data take their size from it (at most 224)
unless --image-size says otherwise, and say which they took."""
import json
import subprocess
import sys

import h5py
import numpy as np
import pytest
from PIL import Image

from launcher import environment
from mpitrain.datasets.convert import convert_digits, convert_imagefolder, convert_synthetic
from mpitrain.datasets.h5format import Reader, default_image_size


def mpitrain(*args, timeout=300):
    """One process, no mpiexec (MPI starts as a singleton)."""
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], capture_output=True,
                          text=True, timeout=timeout, env=environment(1))


def test_convert_records_the_median_size_and_old_files_keep_the_default(tmp_path):
    src = tmp_path / "src"
    rng = np.random.default_rng(0)
    for cls, sizes in (("a", [(96, 96), (96, 96)]), ("b", [(80, 50), (300, 400)])):
        (src / cls).mkdir(parents=True)
        for i, (width, height) in enumerate(sizes):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(src / cls / f"{i}.jpg")
    convert_imagefolder(str(src), str(tmp_path / "f.h5"))
    with Reader(str(tmp_path / "f.h5")) as r:
        # heights 96, 96, 50, 400 and widths 96, 96, 80, 300: medians 96 and 96
        assert r.image_size == (96, 96)
        assert default_image_size(r) == 96
    convert_synthetic(str(tmp_path / "big.h5"), 4, (500, 375), classes=2)
    with Reader(str(tmp_path / "big.h5")) as r:
        assert r.image_size == (375, 500) and default_image_size(r) == 224   # capped
    convert_digits(str(tmp_path / "digits"))
    with Reader(str(tmp_path / "digits" / "digits_train.h5")) as r:
        assert r.image_size == (32, 32) and default_image_size(r) == 32
    with h5py.File(tmp_path / "f.h5", "r+") as f:       # a file written before the attribute
        del f.attrs["image_size"]
    with Reader(str(tmp_path / "f.h5")) as r:
        assert r.image_size is None and default_image_size(r) == 224


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 40x40 JPEG file of 4 classes and its validation file."""
    path = tmp_path_factory.mktemp("small")
    convert_synthetic(str(path / "s.h5"), 64, (40, 40), classes=4)
    convert_synthetic(str(path / "s_val.h5"), 16, (40, 40), classes=4, seed=1)
    return path


def test_train_and_eval_take_the_datas_size_and_say_so(small, tmp_path):
    run_dir = tmp_path / "run"
    r = mpitrain("train", "--data", str(small / "s.h5"), "--batch-size", "16", "--epochs", "1",
                 "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "64 train / 16 val images, 40x40 from the data)" in r.stdout, r.stdout
    assert json.loads((run_dir / "config.json").read_text())["image_size"] is None
    (ckpt,) = run_dir.glob("checkpoint-*.h5")
    r = mpitrain("eval", "--checkpoint", str(ckpt), "--data", str(small / "s_val.h5"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(16 images, 40x40): top-1" in r.stdout, r.stdout
    r = mpitrain("eval", "--checkpoint", str(ckpt), "--data", str(small / "s_val.h5"),
                 "--image-size", "48")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(16 images, 48x48): top-1" in r.stdout, r.stdout
    r = mpitrain("train", "--data", str(small / "s.h5"), "--batch-size", "16", "--epochs", "1",
                 "--run-dir", str(tmp_path / "given"), "--image-size", "32")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "16 val images, 32x32)" in r.stdout, r.stdout


def test_bench_data_takes_the_datas_size(small):
    r = mpitrain("bench", "data", "--data", str(small / "s.h5"), "--workers", "0",
                 "--batches", "2", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["image_size"] == 40
    r = mpitrain("bench", "data", "--data", str(small / "s.h5"), "--workers", "0",
                 "--batches", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("images 40x40 from the data (--image-size to change)\n")


def test_study_takes_an_image_size():
    """Checked before any run: a missing file, not an unknown option."""
    r = mpitrain("study", "large-batch", "--data", "no/such.h5", "--image-size", "32")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "training file no/such.h5 does not exist; check --data" in r.stderr, r.stderr


def test_memory_for_a_step_counts_every_rank_of_the_host_and_the_layers_outputs(digits):
    """The loaders' buffers are asked of the host for each of its ranks, and a step's
    layer outputs (leaf_shapes: at least what training keeps for backward) come on top
    of them: a step they cannot hold is refused before any work, naming the sizes."""
    from mpitrain.checks import (ConfigError, check_activations_fit, describe_data,
                                 leaf_shapes)
    from mpitrain.datasets.h5format import available_memory
    from mpitrain.nets import build_model
    files = (str(digits / "digits_train.h5"), str(digits / "digits_val.h5"))
    *_, loader_bytes = describe_data(*files, None, 16, 2, 2, np.float32)
    with pytest.raises(ConfigError, match=r"in batches of 16 need 0\.0 GiB of buffers on each "
                                          r"of the 1000000000 ranks of this host"):
        describe_data(*files, None, 16, 2, 2, np.float32, ranks_here=10**9)
    model = build_model("resnet_small", num_classes=10)
    shapes = leaf_shapes(model, 32)
    assert not [m for _, m in model.named_modules() if "run_layer" in vars(m)]  # as it was
    check_activations_fit(shapes, "resnet_small", 32, 16, 2, 4, loader_bytes)
    have = available_memory()
    with pytest.raises(ConfigError, match=r"resnet_small at 32x32 keeps at least 0\.0 GiB of "
                                          r"layer outputs for a step's 16 image\(s\), and its "
                                          r"loaders .* GiB on each of the 2 ranks of this host, "
                                          r"more than"):
        check_activations_fit(shapes, "resnet_small", 32, 16, 2, 4, have // 2)


def test_only_a_window_wider_than_its_map_is_blamed_on_the_image_size(monkeypatch):
    """check_image_size took any ValueError of its one-image forward for feature maps that
    vanish: a bad MPITRAIN_BLAS, raised by the first product, was refused as an image
    size too small."""
    from mpitrain.checks import ConfigError, check_image_size
    from mpitrain.kernels import gemm
    from mpitrain.nets import build_model
    model = build_model("alexnet", num_classes=10)
    with pytest.raises(ConfigError, match="--image-size 32 is too small for alexnet: its "
                                          "feature maps shrink to nothing; the smallest size "
                                          "it takes is 63"):
        check_image_size(model, "alexnet", 32)
    monkeypatch.setenv("MPITRAIN_BLAS", "foo")
    gemm.team_blas.cache_clear()
    try:
        with pytest.raises(ValueError, match="MPITRAIN_BLAS='foo': expected mkl or openblas"):
            check_image_size(model, "alexnet", 32)
    finally:
        monkeypatch.undo()
        gemm.team_blas.cache_clear()
