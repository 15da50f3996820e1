"""Decoding and augmentation of one image, written into a batch slot.

Every transform is "take a box of the source image, resize it to size x size":

    training    random-resized-crop (torchvision's RandomResizedCrop): a box of
                area fraction a ~ U(scale) and aspect r with log r ~ U(log ratio),
                at a uniform position; then a horizontal flip with probability 1/2
    validation  resize the short side to size / crop_fraction and take the
                centre size x size, which is the centred square of side
                crop_fraction * short side of the source, resized to size

    normalise   out[h, w, c] = (pixel[h, w, c] - mean[c]) / std[c], in the output
                dtype (mean, std in stored pixel units, as the file holds them)

The resize is bilinear with Pillow's antialiasing (the filter of torchvision's resize
of PIL images, over the box inside the image rather than a crop), done by one Numba
kernel that also flips and normalises, so a decoded image is read once and the batch
slot written once.

JPEGs are decoded by libjpeg-turbo through simplejpeg when it is installed,
Pillow otherwise (and for PNG and the JPEGs simplejpeg cannot turn into RGB).
Either way a JPEG is decoded at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling,
Pillow's draft mode) when the box still covers at least size x size pixels at
that scale, so the decoder never produces pixels the resize would throw away.
(libjpeg-turbo also scales by 3/8, 5/8, 6/8 and 7/8, through IDCTs without SIMD, which
save nothing over the scales above or the full size; not used.)
With libjpeg-turbo, a sequential JPEG is decoded only down to the MCU row that
holds the last row the resize reads (the exact decode one MCU row further, for its
chroma upsampling): the height in its frame header is lowered, and the decoder
stops there; the rows it gives are those of the full decode, bit for bit.
simplejpeg decodes into a buffer of each worker thread, which the resize reads.
Training decodes with libjpeg-turbo's fast integer IDCT and plain chroma
upsampling: a few grey levels from the exact decode on average, and faster (the
measurements: docs/benchmarks-record.md, "Data pipeline").
"""
import io
import math
import re
import threading

import numba
import numpy as np
from PIL import Image

try:
    import simplejpeg
except ImportError:             # Pillow decodes everything, a little slower
    simplejpeg = None

RATIO = (3 / 4, 4 / 3)
SCALE = (0.08, 1.0)


def random_resized_crop_box(width, height, rng, scale=SCALE, ratio=RATIO):
    """(x0, y0, w, h) of a random crop, as torchvision's RandomResizedCrop.get_params:
    ten tries at a box that fits, then the largest centred box within the ratio range."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            x0 = int(rng.integers(0, width - w + 1))
            y0 = int(rng.integers(0, height - h + 1))
            return x0, y0, w, h
    if width / height < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif width / height > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def center_crop_box(width, height, crop_fraction):
    """(x0, y0, w, h): the centred square of side crop_fraction * min(width, height)."""
    side = crop_fraction * min(width, height)
    return (width - side) / 2, (height - side) / 2, side, side


def draft_factor(w, h, size):
    """The largest JPEG decode reduction s in (8, 4, 2, 1) that keeps a w x h box
    at least size x size pixels."""
    for s in (8, 4, 2):
        if w >= s * size and h >= s * size:
            return s
    return 1


class Augment:
    """Turns a record (encoded bytes or a pixel array) into one normalised
    (size, size, 3) image written into `out`.

    train: random-resized-crop with `scale` and `ratio`, then a flip with
    probability 1/2 when `flip`; otherwise the validation transform with
    `crop_fraction` (1.0 keeps the whole short side: an image already of
    size x size passes through untouched). turbo: decode JPEGs with simplejpeg
    when it is installed.
    """

    def __init__(self, size, mean, std, train=True, scale=SCALE, ratio=RATIO,
                 crop_fraction=0.875, flip=True, turbo=True):
        self.size = size
        self.turbo = turbo and simplejpeg is not None
        self.train = train
        self.scale, self.ratio = scale, ratio
        self.crop_fraction = crop_fraction
        self.flip = flip
        self.mean = np.asarray(mean, np.float64)
        self.inv_std = 1 / np.asarray(std, np.float64)
        self._scratch = threading.local()      # each worker thread's decode and work buffers

    def _buffer(self, name, shape, dtype):
        """This thread's array `name` of at least prod(shape) elements, as `shape`."""
        n = math.prod(shape)
        buffer = getattr(self._scratch, name, None)
        if buffer is None or buffer.size < n or buffer.dtype != dtype:
            buffer = np.empty(n, dtype)
            setattr(self._scratch, name, buffer)
        return buffer[:n].reshape(shape)

    def box(self, width, height, rng):
        if self.train:
            return random_resized_crop_box(width, height, rng, self.scale, self.ratio)
        return center_crop_box(width, height, self.crop_fraction)

    def draw(self, width, height, rng):
        """(flip, (x0, y0, w, h)) of a width x height image: the random draws from rng,
        in their order (batch_augment.py draws the same)."""
        flip = self.train and self.flip and rng.random() < 0.5
        return flip, self.box(width, height, rng)

    def __call__(self, record, out, rng=None):
        """record: uint8 bytes of a JPEG/PNG (1-D array or bytes) or an (H, W, 3)
        pixel array of any integer dtype; out: (size, size, 3) float view to fill.
        rng: a NumPy Generator (training only)."""
        encoded = not (isinstance(record, np.ndarray) and record.ndim == 3)
        width, height = image_size(record, self.turbo) if encoded else record.shape[1::-1]
        flip, (x0, y0, w, h) = self.draw(width, height, rng)
        pixels = record
        if encoded:
            reduce = draft_factor(w, h, self.size)
            # the last source row the resize reads: the box's bottom plus the filter's
            # support (the larger of the scale and one decoded pixel) and rounding
            rows = y0 + h + reduce * (max(h / (reduce * self.size), 1.0) + 2)
            shape = (-(-height // reduce), -(-width // reduce), 3)
            pixels = decode(record, reduce, fast=self.train, turbo=self.turbo,
                            rows=math.ceil(rows), buffer=self._buffer("pixels", shape, np.uint8))
            # a JPEG decoded at 1/s of its size (s = 1, 2, 4 or 8, the sides rounded up):
            # source coordinate x is decoded coordinate x / s, as libjpeg's scaled IDCT
            # samples it (the last column and row cover less than s source pixels)
            s = 2 ** round(math.log2(width / pixels.shape[1]))
            x0, y0, w, h = x0 / s, y0 / s, w / s, h / s
        work = out if out.dtype in (np.float32, np.float64) else \
            self._buffer("work", out.shape, np.float32)
        resize_normalise(pixels, (x0, y0, x0 + w, y0 + h), flip, self.mean.astype(work.dtype),
                         self.inv_std.astype(work.dtype), work)
        if work is not out:
            out[...] = work


def image_size(data, turbo=True):
    """(width, height) of an encoded image, from its header."""
    if turbo and simplejpeg is not None and _is_jpeg(data):
        try:
            height, width = simplejpeg.decode_jpeg_header(data)[:2]
            return width, height
        except ValueError:
            pass                    # Pillow reads it, or names what is wrong
    return Image.open(io.BytesIO(data)).size


def decode(data, reduce=1, fast=False, turbo=True, rows=None, buffer=None):
    """(H, W, 3) uint8 RGB pixels of an encoded image; a JPEG at 1/reduce of its
    size (reduce in 1, 2, 4, 8; H and W rounded up). fast: libjpeg-turbo's fast
    IDCT and upsampling (simplejpeg only; Pillow always decodes exactly).

    With simplejpeg: rows, when given, is how many top rows (at full size) the
    caller reads: a sequential JPEG is decoded down to a little below them and
    the rows under that are left as `buffer` had them. buffer: a (H, W, 3) uint8
    array of that shape to decode into (the result is then a view of it)."""
    if turbo and simplejpeg is not None and _is_jpeg(data):
        try:
            return _decode_turbo(data, reduce, fast, rows, buffer)
        except ValueError:
            pass                    # Pillow reads it, or names what is wrong
    im = Image.open(io.BytesIO(data))
    if reduce > 1 and im.format in ("JPEG", "MPO"):     # MPO: a JPEG, more frames after
        im.draft("RGB", (im.width // reduce, im.height // reduce))
    return np.asarray(to_rgb(im))


# Pillow's modes of 16-bit grey images (a 16-bit PNG is "I;16"; "I" holds 32-bit integers)
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def to_rgb(im):
    """A Pillow image in RGB. A 16-bit grey one is first scaled to 8 bits,
        p8 = (p16 * 255 + 32767) // 65535     (p16 clipped to [0, 65535]),
    where Pillow's convert("RGB") would clip it at 255 (nearly every pixel white); any
    other mode is Pillow's to convert."""
    if im.mode in SIXTEEN_BIT_MODES:
        grey = np.clip(np.asarray(im, np.int64), 0, 65535)
        im = Image.fromarray(((grey * 255 + 32767) // 65535).astype(np.uint8), "L")
    return im if im.mode == "RGB" else im.convert("RGB")


# libjpeg's warning at the end of a JPEG decoded only down to a lowered height: the
# rest of the scan is skipped up to the end-of-image marker (any other warning is an error)
_SKIPPED_TO_EOI = re.compile(r"extraneous bytes before marker 0xd9")


def _decode_turbo(data, reduce, fast, rows, buffer):
    height, width, colorspace = simplejpeg.decode_jpeg_header(data)[:3]
    shape = (-(-height // reduce), -(-width // reduce), 3)
    if buffer is None or buffer.shape != shape:
        buffer = np.empty(shape, np.uint8)
    options = dict(fastdct=fast, fastupsample=fast, min_width=shape[1])
    frame = _sequential_frame(data) if rows is not None and colorspace in ("YCbCr", "Gray") \
        else None
    if frame is not None:
        at, mcu_rows = frame
        # down to the MCU row holding the last row asked for; the exact decode's fancy
        # upsampling reads the chroma row below it too: one MCU row more
        cut = min(height, (-(-rows // mcu_rows) + (0 if fast else 1)) * mcu_rows)
        if cut < height:
            lowered = bytearray(data)
            lowered[at:at + 2] = cut.to_bytes(2, "big")
            top = buffer[:-(-cut // reduce)]
            try:
                simplejpeg.decode_jpeg(lowered, min_height=top.shape[0], buffer=top, **options)
                return buffer
            except ValueError as e:
                if _SKIPPED_TO_EOI.search(str(e)):
                    return buffer
            # another warning (a second scan, damaged data): the whole image, strictly
    return simplejpeg.decode_jpeg(data, min_height=shape[0], buffer=buffer, **options)


def _sequential_frame(data):
    """(offset of the height field, MCU height in rows) of a baseline or extended
    sequential Huffman JPEG's frame header (SOF0, SOF1), or None for any other frame."""
    data = memoryview(data).cast("B")               # Python ints, from bytes or an array
    at = 2
    while at + 4 <= len(data):
        marker, length = data[at + 1], data[at + 2] << 8 | data[at + 3]
        if data[at] != 0xFF or marker == 0xDA:       # not a marker, or the scan: no SOF0/1
            return None
        if marker in (0xC0, 0xC1):
            components = data[at + 9] if at + 10 <= len(data) else 0
            if components == 0 or at + 10 + 3 * components > len(data):
                return None
            vertical = max(data[at + 11 + 3 * c] & 0x0F for c in range(components))
            return at + 5, 8 * vertical
        if 0xC2 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return None                              # progressive, lossless, arithmetic
        at += 2 + length
    return None


def _is_jpeg(data):
    return bytes(data[:2]) == b"\xff\xd8"


def resize_normalise(pixels, box, flip, mean, inv_std, out):
    """out[i, j] = (resized[i, j'] - mean) * inv_std, j' = W-1-j when flip, where
    `resized` is the box (x0, y0, x1, y1) of pixels (H, W, 3) resized to out's
    (h, w) by Pillow's antialiased bilinear filter (see filter_taps). out and
    the arithmetic are float32 or float64."""
    x0, y0, x1, y1 = (float(v) for v in box)
    height, width = pixels.shape[:2]
    xs = filter_taps(x0, x1, width, out.shape[1])
    ys = filter_taps(y0, y1, height, out.shape[0])
    _resize_normalise(np.ascontiguousarray(pixels), *xs, *ys, flip, mean, inv_std, out)


@numba.njit(nogil=True, cache=True)
def filter_taps(in0, in1, in_size, out_size):
    """Pillow's bilinear resampling of [in0, in1) onto out_size pixels, as
    (first, count, weights): output pixel i is

        sum_k weights[i, k] * in[first[i] + k],  k < count[i]

    centred at c = in0 + (i + 1/2) * scale, scale = (in1 - in0) / out_size, with
    weights proportional to max(0, 1 - |first[i] + k + 1/2 - c| / support),
    support = max(scale, 1), summing to 1: on reduction the triangle widens
    with the scale, so the resize averages pixels rather than skipping them."""
    scale = (in1 - in0) / out_size
    support = max(scale, 1.0)
    first = np.empty(out_size, np.int64)
    count = np.empty(out_size, np.int64)
    weights = np.zeros((out_size, int(math.ceil(support)) * 2 + 1))
    for i in range(out_size):
        centre = in0 + (i + 0.5) * scale
        first[i] = max(int(centre - support + 0.5), 0)
        count[i] = min(int(centre + support + 0.5), in_size) - first[i]
        total = 0.0
        for k in range(count[i]):
            weights[i, k] = max(0.0, 1.0 - abs((first[i] + k + 0.5 - centre) / support))
            total += weights[i, k]
        if total > 0:      # element by element: a slice would compile a shape-error message
            for k in range(count[i]):
                weights[i, k] /= total
    return first, count, weights


@numba.njit(nogil=True, cache=True, fastmath=True)
def _axpy(y, a, x):
    """y += a * x."""
    for e in range(y.shape[0]):
        y[e] += a * x[e]


@numba.njit(nogil=True, cache=True, fastmath=True, inline="always")
def _resize_row(row, x_first, xw, taps, flip, mean, inv_std, out):
    """One output row from one row of the vertical pass:

        out[jo, c] = (sum_k xw[j, k] * row[(x_first[j] + k) * 3 + c] - mean[c]) * inv_std[c]

    for k < taps, jo = W-1-j when flip. row: (box columns + taps) * 3, x_first
    counted from the box's first column."""
    ow = out.shape[0]
    for j in range(ow):
        jo = ow - 1 - j if flip else j
        b = x_first[j] * 3
        r, g, bl = row.dtype.type(0), row.dtype.type(0), row.dtype.type(0)
        for k in range(taps):
            w = xw[j, k]
            r += w * row[b]
            g += w * row[b + 1]
            bl += w * row[b + 2]
            b += 3
        out[jo, 0] = (r - mean[0]) * inv_std[0]
        out[jo, 1] = (g - mean[1]) * inv_std[1]
        out[jo, 2] = (bl - mean[2]) * inv_std[2]


@numba.njit(nogil=True, cache=True, fastmath=True)
def _resize_normalise(pixels, x_first, x_count, x_weights, y_first, y_count, y_weights,
                      flip, mean, inv_std, out):
    """Row by row: the vertical pass as contiguous multiply-adds of source rows
    (over the box's columns), then the horizontal pass of that one row, normalised
    into the output row. Every output column sums the same number of taps (the
    largest count, the rest weighted 0), and that number is a constant at each
    call of _resize_row, so the compiler unrolls its inner sum."""
    height, width, C = pixels.shape
    oh, ow = out.shape[0], out.shape[1]
    xa, xb = x_first[0], x_first[ow - 1] + x_count[ow - 1]     # columns the box reads
    taps = 0
    for j in range(ow):
        taps = max(taps, x_count[j])
    first = np.empty(ow, np.int64)
    xw = np.zeros((ow, taps), out.dtype)                       # (ow, taps)
    for j in range(ow):
        first[j] = x_first[j] - xa
        for k in range(x_count[j]):
            xw[j, k] = x_weights[j, k]
    yw = y_weights.astype(out.dtype)
    rows = pixels.reshape(height, width * C)
    n = (xb - xa) * C
    row = np.zeros(n + taps * C, out.dtype)    # (box columns + taps) * C: padded taps read 0
    for i in range(oh):
        row[:n] = 0
        for k in range(y_count[i]):
            _axpy(row[:n], yw[i, k], rows[y_first[i] + k, xa * C:xb * C])
        if taps == 2:
            _resize_row(row, first, xw, 2, flip, mean, inv_std, out[i])
        elif taps == 3:
            _resize_row(row, first, xw, 3, flip, mean, inv_std, out[i])
        elif taps == 4:
            _resize_row(row, first, xw, 4, flip, mean, inv_std, out[i])
        else:
            _resize_row(row, first, xw, taps, flip, mean, inv_std, out[i])
