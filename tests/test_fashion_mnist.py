"""`convert fashion-mnist`: the IDX reader, the split into training, validation and test
files, and the real data where Debian's dataset-fashion-mnist is installed."""
import gzip
import os
import subprocess
import sys

import numpy as np
import pytest

from mpitrain.datasets import convert
from mpitrain.datasets.h5format import Reader


def idx_bytes(array):
    a = np.asarray(array, np.uint8)
    head = bytes([0, 0, 0x08, a.ndim]) + b"".join(d.to_bytes(4, "big") for d in a.shape)
    return head + a.tobytes()


def write_set(folder, train_x, train_y, test_x, test_y):
    folder.mkdir(parents=True, exist_ok=True)
    for name, a in (("train-images-idx3-ubyte.gz", train_x),
                    ("train-labels-idx1-ubyte.gz", train_y),
                    ("t10k-images-idx3-ubyte.gz", test_x),
                    ("t10k-labels-idx1-ubyte.gz", test_y)):
        with gzip.open(folder / name, "wb") as f:
            f.write(idx_bytes(a))
    return str(folder)


def test_idx_files_read_back_and_damaged_ones_are_refused(tmp_path):
    a = np.random.default_rng(0).integers(0, 256, (5, 4, 3), dtype=np.uint8)
    (tmp_path / "a.idx").write_bytes(idx_bytes(a))
    with gzip.open(tmp_path / "a.idx.gz", "wb") as f:
        f.write(idx_bytes(a))
    for name in ("a.idx", "a.idx.gz"):
        np.testing.assert_array_equal(convert.read_idx(str(tmp_path / name)), a)
    (tmp_path / "short.idx").write_bytes(idx_bytes(a)[:-1])
    with pytest.raises(convert.ConvertError, match="truncated"):
        convert.read_idx(str(tmp_path / "short.idx"))
    (tmp_path / "float.idx").write_bytes(bytes([0, 0, 0x0D, 1]) + (4).to_bytes(4, "big")
                                         + bytes(16))
    with pytest.raises(convert.ConvertError, match="not an IDX file of unsigned bytes"):
        convert.read_idx(str(tmp_path / "float.idx"))


def test_the_training_images_split_stratified_and_the_test_images_kept_apart(tmp_path):
    rng = np.random.default_rng(1)
    train_y = np.repeat(np.arange(10), 20)                 # 200 images, 20 a class
    train_x = rng.integers(0, 256, (200, 28, 28), dtype=np.uint8)
    test_y = np.arange(30) % 10
    test_x = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8)
    source = write_set(tmp_path / "src", train_x, train_y, test_x, test_y)
    out = convert.convert_fashion_mnist(str(tmp_path / "data"), seed=0, source=source)
    assert out.counts == {"train": 180, "val": 20, "test": 30}
    seen = []
    for split in ("train", "val", "test"):
        with Reader(out.files[split]) as r:
            pixels, labels = r.images[...], np.asarray(r.labels)
            assert r.class_names[0] == "T-shirt/top" and len(r.class_names) == 10
            mean = r.mean
        assert mean[0] == mean[1] == mean[2]
        assert pixels.shape[1:] == (28, 28, 3) and pixels.dtype == np.uint8
        np.testing.assert_array_equal(pixels[..., 0], pixels[..., 2])      # gray repeated
        seen.append((split, pixels[..., 0], labels, mean[0]))
    (_, tr, tr_y, mean), (_, va, va_y, _), (_, te, te_y, _) = seen
    assert np.bincount(va_y, minlength=10).tolist() == [2] * 10         # stratified
    np.testing.assert_array_equal(te, test_x)
    np.testing.assert_array_equal(te_y, test_y)
    # training and validation are the source's images, each once, with their labels
    together = np.concatenate([tr, va]).reshape(200, -1)
    rows = {row.tobytes(): label for row, label in zip(train_x.reshape(200, -1), train_y)}
    assert sorted(r.tobytes() for r in together) == sorted(rows)
    assert all(rows[r.tobytes()] == y for r, y in zip(together, np.concatenate([tr_y, va_y])))
    assert mean == pytest.approx(tr.mean())


def test_a_conversion_stopped_half_way_keeps_the_files_of_the_one_before(tmp_path,
                                                                        monkeypatch):
    """Converted again with another seed and stopped while its last file is written: the
    three files of the earlier conversion stay as they were, never a new validation
    split beside an older training file that holds its images."""
    from mpitrain.datasets.h5format import Writer
    rng = np.random.default_rng(2)
    source = write_set(tmp_path / "src", rng.integers(0, 256, (100, 28, 28), dtype=np.uint8),
                       np.arange(100) % 10, rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
                       np.arange(10))
    out = convert.convert_fashion_mnist(str(tmp_path / "data"), seed=0, source=source)
    before = {path: open(path, "rb").read() for path in out.files.values()}
    write = Writer.write

    def stopped_in_training(self, mean, std):
        if self.path == out.files["train"]:
            raise KeyboardInterrupt("stopped by the user")
        write(self, mean, std)
    monkeypatch.setattr(Writer, "write", stopped_in_training)
    with pytest.raises(KeyboardInterrupt):
        convert.convert_fashion_mnist(str(tmp_path / "data"), seed=1, source=source)
    assert {path: open(path, "rb").read() for path in before} == before
    assert sorted(os.listdir(tmp_path / "data")) == sorted(os.path.basename(p) for p in before)


def test_a_set_whose_labels_do_not_match_its_images_is_refused(tmp_path):
    x = np.zeros((10, 28, 28), np.uint8)
    source = write_set(tmp_path / "src", x, np.arange(9), x, np.arange(10))
    with pytest.raises(convert.ConvertError, match="do not make one 10-class set"):
        convert.convert_fashion_mnist(str(tmp_path / "data"), source=source)
    assert not os.path.exists(tmp_path / "data" / "fashion-mnist_train.h5")


@pytest.mark.skipif(not os.path.isdir(convert.FASHION_MNIST_DIR),
                    reason=f"{convert.FASHION_MNIST_PACKAGE} is not installed "
                           f"(apt-get install {convert.FASHION_MNIST_PACKAGE})")
def test_convert_fashion_mnist_on_the_real_data(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mpitrain", "convert", "fashion-mnist",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "train: 54000 images" in r.stdout and "test: 10000 images" in r.stdout
    with Reader(str(tmp_path / "fashion-mnist_val.h5")) as val:
        assert np.bincount(np.asarray(val.labels)).tolist() == [600] * 10
    test_x = convert.read_idx(os.path.join(convert.FASHION_MNIST_DIR, "t10k-images-idx3-ubyte.gz"))
    with Reader(str(tmp_path / "fashion-mnist_test.h5")) as test:
        np.testing.assert_array_equal(test.images[:100, ..., 1], test_x[:100])
        assert 70 < test.mean[0] < 75                       # Fashion-MNIST's mean gray, 72.9
