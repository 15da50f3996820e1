"""datasets/batch_augment.py: a batch decoded together, then cropped, resized, flipped and
normalised by one kernel, against the CPU loader's transform (augment.py) on the same
pixels, against the CPU loader itself (whose decode differs), and its CUDA kernel under
the numba-cuda simulator against its CPU form."""
import io
import os
import subprocess
import sys

import numpy as np
import pytest

from mpitrain.datasets.augment import Augment, decode, resize_normalise
from mpitrain.datasets.batch_augment import BatchAugment, _crop_cpu, _crop_cuda
from mpitrain.datasets.convert import convert_synthetic
from mpitrain.datasets.h5format import Reader
from mpitrain.datasets.loader import Loader

MEAN, STD = np.array([120.0, 110.0, 100.0]), np.array([60.0, 55.0, 50.0])


def records(n, size, seed=0):
    """n synthetic JPEGs of size (width, height), as bytes."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.h5")
        convert_synthetic(path, n, size, classes=2, seed=seed)
        with Reader(path) as r:
            return [bytes(r.record(i)) for i in range(n)]


@pytest.mark.parametrize("train", [True, False])
def test_the_kernel_is_the_cpu_transform_on_the_same_pixels(train):
    """Each image: augment.resize_normalise of its whole decode with the box and flip that
    Augment draws from the same generator, within fp32 rounding."""
    recs = records(6, (150, 100))
    augment = Augment(40, MEAN, STD, train=train, scale=(0.2, 1.0))
    out = np.empty((6, 40, 40, 3), np.float32)
    BatchAugment(augment)(recs, [np.random.default_rng([3, i]) for i in range(6)], out)
    flips = 0
    for i, rec in enumerate(recs):
        rng = np.random.default_rng([3, i])
        flip, (x0, y0, w, h) = augment.draw(150, 100, rng)
        flips += flip
        want = np.empty((40, 40, 3), np.float32)
        resize_normalise(decode(rec), (x0, y0, x0 + w, y0 + h), flip,
                         augment.mean.astype(np.float32), augment.inv_std.astype(np.float32),
                         want)
        np.testing.assert_allclose(out[i], want, rtol=1e-5, atol=2e-5)
    assert (0 < flips < 6) if train else flips == 0


def test_a_batch_against_the_cpu_loader_within_the_decoders_rounding(tmp_path):
    """The same records, shuffle and draws as Loader's first training batch: the CPU
    loader decodes at reduced scale with the fast IDCT, so pixels differ by the
    decoders' rounding: on average under 1.5 grey levels, nowhere by 12 (measured: 0.8 and 5.4)."""
    path = str(tmp_path / "s.h5")
    convert_synthetic(path, 16, (500, 375), classes=4)
    with Loader(path, 8, train=True, image_size=64, workers=0, seed=5) as loader:
        x, _ = next(iter(loader))
        indices = loader.sampler.epoch_indices(0)[0]
        with Reader(path) as r:
            recs = [bytes(r.record(int(i))) for i in indices]
        out = np.empty_like(x)
        BatchAugment(loader.augment)(recs, [np.random.default_rng([5, 0, int(i)])
                                            for i in indices], out)
        grey = np.abs(out - x) * loader.std     # in stored pixel units
    assert grey.mean() < 1.5 and grey.max() < 12, (grey.mean(), grey.max())


def simulated_kernel():
    """_crop_cuda under the simulator equals _crop_cpu (run in a child: the simulator is
    chosen when numba is imported)."""
    recs = records(2, (40, 30))
    batch = BatchAugment(Augment(6, MEAN, STD, train=True, scale=(0.3, 1.0)))
    rngs = lambda: [np.random.default_rng([1, i]) for i in range(2)]   # noqa: E731
    args = batch.arguments(batch.decode(recs, np), rngs(), 6, np)
    want, got = np.empty((2, 6, 6, 3), np.float32), np.empty((2, 6, 6, 3), np.float32)
    _crop_cpu(*args, want)
    _crop_cuda[2, 32](*args, got)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_cuda_kernel_under_the_simulator():
    from launcher import under_cuda_simulator
    under_cuda_simulator("test_batch_augment", "simulated_kernel")


def turned(record):
    """record (a JPEG) again, with EXIF's orientation 6 (shown turned 90 degrees): its
    stored pixels and size are the record's."""
    import io

    from PIL import Image
    image = Image.open(io.BytesIO(record))
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    image.save(out, "JPEG", quality=95, exif=exif)
    return out.getvalue()


def test_an_image_keeps_its_stored_orientation():
    """The host decode (the CPU loader's, and the reference for nvImageCodec's) does not
    turn an image by its EXIF orientation: its size is its header's."""
    rec = turned(records(1, (50, 30))[0])
    assert BatchAugment(Augment(8, MEAN, STD)).decode([rec], np)[0].shape == (30, 50, 3)


@pytest.mark.gpu
def test_nvimagecodec_batches_on_the_gpu_against_the_host_decode():
    """The same batch decoded by nvImageCodec and transformed on the GPU in fp16, and on
    the host: within the decoders' rounding and fp16's; an image with an EXIF orientation
    is not turned on either."""
    import cupy

    from mpitrain.datasets.batch_augment import gpu_decoder_problem
    assert gpu_decoder_problem() is None
    recs = records(8, (500, 375))
    recs[3] = turned(recs[3])
    batch = BatchAugment(Augment(96, MEAN, STD, train=True))
    rngs = lambda: [np.random.default_rng([2, i]) for i in range(8)]   # noqa: E731
    host = batch(recs, rngs(), np.empty((8, 96, 96, 3), np.float32))
    device = batch(recs, rngs(), cupy.empty((8, 96, 96, 3), cupy.float16))
    assert batch.host_decoded == 0          # every JPEG on the GPU
    grey = np.abs(cupy.asnumpy(device).astype(np.float32) - host) * STD
    assert grey.mean() < 1 and grey.max() < 16, (grey.mean(), grey.max())


def reencoded(record, mode, fmt):
    """record's pixels in Pillow's mode ("L": grey) encoded again as fmt."""
    from PIL import Image
    out = io.BytesIO()
    Image.fromarray(decode(record)).convert(mode).save(out, fmt)
    return out.getvalue()


@pytest.mark.gpu
def test_a_record_nvimagecodec_does_not_take_is_decoded_on_the_host():
    """A batch of JPEGs, a PNG (convert keeps PNGs as they are), a grey JPEG and two
    records that decode nowhere (bytes that are no image; a JPEG's first marker and then
    garbage, whose header nvImageCodec cannot parse): every image is decoded, on the GPU
    or on the host, within the decoders' rounding of the host's decode, and the two bad
    records are None on both, leaving the rest of the batch decoded. The rounding: on
    these images libjpeg-turbo's own fast IDCT and upsampling differ from its exact
    decode by 1.5 grey levels on average; another image, or swapped channels, by tens."""
    import cupy
    recs = records(6, (500, 375))
    recs[1] = reencoded(recs[1], "RGB", "PNG")
    recs[2] = reencoded(recs[2], "L", "JPEG")
    recs += [b"garbage" * 50, b"\xff\xd8" + b"garbage" * 50]
    batch = BatchAugment(Augment(96, MEAN, STD, train=True))
    host, device = batch.decode(recs, np), batch.decode(recs, cupy)
    assert [im is None for im in device] == [im is None for im in host] == [False] * 6 + [True] * 2
    assert batch.host_decoded == 3      # the PNG and the bad two; every JPEG on the GPU
    for h, d in zip(host[:6], device[:6]):
        assert isinstance(d, cupy.ndarray) and d.shape == h.shape == (375, 500, 3)
        assert np.abs(cupy.asnumpy(d).astype(np.float32) - h).mean() < 3
    np.testing.assert_array_equal(cupy.asnumpy(device[1]), host[1])      # PNG: lossless


def test_decoding_on_the_gpu_is_refused_where_it_cannot_work(digits):
    """On the CPU, and (before anything of the GPU's is asked) on records of pixels."""
    from mpitrain.checks import ConfigError, check_decode
    from mpitrain.options import Config
    with pytest.raises(ConfigError, match="this run is on the CPU: add --device gpu"):
        check_decode(Config(decode="gpu"), "cpu")
    assert check_decode(Config(decode="cpu"), "cpu") == "cpu"
    pixels = str(digits / "digits_train.h5")
    with pytest.raises(ConfigError, match=f"--decode gpu decodes JPEG records, and {pixels} "
                                          f"holds decoded pixels .* drop --decode gpu"):
        check_decode(Config(decode="gpu"), "cuda:0", [pixels])


@pytest.mark.parametrize("skip", [True, False])
def test_a_batch_replaces_a_bad_record_as_the_cpu_loader_does(tmp_path, skip):
    """Loader._decoded, which gathers the GPU loader's records (here with the host's
    decode): with skip_bad_records each record that does not decode is replaced by the
    next in file order that does, and counted, as the CPU loader replaces it: the same
    labels, bad records and count, pixels within the decoders' rounding. Without it the
    first bad record is a DataError that names it."""
    from test_data import jpeg_file

    from mpitrain.datasets.loader import DataError
    path = jpeg_file(str(tmp_path / "corrupt.h5"), n=12, corrupt={3, 4, 7})
    common = dict(train=True, image_size=32, workers=0, seed=5, skip_bad_records=skip)
    with Loader(path, 12, **common) as cpu, Loader(path, 12, **common) as batched, \
            Reader(path) as reader:
        batch = BatchAugment(batched.augment)
        indices = batched.sampler.epoch_indices(0)[0]
        args = (reader, 0, indices, 0, lambda recs: batch.decode(recs, np))
        if not skip:
            with pytest.raises(DataError, match=r"corrupt.h5: record [347] cannot be decoded .*"
                                                r"train and eval skip such records with "
                                                r"--skip-bad-records"):
                batched._decoded(*args)
            return
        records, rngs, rs, images = batched._decoded(*args)
        x, y = next(iter(cpu))
        out = batch(records, rngs, np.empty_like(x), images)
    np.testing.assert_array_equal(batched.labels[rs], y)
    # the rows where a record stands in for a bad one, which an evaluation leaves out
    np.testing.assert_array_equal(rs != indices, cpu.last_stand_in)
    assert sorted(indices[cpu.last_stand_in]) == [3, 4, 7]
    assert batched.bad_indices == cpu.bad_indices == {3, 4, 7}
    assert batched._slot_bad[0] == cpu.skipped == 3     # one per row replaced: 3, 4 and 7
    grey = np.abs(out - x) * cpu.std
    assert grey.mean() < 1.5 and grey.max() < 12, (grey.mean(), grey.max())


def test_train_with_decode_gpu_on_the_cpu_exits_2_with_nothing_written(tmp_path):
    from launcher import environment
    r = subprocess.run([sys.executable, "-m", "mpitrain", "train", "--data-dir",
                        str(tmp_path / "data"), "--epochs", "1", "--decode", "gpu",
                        "--device", "cpu", "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300, env=environment(1))
    assert r.returncode == 2 and "--decode gpu decodes on the GPU" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("train", [True, False])
def test_the_loader_decoding_on_the_gpu_against_the_cpu_loader(tmp_path, train):
    """An epoch's three batches from Loader(decode="gpu") (the ring on the device, two
    workers on their own streams) against the CPU loader's, with two bad records skipped:
    the same labels and skips, pixels within the decoders' rounding."""
    import cupy
    import h5py

    from mpitrain import backend
    path = str(tmp_path / "s.h5")
    convert_synthetic(path, 48, (500, 375), classes=4)
    with h5py.File(path, "r+") as f:
        for i in (5, 30):
            f["images"][f["offsets"][i]:f["offsets"][i + 1]] = 1
    common = dict(train=train, image_size=64, workers=2, seed=7, skip_bad_records=True)
    try:
        backend.use_device("gpu")
        with Loader(path, 16, decode="gpu", **common) as gpu_loader, \
                Loader(path, 16, **common) as cpu_loader:
            for _ in range(3):
                (xg, yg), (xc, yc) = next(iter(gpu_loader)), next(iter(cpu_loader))
                np.testing.assert_array_equal(yg, yc)
                grey = np.abs(cupy.asnumpy(xg) - xc) * cpu_loader.std
                assert grey.mean() < 1.5 and grey.max() < 12, (grey.mean(), grey.max())
            assert gpu_loader.bad_indices == cpu_loader.bad_indices == {5, 30}
            assert gpu_loader.skipped == cpu_loader.skipped == 2
            # every good record on the GPU; each bad one tried twice (in its batch, then
            # alone), in this epoch and maybe in the next one's first two batches, prefetched
            assert gpu_loader.host_decoded in (4, 6, 8), gpu_loader.host_decoded
    finally:
        backend.use_device("cpu")
