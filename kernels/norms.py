"""Per-parameter L2 norms of the master weights and of the gradient (LARS's inputs).

    w_norm[s] = sqrt( sum_{i in segment s} master_i^2 )
    g_norm[s] = sqrt( sum_{i in segment s} grad_i^2 )

accumulated in float64, one value per row of the segment table. Both norms
come from one pass that reads each element of master and grad once. The
gradient norm is of the buffer as given: under loss scaling the caller
multiplies it by inv_scale (norms are positively homogeneous).

Sums are taken per piece and then added per segment in piece order
(kernels/segments.py), so the CPU and CUDA results do not depend on the number
of threads. A non-finite gradient gives a non-finite g_norm for its segment.
"""
import math

import numpy as np
from numba import cuda, float64, njit, prange

from mpitrain.backend import array_module

from .segments import CUDA_MAX_THREADS, LANES, cuda_shape, device_layout, layout, pick


def segment_norms(master, grad, segments, impl=None):
    """(w_norm, g_norm): float64 arrays of one value per segment, in the arrays' module.

    impl: "numpy" | "numba" | "cuda", or None to choose by array type
    (kernels.segments.pick)."""
    return _IMPLS[pick(impl, master)](master, grad, segments)


def segment_norms_numpy(master, grad, segments):
    """Reference: w_norm[s] = sqrt(sum w_i^2), g_norm[s] = sqrt(sum g_i^2) over segment s,
    each element converted to float64 before squaring."""
    xp = array_module(master)
    w_norm = np.zeros(len(segments))
    g_norm = np.zeros(len(segments))
    for s, (offset, size) in enumerate(zip(segments["offset"], segments["size"])):
        w = master[offset:offset + size].astype(np.float64)
        g = grad[offset:offset + size].astype(np.float64)
        w_norm[s] = float(xp.sqrt(xp.dot(w, w)))
        g_norm[s] = float(xp.sqrt(xp.dot(g, g)))
    return xp.asarray(w_norm), xp.asarray(g_norm)


# ----- Numba CPU -----

@njit(cache=True)
def sum_squares(x, y):
    """(sum x_i^2, sum y_i^2) in float64 over two slices of equal length.

    Without fastmath, LLVM may not reorder a floating-point sum, so a single
    accumulator runs at one add per cycle-latency. LANES independent partial
    sums (lane k takes elements k, k + LANES, ...) are an order we chose, so the
    loop vectorises; the lanes are then added in order, then the tail."""
    lane_x = np.zeros(LANES)
    lane_y = np.zeros(LANES)
    blocks = x.size // LANES
    for b in range(blocks):
        xs = x[b * LANES:(b + 1) * LANES]
        ys = y[b * LANES:(b + 1) * LANES]
        for k in range(LANES):
            a = np.float64(xs[k])
            c = np.float64(ys[k])
            lane_x[k] += a * a
            lane_y[k] += c * c
    sx = lane_x.sum()
    sy = lane_y.sum()
    for i in range(blocks * LANES, x.size):
        a = np.float64(x[i])
        c = np.float64(y[i])
        sx += a * a
        sy += c * c
    return sx, sy


@njit(cache=True)
def pieces_to_segments(part_x, part_y, seg_first, out_x, out_y):
    """out[s] = sqrt(sum of the piece sums of segment s), pieces added in order."""
    for s in range(out_x.size):
        sx = 0.0
        sy = 0.0
        for p in range(seg_first[s], seg_first[s + 1]):
            sx += part_x[p]
            sy += part_y[p]
        out_x[s] = np.sqrt(sx)
        out_y[s] = np.sqrt(sy)


@njit(parallel=True, cache=True)
def _piece_sums_cpu(master, grad, piece_start, piece_stop, chunk_first, part_w, part_g):
    for c in prange(chunk_first.size - 1):
        for p in range(chunk_first[c], chunk_first[c + 1]):
            a = piece_start[p]
            b = piece_stop[p]
            part_w[p], part_g[p] = sum_squares(master[a:b], grad[a:b])


def segment_norms_numba(master, grad, segments):
    """Numba CPU version of segment_norms_numpy (threads take whole chunks)."""
    lay = layout(segments)
    part_w = np.empty(lay.piece_start.size)
    part_g = np.empty(lay.piece_start.size)
    _piece_sums_cpu(master, grad, lay.piece_start, lay.piece_stop, lay.chunk_first, part_w, part_g)
    w_norm = np.empty(lay.num_segments)
    g_norm = np.empty(lay.num_segments)
    pieces_to_segments(part_w, part_g, lay.seg_first, w_norm, g_norm)
    return w_norm, g_norm


# ----- Numba CUDA -----

@cuda.jit(device=True)
def block_sum2(x, y):
    """Sums of x and y over the threads of a block (a tree in shared memory); every
    thread gets the totals. blockDim.x must be a power of two <= CUDA_MAX_THREADS."""
    buf_x = cuda.shared.array(CUDA_MAX_THREADS, float64)
    buf_y = cuda.shared.array(CUDA_MAX_THREADS, float64)
    t = cuda.threadIdx.x
    buf_x[t] = x
    buf_y[t] = y
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if t < half:
            buf_x[t] += buf_x[t + half]
            buf_y[t] += buf_y[t + half]
        cuda.syncthreads()
        half //= 2
    return buf_x[0], buf_y[0]


@cuda.jit
def _piece_sums_cuda(master, grad, piece_start, piece_stop, part_w, part_g):
    p = cuda.blockIdx.x        # one block per piece
    sw = 0.0
    sg = 0.0
    for i in range(piece_start[p] + cuda.threadIdx.x, piece_stop[p], cuda.blockDim.x):
        a = np.float64(master[i])
        c = np.float64(grad[i])
        sw += a * a
        sg += c * c
    sw, sg = block_sum2(sw, sg)
    if cuda.threadIdx.x == 0:
        part_w[p] = sw
        part_g[p] = sg


@cuda.jit
def pieces_to_segments_cuda(part_x, part_y, seg_first, out_x, out_y):
    """One thread per segment: out[s] = sqrt(sum of its piece sums, in piece order)."""
    s = cuda.grid(1)
    if s < out_x.size:
        sx = 0.0
        sy = 0.0
        for p in range(seg_first[s], seg_first[s + 1]):
            sx += part_x[p]
            sy += part_y[p]
        out_x[s] = math.sqrt(sx)
        out_y[s] = math.sqrt(sy)


def segment_norms_cuda(master, grad, segments):
    """Numba CUDA version of segment_norms_numpy: one block per piece reduces in shared
    memory, then one thread per segment adds its pieces."""
    threads, chunk = cuda_shape()
    xp = array_module(master)
    lay = device_layout(segments, chunk, xp)
    pieces = lay.piece_start.size
    part_w = xp.zeros(pieces)
    part_g = xp.zeros(pieces)
    w_norm = xp.zeros(lay.num_segments)
    g_norm = xp.zeros(lay.num_segments)
    if pieces:
        _piece_sums_cuda[pieces, threads](master, grad, lay.piece_start, lay.piece_stop,
                                          part_w, part_g)
        pieces_to_segments_cuda[(lay.num_segments + threads - 1) // threads, threads](
            part_w, part_g, lay.seg_first, w_norm, g_norm)
    return w_norm, g_norm


_IMPLS = {"numpy": segment_norms_numpy, "numba": segment_norms_numba, "cuda": segment_norms_cuda}
