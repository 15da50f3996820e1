"""How the optimizer kernels walk the arena: pieces, chunks, and which implementation runs.

The arena's segment table (offset, size, decay, lars per parameter) says where
each parameter lies in the flat buffers. Parameters start on aligned offsets
(mpitrain.arena.ALIGN), so there may be a gap of padding (..) after each one:
elements of no parameter, which no kernel reads into a norm or writes. The
kernels cut the arena at every segment boundary and at every multiple of
`chunk` elements, and keep only the pieces inside a segment:

    arena   |--- seg 0 ---|..|------------ seg 1 ------------|..|- seg 2 -|
    chunks  |----- chunk 0 -----|----- chunk 1 -----|--- chunk 2 ---------|
    pieces  |  p0         |  |p1|  p2               | p3     |  |  p4     |

A piece lies inside one parameter (one set of per-parameter constants: step
size, decay) and inside one chunk. The CPU kernels give whole chunks to the
threads: every chunk is the same range of the arena (the last one shorter), so
both cores get about the same work even when one parameter is huge and the rest
are tiny (a chunk with padding in it holds a few parameter elements fewer).
The CUDA kernels run one thread block per piece (chunk = a few thousand
elements). Per-parameter sums (norms) are first taken per piece and then added
per segment in piece order, so the result does not depend on how many threads
ran: every rank computes bit-identical norms.

Implementations: every kernel has three with one signature, picked by `pick`:
"numpy" (the reference, whose docstring states the formula), "numba" (CPU,
`njit(parallel=True)`), "cuda" (`cuda.jit`, for CuPy arrays; also runs under
the numba-cuda simulator with NUMBA_ENABLE_CUDASIM=1 on NumPy arrays).

Launching (`launch`). A CUDA kernel on CuPy arrays runs on CuPy's current
stream (the compute stream: the layers' and cuDNN's work is queued there), not
on Numba's default stream. Numba imports a CuPy array through
`__cuda_array_interface__`, whose v3 "stream" entry (CuPy exports its current
stream) Numba synchronises with the host before the launch, once per array
argument, unless told not to; `launch` wraps each CuPy array with
`cuda.as_cuda_array(a, sync=False)`, which is safe because the kernel is
queued on that very stream, after the work that wrote the array. On NumPy
arrays (the simulator, or host arrays copied by Numba) it is Numba's ordinary launch.
"""
import importlib
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from mpitrain.arena import SEGMENT_DTYPE
from mpitrain.backend import array_module

IMPLEMENTATIONS = ("numpy", "numba", "cuda")

CPU_CHUNK = 1 << 16        # elements per CPU work unit: 256 KiB of fp32, hundreds per ResNet-50
LANES = 64                 # independent partial sums in the CPU reductions (see update.py)
CUDA_MAX_THREADS = 256     # size of the shared-memory reduction buffers


def pick(impl, array):
    """The implementation to run on `array`: `impl` if given, else "cuda" for a CuPy
    array and "numba" for a NumPy one."""
    on_gpu = array_module(array) is not np
    if impl is None:
        return "cuda" if on_gpu else "numba"
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown kernel implementation {impl!r}; choose one of "
                         f"{', '.join(IMPLEMENTATIONS)}")
    if impl == "numba" and on_gpu:
        raise ValueError("the numba CPU kernels need NumPy arrays; use impl='cuda' for CuPy arrays")
    return impl


def launch(kernel, blocks, threads, *args):
    """kernel[blocks, threads](*args), on CuPy's current stream when any argument is a
    CuPy array, each such array handed to Numba without a host synchronisation (see the
    module docstring). Returns nothing: the kernel's results are in its arrays."""
    if not any(_on_device(a) for a in args):
        kernel[blocks, threads](*args)
        return
    from numba import cuda
    args = tuple(cuda.as_cuda_array(a, sync=False) if _on_device(a) else a for a in args)
    kernel[blocks, threads, _current_stream()](*args)


def _on_device(a):
    return type(a).__module__.startswith("cupy")


_numba_streams = {}     # CuPy stream pointer -> the Numba stream object that wraps it


def _current_stream():
    """CuPy's current stream as a Numba stream (0, the legacy default stream, for CuPy's
    null stream). Numba's wrapper only holds the handle, so it is made once per pointer."""
    import cupy
    ptr = cupy.cuda.get_current_stream().ptr
    if ptr == 0:
        return 0
    if ptr not in _numba_streams:
        from numba import cuda
        _numba_streams[ptr] = cuda.external_stream(ptr)
    return _numba_streams[ptr]


def cuda_shape():
    """(threads per block, elements per piece) for the CUDA kernels.

    The simulator runs every GPU thread as a Python thread, so it gets small
    blocks and small pieces (which also makes small test arenas span several
    pieces per parameter)."""
    from numba import config
    return (32, 128) if config.ENABLE_CUDASIM else (CUDA_MAX_THREADS, 16 * CUDA_MAX_THREADS)


class Layout(NamedTuple):
    """The pieces of an arena (see the module docstring); all int64 unless noted."""
    piece_seg: np.ndarray      # (pieces,) segment of each piece
    piece_start: np.ndarray    # (pieces,) first element
    piece_stop: np.ndarray     # (pieces,) one past the last element
    seg_first: np.ndarray      # (segments + 1,) pieces of segment s: seg_first[s]:seg_first[s+1]
    chunk_first: np.ndarray    # (chunks + 1,) pieces of chunk c: chunk_first[c]:chunk_first[c+1]
    decay: np.ndarray          # (segments,) bool: weight decay applies
    lars: np.ndarray           # (segments,) bool: the trust ratio applies

    @property
    def num_segments(self):
        return self.decay.size


def layout(segments, chunk=None):
    """The Layout of a segment table (a structured array with offset, size, decay, lars),
    cut into chunks of `chunk` elements (default CPU_CHUNK); cached per table.

    Segments must be in arena order and must not overlap (each offset >= the previous
    segment's end); the gaps between them are padding and get no piece."""
    return _layout(_key(segments), int(chunk or CPU_CHUNK))


def device_layout(segments, chunk, xp):
    """`layout(segments, chunk)` with every array moved to the array module xp (cached)."""
    return _device_layout(_key(segments), int(chunk), xp.__name__)


def _key(segments):
    """The table as bytes of mpitrain.arena.SEGMENT_DTYPE: hashable, for the caches."""
    return np.asarray(segments).astype(SEGMENT_DTYPE).tobytes()


@lru_cache(maxsize=16)
def _layout(table_bytes, chunk):
    seg = np.frombuffer(table_bytes, dtype=SEGMENT_DTYPE)
    n = seg.size
    offset = seg["offset"].astype(np.int64)
    size = seg["size"].astype(np.int64)
    end = offset + size
    _check_order(offset, size, end)
    total = int(end[-1]) if n else 0
    chunk_starts = np.arange(0, total, chunk, dtype=np.int64)
    cuts = np.unique(np.concatenate([offset, end, chunk_starts, [total]]))
    piece_start, piece_stop = cuts[:-1], cuts[1:]
    # the segment holding a piece is the first whose end lies beyond the piece's start
    # (ends are sorted; empty segments end where they start, so they hold no piece); a
    # piece that starts before that segment's offset is padding, and is dropped
    piece_seg = np.searchsorted(end, piece_start, side="right").astype(np.int64)
    inside = offset[piece_seg] <= piece_start
    piece_seg, piece_start, piece_stop = piece_seg[inside], piece_start[inside], piece_stop[inside]
    seg_first = np.append(np.searchsorted(piece_start, offset), piece_start.size).astype(np.int64)
    chunk_first = np.append(np.searchsorted(piece_start, chunk_starts),
                            piece_start.size).astype(np.int64)
    out = Layout(piece_seg, piece_start, piece_stop, seg_first, chunk_first,
                 seg["decay"].astype(np.bool_), seg["lars"].astype(np.bool_))
    for a in out:
        a.flags.writeable = False      # shared by every caller through the cache
    return out


def _check_order(offset, size, end):
    """ValueError unless the segments lie in order, without overlap, inside the arena."""
    bad = np.flatnonzero((offset < 0) | (size < 0))
    if bad.size:
        s = bad[0]
        raise ValueError(f"segment {s} has a negative offset or size "
                         f"(offset {offset[s]}, size {size[s]})")
    bad = np.flatnonzero(offset[1:] < end[:-1])
    if bad.size:
        s = bad[0] + 1
        raise ValueError(f"segment {s} (offset {offset[s]}) starts before the end of segment "
                         f"{s - 1} ({end[s - 1]}): segments must be in arena order and must "
                         f"not overlap")


@lru_cache(maxsize=16)
def _device_layout(table_bytes, chunk, xp_name):
    xp = importlib.import_module(xp_name)
    return Layout(*(xp.asarray(np.array(a)) for a in _layout(table_bytes, chunk)))


def as_dtype(array, *values):
    """Python scalars as NumPy scalars of array's dtype, so the kernels compute in that dtype."""
    t = array.dtype.type
    return tuple(t(v) for v in values)
