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

The resize is bilinear with Pillow's antialiasing (what torchvision does on
PIL images). A JPEG is decoded with Pillow's draft mode at 1/2, 1/4 or 1/8
scale when the box still covers at least size x size pixels at that scale,
so the decoder never produces pixels the resize would throw away.
"""
import io
import math

import numba
import numpy as np
from PIL import Image

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
    size x size passes through untouched).
    """

    def __init__(self, size, mean, std, train=True, scale=SCALE, ratio=RATIO,
                 crop_fraction=0.875, flip=True):
        self.size = size
        self.train = train
        self.scale, self.ratio = scale, ratio
        self.crop_fraction = crop_fraction
        self.flip = flip
        self.mean = np.asarray(mean, np.float64)
        self.inv_std = 1 / np.asarray(std, np.float64)

    def box(self, width, height, rng):
        if self.train:
            return random_resized_crop_box(width, height, rng, self.scale, self.ratio)
        return center_crop_box(width, height, self.crop_fraction)

    def __call__(self, record, out, rng=None):
        """record: uint8 bytes of a JPEG/PNG (1-D array or bytes) or an (H, W, 3)
        pixel array; out: (size, size, 3) C-contiguous float view to fill. rng: a
        NumPy Generator (training only)."""
        flip = self.train and self.flip and rng.random() < 0.5
        if isinstance(record, np.ndarray) and record.ndim == 3:
            image = self.crop_pixels(record, rng)
            if flip:
                image = np.ascontiguousarray(image[:, ::-1])
        else:
            im = self.crop_encoded(record, rng)
            image = np.asarray(im.transpose(Image.FLIP_LEFT_RIGHT) if flip else im)
        normalise(image, self.mean, self.inv_std, out)

    def crop_encoded(self, data, rng):
        """Decode (at reduced scale when the box allows), crop and resize: an RGB
        PIL image of size x size."""
        im = Image.open(io.BytesIO(data))
        width, height = im.size
        x0, y0, w, h = self.box(width, height, rng)
        s = draft_factor(w, h, self.size)
        if s > 1 and im.format == "JPEG" and im.draft("RGB", (width // s, height // s)):
            x0, y0, w, h = x0 / s, y0 / s, w / s, h / s
        if im.mode != "RGB":
            im = im.convert("RGB")
        return im.resize((self.size, self.size), Image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))

    def crop_pixels(self, pixels, rng):
        """Crop and resize stored pixels (any integer dtype) channel by channel in
        float32: (size, size, 3). A box that is the whole image at the output size
        is the identity, taken exactly."""
        height, width = pixels.shape[:2]
        x0, y0, w, h = self.box(width, height, rng)
        if (x0, y0, w, h) == (0, 0, width, height) and width == height == self.size:
            return pixels
        planes = [np.asarray(Image.fromarray(pixels[..., c].astype(np.float32))
                             .resize((self.size, self.size), Image.BILINEAR,
                                     box=(x0, y0, x0 + w, y0 + h)))
                  for c in range(3)]
        return np.stack(planes, axis=2)


def normalise(image, mean, inv_std, out):
    """out = (image - mean) * inv_std for a C-contiguous (H, W, 3) image and out.

    Computed in float64 for a float64 out, otherwise in float32 and stored in
    out's dtype (float16 under mixed precision). Both are viewed as (H, W*3)
    rows against mean and inv_std tiled along a row; float32 and float64 take
    one fused pass (a Numba loop, ten times NumPy's subtract-then-multiply,
    which casts through buffers).
    """
    if not out.flags.c_contiguous:
        raise ValueError("normalise writes through a reshaped view: out must be C-contiguous")
    h, w = image.shape[:2]
    work = np.float64 if out.dtype == np.float64 else np.float32
    rows = image.reshape(h, w * 3)
    m = np.tile(mean.astype(work), w)
    s = np.tile(inv_std.astype(work), w)
    if out.dtype == work:
        _normalise_rows(rows, m, s, out.reshape(h, w * 3))
    else:
        out.reshape(h, w * 3)[...] = (rows - m) * s


@numba.njit(nogil=True, cache=True)
def _normalise_rows(src, mean, inv_std, dst):
    """dst[i, j] = (src[i, j] - mean[j]) * inv_std[j]."""
    for i in range(src.shape[0]):
        for j in range(src.shape[1]):
            dst[i, j] = (src[i, j] - mean[j]) * inv_std[j]
