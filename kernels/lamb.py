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
Between the two, the per-segment sums [sum w^2; sum r^2] (a (2, segments)
float64 array) go through `sum_partials` when one is given: a sharded update
(mpitrain.shard) adds its ranks' partial sums there, so that trust_s is the
whole parameter's (as kernels/update.py does for LARS).
Recomputing r costs a few flops but no memory traffic: storing it would cost a
write and a read of one more arena-sized buffer.

Each formula (r, pass 1 and pass 2 on one element, the trust ratio of one
segment) is one plain Python function marked `register_jitable`, compiled by
the Numba CPU loops and by the CUDA kernels that call it, as in
kernels/update.py, whose square, pieces_to_segments and store_half it shares
(Numba's on-disk cache checks only the file of the function it caches: after
changing those in update.py, delete kernels/__pycache__/lamb.*.nb?). Only the
parameters' elements are read and written: the padding between segments keeps
whatever it holds, in master, m, v and working.

m and v are two extra flat buffers of the master's size and dtype, zero at
the start (`lamb_state`); arena.momentum can serve as m. Arithmetic is in the
master's dtype; the norms accumulate in float64. Returns trust_s per segment.
"""
import math

import numpy as np
from numba import cuda, njit, prange
from numba.extending import register_jitable

from mpitrain.backend import array_module, to_numpy

from .cast import refresh_working
from .segments import LANES, as_dtype, cuda_shape, device_layout, launch, layout, pick
from .update import (pieces_to_segments, pieces_to_segments_cuda, square, store_block_sums,
                     store_half, store_working, working_args)


def lamb_state(master):
    """(m, v): LAMB's two moment buffers, zeros shaped and typed like master."""
    xp = array_module(master)
    return xp.zeros_like(master), xp.zeros_like(master)


@register_jitable
def direction(m, v, w, bc1, bc2, eps, wd):
    """LAMB's r = (m / bc1) / (sqrt(v / bc2) + eps) + wd * w, bc = bias corrections."""
    return (m / bc1) / (math.sqrt(v / bc2) + eps) + wd * w


@register_jitable
def lamb_moments(w, g, m, v, inv_scale, b1, c1, b2, c2, bc1, bc2, eps, wd):
    """Pass 1 on one element, in the dtype of its inputs (c1 = 1 - b1, c2 = 1 - b2):
    returns (m', v', r) for g' = g * inv_scale, m' = b1 m + c1 g', v' = b2 v + c2 g'^2,
    r = direction(m', v', w) as float64."""
    g = g * inv_scale
    m = b1 * m + c1 * g
    v = b2 * v + c2 * g * g
    return m, v, np.float64(direction(m, v, w, bc1, bc2, eps, wd))


@register_jitable
def lamb_apply(w, m, v, step, bc1, bc2, eps, wd):
    """Pass 2 on one element: w' = w - step * direction(m, v, w), step = lr * trust_s."""
    return w - step * direction(m, v, w, bc1, bc2, eps, wd)


@register_jitable
def lamb_coefficients(s, sum_w, sum_r, lars, lr, trust, step, ratio):
    """Segment s: ||w|| = sqrt(sum_w[s]), ||r|| = sqrt(sum_r[s]); ratio[s] = ||w|| / ||r||
    where trust and lars[s] and both norms are > 0, else 1; step[s] = lr * ratio[s]."""
    w_norm = math.sqrt(sum_w[s])
    r_norm = math.sqrt(sum_r[s])
    t = 1.0
    if trust and lars[s] and w_norm > 0.0 and r_norm > 0.0:
        t = w_norm / r_norm
    ratio[s] = t
    step[s] = lr * t


def lamb_update(master, working, grad, exp_avg, exp_avg_sq, segments, lr, step, beta1=0.9,
                beta2=0.999, eps=1e-6, weight_decay=0.0, inv_scale=1.0, trust=True, impl=None,
                sum_partials=None):
    """Apply LAMB step number `step` (1 for the first) in place; see the module docstring.

    exp_avg, exp_avg_sq: the moments m and v (lamb_state). sum_partials: None, or a
    function that adds the (2, segments) float64 sums [sum w^2; sum r^2] over the ranks
    in place, when the table holds only part of each parameter (a shard); called when
    trust is on. Returns trust_s, one float64 per segment, in the arrays' module."""
    if step < 1:
        raise ValueError(f"LAMB steps count from 1, got {step}")
    return _IMPLS[pick(impl, master)](master, working, grad, exp_avg, exp_avg_sq, segments, lr,
                                      step, beta1, beta2, eps, weight_decay, inv_scale, trust,
                                      sum_partials)


def lamb_update_numpy(master, working, grad, exp_avg, exp_avg_sq, segments, lr, step, beta1,
                      beta2, eps, weight_decay, inv_scale, trust, sum_partials):
    """Reference, one parameter at a time (formula in the module docstring): the moments
    and r of every parameter, the sums of squares (through sum_partials), then the
    weights."""
    xp = array_module(master)
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    table = list(enumerate(segments[["offset", "size", "decay", "lars"]]))
    directions = []
    sums = np.zeros((2, len(segments)))
    for s, (offset, size, decay, lars) in table:
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
        directions.append(r)
        sums[:, s] = [float(to_numpy(xp.dot(a, a))) for a in
                      (w.astype(np.float64), r.astype(np.float64))]
    _sum_segments(sums, sum_partials, trust)
    ratios = np.ones(len(segments))
    for (s, (offset, size, decay, lars)), r in zip(table, directions):
        w_norm, r_norm = np.sqrt(sums[:, s])
        if trust and lars and w_norm > 0 and r_norm > 0:
            ratios[s] = w_norm / r_norm
        master[offset:offset + size] -= float(lr * ratios[s]) * r
    refresh_working(master, working, segments)
    return xp.asarray(ratios)


# ----- Numba CPU -----

@njit(cache=True)
def _moments_piece(w, g, m, v, inv_scale, b1, c1, b2, c2, bc1, bc2, eps, wd):
    """Pass 1 on one piece: update m, v; return (sum w^2, sum r^2) in float64, with
    LANES partial sums as in update.sum_squares."""
    lane_w = np.zeros(LANES)
    lane_r = np.zeros(LANES)
    blocks = w.size // LANES
    for b in range(blocks + 1):
        lo = b * LANES
        n = min(LANES, w.size - lo)      # the last block is the tail
        for k in range(n):
            i = lo + k
            mi, vi, r = lamb_moments(w[i], g[i], m[i], v[i], inv_scale, b1, c1, b2, c2, bc1,
                                     bc2, eps, wd)
            m[i] = mi
            v[i] = vi
            lane_w[k] += square(w[i])
            lane_r[k] += r * r
    return lane_w.sum(), lane_r.sum()


@njit(parallel=True, cache=True)
def _moments_cpu(master, grad, m, v, piece_seg, piece_start, piece_stop, chunk_first, wd,
                 inv_scale, b1, c1, b2, c2, bc1, bc2, eps, part_w, part_r):
    """Pass 1: (m_i, v_i, r_i) = lamb_moments(...); part_w[p], part_r[p] = sum w_i^2, r_i^2
    over piece p; threads take whole chunks."""
    for c in prange(chunk_first.size - 1):
        for p in range(chunk_first[c], chunk_first[c + 1]):
            a = piece_start[p]
            b = piece_stop[p]
            part_w[p], part_r[p] = _moments_piece(master[a:b], grad[a:b], m[a:b], v[a:b],
                                                  inv_scale, b1, c1, b2, c2, bc1, bc2, eps,
                                                  wd[piece_seg[p]])


@njit(cache=True)
def _lamb_coefficients(sum_w, sum_r, lars, lr, trust, step, ratio):
    """lamb_coefficients for every segment, one after another."""
    for s in range(step.size):
        lamb_coefficients(s, sum_w, sum_r, lars, lr, trust, step, ratio)


@njit(cache=True)
def _apply_piece(w, half, m, v, step, bc1, bc2, eps, wd):
    """Pass 2 on one piece (slices): w_i = lamb_apply(...), half_i = fp16(w_i) if half is not
    empty."""
    for i in range(w.size):
        wi = lamb_apply(w[i], m[i], v[i], step, bc1, bc2, eps, wd)
        w[i] = wi
        store_half(half, i, wi)


@njit(parallel=True, cache=True)
def _apply_cpu(master, half, m, v, piece_seg, piece_start, piece_stop, chunk_first, step, wd,
               bc1, bc2, eps):
    """Pass 2: _apply_piece on every piece with its segment's step and wd; threads take whole
    chunks."""
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


def _sum_segments(sums, sum_partials, trust):
    """Add the per-segment sums over the ranks (sum_partials) when the trust ratio needs them."""
    if trust and sum_partials is not None:
        sum_partials(sums)


def lamb_update_numba(master, working, grad, exp_avg, exp_avg_sq, segments, lr, step, beta1,
                      beta2, eps, weight_decay, inv_scale, trust, sum_partials):
    """Numba CPU version of lamb_update_numpy: the two passes, threads take whole chunks."""
    lay = layout(segments)
    inv, b1, c1, b2, c2, bc1, bc2, eps_ = _scalars(master, step, beta1, beta2, eps, inv_scale)
    wd = np.where(lay.decay, weight_decay, 0.0).astype(master.dtype)
    part_w = np.empty(lay.piece_start.size)
    part_r = np.empty(lay.piece_start.size)
    _moments_cpu(master, grad, exp_avg, exp_avg_sq, lay.piece_seg, lay.piece_start,
                 lay.piece_stop, lay.chunk_first, wd, inv, b1, c1, b2, c2, bc1, bc2, eps_,
                 part_w, part_r)
    sums = np.zeros((2, lay.num_segments))
    pieces_to_segments(part_w, part_r, lay.seg_first, sums[0], sums[1])
    _sum_segments(sums, sum_partials, trust)
    steps = np.empty(lay.num_segments, master.dtype)
    ratio = np.empty(lay.num_segments)
    _lamb_coefficients(sums[0], sums[1], lay.lars, lr, trust, steps, ratio)
    fused_half = working is not master and working.dtype == np.float16
    half = working.view(np.uint16) if fused_half else np.empty(0, np.uint16)
    _apply_cpu(master, half, exp_avg, exp_avg_sq, lay.piece_seg, lay.piece_start, lay.piece_stop,
               lay.chunk_first, steps, wd, bc1, bc2, eps_)
    if not fused_half:
        refresh_working(master, working, segments)
    return ratio


# ----- Numba CUDA -----

@cuda.jit
def _moments_cuda(master, grad, m, v, piece_seg, piece_start, piece_stop, wd, inv_scale, b1, c1,
                  b2, c2, bc1, bc2, eps, part_w, part_r):
    """Pass 1: (m_i, v_i, r_i) = lamb_moments(...); part_w[p], part_r[p] = sum w_i^2, r_i^2
    over piece p; one block per piece."""
    p = cuda.blockIdx.x        # one block per piece
    d = wd[piece_seg[p]]
    sw = 0.0
    sr = 0.0
    for i in range(piece_start[p] + cuda.threadIdx.x, piece_stop[p], cuda.blockDim.x):
        m[i], v[i], r = lamb_moments(master[i], grad[i], m[i], v[i], inv_scale, b1, c1, b2, c2,
                                     bc1, bc2, eps, d)
        sw += square(master[i])
        sr += r * r
    store_block_sums(part_w, part_r, p, sw, sr)


@cuda.jit
def _lamb_coefficients_cuda(sum_w, sum_r, lars, lr, trust, step, ratio):
    """One thread per segment: lamb_coefficients."""
    s = cuda.grid(1)
    if s < step.size:
        lamb_coefficients(s, sum_w, sum_r, lars, lr, trust, step, ratio)


@cuda.jit
def _apply_cuda(master, m, v, piece_seg, piece_start, piece_stop, step, wd, bc1, bc2, eps,
                working, write_working, via_fp32):
    """Pass 2: master_i = lamb_apply(...), working_i = cast(master_i); one block per piece."""
    p = cuda.blockIdx.x        # one block per piece
    st = step[piece_seg[p]]
    d = wd[piece_seg[p]]
    for i in range(piece_start[p] + cuda.threadIdx.x, piece_stop[p], cuda.blockDim.x):
        w = lamb_apply(master[i], m[i], v[i], st, bc1, bc2, eps, d)
        master[i] = w
        store_working(working, i, w, write_working, via_fp32)


def lamb_update_cuda(master, working, grad, exp_avg, exp_avg_sq, segments, lr, step, beta1,
                     beta2, eps, weight_decay, inv_scale, trust, sum_partials):
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
    sums = xp.zeros((2, nseg))
    steps = xp.empty(nseg, master.dtype)
    ratio = xp.ones(nseg)
    blocks = (nseg + threads - 1) // threads
    if pieces:
        launch(_moments_cuda, pieces, threads, master, grad, exp_avg, exp_avg_sq, lay.piece_seg,
               lay.piece_start, lay.piece_stop, wd, inv, b1, c1, b2, c2, bc1, bc2, eps_,
               part_w, part_r)
        launch(pieces_to_segments_cuda, blocks, threads, part_w, part_r, lay.seg_first,
               sums[0], sums[1])
    _sum_segments(sums, sum_partials, trust)     # every rank, with pieces in its shard or not
    if pieces:
        launch(_lamb_coefficients_cuda, blocks, threads, sums[0], sums[1], lay.lars, lr, trust,
               steps, ratio)
        launch(_apply_cuda, pieces, threads, master, exp_avg, exp_avg_sq, lay.piece_seg,
               lay.piece_start, lay.piece_stop, steps, wd, bc1, bc2, eps_,
               *working_args(master, working))
    return ratio


_IMPLS = {"numpy": lamb_update_numpy, "numba": lamb_update_numba, "cuda": lamb_update_cuda}
