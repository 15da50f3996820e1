"""The data pipeline: file format, converters, sharded sampler, loader, augmentation."""
import io
import os

import h5py
import numpy as np
import pytest
from PIL import Image

from mpitrain.datasets.augment import (Augment, decode, draft_factor, filter_taps,
                                       random_resized_crop_box, resize_normalise, simplejpeg)
from mpitrain.datasets.convert import (convert_digits, convert_imagefolder, convert_synthetic,
                                       encode_file, val_path)
from mpitrain.datasets.h5format import FormatError, Reader, Writer
from mpitrain.datasets.loader import DataError, Loader, ShardedSampler
from mpitrain.datasets.split import stratified_val


# -- fixtures -------------------------------------------------------------------
def digit_images(per_class=4):
    """uint8 (N, 32, 32, 3) digits (upsampled to 0..255) and their labels."""
    from sklearn.datasets import load_digits

    from mpitrain.datasets.digits import upsample
    d = load_digits()
    pick = np.concatenate([np.flatnonzero(d.target == c)[:per_class] for c in range(10)])
    grey = np.clip(np.rint(upsample(d.images[pick].astype(np.float64)) * 255 / 16), 0, 255)
    return np.repeat(grey.astype(np.uint8)[..., None], 3, axis=3), d.target[pick].astype(np.int64)


def encode(rgb, fmt, **options):
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, fmt, **options)
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Digits as JPEG and PNG files in class folders, plus three bad files.

    Returns (root, {relative path: (label, pixels, format)}, [bad relative paths])."""
    root = tmp_path_factory.mktemp("digits_folder")
    images, labels = digit_images()
    good = {}
    for i, (rgb, y) in enumerate(zip(images, labels)):
        fmt, ext = ("JPEG", "jpg") if i % 2 else ("PNG", "png")
        rel = os.path.join(str(y), f"img{i:03d}.{ext}")
        os.makedirs(root / str(y), exist_ok=True)
        (root / rel).write_bytes(encode(rgb, fmt, **({"quality": 95} if fmt == "JPEG" else {})))
        good[rel] = (int(y), rgb, fmt)
    jpeg = encode(images[0], "JPEG", quality=95)
    bad = {os.path.join("0", "corrupt.jpg"): b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4,
           os.path.join("1", "truncated.jpg"): jpeg[:len(jpeg) // 2],
           os.path.join("2", "notes.txt"): b"not an image at all\n"}
    for rel, data in bad.items():
        (root / rel).write_bytes(data)
    return root, good, sorted(bad)


@pytest.fixture(scope="module")
def converted(folder, tmp_path_factory):
    root, good, bad = folder
    dst = str(tmp_path_factory.mktemp("converted") / "digits.h5")
    return dst, convert_imagefolder(str(root), dst, seed=3)


def jpeg_file(path, n=12, size=(96, 72), classes=3, corrupt=()):
    """An encoded file of n smooth JPEGs (labels i mod classes); records in
    `corrupt` hold bytes that are not an image."""
    rng = np.random.default_rng(0)
    with Writer(path, [f"c{c}" for c in range(classes)]) as w:
        for i in range(n):
            coarse = rng.integers(0, 256, (3, 4, 3), dtype=np.uint8)
            rgb = np.asarray(Image.fromarray(coarse).resize(size, Image.BICUBIC))
            data = b"garbage" * 50 if i in corrupt else encode(rgb, "JPEG", quality=90)
            w.add(i % classes, data)
        w.commit([120.0, 110.0, 100.0], [60.0, 55.0, 50.0])
    return path


# -- round trip through an image folder -------------------------------------------
def test_convert_reports_exactly_the_bad_files(folder, converted):
    root, good, bad = folder
    dst, result = converted
    assert sorted(rel for rel, _ in result.skipped) == bad
    assert result.counts == {"train": len(good)}
    with open(result.report_path) as fh:
        lines = [line for line in fh if not line.startswith("#")]
    assert sorted(line.split("\t")[0] for line in lines) == bad
    assert all(len(line.split("\t")[1].strip()) > 0 for line in lines)   # a reason each


def test_round_trip_keeps_labels_bytes_and_pixels(folder, converted):
    root, good, bad = folder
    dst, _ = converted
    with Reader(dst) as r:
        names = [s.decode() for s in r.file["filenames"][:]]
        assert sorted(names) == sorted(good)
        assert r.class_names == [str(c) for c in range(10)]
        for i, name in enumerate(names):
            label, rgb, fmt = good[name]
            assert r.labels[i] == label
            data = bytes(r.record(i))
            assert data == (root / name).read_bytes()           # stored, never re-encoded
            decoded = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            if fmt == "PNG":
                assert np.array_equal(decoded, rgb)
            else:
                assert np.abs(decoded.astype(int) - rgb).mean() < 2.0


def test_a_cameras_mpo_jpeg_is_stored_as_its_bytes(tmp_path):
    """An MPO file (a camera's JPEG with further frames after it, which Pillow names a
    format of its own) is a JPEG to every decoder: stored byte for byte, never as PNG."""
    images, _ = digit_images()
    path = tmp_path / "photo.jpg"
    first = Image.fromarray(images[0]).resize((64, 48))
    second = first.transpose(Image.FLIP_TOP_BOTTOM)
    first.save(path, "MPO", save_all=True, append_images=[second], quality=90)
    assert Image.open(path).format == "MPO"
    data, _ = encode_file(str(path))
    assert data == path.read_bytes()
    assert np.array_equal(decode(data), np.asarray(Image.open(path).convert("RGB")))
    for turbo in (True, False):                 # scaled as a JPEG is, by either decoder
        assert decode(data, 2, turbo=turbo).shape == (24, 32, 3)


def test_loader_gives_back_the_images(folder, converted):
    root, good, bad = folder
    dst, _ = converted
    loader = Loader(dst, global_batch=8, train=False, image_size=32, crop_fraction=1.0,
                    workers=2)
    with Reader(dst) as r:
        names = [s.decode() for s in r.file["filenames"][:]]
        mean, std = r.mean, r.std
    seen = 0
    for step, (x, y) in enumerate(loader):
        for j in range(len(y)):
            i = step * 8 + j
            if i >= len(names):
                break               # padding of the last step
            label, rgb, fmt = good[names[i]]
            assert y[j] == label
            pixels = x[j] * std + mean
            tolerance = 1e-3 if fmt == "PNG" else 3.0
            assert np.abs(pixels - rgb).mean() < tolerance
            seen += 1
    assert seen == len(good)
    loader.close()


def test_order_follows_the_seed_and_split_is_stratified(folder, tmp_path):
    root, good, bad = folder

    def order(seed, name):
        dst = str(tmp_path / name)
        convert_imagefolder(str(root), dst, seed=seed)
        with h5py.File(dst) as f:
            return list(f["filenames"][:])
    assert order(1, "a.h5") == order(1, "b.h5")
    assert order(1, "a.h5") != order(2, "c.h5")

    dst = str(tmp_path / "split.h5")
    result = convert_imagefolder(str(root), dst, val_fraction=0.25, seed=0)
    assert result.files == {"train": dst, "val": val_path(dst)}
    with Reader(dst) as tr, Reader(val_path(dst)) as va:
        assert np.array_equal(tr.mean, va.mean)       # validation uses training statistics
        names = set(tr.file["filenames"][:]) | set(va.file["filenames"][:])
        assert len(names) == len(good) == len(tr) + len(va)
        # round(0.25 * 5) = 1 file of each class is drawn for validation before the
        # files are decoded, so a bad file may take its class's place (classes 0-2)
        per_class = np.bincount(va.labels, minlength=10)
        assert (per_class[3:] == 1).all() and (per_class[:3] <= 1).all()


def test_resize_short_stores_downscaled_jpegs(folder, tmp_path):
    root, good, bad = folder
    dst = str(tmp_path / "small.h5")
    convert_imagefolder(str(root), dst, resize_short=16)
    with Reader(dst) as r:
        for i in range(len(r)):
            im = Image.open(io.BytesIO(bytes(r.record(i))))
            assert im.format == "JPEG" and min(im.size) == 16


def test_stratified_val_takes_a_fraction_of_each_class():
    labels = np.repeat(np.arange(4), [10, 20, 5, 1])
    val = stratified_val(labels, 0.2, np.random.default_rng(0))
    assert [int(val[labels == c].sum()) for c in range(4)] == [2, 4, 1, 0]


def test_interrupted_conversion_leaves_no_file(folder, tmp_path):
    root, good, bad = folder
    out = tmp_path / "out"
    out.mkdir()

    def interrupt(done, total):
        raise KeyboardInterrupt("stopped by the user")
    with pytest.raises(KeyboardInterrupt):
        convert_imagefolder(str(root), str(out / "x.h5"), val_fraction=0.2, progress=interrupt)
    assert os.listdir(out) == []

    with pytest.raises(RuntimeError):
        with Writer(str(out / "y.h5"), ["a"]) as w:
            w.add(0, b"bytes")
            raise RuntimeError("disk full")
    assert os.listdir(out) == []


def test_a_reconversion_interrupted_in_its_training_file_keeps_the_older_pair(
        folder, tmp_path, monkeypatch):
    """Converted again with another seed and stopped while the training file is written:
    the older conversion's two files stay together, never the new validation split beside
    the older training file (whose images it would share)."""
    root, good, bad = folder
    dst = str(tmp_path / "x.h5")
    convert_imagefolder(str(root), dst, val_fraction=0.2, seed=0)
    before = {p: open(p, "rb").read() for p in (dst, str(tmp_path / "x_val.h5"))}
    write = Writer.write

    def stopped_in_training(self, mean, std):
        if self.path == dst:
            raise KeyboardInterrupt("stopped by the user")
        write(self, mean, std)
    monkeypatch.setattr(Writer, "write", stopped_in_training)
    with pytest.raises(KeyboardInterrupt):
        convert_imagefolder(str(root), dst, val_fraction=0.2, seed=1)
    assert {p: open(p, "rb").read() for p in before} == before
    assert sorted(os.listdir(tmp_path)) == ["x.h5", "x.h5.skipped.txt", "x_val.h5"]


def test_a_reconversion_without_a_validation_split_removes_only_its_own_earlier_one(
        folder, tmp_path):
    """Converted again with --val-fraction 0, a folder's earlier validation split (which
    shares images with the new training file) goes; a file converted on its own under
    that name (ImageNet's val folder, as docs/cluster.md converts it) stays."""
    root, good, bad = folder
    dst, val = str(tmp_path / "x.h5"), str(tmp_path / "x_val.h5")
    convert_imagefolder(str(root), dst, val_fraction=0.2, seed=0)
    convert_imagefolder(str(root), dst, val_fraction=0.0, seed=1)
    assert not os.path.exists(val)
    convert_imagefolder(str(root), val, val_fraction=0.0)
    own = open(val, "rb").read()
    convert_imagefolder(str(root), dst, val_fraction=0.0, seed=2)
    assert open(val, "rb").read() == own


# -- the digits files ----------------------------------------------------------------
def test_convert_digits_equals_the_in_memory_split(tmp_path):
    from mpitrain.datasets.digits import load_digits_split
    result = convert_digits(str(tmp_path))
    assert set(os.listdir(tmp_path)) == {"digits_train.h5", "digits_val.h5"}
    expected = load_digits_split(seed=0, val_fraction=0.2)
    for name, x_ref, y_ref in (("train", *expected[:2]), ("val", *expected[2:])):
        loader = Loader(result.files[name], global_batch=len(y_ref), train=False,
                        image_size=32, crop_fraction=1.0, workers=0)
        x, y = next(iter(loader))
        assert np.array_equal(y, y_ref)
        assert x.dtype == np.float32
        np.testing.assert_allclose(x, x_ref, rtol=1e-5, atol=1e-5)


# -- sharding ------------------------------------------------------------------------
def shard_epoch(n, global_batch, size, seed, epoch, drop_last=True):
    """(steps, global_batch) indices of one epoch, assembled from every rank."""
    parts = []
    for rank in range(size):
        s = ShardedSampler(n, global_batch, rank, size, seed, drop_last=drop_last)
        s.load_state_dict({"epoch": epoch, "step": 0})
        parts.append(np.array(list(s)))
    assert len({p.shape for p in parts}) == 1          # every rank the same number of steps
    return np.concatenate(parts, axis=1)


@pytest.mark.parametrize("size", [1, 3, 4])
def test_epoch_covers_every_sample_once_minus_the_remainder(size):
    n, global_batch = 103, 12
    epoch = shard_epoch(n, global_batch, size, seed=5, epoch=0).ravel()
    assert len(epoch) == (n // global_batch) * global_batch == 96
    assert len(np.unique(epoch)) == len(epoch)
    assert set(epoch) <= set(range(n))
    # the dropped remainder is the permutation's tail, different every epoch
    dropped = [set(range(n)) - set(shard_epoch(n, global_batch, size, 5, e).ravel())
               for e in range(3)]
    assert all(len(d) == n % global_batch for d in dropped)
    assert dropped[0] != dropped[1]


def test_epochs_differ_and_seeds_repeat():
    a0 = shard_epoch(50, 10, 2, seed=1, epoch=0)
    assert not np.array_equal(a0, shard_epoch(50, 10, 2, seed=1, epoch=1))
    assert np.array_equal(a0, shard_epoch(50, 10, 2, seed=1, epoch=0))
    assert not np.array_equal(a0, shard_epoch(50, 10, 2, seed=2, epoch=0))


def test_padding_repeats_the_start_without_drop_last():
    epoch = shard_epoch(23, 8, 2, seed=0, epoch=0, drop_last=False).ravel()
    assert len(epoch) == 24
    assert set(epoch) == set(range(23))
    assert epoch[-1] == epoch[0]


def test_validation_loader_marks_the_padding(tmp_path):
    path = jpeg_file(str(tmp_path / "ten.h5"), n=10)
    seen = []
    for rank in range(2):
        loader = Loader(path, 4, rank=rank, size=2, train=False, image_size=8, workers=1)
        valid = []
        for x, y in loader:
            valid.append(loader.last_valid)
            seen += list(y[:loader.last_valid])
        loader.close()
        assert valid == ([2, 2, 2] if rank == 0 else [2, 2, 0])
    assert sorted(seen) == sorted(np.arange(10) % 3)   # every label once


def test_sampler_resumes_mid_epoch():
    s = ShardedSampler(40, 8, 1, 2, seed=3)
    it = iter(s)
    first = [next(it) for _ in range(2)]
    state = s.state_dict()
    assert state == {"epoch": 0, "step": 2}
    rest = list(it)
    t = ShardedSampler(40, 8, 1, 2, seed=3)
    t.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(rest, t))
    assert len(first) + len(rest) == 5 and s.state_dict() == {"epoch": 1, "step": 0}


def test_sampler_refuses_batches_that_do_not_split():
    with pytest.raises(ValueError, match="does not divide"):
        ShardedSampler(100, 10, 0, 3)
    with pytest.raises(ValueError, match="no full global batch"):
        ShardedSampler(5, 8, 0, 1)


# -- augmentation -----------------------------------------------------------------------
def smooth_image(width, height, seed=0):
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_augment_shape_dtype_and_range(dtype):
    mean, std = np.array([120.0, 110, 100]), np.array([60.0, 55, 50])
    data = encode(smooth_image(120, 90), "JPEG", quality=90)
    out = np.full((5, 40, 40, 3), np.nan, dtype)
    for train in (True, False):
        aug = Augment(40, mean, std, train=train)
        for i in range(5):
            aug(data, out[i], np.random.default_rng(i))
        assert np.isfinite(out).all()
        lo, hi = (0 - mean) / std, (255 - mean) / std
        assert (out >= lo - 1e-2).all() and (out <= hi + 1e-2).all()
        assert np.abs(out.astype(np.float64)).max() > 0.5        # not all constant


def test_augment_pixel_records_in_any_integer_dtype():
    rgb = smooth_image(40, 40).astype(np.uint16) * 4           # stored units 0..1020
    mean, std = np.array([500.0] * 3), np.array([250.0] * 3)
    out = np.empty((24, 24, 3), np.float32)
    Augment(24, mean, std, train=True)(rgb, out, np.random.default_rng(0))
    assert np.isfinite(out).all() and out.min() >= -2.01 and out.max() <= 2.09
    same = np.empty((40, 40, 3), np.float32)                     # whole image, same size
    Augment(40, mean, std, train=False, crop_fraction=1.0)(rgb, same)
    np.testing.assert_allclose(same, (rgb - mean) / std, rtol=1e-6, atol=1e-6)


def test_validation_is_deterministic_training_is_random():
    data = encode(smooth_image(120, 90), "JPEG", quality=90)
    val = Augment(32, [128] * 3, [64] * 3, train=False)
    a, b = np.empty((32, 32, 3), np.float32), np.empty((32, 32, 3), np.float32)
    val(data, a, np.random.default_rng(0))
    val(data, b, np.random.default_rng(1))
    assert np.array_equal(a, b)
    train = Augment(32, [128] * 3, [64] * 3, train=True)
    train(data, a, np.random.default_rng(0))
    train(data, b, np.random.default_rng(0))
    assert np.array_equal(a, b)
    train(data, b, np.random.default_rng(1))
    assert not np.array_equal(a, b)


def test_validation_transform_is_resize_then_centre_crop():
    rgb = smooth_image(192, 96)         # short side 96 -> 64 = 56 / 0.875: whole pixels throughout
    val = Augment(56, [0] * 3, [1] * 3, train=False, crop_fraction=0.875)
    out = np.empty((56, 56, 3), np.float32)
    val(encode(rgb, "PNG"), out)
    resized = Image.fromarray(rgb).resize((128, 64), Image.BILINEAR)
    ref = np.asarray(resized.crop((36, 4, 92, 60)), np.float32)
    assert np.abs(out - ref).mean() < 0.5


def test_random_crop_boxes_fit_and_respect_scale_and_ratio():
    rng = np.random.default_rng(0)
    for _ in range(500):
        x0, y0, w, h = random_resized_crop_box(500, 375, rng)
        assert 0 <= x0 and 0 <= y0 and x0 + w <= 500 and y0 + h <= 375
        assert 0.07 <= w * h / (500 * 375) <= 1.0
        assert 3 / 4 - 0.02 <= w / h <= 4 / 3 + 0.02


def test_flip_mirrors_the_crop():
    data = encode(smooth_image(64, 64), "PNG")
    aug = Augment(64, [0] * 3, [1] * 3, train=True, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    outs = []
    for seed in range(8):
        out = np.empty((64, 64, 3), np.float32)
        aug(data, out, np.random.default_rng(seed))
        outs.append(out)
    plain = [o for o in outs if np.array_equal(o, outs[0])]
    mirrored = [o for o in outs if np.array_equal(o, outs[0][:, ::-1])]
    assert len(plain) + len(mirrored) == 8 and plain and mirrored


def test_draft_decoding_matches_full_decoding():
    rgb = smooth_image(400, 300)
    data = encode(rgb, "JPEG", quality=95)
    assert draft_factor(300, 300, 32) == 8 and draft_factor(300, 300, 100) == 2
    full = Image.open(io.BytesIO(data)).convert("RGB")
    ref = np.asarray(full.resize((32, 32), Image.BILINEAR, box=(50, 0, 350, 300)), np.float32)
    for turbo in (False, True):
        aug = Augment(32, [0] * 3, [1] * 3, train=False, crop_fraction=1.0, turbo=turbo)
        out = np.empty((32, 32, 3), np.float32)
        aug(data, out)
        assert np.abs(out - ref).mean() < 2.0


def test_a_reduced_decode_keeps_the_crop_where_a_side_does_not_divide():
    """A JPEG decoded at 1/s of its size (375 rows at 1/4: 94) maps source coordinate y
    to y / s, as libjpeg's scaled IDCT samples it: a ramp's rows come out where the full
    decode puts them, to the far edge."""
    height, width = 375, 500
    yy, xx = np.mgrid[0:height, 0:width]
    rgb = np.stack([yy * 0.6, xx * 0.45, np.full(yy.shape, 128.0)], -1).astype(np.uint8)
    data = encode(rgb, "JPEG", quality=100, subsampling=0)
    assert draft_factor(height, height, 90) == 4
    x0, ref = (width - height) / 2, np.empty((90, 90, 3))
    resize_normalise(decode(data), (x0, 0, x0 + height, height), False, np.zeros(3),
                     np.ones(3), ref)
    for turbo in (False, True):
        aug = Augment(90, [0] * 3, [1] * 3, train=False, crop_fraction=1.0, turbo=turbo)
        out = np.empty((90, 90, 3))
        aug(data, out)
        error = out - ref
        for edge in (error[:10, :, 0], error[-10:, :, 0], error[:, :10, 1], error[:, -10:, 1]):
            assert abs(edge.mean()) < 0.2, (turbo, edge.mean())


def resize_reference(pixels, box, size):
    """Float64 antialiased bilinear resize of box (x0, y0, x1, y1), straight from
    the formula: out[i, j] = sum_y sum_x wy(i, y) wx(j, x) pixels[y, x]."""
    def weights(lo, hi, n_in, n_out):
        scale = (hi - lo) / n_out
        support = max(scale, 1.0)
        centres = lo + (np.arange(n_out) + 0.5) * scale
        first = np.maximum((centres - support + 0.5).astype(int), 0)
        last = np.minimum((centres + support + 0.5).astype(int), n_in)
        taps = np.maximum(0, 1 - np.abs(np.arange(n_in)[None] + 0.5 - centres[:, None]) / support)
        inside = (np.arange(n_in)[None] >= first[:, None]) & (np.arange(n_in)[None] < last[:, None])
        taps *= inside
        return taps / taps.sum(1, keepdims=True)
    wy = weights(box[1], box[3], pixels.shape[0], size)
    wx = weights(box[0], box[2], pixels.shape[1], size)
    return np.einsum("iy,jx,yxc->ijc", wy, wx, pixels.astype(np.float64), optimize=True)


@pytest.mark.parametrize("box,size", [((37, 20, 437, 320), 56),         # reduction
                                      ((10.5, 3.25, 41.75, 30.0), 64),  # enlargement, fractions
                                      ((0, 0, 90, 60), 60),             # mixed
                                      ((0, 0, 90, 60), 45),
                                      # a training crop at the image's right and bottom
                                      # edges, where the last pixels have fewer taps
                                      ((130.0, 41.5, 450, 330), 224)])
def test_resize_matches_the_float64_formula_and_pillow(box, size):
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (330, 450, 3), dtype=np.uint8)
    mean, inv_std = np.array([100.0, 120, 140]), 1 / np.array([50.0, 60, 70])
    ref = resize_reference(pixels, box, size)
    for flip in (False, True):
        out = np.empty((size, size, 3))
        resize_normalise(pixels, box, flip, mean, inv_std, out)
        expected = (ref[:, ::-1] if flip else ref) - mean
        np.testing.assert_allclose(out, expected * inv_std, rtol=0, atol=1e-9)
    out32 = np.empty((size, size, 3), np.float32)
    resize_normalise(pixels, box, False, np.zeros(3, np.float32), np.ones(3, np.float32), out32)
    pil = np.asarray(Image.fromarray(pixels).resize((size, size), Image.BILINEAR, box=box))
    assert np.abs(out32 - pil).max() <= 1.0      # Pillow rounds to uint8 between the passes


@pytest.mark.torch
def test_resize_matches_torch_antialiased_interpolate():
    torch = pytest.importorskip("torch")
    # torch resizes a cropped tensor; a box inside a larger image also weighs the
    # pixels just outside it (as Pillow does), so the kernel is given the crop
    pixels = np.random.default_rng(2).integers(0, 256, (100, 130, 3), dtype=np.uint8)
    for size in (48, 200):
        out = np.empty((size, size, 3))
        resize_normalise(pixels, (0, 0, 130, 100), False, np.zeros(3), np.ones(3), out)
        crop = torch.from_numpy(pixels.astype(np.float64)).permute(2, 0, 1)
        ref = torch.nn.functional.interpolate(crop[None], size=(size, size), mode="bilinear",
                                              antialias=True, align_corners=False)
        np.testing.assert_allclose(out, ref[0].permute(1, 2, 0).numpy(), rtol=0, atol=1e-9)


def test_filter_taps_sum_to_one_and_stay_inside():
    for lo, hi, n_in, n_out in ((0, 500, 500, 224), (3.5, 40.2, 64, 224), (0, 7, 7, 7)):
        first, count, weights = filter_taps(lo, hi, n_in, n_out)
        np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-12)
        assert (first >= 0).all() and (first + count <= n_in).all()
    first, count, weights = filter_taps(0, 7, 7, 7)            # same size: the identity
    assert (first == np.arange(7)).all() and (weights[:, 0] == 1).all()


@pytest.mark.skipif(simplejpeg is None, reason="simplejpeg is not installed")
def test_libjpeg_turbo_decoding_agrees_with_pillow():
    rgb = smooth_image(203, 150)
    for mode in ("RGB", "L", "CMYK"):            # CMYK: simplejpeg refuses, Pillow converts
        buf = io.BytesIO()
        Image.fromarray(rgb).convert(mode).save(buf, "JPEG", quality=90)
        data = buf.getvalue()
        for reduce in (1, 2, 4, 8):
            pil = decode(data, reduce, turbo=False).astype(np.int64)
            exact = decode(data, reduce, turbo=True).astype(np.int64)
            fast = decode(data, reduce, fast=True, turbo=True).astype(np.int64)
            assert pil.shape == exact.shape == fast.shape \
                == (-(-150 // reduce), -(-203 // reduce), 3)
            assert np.abs(exact - pil).max() <= 1
            assert np.abs(fast - pil).mean() < 2.0 and np.abs(fast - pil).max() <= 24
    with pytest.raises(Exception):
        decode(data[:len(data) // 2], turbo=True)              # truncated: an error, not garbage


def textured_image(width, height, seed=0):
    """A smooth image with noise on it: every 8x8 block has detail for the IDCT."""
    noise = np.random.default_rng(seed).integers(-40, 41, (height, width, 3))
    return np.clip(smooth_image(width, height, seed) + noise, 0, 255).astype(np.uint8)


@pytest.mark.skipif(simplejpeg is None, reason="simplejpeg is not installed")
@pytest.mark.parametrize("subsampling", [0, 2])          # 4:4:4 (8-row MCUs), 4:2:0 (16)
def test_decoding_stops_below_the_rows_asked_for(subsampling):
    data = encode(textured_image(203, 150), "JPEG", quality=90, subsampling=subsampling)
    for reduce in (1, 2):
        shape = (-(-150 // reduce), -(-203 // reduce), 3)
        for fast in (True, False):
            whole = decode(data, reduce, fast=fast)
            for rows in (1, 40, 97):
                out = np.full(shape, 7, np.uint8)
                got = decode(data, reduce, fast=fast, rows=rows, buffer=out)
                assert np.shares_memory(got, out) and got.shape == shape
                need = -(-rows // reduce)
                assert np.array_equal(got[:need], whole[:need])      # the same bits
                untouched = (got == 7).all(axis=(1, 2))
                assert untouched[-(-(rows + 48) // reduce):].all()    # never decoded
            assert np.array_equal(decode(data, reduce, fast=fast, rows=150), whole)


@pytest.mark.skipif(simplejpeg is None, reason="simplejpeg is not installed")
def test_decoding_to_rows_falls_back_to_the_whole_image():
    rgb = textured_image(120, 90)
    progressive = encode(rgb, "JPEG", quality=90, progressive=True)
    out = np.full((90, 120, 3), 7, np.uint8)
    assert np.array_equal(decode(progressive, rows=10, buffer=out), decode(progressive))
    truncated = encode(rgb, "JPEG", quality=90)
    truncated = truncated[:len(truncated) * 3 // 4]          # the rows asked for are all there
    with pytest.raises(Exception):
        decode(truncated, rows=10)                           # still an error, not garbage


@pytest.mark.parametrize("size", [224, 48])                  # 48: 1/2 to 1/8 scaled decodes
def test_augment_equals_the_whole_decode_bit_for_bit(size):
    data = encode(textured_image(500, 375), "JPEG", quality=90)
    mean, std = np.array([120.0, 110, 100]), np.array([60.0, 55, 50])
    out, ref = np.empty((size, size, 3), np.float32), np.empty((size, size, 3), np.float32)
    for train in (True, False):
        aug = Augment(size, mean, std, train=train)
        for seed in range(12 if train else 1):
            rng = np.random.default_rng(seed)
            aug(data, out, np.random.default_rng(seed))
            flip = rng.random() < 0.5 if train else False
            x0, y0, w, h = aug.box(500, 375, rng)
            reduce = draft_factor(w, h, size)
            pixels = decode(data, reduce, fast=train)       # source x is decoded x / reduce
            resize_normalise(pixels, (x0 / reduce, y0 / reduce, (x0 + w) / reduce,
                                      (y0 + h) / reduce),
                             flip, aug.mean.astype(np.float32), aug.inv_std.astype(np.float32),
                             ref)
            assert np.array_equal(out, ref)


# -- bad files and bad records -----------------------------------------------------------------
def test_reader_refuses_other_formats_and_versions(tmp_path):
    path = jpeg_file(str(tmp_path / "ok.h5"))
    for attr, value, expected in (("format", "fuel-imagenet", "expected 'mpitrain-images'"),
                                  ("version", 7, "version 7, expected 1")):
        bad = str(tmp_path / f"bad_{attr}.h5")
        with open(path, "rb") as src, open(bad, "wb") as dst:
            dst.write(src.read())
        with h5py.File(bad, "r+") as f:
            f.attrs[attr] = value
        with pytest.raises(FormatError, match=expected) as info:
            Loader(bad, 4)
        assert bad in str(info.value)
    not_hdf5 = tmp_path / "plain.h5"
    not_hdf5.write_bytes(b"hello")
    with pytest.raises(FormatError, match="cannot be opened as HDF5"):
        Reader(str(not_hdf5))


def test_reader_refuses_missing_keys_and_labels_out_of_range(tmp_path):
    path = jpeg_file(str(tmp_path / "three.h5"), classes=3)
    with pytest.raises(FormatError, match=r"label 2 of record 2 is outside 0..1 \(the model has "
                                          r"2 classes\)") as info:
        Loader(path, 4, num_classes=2)
    assert path in str(info.value)
    Loader(path, 4, num_classes=3).close()
    with h5py.File(path, "r+") as f:
        del f["offsets"]
    with pytest.raises(FormatError, match="'offsets' is missing"):
        Reader(path)


def test_a_record_declaring_a_decompression_bomb_has_no_shape(tmp_path):
    """Writer.add reads a record's size from its header: a PNG declaring 60000x60000 (past
    Pillow's limit) raised DecompressionBombError out of it; it is a record without a
    shape, as one whose header Pillow cannot read, which the loader refuses or skips."""
    import struct
    import zlib
    from mpitrain.datasets.h5format import encoded_shape

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 60000, 60000, 8, 2,
                                                              0, 0, 0)) + chunk(b"IEND", b"")
    assert encoded_shape(bomb) is None
    with Writer(str(tmp_path / "b.h5"), ["a", "b"]) as w:
        w.add(0, bomb)
        assert w.shapes == []


def replace(f, key, value):
    del f[key]
    f[key] = value


@pytest.mark.parametrize("damage,message", [
    (lambda f: replace(f, "class_names", np.arange(2)),
     r"class_names must be a 1-D dataset of strings, found int64 \(2,\)"),
    (lambda f: replace(f, "class_names", np.array([b"a"])),
     r"label 1 of record 1 is outside 0..0 \(its class_names name 1 classes\)"),
    (lambda f: f.attrs.__setitem__("version", "1"), "format version '1', expected 1"),
    (lambda f: replace(f, "std", np.array([1e-300, 1.0, 1.0])),
     "std must be positive, and it and its reciprocal finite in float32"),
    (lambda f: replace(f, "mean", np.array([1e300, 1.0, 1.0])), "mean must be finite in float32"),
    (lambda f: replace(f, "mean", np.array([b"a", b"b", b"c"])), r"damaged \(ValueError: "),
    (lambda f: (f.__delitem__("labels"), f.create_group("labels")),
     r"damaged \(AttributeError: "),
    (lambda f: f.attrs.__setitem__("image_size", "big"), r"damaged \(ValueError: "),
])
def test_a_damaged_part_of_a_data_file_is_a_format_error(damage, message, tmp_path):
    """Parts of another kind than convert writes were read as they came: integer class
    names trained a whole epoch and then failed the checkpoint, a std of 1e-300 trained as
    a divergence, and a group, a scalar or strings in place of a dataset ended in a
    traceback. Each is a FormatError naming the file."""
    path = jpeg_file(str(tmp_path / "d.h5"), n=4)
    with h5py.File(path, "r+") as f:
        damage(f)
    with pytest.raises(FormatError, match=message) as info:
        Reader(path).close()
    assert str(info.value).startswith(f"{path}: "), info.value


def test_a_data_file_that_cannot_be_opened_now_or_at_all_is_named_so(tmp_path):
    """A file held open for writing (a conversion still running) was "cannot be opened as
    HDF5 ... mpitrain reads the files that convert makes"; a link to nothing "does not
    exist"; a folder named x.h5 was offered `convert ... data/x.h5.h5`."""
    from test_checkpoint import held_open
    path = jpeg_file(str(tmp_path / "d.h5"), n=4)
    with held_open(path), pytest.raises(FormatError) as info:
        Reader(path)
    assert str(info.value) == (f"{path}: another process holds it open for writing (HDF5 "
                               f"locks the file: a conversion still running, or an HDF5 "
                               f"viewer); wait for it, or close it")
    loop = tmp_path / "loop.h5"
    loop.symlink_to(loop)
    with pytest.raises(FormatError, match="is a symbolic link to nothing"):
        Reader(str(loop))
    (tmp_path / "x.h5").mkdir()
    with pytest.raises(FormatError, match=r"convert imagefolder \S+/x.h5 data/x.h5 "):
        Reader(str(tmp_path / "x.h5"))


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_record_raises_naming_its_index(tmp_path, workers):
    path = jpeg_file(str(tmp_path / "corrupt.h5"), n=12, corrupt={7})
    loader = Loader(path, 4, train=False, workers=workers, image_size=32)
    with pytest.raises(DataError, match=r"corrupt.h5: record 7 cannot be decoded"):
        for _ in loader:
            pass
    loader.close()


def test_a_bad_record_read_ahead_leaves_the_batches_before_it_to_come(tmp_path):
    """A worker that fails on a batch read ahead ends the loader only when that batch is
    asked for: the batches before it, slower to decode on the other workers, come first."""
    rng = np.random.default_rng(0)
    path = str(tmp_path / "late.h5")
    with Writer(path, ["a", "b"]) as w:
        for i in range(24):                 # batches of 4: 3 and 4 slow, 5 starts bad
            slow = 12 <= i < 20
            rgb = rng.integers(0, 256, (900, 900, 3) if slow else (16, 16, 3), dtype=np.uint8)
            w.add(i % 2, b"garbage" * 9 if i == 20 else encode(rgb, "PNG"))
        w.commit([120.0] * 3, [60.0] * 3)
    loader = Loader(path, 4, train=False, workers=3, prefetch=2, image_size=16)
    came = 0
    with pytest.raises(DataError, match="record 20 cannot be decoded"):
        for _ in loader:
            came += 1
    assert came == 5
    loader.close()


def test_of_two_workers_failing_the_earlier_batchs_failure_is_raised(tmp_path):
    """A worker that fails at once on batch 2, while another is still failing, slowly, on
    batch 1: the consumer, waiting for batch 1, gets batch 1's error (it waited for ever
    when only the first failure to arrive was kept)."""
    import threading
    rng = np.random.default_rng(0)
    big = encode(rng.integers(0, 256, (3000, 3000, 3), dtype=np.uint8), "JPEG", quality=95)
    small = encode(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), "PNG")
    path = str(tmp_path / "two.h5")
    with Writer(path, ["a", "b"]) as w:
        for i, data in enumerate((small, big[:len(big) * 95 // 100], b"garbage" * 9, small)):
            w.add(i % 2, data)                  # record 1 fails late, record 2 at once
        w.commit([120.0] * 3, [60.0] * 3)
    loader = Loader(path, 1, train=False, workers=2, prefetch=2, image_size=16)
    came, raised = [], []

    def consume():
        try:
            for _ in loader:
                came.append(1)
        except DataError as e:
            raised.append(str(e))
    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(60)
    assert not consumer.is_alive() and len(came) == 1, (came, raised)
    assert raised and "record 1 cannot be decoded" in raised[0], raised
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("corrupt", [{3, 7}, {3, 4}])
def test_skip_bad_records_replaces_and_counts(tmp_path, workers, corrupt):
    """Each bad record is replaced and counted once, also where the next one in file
    order, tried in its place, is bad too."""
    path = jpeg_file(str(tmp_path / "corrupt.h5"), n=12, corrupt=corrupt)
    loader = Loader(path, 4, train=True, workers=workers, image_size=32, skip_bad_records=True)
    for epoch in range(2):
        labels = np.concatenate([y.copy() for _, y in loader])
        assert len(labels) == 12
    assert loader.bad_indices == corrupt
    assert loader.skipped == 4                          # two records, two epochs
    loader.close()


# -- the loader ---------------------------------------------------------------------------
def test_loader_is_deterministic_whatever_the_workers_and_resumes(tmp_path):
    path = jpeg_file(str(tmp_path / "data.h5"), n=24)

    def batches(workers, state=None, count=8):
        loader = Loader(path, 8, rank=1, size=2, train=True, image_size=24, workers=workers,
                        prefetch=2, seed=4)
        if state:
            loader.load_state_dict(state)
        got = []
        while len(got) < count:
            for x, y in loader:
                got.append((x.copy(), y.copy(), loader.state_dict()))
                if len(got) == count:
                    break
        loader.close()
        return got

    serial, threaded = batches(0), batches(3)
    assert len(serial) == 8                               # 3 steps per epoch, across epochs
    for (xa, ya, sa), (xb, yb, sb) in zip(serial, threaded):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb) and sa == sb
    assert serial[2][2] == {"epoch": 1, "step": 0}
    resumed = batches(2, state=serial[3][2], count=4)
    for (xa, ya, _), (xb, yb, _) in zip(serial[4:], resumed):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    assert not np.array_equal(serial[0][0], serial[3][0])  # epochs differ


@pytest.mark.gpu
def test_pinned_ring_gives_the_same_batches(tmp_path):
    path = jpeg_file(str(tmp_path / "data.h5"), n=8)
    plain = Loader(path, 4, train=False, image_size=16, workers=1)
    pinned = Loader(path, 4, train=False, image_size=16, workers=1, pinned=True)
    for (xa, ya), (xb, yb) in zip(plain, pinned):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    plain.close()
    pinned.close()


@pytest.mark.gpu
def test_a_pinned_slot_is_filled_again_only_after_its_copy_to_the_gpu(tmp_path):
    """A page-locked batch is copied when the GPU reaches the copy. With the GPU kept busy
    before each copy (a kernel that spins), the workers, a batch ahead, must not refill a
    slot whose copy has not run yet: every copy is the plain loader's batch."""
    import cupy
    path = jpeg_file(str(tmp_path / "data.h5"), n=32)
    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
        long long start = clock64(); while (clock64() - start < cycles) {} }''', "spin")
    common = dict(train=False, image_size=16, workers=2, prefetch=1)
    with Loader(path, 4, **common) as plain:
        expected = [x.copy() for x, _ in plain]
    with Loader(path, 4, pinned=True, **common) as pinned:
        copies = []
        for x, _ in pinned:
            spin((1,), (1,), (np.int64(20_000_000),))      # some 10 ms of the GPU's clock
            copies.append(cupy.asarray(x))
    assert len(copies) == len(expected) == 8
    for got, want in zip(copies, expected):
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


def test_loader_reports_waiting_and_reuses_its_buffers(tmp_path):
    path = jpeg_file(str(tmp_path / "data.h5"), n=16)
    loader = Loader(path, 4, train=False, image_size=16, workers=1, prefetch=1)
    buffers, waits = set(), []
    for x, _ in loader:
        buffers.add(x.__array_interface__["data"][0])
        waits.append(loader.last_wait)
    assert len(buffers) == 2                              # double-buffered
    assert loader.wait_time == pytest.approx(sum(waits)) and loader.wait_time > 0
    loader.close()


def test_synthetic_jpegs_are_the_same_on_any_number_of_threads(tmp_path):
    """convert_synthetic draws image i from (seed, i): one thread and three write the same
    records, labels and statistics; another seed, other images."""
    files = {}
    for threads, seed in ((1, 0), (3, 0), (2, 1)):
        path = str(tmp_path / f"s{threads}.h5")
        convert_synthetic(path, 70, (40, 30), classes=3, seed=seed, threads=threads)
        with Reader(path) as r:
            files[threads] = ([bytes(r.record(i)) for i in range(len(r))], r.labels.tolist(),
                              r.mean.tolist(), r.std.tolist())
    assert files[1] == files[3]
    assert files[1][1] == [i % 3 for i in range(70)]
    assert all(Image.open(io.BytesIO(b)).size == (40, 30) for b in files[1][0])
    assert not set(files[1][0]) & set(files[2][0])


def test_validation_leaves_out_a_bad_record_and_its_stand_in(tmp_path):
    """With --skip-bad-records a bad validation record is replaced in its batch by the next
    good one, which validation must not score twice: scores on a file with a bad record are
    those on the same file without it."""
    import json
    import subprocess
    import sys

    from launcher import environment
    train = jpeg_file(str(tmp_path / "train.h5"), n=48)
    bad = jpeg_file(str(tmp_path / "bad.h5"), n=12, corrupt={3})
    without = str(tmp_path / "without.h5")
    with Reader(bad) as r, Writer(without, r.class_names) as w:
        for i in range(len(r)):
            if i != 3:
                w.add(int(r.labels[i]), bytes(r.record(i)))
        w.commit(r.mean, r.std)
    scores = []
    for val in (bad, without):
        run_dir = tmp_path / ("run-" + os.path.basename(val))
        r = subprocess.run([sys.executable, "-m", "mpitrain", "train", "--data", train,
                            "--val-data", val, "--skip-bad-records", "--image-size", "32",
                            "--batch-size", "8", "--epochs", "1", "--workers", "1",
                            "--run-dir", str(run_dir)], capture_output=True, text=True,
                           timeout=300, env=environment(1))
        assert r.returncode == 0, r.stdout + r.stderr
        evals = [json.loads(x) for x in open(run_dir / "metrics.jsonl") if '"eval"' in x]
        scores.append(evals[-1])
        scored = ("11 images scored, 1 bad record(s) left out" if val == bad else "11 images")
        assert f"top-1 ({scored}, 1 epoch, " in r.stdout, r.stdout
    assert scores[0]["bad_records"] == 1 and scores[1]["bad_records"] == 0
    for key in ("top1", "loss"):
        assert scores[0][key] == scores[1][key], (key, scores)

    # eval scores the run's validation file as the run did, unless told otherwise
    def evaluate(*options):
        return subprocess.run([sys.executable, "-m", "mpitrain", "eval", "--checkpoint",
                               str(tmp_path / "run-bad.h5"), "--workers", "1", *options],
                              capture_output=True, text=True, timeout=300, env=environment(1))
    r = evaluate("--json")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["bad_records"] == 1 and result["top1"] == scores[0]["top1"], result
    assert result["scored"] == 11 and result["images"] == 12, result
    r = evaluate()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bad.h5 (11 images scored, 1 bad record(s) left out, 32x32): top-1" in r.stdout, \
        r.stdout
    r = evaluate("--no-skip-bad-records")
    assert r.returncode == 2 and "bad.h5: record 3 cannot be decoded" in r.stderr \
        and "train and eval skip such records with --skip-bad-records" in r.stderr, r.stderr


def test_a_sixteen_bit_png_is_scaled_to_eight_bits_not_clipped(tmp_path):
    """Pillow's convert("RGB") clips a 16-bit grey PNG at 255, nearly all of it white: the
    loader's decode and convert's statistics scale it to 8 bits instead, rounded."""
    ramp = (np.arange(64 * 64, dtype=np.int64).reshape(64, 64) * 16).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, "PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode.startswith("I")
    eight = ((ramp.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8)
    expected = np.repeat(eight[..., None], 3, axis=2)
    np.testing.assert_array_equal(decode(buf.getvalue()), expected)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "ramp.png").write_bytes(buf.getvalue())
    from mpitrain.datasets.convert import encode_file, histogram
    data, hist = encode_file(str(tmp_path / "a" / "ramp.png"))
    assert data == buf.getvalue()                       # kept as it is: decoding scales it
    np.testing.assert_array_equal(hist, histogram(expected))


def test_file_names_that_are_not_utf8_or_break_a_line_are_kept_escaped(tmp_path):
    """A file named in Latin-1 (an archive unpacked from another system) ended convert in a
    UnicodeEncodeError once every image was decoded, and a name holding a line break split
    its line of the skipped files' report in two. Such names are stored and listed
    escaped; a class folder so named is refused before any work, as class names are kept."""
    import subprocess
    import sys
    src, dst = tmp_path / "src", tmp_path / "d.h5"
    images, _ = digit_images()
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(3):
            (src / c / f"{i}.png").write_bytes(encode(images[i + 3 * (c == "b")], "PNG"))
    latin = os.fsencode(src / "a") + b"/caf\xe9.png"
    with open(latin, "wb") as f:
        f.write(encode(images[7], "PNG"))
    (src / "b" / "two\nlines.png").write_bytes(b"not an image")

    def convert():
        return subprocess.run([sys.executable, "-m", "mpitrain", "convert", "imagefolder",
                               str(src), str(dst)], capture_output=True, text=True, timeout=120)
    r = convert()
    assert r.returncode == 0, r.stdout + r.stderr
    with Reader(str(dst)) as reader:
        assert len(reader) == 7
        names = {s.decode() for s in reader.file["filenames"][:]}
    assert "a/caf\\xe9.png" in names
    report = (tmp_path / "d.h5.skipped.txt").read_text().splitlines()
    assert report[1:] == ["b/two\\nlines.png\tnot an image (no format Pillow reads)"], report
    # a class folder of such a name
    os.rename(os.fsencode(src / "b"), os.fsencode(src) + b"/caf\xe9")
    os.remove(dst)
    r = convert()
    assert r.returncode == 2 and "the name of class folder caf\\xe9 is not UTF-8 text on one " \
        "line, as a data file keeps its class names: rename the folder" in r.stderr, r.stderr
    assert not dst.exists()


def test_a_class_left_without_a_readable_training_image_is_refused(tmp_path):
    """Its training files all fail to decode: a model would be scored on a class it never
    trained on. Refused, naming the class and a skipped file, and nothing written."""
    from mpitrain.datasets.convert import ConvertError
    src, dst = tmp_path / "src", tmp_path / "out" / "d.h5"
    images, _ = digit_images()
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(4):
            (src / c / f"{i}.png").write_bytes(encode(images[i], "PNG"))
    for i in range(4):                                  # every file of b is broken
        (src / "b" / f"{i}.png").write_bytes(b"garbage" * 20)
    with pytest.raises(ConvertError, match=r"class b has no readable training image \(the "
                                           r"first skipped: b/\d.png: .*\), so a model would "
                                           r"be scored on a class it never saw"):
        convert_imagefolder(str(src), str(dst), val_fraction=0.25, seed=0)
    assert not dst.parent.exists() or not os.listdir(dst.parent)


def test_a_copy_of_a_file_is_kept_once(tmp_path):
    """Byte-for-byte copies (in one class or in two) could stand on both sides of the split
    and be scored as images trained on: the first in the file order is kept, the others are
    skipped as copies of it and listed with that reason."""
    images, _ = digit_images()
    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
    for i in range(6):
        (src / "a" / f"{i}.png").write_bytes(encode(images[i], "PNG"))
        (src / "b" / f"{i}.png").write_bytes(encode(images[10 + i], "PNG"))
    copies = [os.path.join("a", "copy.png"), os.path.join("b", "0-again.png")]
    for rel in copies:
        (src / rel).write_bytes((src / "a" / "0.png").read_bytes())
    result = convert_imagefolder(str(src), str(tmp_path / "d.h5"), val_fraction=0.3, seed=1)
    group = {os.path.join("a", "0.png"), *copies}
    assert sum(result.counts.values()) == 12 and len(result.skipped) == 2
    kept = (group - {rel for rel, _ in result.skipped}).pop()
    assert sorted(result.skipped) == sorted((rel, f"a byte-for-byte copy of {kept}")
                                            for rel in group - {kept})
