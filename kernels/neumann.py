"""The Neumann optimizer (Krishnan, Xiao and Saurous, 2017, "Neumann Optimizer: A Practical
Optimization Algorithm for Deep Neural Networks", arXiv:1712.03298), over the arena.

The paper's Algorithm 2, step t, with w the weights, m the Neumann iterate, v the moving
average of the weights (v_0 = w_0, m_0 = 0) and g the mini-batch gradient:

    if t = 1 modulo K:                                              (reset)
        m_t = -eta g
    else:
        d_t = g + (alpha ||w - v||^2 - beta / ||w - v||^2) (w - v) / ||w - v||      (Eq. 8)
        m_t = mu(t) m_{t-1} - eta(t) d_t
        w_t = w_{t-1} + mu(t) m_t - eta(t) d_t
        v_t = w_t + gamma (v_{t-1} - w_t)

d_t is the gradient of the mini-batch loss plus a cubic regulariser (alpha/3) ||w - v||^3,
attractive, and a repulsive one beta / ||w - v||; w is the displaced iterate of Nesterov's
momentum (the paper's w + mu m), so the gradient is taken where the weights are. Algorithm 2
starts with a few steps of vanilla SGD, w_t = w_{t-1} - eta g, that touch neither m nor v.

Per element i of segment s (wd_s = weight_decay where decay_s, else 0; the L2 penalty is
part of the mini-batch loss, so it enters g), one of three phases per step:

    g     = grad_i * inv_scale + wd_s * w_i
    sgd:     w_i -= eta g
    reset:   m_i  = -eta g
    neumann: d    = g + c (w_i - v_i)
             m_i  = mu m_i - eta d
             w_i  = w_i + mu m_i - eta d
             v_i  = w_i + gamma (v_i - w_i)
    working_i = cast(w_i)

    c = alpha ||w - v|| - beta n / ||w - v||^3       (Eq. 8 with beta = beta_per_weight * n)
    c = 0 when ||w - v|| = 0                          ((w - v) / ||w - v|| is undefined there)

||w - v|| is the norm over the whole weight vector, all n parameter elements, as Eq. 8
writes it (not per layer); the paper's Table 1 sets alpha = 1e-7, beta = 1e-5 x the number
of variables, gamma = 0.99 and mu(t) = 1 - 1/(1 + t) from 0.5 up to 0.9. The listing is
read with lines 9-12 as the else branch: a reset step sets m and leaves w and v as they are.
The algorithm's result is w_T - mu(T) m_T; the arena keeps the displaced w_T, which the
layers evaluate, as PyTorch's Nesterov momentum does.

Kernel passes on a neumann step (sgd and reset steps need only the second):
  1. sums: per piece sum (w_i - v_i)^2 in float64, then per segment in piece order;
     the (2, segments) float64 array [sum (w - v)^2; elements] goes through
     `sum_partials` when one is given (a shard adds the other ranks' parts), then c;
  2. element pass: the phase's formulas (reads grad, w, m, v; writes w, m, v, working).
c is computed from the sums in the arrays' module and handed to pass 2 as a one-element
array: no host synchronisation on a GPU. Each formula is one `register_jitable` body
compiled for the CPU loops and the CUDA kernels, as in kernels/update.py and lamb.py.
Only parameter elements are read and written: padding keeps whatever it holds.
"""

import numpy as np
from numba import cuda, njit, prange
from numba.extending import register_jitable

from mpitrain.backend import array_module

from .cast import refresh_working
from .segments import LANES, as_dtype, cuda_shape, device_layout, launch, layout, pick
from .update import (pieces_to_segments, pieces_to_segments_cuda, store_block_sums, store_half,
                     store_working, working_args)

PHASES = {"sgd": 0, "reset": 1, "neumann": 2}


@register_jitable
def neumann_element(w, g, m, v, inv_scale, wd, c, mu, eta, gamma, phase):
    """One element of the element pass, in the dtype of its inputs: returns (w', m', v') for
    the phase (0 sgd, 1 reset, 2 neumann; formulas in the module docstring)."""
    g = g * inv_scale + wd * w
    if phase == 0:
        return w - eta * g, m, v
    if phase == 1:
        return w, -eta * g, v
    d = g + c * (w - v)
    m = mu * m - eta * d
    w = w + mu * m - eta * d
    return w, m, w + gamma * (v - w)


@register_jitable
def displacement_square(w, v):
    """(w - v)^2 in float64, the difference taken in the dtype of w."""
    u = np.float64(w - v)
    return u * u


def regulariser(sums, alpha, beta, xp):
    """c of the module docstring as a one-element float64 array in xp, from the per-segment
    [sum (w - v)^2; elements] (summed over the ranks already)."""
    total = sums[0].sum(keepdims=True)
    n = sums[1].sum(keepdims=True)
    safe = xp.where(total > 0, total, 1.0)
    return xp.where(total > 0, alpha * xp.sqrt(safe) - beta * n / (safe * xp.sqrt(safe)), 0.0)


def neumann_update(master, working, grad, iterate, average, segments, lr, phase, mu=0.9,
                   alpha=1e-7, beta=1e-5, gamma=0.99, weight_decay=0.0, inv_scale=1.0, impl=None,
                   sum_partials=None):
    """Apply one step of the Neumann optimizer in place; see the module docstring.

    iterate, average: m and v, flat arrays like master; phase: "sgd", "reset" or "neumann";
    beta: per weight (the paper's beta over n elements is beta * n). sum_partials: None, or
    a function that adds the (2, segments) float64 sums over the ranks in place, when the
    table holds only part of each parameter (a shard); called on neumann steps.
    Returns c as a one-element float64 array in the arrays' module (0 outside neumann steps)."""
    if phase not in PHASES:
        raise ValueError(f"unknown Neumann phase {phase!r}; choose one of {', '.join(PHASES)}")
    return _IMPLS[pick(impl, master)](master, working, grad, iterate, average, segments, lr,
                                      PHASES[phase], mu, alpha, beta, gamma, weight_decay,
                                      inv_scale, sum_partials)


def _coefficient(sums, sum_partials, phase, alpha, beta, xp):
    """c from the sums (added over the ranks first) on a neumann step, else 0."""
    if phase != PHASES["neumann"]:
        return xp.zeros(1)
    if sum_partials is not None:
        sum_partials(sums)
    return regulariser(sums, alpha, beta, xp)


def neumann_update_numpy(master, working, grad, iterate, average, segments, lr, phase, mu, alpha,
                         beta, gamma, weight_decay, inv_scale, sum_partials):
    """Reference, one parameter at a time (formulas in the module docstring)."""
    xp = array_module(master)
    table = segments[["offset", "size", "decay"]]
    sums = xp.zeros((2, len(segments)))
    for s, (offset, size, _) in enumerate(table):
        u = (master[offset:offset + size] - average[offset:offset + size]).astype(np.float64)
        sums[0, s] = xp.dot(u, u)
        sums[1, s] = size
    coef = _coefficient(sums, sum_partials, phase, alpha, beta, xp)
    c = float(coef[0])
    for offset, size, decay in table:
        sl = slice(offset, offset + size)
        w, m, v = master[sl], iterate[sl], average[sl]
        g = grad[sl] * inv_scale
        if decay:
            g += weight_decay * w
        if phase == PHASES["sgd"]:
            w -= lr * g
        elif phase == PHASES["reset"]:
            m[...] = -lr * g
        else:
            d = g + c * (w - v)
            m *= mu
            m -= lr * d
            w += mu * m - lr * d
            v[...] = w + gamma * (v - w)
    refresh_working(master, working, segments)
    return coef


# ----- Numba CPU -----

@njit(cache=True)
def _displacement_piece(w, v):
    """sum (w_i - v_i)^2 in float64 over one piece, with LANES partial sums."""
    lanes = np.zeros(LANES)
    blocks = w.size // LANES
    for b in range(blocks + 1):
        lo = b * LANES
        for k in range(min(LANES, w.size - lo)):
            lanes[k] += displacement_square(w[lo + k], v[lo + k])
    return lanes.sum()


@njit(parallel=True, cache=True)
def _displacement_cpu(master, average, piece_start, piece_stop, chunk_first, part):
    """part[p] = sum (w_i - v_i)^2 over piece p; threads take whole chunks."""
    for c in prange(chunk_first.size - 1):
        for p in range(chunk_first[c], chunk_first[c + 1]):
            part[p] = _displacement_piece(master[piece_start[p]:piece_stop[p]],
                                          average[piece_start[p]:piece_stop[p]])


@njit(cache=True)
def _element_piece(w, half, g, m, v, inv_scale, wd, c, mu, eta, gamma, phase):
    """The element pass on one piece (slices); half is empty when there is no fp16 copy."""
    for i in range(w.size):
        wi, mi, vi = neumann_element(w[i], g[i], m[i], v[i], inv_scale, wd, c, mu, eta, gamma,
                                     phase)
        w[i] = wi
        m[i] = mi
        v[i] = vi
        store_half(half, i, wi)


@njit(parallel=True, cache=True)
def _element_cpu(master, half, grad, iterate, average, piece_seg, piece_start, piece_stop,
                 chunk_first, wd, coef, inv_scale, mu, eta, gamma, phase):
    """The element pass on every piece with its segment's wd; threads take whole chunks."""
    c = coef[0]
    for ch in prange(chunk_first.size - 1):
        for p in range(chunk_first[ch], chunk_first[ch + 1]):
            a = piece_start[p]
            b = piece_stop[p]
            _element_piece(master[a:b], half[a:b], grad[a:b], iterate[a:b], average[a:b],
                           inv_scale, wd[piece_seg[p]], c, mu, eta, gamma, phase)


def neumann_update_numba(master, working, grad, iterate, average, segments, lr, phase, mu, alpha,
                         beta, gamma, weight_decay, inv_scale, sum_partials):
    """Numba CPU version of neumann_update_numpy: the sums pass on neumann steps, then the
    element pass; threads take whole chunks."""
    lay = layout(segments)
    sums = np.zeros((2, lay.num_segments))
    if phase == PHASES["neumann"]:
        part = np.empty(lay.piece_start.size)
        _displacement_cpu(master, average, lay.piece_start, lay.piece_stop, lay.chunk_first, part)
        pieces_to_segments(part, part, lay.seg_first, sums[0], sums[1])
        sums[1] = segments["size"]          # the elements, in place of a second sum
    coef = _coefficient(sums, sum_partials, phase, alpha, beta, np)
    wd = np.where(lay.decay, weight_decay, 0.0).astype(master.dtype)
    fused_half = working is not master and working.dtype == np.float16
    half = working.view(np.uint16) if fused_half else np.empty(0, np.uint16)
    _element_cpu(master, half, grad, iterate, average, lay.piece_seg, lay.piece_start,
                 lay.piece_stop, lay.chunk_first, wd, coef.astype(master.dtype),
                 *as_dtype(master, inv_scale, mu, lr, gamma), phase)
    if not fused_half:
        refresh_working(master, working, segments)
    return coef


# ----- Numba CUDA -----

@cuda.jit
def _displacement_cuda(master, average, piece_start, piece_stop, part, unused):
    """part[p] = sum (w_i - v_i)^2 over piece p; one block per piece."""
    p = cuda.blockIdx.x        # one block per piece
    su = 0.0
    for i in range(piece_start[p] + cuda.threadIdx.x, piece_stop[p], cuda.blockDim.x):
        su += displacement_square(master[i], average[i])
    store_block_sums(part, unused, p, su, 0.0)


@cuda.jit
def _element_cuda(master, grad, iterate, average, piece_seg, piece_start, piece_stop, wd, coef,
                  inv_scale, mu, eta, gamma, phase, working, write_working, via_fp32):
    """The element pass, working_i = cast(w_i); one block per piece."""
    p = cuda.blockIdx.x        # one block per piece
    d = wd[piece_seg[p]]
    c = coef[0]
    for i in range(piece_start[p] + cuda.threadIdx.x, piece_stop[p], cuda.blockDim.x):
        w, iterate[i], average[i] = neumann_element(master[i], grad[i], iterate[i], average[i],
                                                    inv_scale, d, c, mu, eta, gamma, phase)
        master[i] = w
        store_working(working, i, w, write_working, via_fp32)


def neumann_update_cuda(master, working, grad, iterate, average, segments, lr, phase, mu, alpha,
                        beta, gamma, weight_decay, inv_scale, sum_partials):
    """Numba CUDA version of neumann_update_numpy: the sums one block per piece and one
    thread per segment (neumann steps), then the element pass one block per piece."""
    threads, chunk = cuda_shape()
    xp = array_module(master)
    lay = device_layout(segments, chunk, xp)
    pieces, nseg = lay.piece_start.size, lay.num_segments
    sums = xp.zeros((2, nseg))
    if phase == PHASES["neumann"] and pieces:
        part, unused = xp.zeros(pieces), xp.zeros(pieces)
        launch(_displacement_cuda, pieces, threads, master, average, lay.piece_start,
               lay.piece_stop, part, unused)
        launch(pieces_to_segments_cuda, (nseg + threads - 1) // threads, threads, part, unused,
               lay.seg_first, sums[0], sums[1])
    sums[1] = xp.asarray(segments["size"])
    coef = _coefficient(sums, sum_partials, phase, alpha, beta, xp)
    wd = xp.where(lay.decay, weight_decay, 0.0).astype(master.dtype)
    if pieces:
        launch(_element_cuda, pieces, threads, master, grad, iterate, average, lay.piece_seg,
               lay.piece_start, lay.piece_stop, wd, coef.astype(master.dtype),
               *as_dtype(master, inv_scale, mu, lr, gamma), phase,
               *working_args(master, working))
    return coef


_IMPLS = {"numpy": neumann_update_numpy, "numba": neumann_update_numba,
          "cuda": neumann_update_cuda}
