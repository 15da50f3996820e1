"""Converters into the mpitrain image format (datasets/h5format.py).

    convert_imagefolder  ImageNet layout: SRC/<class>/<image>, one folder per class
    convert_digits       the bundled scikit-learn digits, the split of digits.py
    convert_fashion_mnist  Fashion-MNIST from Debian's dataset-fashion-mnist (IDX files):
                         training, validation and test files
    convert_synthetic    generated JPEGs of ImageNet size, for benchmarks

Every image of a folder is decoded once to validate it; files that Pillow
cannot read (corrupt, truncated, not an image) are skipped and listed, with
the reason, in DST.skipped.txt. JPEG and PNG files are stored byte for byte;
other formats Pillow reads are stored as PNG (lossless). Per-channel mean and
std come from exact per-channel histograms of the decoded training images.

`progress(done, total)` is called as images are processed. Under MPI (pass
an mpi4py communicator) every rank validates and encodes an interleaved
share of each round of images, rank 0 gathers them and writes; the result is
the same file as a serial run.
"""
import contextlib
import gzip
import hashlib
import io
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, UnidentifiedImageError

from mpitrain.files import save_text

from .augment import to_rgb
from .h5format import Writer
from .split import stratified_val

ROUND = 64          # images per rank between two gathers under MPI


@dataclass
class Conversion:
    """What a converter wrote: files {"train": path, "val": path}, records per
    split, skipped [(relative path, reason)] and the report file's path."""
    files: dict
    counts: dict
    skipped: list = field(default_factory=list)
    report_path: str = None


def val_path(dst):
    """Where the validation split of `dst` goes: x.h5 -> x_val.h5."""
    stem, ext = os.path.splitext(dst)
    return f"{stem}_val{ext or '.h5'}"


class ConvertError(ValueError):
    """A source that cannot be converted; the message names it and the fix."""


def list_imagefolder(src):
    """(class_names, [(relative path, label)], [(relative path, reason)]): sorted class
    folders, sorted files, hidden entries ignored; an entry of a class folder that is
    not a file (a folder, a broken symbolic link or a loop of them) is listed with the
    reason it is skipped. ConvertError for a SRC without class folders or images."""
    if not os.path.isdir(src):
        raise ConvertError(f"{src} is not a folder; give the folder that holds one "
                           f"sub-folder of images per class")
    classes = sorted(d for d in os.listdir(src)
                     if not d.startswith(".") and os.path.isdir(os.path.join(src, d)))
    if not classes:
        raise ConvertError(f"{src}: no class folders (expected SRC/<class>/<image>): put "
                           f"each class's images in a sub-folder named after it")
    if len(classes) == 1:
        raise ConvertError(f"{src}: one class folder ({classes[0]}), and a classifier needs "
                           f"two or more: put each class's images in a sub-folder of its own")
    for name in classes:
        if printable(name) != name:
            raise ConvertError(f"{src}: the name of class folder {printable(name)} is not "
                               f"UTF-8 text on one line, as a data file keeps its class names: "
                               f"rename the folder")
    items, skipped = [], []
    for label, name in enumerate(classes):
        folder = os.path.join(src, name)
        for file in sorted(os.listdir(folder)):
            path, rel = os.path.join(folder, file), os.path.join(name, file)
            if file.startswith("."):
                continue
            if os.path.isfile(path):
                items.append((rel, label))
            else:
                skipped.append((printable(rel), _not_a_file(path)))
    if not items:
        raise ConvertError(f"{src}: its {len(classes)} class folder(s) hold no image files "
                           f"(expected SRC/<class>/<image>)")
    empty = sorted(set(classes) - {rel.split(os.sep, 1)[0] for rel, _ in items})
    if empty:
        # what they do hold: sub-folders, say, whose images are a level too deep
        inside = [f"{rel} is {why}" for rel, why in skipped if rel.split(os.sep, 1)[0] in empty]
        if len(inside) > 3:
            inside[3:] = [f"{len(inside) - 3} more such"]
        held = f": {'; '.join(inside)}" if inside else ""
        raise ConvertError(f"{src}: class folder(s) {', '.join(empty)} hold no image file"
                           f"{held}, so the network would have a class it never sees: put "
                           f"its images in, or remove the folder")
    return classes, items, skipped


def printable(rel):
    """A file's name as a data file stores it and the report lists it: bytes that are not
    UTF-8 (an archive unpacked from another system) as \\xNN escapes, and the tabs and
    line breaks of the report's lines escaped."""
    text = os.fsencode(rel).decode("utf-8", "backslashreplace")
    return text.translate({9: "\\t", 10: "\\n", 13: "\\r"})


def _not_a_file(path):
    """Why `path`, found in a class folder, is not an image file."""
    if os.path.isdir(path):
        return "a folder (images are read one level below SRC only)"
    try:
        os.stat(path)
    except OSError as e:
        return f"a symbolic link that leads nowhere ({e.strerror})"
    return "not a regular file"


def histogram(rgb):
    """(3, 256) int64 counts of each channel's values in a uint8 (H, W, 3) image."""
    flat = np.asarray(rgb).reshape(-1, 3)
    return np.stack([np.bincount(flat[:, c], minlength=256) for c in range(3)])


def mean_std(hist):
    """Per-channel mean and std from (3, 256) histograms."""
    v = np.arange(256, dtype=np.float64)
    n = hist.sum(axis=1)
    mean = hist @ v / n
    return mean, np.sqrt(np.maximum(hist @ v ** 2 / n - mean ** 2, 0))


def encode_file(path, resize_short=None):
    """(stored bytes, histogram) of one image file; raises if Pillow cannot decode it all.

    The file's bytes are kept when it is a JPEG (an MPO too: a JPEG whose further
    frames decoders pass over) or PNG; with resize_short, an
    image whose short side is larger is downscaled to it and stored as JPEG
    (quality 90).
    """
    with open(path, "rb") as fh:
        data = fh.read()
    im = Image.open(io.BytesIO(data))
    im.load()                                       # full decode: catches truncation
    rgb = to_rgb(im)                                # as the loader decodes it
    if resize_short and min(rgb.size) > resize_short:
        scale = resize_short / min(rgb.size)
        rgb = rgb.resize((max(1, round(rgb.size[0] * scale)), max(1, round(rgb.size[1] * scale))),
                         Image.BICUBIC)
        data = _save(rgb, "JPEG", quality=90)
    elif im.format not in ("JPEG", "MPO", "PNG"):   # MPO: a camera's JPEG, more frames after
        data = _save(rgb, "PNG")
    return data, histogram(rgb)


def _save(im, fmt, **options):
    buf = io.BytesIO()
    im.save(buf, fmt, **options)
    return buf.getvalue()


def _process(src, item, resize_short):
    """(label, bytes, histogram, None) or (label, None, None, reason)."""
    rel, label = item
    path = os.path.join(src, rel)
    try:
        data, hist = encode_file(path, resize_short)
        return label, data, hist, None
    except UnidentifiedImageError:          # its message names a BytesIO, not the file
        return label, None, None, ("an empty file" if os.path.getsize(path) == 0
                                   else "not an image (no format Pillow reads)")
    except Exception as e:
        return label, None, None, f"{type(e).__name__}: {e}"


def _plan(src, val_fraction, seed):
    """(class names, items in their order on disk, validation mask, skipped entries)."""
    classes, items, skipped = list_imagefolder(src)
    rng = np.random.default_rng(seed)
    items = [items[i] for i in rng.permutation(len(items))]
    is_val = stratified_val([label for _, label in items], val_fraction, rng) \
        if val_fraction > 0 else np.zeros(len(items), bool)
    if val_fraction > 0 and not is_val.any():
        raise ConvertError(f"--val-fraction {val_fraction:g} of {len(items)} images in "
                           f"{len(classes)} class(es) rounds to no validation image in any "
                           f"class; give a larger --val-fraction")
    labels = np.array([label for _, label in items])
    trained = np.bincount(labels[~is_val], minlength=len(classes))   # every class has images
    if not trained.all():
        c = int(np.argmin(trained))
        raise ConvertError(f"--val-fraction {val_fraction:g} takes every image of class "
                           f"{classes[c]} ({np.count_nonzero(labels == c)}) into the "
                           f"validation split, leaving it none to train on; give a smaller "
                           f"--val-fraction")
    return classes, items, is_val, skipped


def convert_imagefolder(src, dst, val_fraction=0.0, resize_short=None, seed=0, progress=None,
                        comm=None):
    """Convert SRC/<class>/<image> into dst (and val_path(dst) when val_fraction > 0).

    The order on disk is a permutation drawn from `seed`; the validation split
    is stratified by class. Returns a Conversion (skipped files and their
    reasons; the same on every rank under MPI).
    """
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    plan = None
    if rank == 0:
        try:
            plan = _plan(src, val_fraction, seed)
        except ConvertError as e:
            plan = e
    if comm is not None:
        plan = comm.bcast(plan, root=0)
    if isinstance(plan, ConvertError):              # raised on every rank alike
        raise plan
    classes, items, is_val, unread = plan

    if rank == 0:
        splits = {"train": dst, "val": val_path(dst)} if val_fraction > 0 else {"train": dst}
        writers = {name: Writer(path, classes, split_of=os.path.basename(dst) if
                                name == "val" else None) for name, path in splits.items()}
        hist = np.zeros((3, 256), np.int64)
        trained = np.zeros(len(classes), np.int64)  # training images written, per class
        first = {}              # digest of a file's bytes -> the first file that had them
        skipped = list(unread)
    try:
        block = ROUND * size
        for start in range(0, len(items), block):
            mine = [_process(src, items[j], resize_short)
                    for j in range(start + rank, min(start + block, len(items)), size)]
            shares = comm.gather(mine, root=0) if comm is not None else [mine]
            if rank != 0:
                continue
            for j in range(start, min(start + block, len(items))):
                label, data, h, reason = shares[(j - start) % size][(j - start) // size]
                rel = printable(items[j][0])
                if reason is None:
                    # a copy could stand in both splits, and be scored as an image trained on
                    digest = hashlib.blake2b(data, digest_size=16).digest()
                    reason = f"a byte-for-byte copy of {first[digest]}" if digest in first \
                        else None
                    first.setdefault(digest, rel)
                if reason is not None:
                    skipped.append((rel, printable(reason)))
                    continue
                writers["val" if is_val[j] else "train"].add(label, data, rel)
                if not is_val[j]:
                    hist += h
                    trained[label] += 1
            if progress is not None:
                progress(min(start + block, len(items)), len(items))
        result = None
        empty = rank == 0 and next((name for name, w in writers.items() if not len(w)), None)
        untrained = next((c for c in range(len(classes)) if not trained[c]), None) \
            if rank == 0 else None
        if empty:
            result = ConvertError(f"{src}: none of its {len(items)} image file(s) could be "
                                  f"read into the {empty} split (the first skipped: "
                                  f"{skipped[0][0]}: {skipped[0][1]}); nothing written")
        elif untrained is not None:
            name = classes[untrained]
            rel, reason = next((rel, reason) for rel, reason in skipped
                               if rel.split(os.sep, 1)[0] == name)
            result = ConvertError(f"{src}: class {name} has no readable training image (the "
                                  f"first skipped: {rel}: {reason}), so a model would be scored "
                                  f"on a class it never saw; mend or remove its files, or "
                                  f"remove the class; nothing written")
        if result is not None:
            for w in writers.values():
                w.abort()
        elif rank == 0:
            mean, std = mean_std(hist)
            # train last; without a validation split, one an earlier conversion cut for
            # DST goes too (never a file converted on its own under that name)
            Writer.commit_splits(list(reversed(writers.values())), mean, std,
                                 stale=[] if "val" in writers else [val_path(dst)])
            report_path = dst + ".skipped.txt"

            save_text(report_path,
                      f"# {len(skipped)} of {len(items)} files skipped (path<TAB>reason)\n"
                      + "".join(f"{rel}\t{reason}\n" for rel, reason in skipped))
            result = Conversion(dict(splits), {n: len(w) for n, w in writers.items()},
                                skipped, report_path)
    except BaseException:
        if rank == 0:           # no temporary file survives; under MPI run with
            for w in writers.values():  # `python -m mpi4py` so the other ranks end too
                w.abort()
        raise
    result = comm.bcast(result, root=0) if comm is not None else result
    if isinstance(result, ConvertError):            # raised on every rank alike
        raise result
    return result


def convert_digits(dst_dir, seed=0, val_fraction=0.2):
    """digits_train.h5 and digits_val.h5 in dst_dir: the split and pixels of
    datasets/digits.py's load_digits_split(seed, val_fraction).

    The 8x8 digits (values 0..16) upsampled bilinearly to 32x32 are multiples
    of 1/64, so they are stored exactly as uint16 pixels p = 64 x (0..1024),
    with the training split's scalar mean and std repeated over 3 channels:
    (p - mean_p) / std_p equals the in-memory (x - mean) / std.
    """
    from sklearn.datasets import load_digits

    from .digits import upsample
    digits = load_digits()
    labels = digits.target.astype(np.int64)
    val = stratified_val(labels, val_fraction, np.random.default_rng(seed))
    x = upsample(digits.images.astype(np.float64))
    pixels = np.rint(x * 64)
    if not np.array_equal(pixels / 64, x):
        raise RuntimeError("upsampled digits are no longer multiples of 1/64; "
                             "convert_digits must follow datasets/digits.py")
    pixels = np.repeat(pixels.astype(np.uint16)[..., None], 3, axis=3)
    mean, std = pixels[~val].mean(), pixels[~val].std()
    return write_pixel_splits([(name, os.path.join(dst_dir, f"digits_{name}.h5"), pixels[mask],
                                labels[mask]) for name, mask in (("val", val), ("train", ~val))],
                              [str(c) for c in range(10)], mean, std, np.uint16)


def write_pixel_splits(splits, classes, mean, std, pixel_dtype=np.uint8):
    """Files of decoded pixels, one a split (name, path, pixels (N, H, W, 3), labels), with
    one scalar mean and std over the channels, made to appear together with the training
    split last (Writer.commit_splits): a conversion stopped half-way leaves the files of
    the one before it."""
    with contextlib.ExitStack() as stack:
        writers = []
        for name, path, images, labels in sorted(splits, key=lambda split: split[0] == "train"):
            w = stack.enter_context(Writer(path, classes, storage="pixels",
                                           pixel_dtype=pixel_dtype))
            for image, label in zip(images, labels):
                w.add(int(label), image)
            writers.append(w)
        Writer.commit_splits(writers, [mean] * 3, [std] * 3)
    return Conversion({name: path for name, path, _, _ in splits},
                      {name: len(labels) for name, _, _, labels in splits})


# Fashion-MNIST (Xiao et al. 2017): Debian's package installs the four IDX files here
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                         "Shirt", "Sneaker", "Bag", "Ankle boot")
FASHION_MNIST_VAL = 0.1         # of the 60,000 training images: 6,000, 600 a class


def read_idx(path):
    """The array of an IDX file (gzip or plain): unsigned bytes, 1 to 4 dimensions.
    The format: two zero bytes, a type byte (0x08: unsigned byte), the number of
    dimensions, each dimension as a big-endian 32-bit integer, then the data."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != 0x08 or not 1 <= data[3] <= 4:
        raise ConvertError(f"{path} is not an IDX file of unsigned bytes (its first bytes "
                           f"are {data[:4].hex()}, expected 000008 and 1 to 4 dimensions)")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    start = 4 + 4 * ndim
    if len(data) - start != int(np.prod(shape)):
        raise ConvertError(f"{path} holds {len(data) - start} bytes of data for a shape of "
                           f"{shape}: the file is truncated or damaged")
    return np.frombuffer(data, np.uint8, offset=start).reshape(shape)


def fashion_mnist_dir(work_dir):
    """The folder of the four IDX files: the installed package's, else the package
    fetched with `apt-get download` and unpacked (no root needed) under work_dir."""
    names = [f"{s}-{k}-idx{d}-ubyte.gz" for s in ("train", "t10k")
             for k, d in (("images", 3), ("labels", 1))]
    unpacked = os.path.join(work_dir, FASHION_MNIST_PACKAGE)
    for folder in (FASHION_MNIST_DIR, unpacked + FASHION_MNIST_DIR):
        if all(os.path.isfile(os.path.join(folder, n)) for n in names):
            return folder
    fix = (f"install it (apt-get install {FASHION_MNIST_PACKAGE}), or put {', '.join(names)} "
           f"in {FASHION_MNIST_DIR}")
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise ConvertError(f"Fashion-MNIST is not installed and this machine has no "
                           f"apt-get to fetch Debian's {FASHION_MNIST_PACKAGE}: {fix}")
    print(f"mpitrain: fetching Debian's {FASHION_MNIST_PACKAGE} (31 MB) into {unpacked}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run(["apt-get", "download", FASHION_MNIST_PACKAGE], cwd=tmp,
                             capture_output=True, text=True)
        debs = [f for f in os.listdir(tmp) if f.endswith(".deb")]
        if got.returncode or not debs:
            raise ConvertError(f"apt-get download {FASHION_MNIST_PACKAGE} failed "
                               f"({(got.stderr or got.stdout).strip()[-300:]}): {fix}")
        subprocess.run(["dpkg", "-x", os.path.join(tmp, debs[0]), unpacked], check=True)
    return unpacked + FASHION_MNIST_DIR


def convert_fashion_mnist(dst_dir, seed=0, source=None):
    """fashion-mnist_{train,val,test}.h5 in dst_dir from the IDX files in `source` (default:
    fashion_mnist_dir). The 60,000 training images are split into training (54,000) and
    a stratified validation set (a FASHION_MNIST_VAL share, drawn with `seed`); the 10,000 test
    images go to a test file that training and the study never read. 28x28 grayscale
    pixels stored as uint8 (H, W, 3), the gray repeated; mean and std are the training
    split's, repeated over the channels."""
    source = source or fashion_mnist_dir(dst_dir)
    read = lambda name: read_idx(os.path.join(source, name))        # noqa: E731
    train_x, train_y = read("train-images-idx3-ubyte.gz"), read("train-labels-idx1-ubyte.gz")
    test_x, test_y = read("t10k-images-idx3-ubyte.gz"), read("t10k-labels-idx1-ubyte.gz")
    for x, y in ((train_x, train_y), (test_x, test_y)):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y) or y.max() >= 10:
            raise ConvertError(f"{source}: images {x.shape} and labels {y.shape} (largest "
                               f"{y.max()}) do not make one 10-class set")
    val = stratified_val(train_y, FASHION_MNIST_VAL, np.random.default_rng(seed))
    mean, std = float(train_x[~val].mean()), float(train_x[~val].std())
    return write_pixel_splits(
        [(name, os.path.join(dst_dir, f"fashion-mnist_{name}.h5"),
          np.repeat(x[..., None], 3, axis=3), y)
         for name, x, y in (("train", train_x[~val], train_y[~val]),
                            ("val", train_x[val], train_y[val]), ("test", test_x, test_y))],
        FASHION_MNIST_CLASSES, mean, std)


def synthetic_image(rng, label, classes, size=(500, 375)):
    """A uint8 (H, W, 3) image: a smooth random colour field tinted by the class,
    with pixel noise, so that it compresses like a photograph."""
    width, height = size
    coarse = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC),
                       np.float32)
    tint = 255 * np.array([np.cos(2 * np.pi * (label / classes + k / 3)) for k in range(3)],
                          np.float32)
    noisy = rng.standard_normal((height, width, 3), np.float32)
    noisy *= 12
    noisy += 0.7 * field
    noisy += 0.3 * (tint + 128) / 2
    return np.clip(noisy, 0, 255, out=noisy).astype(np.uint8)


def _synthetic_jpeg(seed, i, classes, size, quality):
    """Image i of convert_synthetic: (label, JPEG bytes, its (3, 256) histogram), from a
    generator of its own, so that images can be made in any order and on any thread."""
    label = i % classes
    rgb = synthetic_image(np.random.default_rng([seed, i]), label, classes, size)
    return label, _save(Image.fromarray(rgb), "JPEG", quality=quality), histogram(rgb)


def convert_synthetic(dst, count, size=(500, 375), classes=10, seed=0, quality=90,
                      progress=None, threads=None):
    """dst: `count` generated JPEGs of `size` (width, height), labels i mod classes, made
    by `threads` threads (default: one per core this process may run on; NumPy's noise
    and Pillow's resize and encoding run without the GIL) and written in order."""
    from concurrent.futures import ThreadPoolExecutor
    from mpitrain.launcher import cores
    threads = threads or cores()
    hist = np.zeros((3, 256), np.int64)
    with Writer(dst, [f"class{c}" for c in range(classes)]) as w, \
            ThreadPoolExecutor(threads) as pool:
        for start in range(0, count, 64):
            images = pool.map(lambda i: _synthetic_jpeg(seed, i, classes, size, quality),
                              range(start, min(start + 64, count)))
            for i, (label, jpeg, counts) in enumerate(images, start):
                hist += counts
                w.add(label, jpeg, f"synthetic/{i}")
            if progress is not None:
                progress(min(start + 64, count), count)
        w.commit(*mean_std(hist))
    return Conversion({"train": dst}, {"train": count})
