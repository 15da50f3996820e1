"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning"), over the arena.

For every element i of segment s, at step t = 1, 2, ...:

    g     = grad_i * inv_scale                        unscale
    m_i   = beta1 * m_i + (1 - beta1) * g             Adam's moments
    v_i   = beta2 * v_i + (1 - beta2) * g^2
    r_i   = (m_i / (1 - beta1^t)) / (sqrt(v_i / (1 - beta2^t)) + eps) + wd_s * w_i
    w_i  -= lr * trust_s * r_i
    working_i = cast(w_i)

    wd_s    = weight_decay where decay_s, else 0
    trust_s = ||w||_s / ||r||_s where trust is on and lars_s (1 when either norm is 0), else 1
              (the identity scaling function phi of the paper; ||w|| before the update)

The trust ratio needs the norm of r over the whole parameter before any of
its weights may move, so the kernel makes two passes:
  1. moments: update m and v, form r, accumulate ||w||^2 and ||r||^2 per piece
     (reads grad, m, v, w; writes m, v);
  2. apply: per segment trust_s, then recompute r from the new m, v and the
     unchanged w, and write w and working (reads m, v, w; writes w, working).
Recomputing r costs a few flops but no memory traffic: storing it would cost a
write and a read of one more arena-sized buffer.

m and v are two extra flat buffers of the master's size and dtype, zero at
the start (`lamb_state`); arena.momentum can serve as m. Arithmetic is in the
master's dtype; the norms accumulate in float64. Returns trust_s per segment.
"""
import math

import numpy as np
from numba import cuda, njit, prange

from mpitrain.backend import array_module, to_numpy

from .cast import float_to_half_bits, refresh_working
from .norms import block_sum2, pieces_to_segments, pieces_to_segments_cuda
from .segments import LANES, as_dtype, cuda_shape, device_layout, layout, pick
from .update import store_working


def lamb_state(master):
    """(m, v): LAMB's two moment buffers, zeros shaped and typed like master."""
    xp = array_module(master)
    return xp.zeros_like(master), xp.zeros_like(master)


def direction(m, v, w, bc1, bc2, eps, wd):
    """LAMB's r = (m / bc1) / (sqrt(v / bc2) + eps) + wd * w, bc = bias corrections."""
    return (m / bc1) / (math.sqrt(v / bc2) + eps) + wd * w


_direction_cpu = njit(cache=True)(direction)
_direction_cuda = cuda.jit(device=True)(direction)


def lamb_update(master, working, grad, exp_avg, exp_avg_sq, segments, lr, step, beta1=0.9,
                beta2=0.999, eps=1e-6, weight_decay=0.0, inv_scale=1.0, trust=True, impl=None):
    """Apply LAMB step number `step` (1 for the first) in place; see the module docstring.

    exp_avg, exp_avg_sq: the moments m and v (lamb_state). Returns trust_s, one
    float64 per segment, in the arrays' module."""
    if step < 1:
        raise ValueError(f"LAMB steps count from 1, got {step}")
    return _IMPLS[pick(impl, master)](master, working, grad, exp_avg, exp_avg_sq, segments, lr,
                                      step, beta1, beta2, eps, weight_decay, inv_scale, trust)


def lamb_update_numpy(master, working, grad, exp_avg, exp_avg_sq, segments, lr, step, beta1,
                      beta2, eps, weight_decay, inv_scale, trust):
    """Reference, one parameter at a time (formula in the module docstring)."""
    xp = array_module(master)
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    ratios = np.ones(len(segments))
    for s, (offset, size, decay, lars) in enumerate(segments[["offset", "size", "decay", "lars"]]):
        sl = slice(offset, offset + size)
        w, m, v = master[sl], exp_avg[sl], exp_avg_sq[sl]
        g = grad[sl] * inv_scale
        m *= beta1
        m += (1.0 - beta1) * g
        v *= beta2
        v += (1.0 - beta2) * g * g
        r = (m / bc1) / (xp.sqrt(v / bc2) + eps)
        if decay:
            r += weight_decay * w
        if trust and lars:
            w_norm = float(to_numpy(xp.linalg.norm(w.astype(np.float64))))
            r_norm = float(to_numpy(xp.linalg.norm(r.astype(np.float64))))
            if w_norm > 0 and r_norm > 0:
                ratios[s] = w_norm / r_norm
        w -= float(lr * ratios[s]) * r
    refresh_working(master, working)
    return xp.asarray(ratios)


# ----- Numba CPU -----

@njit(cache=True)
def _moments_piece(w, g, m, v, inv_scale, b1, c1, b2, c2, bc1, bc2, eps, wd):
    """Pass 1 on one piece: update m, v; return (sum w^2, sum r^2) in float64, with
    LANES partial sums as in norms.sum_squares."""
    lane_w = np.zeros(LANES)
    lane_r = np.zeros(LANES)
    blocks = w.size // LANES
    for b in range(blocks + 1):
        lo = b * LANES
        n = min(LANES, w.size - lo)      # the last block is the tail
        for k in range(n):
            i = lo + k
            gi = g[i] * inv_scale
            mi = b1 * m[i] + c1 * gi
            vi = b2 * v[i] + c2 * gi * gi
            m[i] = mi
            v[i] = vi
            r = np.float64(_direction_cpu(mi, vi, w[i], bc1, bc2, eps, wd))
            wi = np.float64(w[i])
            lane_w[k] += wi * wi
            lane_r[k] += r * r
    return lane_w.sum(), lane_r.sum()


@njit(parallel=True, cache=True)
def _moments_cpu(master, grad, m, v, piece_seg, piece_start, piece_stop, chunk_first, wd,
                 inv_scale, b1, c1, b2, c2, bc1, bc2, eps, part_w, part_r):
    for c in prange(chunk_first.size - 1):
        for p in range(chunk_first[c], chunk_first[c + 1]):
            a = piece_start[p]
            b = piece_stop[p]
            part_w[p], part_r[p] = _moments_piece(master[a:b], grad[a:b], m[a:b], v[a:b],
                                                  inv_scale, b1, c1, b2, c2, bc1, bc2, eps,
                                                  wd[piece_seg[p]])


@njit(cache=True)
def _lamb_coefficients(w_norm, r_norm, lars, lr, trust, step, ratio):
    for s in range(step.size):
        t = 1.0
        if trust and lars[s] and w_norm[s] > 0.0 and r_norm[s] > 0.0:
            t = w_norm[s] / r_norm[s]
        ratio[s] = t
        step[s] = lr * t


@njit(cache=True)
def _apply_piece(w, half, m, v, step, bc1, bc2, eps, wd):
    for i in range(w.size):
        wi = w[i] - step * _direction_cpu(m[i], v[i], w[i], bc1, bc2, eps, wd)
        w[i] = wi
        if half.size:
            half[i] = float_to_half_bits(np.float32(wi))


@njit(parallel=True, cache=True)
def _apply_cpu(master, half, m, v, piece_seg, piece_start, piece_stop, chunk_first, step, wd,
               bc1, bc2, eps):
    for c in prange(chunk_first.size - 1):
        for p in range(chunk_first[c], chunk_first[c + 1]):
            s = piece_seg[p]
            a = piece_start[p]
            b = piece_stop[p]
            _apply_piece(master[a:b], half[a:b], m[a:b], v[a:b], step[s], bc1, bc2, eps, wd[s])


def _scalars(master, step, beta1, beta2, eps, inv_scale):
    """The per-step scalars in the master's dtype: inv_scale, b1, 1-b1, b2, 1-b2, bc1, bc2, eps."""
    return as_dtype(master, inv_scale, beta1, 1.0 - beta1, beta2, 1.0 - beta2,
                    1.0 - beta1 ** step, 1.0 - beta2 ** step, eps)


def lamb_update_numba(master, working, grad, exp_avg, exp_avg_sq, segments, lr, step, beta1,
                      beta2, eps, weight_decay, inv_scale, trust):
    """Numba CPU version of lamb_update_numpy: the two passes, threads take whole chunks."""
    lay = layout(segments)
    inv, b1, c1, b2, c2, bc1, bc2, eps_ = _scalars(master, step, beta1, beta2, eps, inv_scale)
    wd = np.where(lay.decay, weight_decay, 0.0).astype(master.dtype)
    part_w = np.empty(lay.piece_start.size)
    part_r = np.empty(lay.piece_start.size)
    _moments_cpu(master, grad, exp_avg, exp_avg_sq, lay.piece_seg, lay.piece_start,
                 lay.piece_stop, lay.chunk_first, wd, inv, b1, c1, b2, c2, bc1, bc2, eps_,
                 part_w, part_r)
    w_norm = np.empty(lay.num_segments)
    r_norm = np.empty(lay.num_segments)
    pieces_to_segments(part_w, part_r, lay.seg_first, w_norm, r_norm)
    steps = np.empty(lay.num_segments, master.dtype)
    ratio = np.empty(lay.num_segments)
    _lamb_coefficients(w_norm, r_norm, lay.lars, lr, trust, steps, ratio)
    fused_half = working is not master and working.dtype == np.float16
    half = working.view(np.uint16) if fused_half else np.empty(0, np.uint16)
    _apply_cpu(master, half, exp_avg, exp_avg_sq, lay.piece_seg, lay.piece_start, lay.piece_stop,
               lay.chunk_first, steps, wd, bc1, bc2, eps_)
    if not fused_half:
        refresh_working(master, working)
    return ratio


# ----- Numba CUDA -----

@cuda.jit
def _moments_cuda(master, grad, m, v, piece_seg, piece_start, piece_stop, wd, inv_scale, b1, c1,
                  b2, c2, bc1, bc2, eps, part_w, part_r):
    p = cuda.blockIdx.x        # one block per piece
    d = wd[piece_seg[p]]
    sw = 0.0
    sr = 0.0
    for i in range(piece_start[p] + cuda.threadIdx.x, piece_stop[p], cuda.blockDim.x):
        gi = grad[i] * inv_scale
        mi = b1 * m[i] + c1 * gi
        vi = b2 * v[i] + c2 * gi * gi
        m[i] = mi
        v[i] = vi
        r = np.float64(_direction_cuda(mi, vi, master[i], bc1, bc2, eps, d))
        wi = np.float64(master[i])
        sw += wi * wi
        sr += r * r
    sw, sr = block_sum2(sw, sr)
    if cuda.threadIdx.x == 0:
        part_w[p] = sw
        part_r[p] = sr


@cuda.jit
def _lamb_coefficients_cuda(w_norm, r_norm, lars, lr, trust, step, ratio):
    s = cuda.grid(1)
    if s < step.size:
        t = 1.0
        if trust and lars[s] and w_norm[s] > 0.0 and r_norm[s] > 0.0:
            t = w_norm[s] / r_norm[s]
        ratio[s] = t
        step[s] = lr * t


@cuda.jit
def _apply_cuda(master, working, m, v, piece_seg, piece_start, piece_stop, step, wd, bc1, bc2,
                eps, write_working, via_fp32):
    p = cuda.blockIdx.x
    s = piece_seg[p]
    st = step[s]
    d = wd[s]
    for i in range(piece_start[p] + cuda.threadIdx.x, piece_stop[p], cuda.blockDim.x):
        w = master[i] - st * _direction_cuda(m[i], v[i], master[i], bc1, bc2, eps, d)
        master[i] = w
        if write_working:
            store_working(working, i, w, via_fp32)


def lamb_update_cuda(master, working, grad, exp_avg, exp_avg_sq, segments, lr, step, beta1,
                     beta2, eps, weight_decay, inv_scale, trust):
    """Numba CUDA version of lamb_update_numpy: pass 1 one block per piece, the per-segment
    sums and ratios one thread per segment, pass 2 one block per piece."""
    threads, chunk = cuda_shape()
    xp = array_module(master)
    lay = device_layout(segments, chunk, xp)
    pieces, nseg = lay.piece_start.size, lay.num_segments
    inv, b1, c1, b2, c2, bc1, bc2, eps_ = _scalars(master, step, beta1, beta2, eps, inv_scale)
    wd = xp.where(lay.decay, weight_decay, 0.0).astype(master.dtype)
    part_w = xp.zeros(pieces)
    part_r = xp.zeros(pieces)
    w_norm = xp.zeros(nseg)
    r_norm = xp.zeros(nseg)
    steps = xp.empty(nseg, master.dtype)
    ratio = xp.ones(nseg)
    if pieces:
        seg_blocks = (nseg + threads - 1) // threads
        _moments_cuda[pieces, threads](master, grad, exp_avg, exp_avg_sq, lay.piece_seg,
                                       lay.piece_start, lay.piece_stop, wd, inv, b1, c1, b2, c2,
                                       bc1, bc2, eps_, part_w, part_r)
        pieces_to_segments_cuda[seg_blocks, threads](part_w, part_r, lay.seg_first, w_norm, r_norm)
        _lamb_coefficients_cuda[seg_blocks, threads](w_norm, r_norm, lay.lars, lr, trust, steps,
                                                     ratio)
        _apply_cuda[pieces, threads](master, working, exp_avg, exp_avg_sq, lay.piece_seg,
                                     lay.piece_start, lay.piece_stop, steps, wd, bc1, bc2, eps_,
                                     working is not master, working.dtype == np.float16)
    return ratio


_IMPLS = {"numpy": lamb_update_numpy, "numba": lamb_update_numba, "cuda": lamb_update_cuda}
