"""The mpitrain image file: one HDF5 file per split.

Layout (docs/data-format.md has the full description and the measurements
behind it):

    attrs    format = "mpitrain-images", version = 1,
             storage = "encoded" | "pixels"
    labels       int64 (N,)            class index of every record
    class_names  utf-8 strings (C,)    class index -> name
    mean, std    float64 (3,)          per-channel statistics of the training
                                       split, in stored pixel units (0..255
                                       for 8-bit images)
    filenames    utf-8 strings (N,)    where each record came from (optional)
  storage "encoded":
    images       uint8 (total_bytes,)  the original JPEG/PNG files, end to end,
                                       contiguous and uncompressed
    offsets      int64 (N + 1,)        record i is images[offsets[i]:offsets[i+1]]
  storage "pixels":
    pixels       uint8 or uint16 (N, H, W, 3)   decoded images of one fixed size
    attrs    image_size = (height, width), the median of the stored images' sizes
             (optional: a file may lack it; see default_image_size)

A record is read with one contiguous slice: the fastest layout at random
access, as a variable-length dataset has HDF5 look each vlen element up in a
heap and a chunked one goes through the chunk index (the measurements:
docs/benchmarks-record.md, "The file layout").

Files are written to a temporary name in the destination's directory and
renamed when complete, so an interrupted conversion never leaves a file that
looks finished.
"""
import errno
import io
import os
import socket
import sys

import h5py
import numpy as np

FORMAT = "mpitrain-images"
VERSION = 1
STORAGES = ("encoded", "pixels")


def available_memory():
    """Bytes of memory this process may still use (the cgroup's limit where one is set,
    less what it holds but the page cache it could give back (memory.stat's
    inactive_file, as the kubelet counts a working set), else the kernel's MemAvailable),
    or None where neither can be read."""
    have = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit.isdigit():
                room = int(limit) - int(g.read()) + _cgroup_stat("inactive_file")
                have = room if have is None else min(have, room)
    except (OSError, ValueError):
        pass
    return have


def _split_of(path):
    """The split_of attribute of the file at `path` (None: none, or no such file)."""
    try:
        with h5py.File(path, "r") as f:
            value = f.attrs.get("split_of")
    except OSError:
        return None
    return value.decode() if isinstance(value, bytes) else value


def _cgroup_stat(key):
    """A count of this cgroup's memory.stat (0 where it has none)."""
    try:
        with open("/sys/fs/cgroup/memory.stat") as f:
            for line in f:
                name, value = line.split()
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


class FormatError(ValueError):
    """A file that is not a valid mpitrain image file; the message names the file."""


def _temp_name(path, tag, pid=None):
    """Where a Writer keeps its unfinished file and spool: hidden, beside `path`, named
    after this host and process so that a later run can tell whether its owner lives."""
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.{tag}-{socket.gethostname()}-{pid or os.getpid()}")


def remove_stale(path):
    """Delete the unfinished files a killed conversion of `path` left on this host (their
    process is gone); returns their names."""
    head, tail = os.path.split(os.path.abspath(path))
    prefix, host = f".{tail}.", socket.gethostname()
    removed = []
    for name in os.listdir(head or "."):
        tag, _, owner = name[len(prefix):].partition("-")
        if not name.startswith(prefix) or tag not in ("tmp", "spool"):
            continue
        owner_host, _, pid = owner.rpartition("-")
        if owner_host == host and pid.isdigit() and not _alive(int(pid)):
            os.remove(os.path.join(head, name))
            removed.append(name)
    return removed


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # another user's process
        return True
    return True


class Writer:
    """Writes one split record by record; `commit(mean, std)` makes the file appear (its
    directory is made at the start, where missing).

    storage "encoded": `add(label, data)` takes the encoded bytes of one image;
    they are spooled to a side file so that the images dataset can be written
    contiguous (its size must be known when it is created).
    storage "pixels": `add(label, array)` takes an (H, W, 3) array of the dtype
    given; records are kept in memory (the format is meant for small images).

    split_of: the training file's name where this is the validation split a conversion
    cut from the same folder (an attribute, so that a later conversion of that training
    file without a validation split knows this file for its own: Writer.commit_splits).

    Used as a context manager, an exception inside the block removes every
    temporary file and leaves no destination file.
    """

    def __init__(self, path, class_names, storage="encoded", pixel_dtype=np.uint8,
                 split_of=None):
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
        self.path = path
        self.class_names = list(class_names)
        self.storage = storage
        self.split_of = split_of
        self.pixel_dtype = np.dtype(pixel_dtype)
        self.labels, self.filenames = [], []
        self.sizes, self.pixels, self.shapes = [], [], []
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        for name in remove_stale(path):
            print(f"mpitrain: removed {name}, left by a conversion of {path} that was killed",
                  file=sys.stderr, flush=True)
        self._tmp = _temp_name(path, "tmp")
        self._spool_path = _temp_name(path, "spool")
        self._spool = open(self._spool_path, "wb") if storage == "encoded" else None
        self.done = False

    def __len__(self):
        return len(self.labels)

    def add(self, label, data, filename=""):
        if not 0 <= label < len(self.class_names):
            raise ValueError(f"label {label} outside 0..{len(self.class_names) - 1}")
        if self.storage == "encoded":
            self._spool.write(data)
            self.sizes.append(len(data))
            shape = encoded_shape(data)
            if shape:
                self.shapes.append(shape)
        else:
            data = np.asarray(data)
            if data.ndim != 3 or data.shape[2] != 3 or data.dtype != self.pixel_dtype:
                raise ValueError(f"pixels must be (H, W, 3) {self.pixel_dtype}, "
                                 f"got {data.shape} {data.dtype}")
            if self.pixels and data.shape != self.pixels[0].shape:
                raise ValueError(f"every record must have the shape {self.pixels[0].shape}, "
                                 f"got {data.shape}")
            self.pixels.append(data)
            self.shapes.append(data.shape[:2])
        self.labels.append(int(label))
        self.filenames.append(filename)

    def commit(self, mean, std):
        """Write the datasets into the temporary file, flush it, rename it into place."""
        self.write(mean, std)
        self.publish()

    def write(self, mean, std):
        """Write the datasets into the temporary file and flush it to disk."""
        if not self.labels:
            raise ValueError(f"{self.path}: no records to write")
        strings = h5py.string_dtype("utf-8")
        with h5py.File(self._tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["version"] = VERSION
            f.attrs["storage"] = self.storage
            if self.split_of is not None:
                f.attrs["split_of"] = self.split_of
            if self.shapes:
                f.attrs["image_size"] = np.rint(np.median(self.shapes, axis=0)).astype(np.int64)
            f.create_dataset("labels", data=np.asarray(self.labels, np.int64))
            f.create_dataset("class_names", data=self.class_names, dtype=strings)
            f.create_dataset("filenames", data=self.filenames, dtype=strings)
            f.create_dataset("mean", data=np.asarray(mean, np.float64).reshape(3))
            f.create_dataset("std", data=np.asarray(std, np.float64).reshape(3))
            if self.storage == "encoded":
                self._spool.close()
                offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
                f.create_dataset("offsets", data=offsets)
                images = f.create_dataset("images", shape=(int(offsets[-1]),), dtype=np.uint8)
                block = 64 << 20
                with open(self._spool_path, "rb") as spool:
                    for start in range(0, int(offsets[-1]), block):
                        chunk = np.frombuffer(spool.read(block), np.uint8)
                        images[start:start + len(chunk)] = chunk
            else:
                f.create_dataset("pixels", data=np.stack(self.pixels))
        with open(self._tmp, "rb+") as fh:
            os.fsync(fh.fileno())

    def publish(self):
        """Rename the written temporary file into place."""
        os.replace(self._tmp, self.path)
        self.done = True
        self._cleanup()

    @staticmethod
    def commit_splits(writers, mean, std, stale=()):
        """Make one conversion's split files appear together, the last of `writers` (the
        training split: its presence means the set is complete) last: every temporary
        file written whole, then the older files of these paths removed, and of the
        paths `stale` those an earlier conversion made as the validation split of this
        training file (split_of), then the renames. An interruption never leaves a split
        beside one of an older conversion (whose images the other split might share)."""
        for w in writers:
            w.write(mean, std)
        train = os.path.basename(writers[-1].path)
        for path in [w.path for w in writers] + [p for p in stale if _split_of(p) == train]:
            if os.path.exists(path):
                os.remove(path)
        for w in writers:
            w.publish()

    def abort(self):
        self._cleanup()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

    def _cleanup(self):
        if self._spool is not None:
            self._spool.close()
        if os.path.exists(self._spool_path):
            os.remove(self._spool_path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.done:
            self.abort()
        return False


def check_schema(f, path, num_classes=None):
    """Raise FormatError naming `path` and the problem unless `f` is a valid file.

    Checks the format name and version, the datasets and their dtypes and
    shapes, that offsets are non-decreasing and end at the blob's size, and
    that every label lies in 0..num_classes-1 (num_classes defaults to the
    number of class names stored).
    """
    def fail(problem):
        raise FormatError(f"{path}: {problem}")

    fmt, version, storage = (_plain(f.attrs.get(key)) for key in ("format", "version", "storage"))
    if fmt != FORMAT:
        fail(f"not an mpitrain image file: attribute format is {fmt!r}, expected {FORMAT!r} "
             f"(make one with `python -m mpitrain convert`)")
    if version != VERSION:
        fail(f"format version {version!r}, expected {VERSION}; convert the data again "
             f"with this version of mpitrain")
    if storage not in STORAGES:
        fail(f"attribute storage is {storage!r}, expected one of {STORAGES}")
    payload = ("images", "offsets") if storage == "encoded" else ("pixels",)
    for key in ("labels", "class_names", "mean", "std") + payload:
        if key not in f:
            fail(f"dataset {key!r} is missing")

    names = f["class_names"]
    if names.ndim != 1 or h5py.check_string_dtype(names.dtype) is None:
        fail(f"class_names must be a 1-D dataset of strings, found {names.dtype} "
             f"{names.shape}")
    labels = f["labels"]
    if labels.dtype.kind not in "iu" or labels.ndim != 1:
        fail(f"labels must be a 1-D integer dataset, found {labels.dtype} {labels.shape}")
    n = labels.shape[0]
    # a file is not trusted: what it declares must fit in memory before anything is read
    declared = 8 * (2 * n + 1) + 64 * f["class_names"].size
    have = available_memory()
    if have is not None and declared > have // 2:
        fail(f"declares {n:,} records and {f['class_names'].size:,} classes: their labels, "
             f"offsets and names alone would need {declared / 2**30:.1f} GiB, more than the "
             f"memory available ({have / 2**30:.1f} GiB); the file is damaged or not meant "
             f"for this machine")
    for key in ("mean", "std"):
        if f[key].shape != (3,):
            fail(f"{key} must have shape (3,), found {f[key].shape}")
    # in float32, as the loader normalises: (pixel - mean) / std
    with np.errstate(all="ignore"):
        mean, std = (f[key][:].astype(np.float64).astype(np.float32) for key in ("mean", "std"))
        if not np.all(np.isfinite(mean)):
            fail(f"mean must be finite in float32, found {f['mean'][:]}: the file's statistics "
                 f"are damaged; convert the data again")
        if not np.all((std > 0) & np.isfinite(std) & np.isfinite(1 / std)):
            fail(f"std must be positive, and it and its reciprocal finite in float32, found "
                 f"{f['std'][:]}: the file's statistics are damaged; convert the data again")
    if storage == "encoded":
        images, offsets = f["images"], f["offsets"]
        if images.dtype != np.uint8 or images.ndim != 1:
            fail(f"images must be a 1-D uint8 dataset, found {images.dtype} {images.shape}")
        if offsets.dtype.kind not in "iu" or offsets.shape != (n + 1,):
            fail(f"offsets must be integers of shape ({n + 1},) for {n} labels, "
                 f"found {offsets.dtype} {offsets.shape}")
        o = offsets[:]
        if o[0] != 0 or np.any(np.diff(o) < 0) or o[-1] != images.shape[0]:
            fail(f"offsets must rise from 0 to the images size {images.shape[0]}")
    else:
        pixels = f["pixels"]
        if pixels.dtype not in (np.uint8, np.uint16) or pixels.ndim != 4 \
                or pixels.shape[0] != n or pixels.shape[3] != 3:
            fail(f"pixels must be uint8 or uint16 of shape ({n}, H, W, 3), "
                 f"found {pixels.dtype} {pixels.shape}")
        if 0 in pixels.shape[1:3]:
            fail(f"its images are {pixels.shape[2]}x{pixels.shape[1]} pixels: nothing to "
                 f"train on; convert the data again")

    classes = len(names) if num_classes is None else num_classes
    y = labels[:]
    if n and (y.min() < 0 or y.max() >= classes):
        bad = int(np.flatnonzero((y < 0) | (y >= classes))[0])
        fail(f"label {int(y[bad])} of record {bad} is outside 0..{classes - 1} "
             + ("(its class_names name " if num_classes is None else "(the model has ")
             + f"{classes} classes)")


def _plain(value):
    """An HDF5 attribute as a plain Python value (str, int), for comparisons and messages."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value.item() if isinstance(value, np.generic) else value


def encoded_shape(data):
    """(height, width) of an encoded image, from its header alone; None where the bytes
    are no image (a record the loader will refuse, or skip with --skip-bad-records)."""
    from PIL import Image, UnidentifiedImageError
    try:
        width, height = Image.open(io.BytesIO(bytes(data))).size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return None
    return height, width


# A run's square image side when the data does not say, and the most it takes from the data
DEFAULT_IMAGE_SIZE = 224


def default_image_size(reader):
    """The image side a run takes from a file when no --image-size is given: the short
    side of the file's median image size, at most DEFAULT_IMAGE_SIZE (images larger than
    that are cropped and scaled down to it, as ImageNet's are); DEFAULT_IMAGE_SIZE for an
    encoded file that does not record its size."""
    if reader.image_size is None:
        return DEFAULT_IMAGE_SIZE
    return min(DEFAULT_IMAGE_SIZE, *reader.image_size)


def a_folder(path):
    """The refusal of a folder where a data file was asked for: the data files in it, else
    the command that makes one from its class folders."""
    held = sorted(f for f in os.listdir(path) if f.endswith(".h5")) if os.access(path, os.R_OK) \
        else []
    if held:                    # a folder that `convert digits` (or the like) wrote into
        first = next((f for f in held if f.endswith("_train.h5")), held[0])
        return (f"{path} is a folder of data files ({', '.join(held)}): name one, for "
                f"example {os.path.join(path, first)}")
    name = os.path.basename(os.path.normpath(path)).removesuffix(".h5") or "images"
    return (f"{path} is a folder, and mpitrain reads HDF5 files made by `convert`: `python -m "
            f"mpitrain convert imagefolder {path} data/{name}.h5 --val-fraction 0.1` makes "
            f"data/{name}.h5 and data/{name}_val.h5 from its class folders")


# why h5py could not open a data file, by errno
UNOPENED = {
    errno.EAGAIN: "another process holds it open for writing (HDF5 locks the file: a "
                  "conversion still running, or an HDF5 viewer); wait for it, or close it",
    errno.EACCES: "this user may not read it; let it read the file",
    None: "cannot be opened as HDF5 ({e}); mpitrain reads the files that `python -m mpitrain "
          "convert` makes"}


class Reader:
    """Read access to one file (open one Reader per worker: h5py handles are not
    shared across threads' or processes' work).

    Attributes: path, storage, labels (int64 array), class_names, mean, std
    (float64 (3,)), image_shape ((H, W, 3) for pixel files, None otherwise),
    image_size ((height, width): the median stored image's, None for an encoded
    file that does not record it).
    `record(i)` returns record i: the encoded bytes (a uint8 array) or the
    pixel array.
    """

    def __init__(self, path, num_classes=None, check=True):
        self.path = path
        if os.path.isdir(path):
            raise FormatError(a_folder(path))
        if not os.path.exists(path):
            raise FormatError(f"{path} is a symbolic link to nothing (or a loop of links); "
                              f"point it at a data file" if os.path.islink(path) else
                              f"{path} does not exist; make it with `python -m mpitrain "
                              f"convert ...`")
        try:
            self.file = h5py.File(path, "r")
        except OSError as e:
            raise FormatError(f"{path}: {UNOPENED.get(e.errno, UNOPENED[None]).format(e=e)}") \
                from None
        try:
            if check:
                check_schema(self.file, path, num_classes)
            f = self.file
            self.storage = _plain(f.attrs["storage"])
            self.labels = f["labels"][:].astype(np.int64)
            self.class_names = [s.decode() if isinstance(s, bytes) else s
                                for s in f["class_names"][:]]
            self.mean = f["mean"][:].astype(np.float64)
            self.std = f["std"][:].astype(np.float64)
            if self.storage == "encoded":
                self.offsets = f["offsets"][:]
                self.images = f["images"]
                self.image_shape = None
            else:
                self.images = f["pixels"]
                self.image_shape = self.images.shape[1:]
            self.image_size = tuple(int(v) for v in f.attrs["image_size"]) \
                if "image_size" in f.attrs else self.image_shape and self.image_shape[:2]
        except BaseException as e:
            self.file.close()
            if isinstance(e, (TypeError, ValueError, AttributeError, KeyError)) \
                    and not isinstance(e, FormatError):   # a part of another kind than convert's
                raise FormatError(f"{path}: damaged ({type(e).__name__}: {e}); convert the "
                                  f"data again") from None
            raise

    def __len__(self):
        return len(self.labels)

    def record(self, i):
        if self.storage == "encoded":
            return self.images[self.offsets[i]:self.offsets[i + 1]]
        return self.images[i]

    def close(self):
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def white_level(reader):
    """The stored value of full intensity of a data file: 255 for 8-bit images, the
    largest pixel value of a 16-bit pixel file (read in slices of 1,024 records): the
    format records no white level, and the digits use 1,024 of 65,535."""
    if reader.storage != "pixels" or reader.images.dtype == np.uint8:
        return 255.0
    n = len(reader.labels)
    white = max((int(reader.images[i:i + 1024].max()) for i in range(0, n, 1024)), default=0)
    if white == 0:
        raise FormatError(f"{reader.path}: its 16-bit images are all black (no pixel above 0), "
                          f"so they have no white level to scale images by; convert the "
                          f"data again")
    return float(white)
