"""The fused SGD / LARS update: one pass over the arena.

For every element i of segment s (decay_s, lars_s from the segment table):

    g      = grad_i * inv_scale                  unscale (inv_scale = 1 / (loss scale * world size))
    g     += wd_s * w_i                          wd_s = weight_decay where decay_s, else 0
    v_i    = m * v_i + lr * local_lr_s * g
    w_i   -= v_i                                 (Nesterov: w_i -= m * v_i + lr * local_lr_s * g)
    working_i = cast(w_i)                        fp16 (or nothing when working is master)

with the LARS trust ratio (You et al., 2017) where trust is on and lars_s:

    local_lr_s = eta * ||w||_s / (||g||_s + wd_s * ||w||_s + eps)
    ||g||_s    = ||grad||_s * inv_scale          the norm of the unscaled gradient
    local_lr_s = 1 when ||w||_s or ||g||_s is 0, and wherever trust is off or not lars_s.

Norms are per parameter (kernels/norms.py), on the master weights before the
update. With trust off this is SGD with momentum in the "lr inside the
momentum" form, v = m v + lr g; w -= v. PyTorch's form is v' = m v' + g;
w -= lr v'. The two agree exactly while lr is constant (v = lr v'); when lr
changes, the lr-inside form keeps the velocity of the old rate, which is the
form of Goyal et al. and of the LARS paper.

Each implementation first computes two small per-segment vectors, step_s =
lr * local_lr_s and wd_s, in the master's dtype; then the element pass reads
master, grad and momentum once and writes master, momentum and working once.
All arithmetic is in the master's dtype (fp32; float64 in verification runs).
The fp16 working copy is cast from the fp32-rounded master.

Returns the per-segment local_lr (float64), for logging.
"""
import numpy as np
from numba import cuda, njit, prange

from mpitrain.backend import array_module, to_numpy

from .cast import float_to_half_bits, refresh_working
from .norms import segment_norms_cuda, segment_norms_numba, segment_norms_numpy
from .segments import as_dtype, cuda_shape, device_layout, layout, pick


def trust_ratio(w_norm, g_norm, wd, eta, eps):
    """LARS local learning rate: eta ||w|| / (||g|| + wd ||w|| + eps); 1 when a norm is 0."""
    if w_norm > 0.0 and g_norm > 0.0:
        return eta * w_norm / (g_norm + wd * w_norm + eps)
    return 1.0


_trust_ratio_cpu = njit(cache=True)(trust_ratio)
_trust_ratio_cuda = cuda.jit(device=True)(trust_ratio)


def sgd_update(master, working, grad, velocity, segments, lr, momentum=0.9, weight_decay=0.0,
               inv_scale=1.0, nesterov=False, trust=False, eta=0.001, eps=1e-9, impl=None):
    """Apply one SGD (trust=False) or LARS (trust=True) step in place; see the module docstring.

    master, grad, velocity: flat arrays of one float dtype (velocity is arena.momentum);
    working: the layers' copy, fp16 or master itself; segments: the arena's segment table.
    impl: "numpy" | "numba" | "cuda", or None to choose by array type.
    Returns local_lr, one float64 per segment, in the arrays' module."""
    if nesterov and momentum <= 0:
        raise ValueError("Nesterov momentum needs momentum > 0")
    return _IMPLS[pick(impl, master)](master, working, grad, velocity, segments, lr, momentum,
                                      weight_decay, inv_scale, nesterov, trust, eta, eps)


def sgd_update_numpy(master, working, grad, velocity, segments, lr, momentum, weight_decay,
                     inv_scale, nesterov, trust, eta, eps):
    """Reference, one parameter at a time (formula in the module docstring)."""
    xp = array_module(master)
    n = len(segments)
    local_lr = np.ones(n)
    if trust:
        w_norm, g_norm = (to_numpy(a) for a in segment_norms_numpy(master, grad, segments))
    for s, (offset, size, decay, lars) in enumerate(segments[["offset", "size", "decay", "lars"]]):
        wd = weight_decay if decay else 0.0
        if trust and lars:
            local_lr[s] = trust_ratio(w_norm[s], g_norm[s] * inv_scale, wd, eta, eps)
        step = float(lr * local_lr[s])      # a Python float keeps the arithmetic in w's dtype
        w = master[offset:offset + size]
        v = velocity[offset:offset + size]
        g = grad[offset:offset + size] * inv_scale
        if decay:
            g += wd * w
        v *= momentum
        v += step * g
        if nesterov:
            w -= momentum * v + step * g
        else:
            w -= v
    refresh_working(master, working)
    return xp.asarray(local_lr)


# ----- Numba CPU -----

@njit(cache=True)
def coefficients(w_norm, g_norm, decay, lars, lr, weight_decay, inv_scale, trust, eta, eps,
                 step, wd, local_lr):
    """Per segment: local_lr, step = lr * local_lr and wd (in step's and wd's dtype)."""
    for s in range(step.size):
        d = weight_decay if decay[s] else 0.0
        r = 1.0
        if trust and lars[s]:
            r = _trust_ratio_cpu(w_norm[s], g_norm[s] * inv_scale, d, eta, eps)
        local_lr[s] = r
        step[s] = lr * r
        wd[s] = d


@njit(cache=True)
def _sgd_piece(w, half, g, v, step, wd, inv_scale, m, nesterov):
    """The element pass on one piece (slices); half is empty when there is no fp16 copy."""
    for i in range(w.size):
        d = g[i] * inv_scale + wd * w[i]
        vi = m * v[i] + step * d
        v[i] = vi
        wi = w[i] - (m * vi + step * d if nesterov else vi)
        w[i] = wi
        if half.size:
            half[i] = float_to_half_bits(np.float32(wi))


@njit(parallel=True, cache=True)
def _sgd_cpu(master, half, grad, velocity, piece_seg, piece_start, piece_stop, chunk_first,
             step, wd, inv_scale, m, nesterov):
    for c in prange(chunk_first.size - 1):
        for p in range(chunk_first[c], chunk_first[c + 1]):
            s = piece_seg[p]
            a = piece_start[p]
            b = piece_stop[p]
            _sgd_piece(master[a:b], half[a:b], grad[a:b], velocity[a:b], step[s], wd[s],
                       inv_scale, m, nesterov)


def sgd_update_numba(master, working, grad, velocity, segments, lr, momentum, weight_decay,
                     inv_scale, nesterov, trust, eta, eps):
    """Numba CPU version of sgd_update_numpy: norms pass (if trust), then the fused pass;
    threads take whole chunks of the arena."""
    lay = layout(segments)
    trust = trust and bool(lay.lars.any())
    if trust:
        w_norm, g_norm = segment_norms_numba(master, grad, segments)
    else:
        w_norm = g_norm = np.zeros(lay.num_segments)
    step = np.empty(lay.num_segments, master.dtype)
    wd = np.empty(lay.num_segments, master.dtype)
    local_lr = np.empty(lay.num_segments)
    coefficients(w_norm, g_norm, lay.decay, lay.lars, lr, weight_decay, inv_scale, trust, eta,
                 eps, step, wd, local_lr)
    fused_half = working is not master and working.dtype == np.float16
    half = working.view(np.uint16) if fused_half else np.empty(0, np.uint16)
    _sgd_cpu(master, half, grad, velocity, lay.piece_seg, lay.piece_start, lay.piece_stop,
             lay.chunk_first, step, wd, *as_dtype(master, inv_scale, momentum), nesterov)
    if not fused_half:
        refresh_working(master, working)
    return local_lr


# ----- Numba CUDA -----

@cuda.jit
def coefficients_cuda(w_norm, g_norm, decay, lars, lr, weight_decay, inv_scale, trust, eta, eps,
                      step, wd, local_lr):
    """One thread per segment: what `coefficients` computes."""
    s = cuda.grid(1)
    if s < step.size:
        d = weight_decay if decay[s] else 0.0
        r = 1.0
        if trust and lars[s]:
            r = _trust_ratio_cuda(w_norm[s], g_norm[s] * inv_scale, d, eta, eps)
        local_lr[s] = r
        step[s] = lr * r
        wd[s] = d


@cuda.jit(device=True)
def store_working(working, i, w, via_fp32):
    """working[i] = cast(w); an fp16 copy of a float64 master goes through fp32, as on the CPU."""
    if via_fp32:
        working[i] = np.float32(w)
    else:
        working[i] = w


@cuda.jit
def _sgd_cuda(master, working, grad, velocity, piece_seg, piece_start, piece_stop, step, wd,
              inv_scale, m, nesterov, write_working, via_fp32):
    p = cuda.blockIdx.x        # one block per piece: its segment's constants for every thread
    s = piece_seg[p]
    st = step[s]
    d = wd[s]
    for i in range(piece_start[p] + cuda.threadIdx.x, piece_stop[p], cuda.blockDim.x):
        g = grad[i] * inv_scale + d * master[i]
        v = m * velocity[i] + st * g
        velocity[i] = v
        w = master[i] - (m * v + st * g if nesterov else v)
        master[i] = w
        if write_working:
            store_working(working, i, w, via_fp32)


def sgd_update_cuda(master, working, grad, velocity, segments, lr, momentum, weight_decay,
                    inv_scale, nesterov, trust, eta, eps):
    """Numba CUDA version of sgd_update_numpy: norms kernels (if trust), one thread per
    segment for the coefficients, then one block per piece for the fused pass."""
    threads, chunk = cuda_shape()
    xp = array_module(master)
    lay = device_layout(segments, chunk, xp)
    trust = trust and bool(layout(segments).lars.any())
    if trust:
        w_norm, g_norm = segment_norms_cuda(master, grad, segments)
    else:
        w_norm = g_norm = xp.zeros(lay.num_segments)
    step = xp.empty(lay.num_segments, master.dtype)
    wd = xp.empty(lay.num_segments, master.dtype)
    local_lr = xp.empty(lay.num_segments)
    if lay.num_segments:
        coefficients_cuda[(lay.num_segments + threads - 1) // threads, threads](
            w_norm, g_norm, lay.decay, lay.lars, lr, weight_decay, inv_scale, trust, eta, eps,
            step, wd, local_lr)
    if lay.piece_start.size:
        _sgd_cuda[lay.piece_start.size, threads](
            master, working, grad, velocity, lay.piece_seg, lay.piece_start, lay.piece_stop,
            step, wd, *as_dtype(master, inv_scale, momentum), nesterov, working is not master,
            working.dtype == np.float16)
    return local_lr


_IMPLS = {"numpy": sgd_update_numpy, "numba": sgd_update_numba, "cuda": sgd_update_cuda}
