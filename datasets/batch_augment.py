"""A batch of images decoded together (on the GPU by nvImageCodec), then cropped, resized,
flipped and normalised by one kernel into the step's (N, S, S, 3) input.

The transform is augment.py's, image by image: the same random draws from the same
generator (Augment.draw: the flip, then the box), the same antialiased bilinear taps
(augment.filter_taps), the same normalisation. With the taps of image n,

    out[n, i, j', c] = (sum_a sum_b wy[n, i, a] wx[n, j, b] p_n[yf[n, i] + a, xf[n, j] + b, c]
                        - mean[c]) * inv_std[c],        j' = S - 1 - j where image n is flipped

summed in fp32 and stored in out's dtype. Only the pixels differ from the CPU
loader's: it decodes a large JPEG at 1/2, 1/4 or 1/8 scale where the box allows and,
in training, with libjpeg-turbo's fast IDCT, where here every image is decoded whole
and exactly. The decoded images of a batch are laid end to end in one uint8 buffer
(`offset` of each), so one kernel reads them all.

One scalar body (`crop_pixel`), compiled for the CPU (`_crop_cpu`, the reference the
tests hold the CUDA kernel to) and for CUDA (`_crop_cuda`, a thread per output pixel).
"""
import math

import numpy as np
from numba import cuda, njit, prange
from numba.extending import register_jitable

from mpitrain.backend import array_module
from mpitrain.kernels.segments import cuda_shape, launch

from .augment import Augment, decode, filter_taps


@register_jitable
def crop_pixel(pixels, offset, width, yf, yc, yw, xf, xc, xw, n, i, j, c):
    """sum_a sum_b yw[n, i, a] xw[n, j, b] pixels[offset + ((yf[n, i] + a) * width + xf[n, j]
    + b) * 3 + c]: channel c of output pixel (i, j) of image n, before normalisation."""
    total = np.float32(0.0)
    for a in range(yc[n, i]):
        base = offset + ((yf[n, i] + a) * width + xf[n, j]) * 3 + c
        row = np.float32(0.0)
        for b in range(xc[n, j]):
            row += xw[n, j, b] * np.float32(pixels[base + b * 3])
        total += yw[n, i, a] * row
    return total


@njit(parallel=True, cache=True)
def _crop_cpu(pixels, offsets, widths, yf, yc, yw, xf, xc, xw, flips, mean, inv_std, out):
    """out (N, S, S, 3) float32: every output pixel (see the module docstring)."""
    N, S = out.shape[0], out.shape[1]
    for t in prange(N * S):
        n, i = t // S, t % S
        for j in range(S):
            jo = S - 1 - j if flips[n] else j
            for c in range(3):
                value = crop_pixel(pixels, offsets[n], widths[n], yf, yc, yw, xf, xc, xw,
                                   n, i, j, c)
                out[n, i, jo, c] = (value - mean[c]) * inv_std[c]


@cuda.jit
def _crop_cuda(pixels, offsets, widths, yf, yc, yw, xf, xc, xw, flips, mean, inv_std, out):
    """A thread per output pixel (n, i, j), its three channels (grid-stride loop)."""
    N, S = out.shape[0], out.shape[1]
    for t in range(cuda.grid(1), N * S * S, cuda.gridsize(1)):
        n, rest = t // (S * S), t % (S * S)
        i, j = rest // S, rest % S
        jo = S - 1 - j if flips[n] else j
        for c in range(3):
            value = crop_pixel(pixels, offsets[n], widths[n], yf, yc, yw, xf, xc, xw, n, i, j, c)
            out[n, i, jo, c] = (value - mean[c]) * inv_std[c]


def taps(boxes, sizes, S):
    """Each image's filter taps (filter_taps) along y and x, padded to one width:
    ((yf, yc, yw), (xf, xc, xw)), yf and yc (N, S) int32, yw (N, S, K) float32."""
    out = []
    for axis in (1, 0):                     # y: the box's top and height; x: left and width
        per_image = [filter_taps(float(box[axis]), float(box[axis] + box[axis + 2]),
                                 size[axis], S) for box, size in zip(boxes, sizes)]
        K = max(w.shape[1] for _, _, w in per_image)
        first = np.stack([f for f, _, _ in per_image]).astype(np.int32)
        count = np.stack([c for _, c, _ in per_image]).astype(np.int32)
        weights = np.zeros((len(per_image), S, K), np.float32)
        for n, (_, _, w) in enumerate(per_image):
            weights[n, :, :w.shape[1]] = w
        out.append((first, count, weights))
    return out


class BatchAugment:
    """Augment's transform (the same options, draws and taps) over a batch of records
    decoded together: on the GPU by nvImageCodec when `out` is a CuPy array, else on the
    host by augment.decode (whole and exact), which is the reference."""

    def __init__(self, augment: Augment):
        self.augment = augment
        self._decoder = self._params = None     # nvImageCodec's, made on first use
        self.host_decoded = 0       # records the GPU's decode left to the host's

    def __call__(self, records, rngs, out, images=None):
        """Write the records (encoded bytes, each with its generator in `rngs`; training
        draws from it as Augment does) into out (N, S, S, 3), float32 or (on a GPU)
        float16. images: the records' pixels as `decode` gives them, where the caller has
        decoded them already. Returns out."""
        xp = array_module(out)
        if images is None:
            images = self.decode(records, xp)
        bad = [i for i, im in enumerate(images) if im is None]
        if bad:
            raise ValueError(f"records at batch positions {bad} do not decode")
        args = self.arguments(images, rngs, out.shape[1], xp)
        if xp is np:
            _crop_cpu(*args, out)
        else:
            threads, _ = cuda_shape()
            launch(_crop_cuda, min(-(-out.size // 3 // threads), 65535), threads, *args, out)
        return out

    def arguments(self, images, rngs, S, xp):
        """The kernels' arguments but `out`, in xp's memory: the decoded pixels end to end
        and each image's offset, width, taps and flip, and the normalisation. An image's
        size is that of its pixels, which is its header's (decode keeps the stored
        orientation)."""
        a = self.augment
        sizes, boxes, flips = [], [], []
        for image, rng in zip(images, rngs):
            height, width = image.shape[:2]
            flip, box = a.draw(width, height, rng)
            sizes.append((width, height))
            boxes.append(box)
            flips.append(flip)
        offsets = np.cumsum([0] + [im.size for im in images[:-1]]).astype(np.int64)
        (yf, yc, yw), (xf, xc, xw) = taps(boxes, sizes, S)
        pixels = xp.concatenate([im.reshape(-1) for im in images])
        return [pixels] + [xp.asarray(v) for v in (
            offsets, np.array([w for w, _ in sizes], np.int64), yf, yc, yw, xf, xc, xw,
            np.array(flips, np.uint8), a.mean.astype(np.float32), a.inv_std.astype(np.float32))]

    def decode(self, records, xp):
        """(H, W, 3) uint8 pixels of each record in xp's memory, None for one that does not
        decode. On the GPU, nvImageCodec decodes the batch's JPEGs together (on the current
        stream, which then orders the crop kernel after it and frees the decoded buffers
        after that); a record it does not take (a PNG, which `convert` keeps as it is, a CMYK
        JPEG, or one nvJPEG refuses) is decoded on the host as the CPU loader decodes it, and
        copied over. Neither decoder turns an image by its EXIF orientation, as the CPU
        loader does not."""
        images = [None] * len(records) if xp is np else self._decode_on_gpu(records)
        if xp is not np:
            self.host_decoded += images.count(None)
        return [image if image is not None else _on(xp, _decode_or_none(r, self.augment.turbo))
                for image, r in zip(images, records)]

    def _decode_on_gpu(self, records):
        """nvImageCodec's (H, W, 3) pixels of each grey or colour JPEG record, None for
        every other record and for a JPEG it does not decode into three channels. Each
        record is parsed alone, so that one bad header leaves the rest of the batch to the
        GPU."""
        import cupy
        from nvidia import nvimgcodec
        if self._decoder is None:
            self._decoder = gpu_decoder()
            self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False)
        streams = [_code_stream(nvimgcodec, r) for r in records]
        taken = [i for i, s in enumerate(streams) if s is not None]
        images = [None] * len(records)
        if taken:
            decoded = self._decoder.decode([streams[i] for i in taken], params=self._params,
                                           cuda_stream=cupy.cuda.get_current_stream().ptr)
            for i, image in zip(taken, decoded):
                pixels = None if image is None else _device_pixels(cupy, image)
                if pixels is not None and pixels.shape[2:] == (3,) and pixels.dtype == np.uint8:
                    images[i] = pixels
        return images


def _device_pixels(cupy, image):
    """An nvImageCodec image's pixels as a CuPy array that keeps the image alive.
    cupy.asarray would wait on the host for the stream the image was decoded on (the
    stream its __cuda_array_interface__ names); the crop kernel runs on that same stream,
    after the decode, so nothing needs to wait."""
    face = image.__cuda_array_interface__
    shape, dtype, strides = tuple(face["shape"]), np.dtype(face["typestr"]), face.get("strides")
    extent = (dtype.itemsize * math.prod(shape) if strides is None else     # bytes
              dtype.itemsize + sum((n - 1) * s for n, s in zip(shape, strides)))
    memory = cupy.cuda.UnownedMemory(face["data"][0], extent, image)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides=strides)


# nvImageCodec's backends that decode on the GPU (nvJPEG's: on the GPU alone, with the
# Huffman decoding on the host, on the GPU's JPEG engine); never its CPU decoders
GPU_BACKENDS = ("GPU_ONLY", "HYBRID_CPU_GPU", "HW_GPU_ONLY")
# the records given to them: (codec, channels in the header)
GPU_JPEGS = (("jpeg", 1), ("jpeg", 3))


def gpu_decoder():
    """An nvImageCodec decoder on the current GPU, with GPU_BACKENDS only and one host
    thread: each loader worker has its own, so --workers is the number of host threads
    that decode, as on the CPU (the library's default, a thread per core for every
    decoder, would start workers x cores)."""
    from nvidia import nvimgcodec
    return nvimgcodec.Decoder(max_num_cpu_threads=1, backends=[
        nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, k)) for k in GPU_BACKENDS])


def gpu_decoder_problem():
    """None when nvImageCodec decodes a JPEG on the current GPU, else what is missing."""
    try:
        from nvidia import nvimgcodec
    except ImportError:
        return ("--decode gpu needs nvImageCodec: pip install 'nvidia-nvimgcodec-cu13[nvjpeg]' "
                "(or -cu12), or the gpu-cu13 extra")
    import io

    from PIL import Image
    probe = io.BytesIO()
    Image.new("RGB", (16, 16), (128, 128, 128)).save(probe, "JPEG")
    try:
        image = gpu_decoder().decode([nvimgcodec.CodeStream(probe.getvalue())])[0]
    except Exception as e:      # the library's own failure, named
        return f"--decode gpu: nvImageCodec fails on this GPU ({type(e).__name__}: {e})"
    if image is None:
        return ("--decode gpu: nvImageCodec decodes no JPEG on this GPU, so nvJPEG is missing: "
                "pip install nvidia-nvjpeg (CUDA 13) or nvidia-nvjpeg-cu12 (CUDA 12)")
    return None


def _code_stream(nvimgcodec, record):
    """nvImageCodec's parsed header of a grey or colour JPEG record; None for another
    format, a CMYK JPEG (whose conversion to RGB is the host's), or a header it cannot
    parse. The header is parsed when first asked for, so it is asked for here: a bad one
    would otherwise fail the whole batch's decode."""
    try:
        stream = nvimgcodec.CodeStream(record)      # bytes, or the reader's uint8 array
        return stream if (stream.codec_name, stream.num_channels) in GPU_JPEGS else None
    except Exception:           # the library's refusal of the header
        return None


def _on(xp, pixels):
    return None if pixels is None else xp.asarray(pixels)


def _decode_or_none(record, turbo):
    try:
        return decode(record, turbo=turbo)
    except Exception:           # any failure of the decoders: the record is bad
        return None
