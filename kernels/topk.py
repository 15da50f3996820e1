"""Top-k selection by magnitude with error feedback, and the sum of every rank's picks.

For one fusion bucket of n float32 elements and 1 <= k <= n (mpitrain/comm/topk.py):

    acc_i      = grad_i + scale * residual_i        the gradient plus what earlier steps held back
    key_i      = the bits of acc_i with the sign cleared, as an integer: it orders like
                 |acc_i| (finite < inf < NaN), so a non-finite value is always picked first
    T          = the k-th largest key
    selected_i = key_i > T, or key_i == T and i is among the first need = k - #{key > T}
                 indices with key == T                       (ties by index: exactly k)
    values, indices = acc_i and i of the selected, in increasing i
    out_i      = 0 where selected, else acc_i * (1 / scale)  the new residual, unscaled

    scatter_sum:  bucket_i = 0; for r = 0 .. p-1 in order: bucket[indices[r, j]] += values[r, j]
                  (every rank adds the same pairs in the same order: the same bits everywhere)

T without a sort (radix select). The key has 31 bits. Four passes take 8 bits at a time
from the top: each counts, in a 256-bin histogram, the 8 bits of the keys whose higher
bits equal the prefix of T found so far; walking the bins from the top, the bin where the
running count reaches `need` (k less what the higher bins held) is the next 8 bits of T
(`choose_bin`). After the fourth pass `need` is how many keys equal to T are taken.

In index order without a sort (compaction): the bucket is cut into chunks; one pass counts
each chunk's keys above T and equal to T (`count_chunk`), a scan over the chunks gives
each chunk's first output position and the ties before it (`scan_chunks`), and a last
pass writes each chunk's picks from there (`write_chunk`). So a bucket takes seven passes
(the sum, four histograms, the counts, the writes), whatever k is.

Implementations (kernels/segments.py: pick): "numpy", the reference (a full sort by
(-key, index): the definition above); "numba" (CPU: chunks in parallel, or on the
calling thread alone with parallel=False, for the Reducer's communication thread);
"cuda" (the sum and histograms as grid-stride loops, the histograms with atomic adds
into each block's shared memory; one thread per chunk for the counts and the writes).
The per-element and per-chunk bodies are written once (register_jitable) and compiled
for both targets; the scan over the chunks is prefix sums of NumPy or CuPy.
"""
import math

import numpy as np
from numba import cuda, njit, prange
from numba.extending import register_jitable

from mpitrain.backend import array_module

from . import team
from .segments import CPU_CHUNK, as_dtype, launch, pick

BITS = 8                                   # bits of the key per radix pass
SHIFTS = (24, 16, 8, 0)                    # the passes over a 31-bit key, from the top
SIGN_CLEARED = 0x7FFFFFFF
NO_BIN = 1 << BITS                         # the digit of a key that is no longer a candidate
HIST_LANES = 4                             # CPU: element i counts in histogram i % 4


# ----- the bodies, one for every target -----

@register_jitable
def accumulate(grad, residual, out, scale, i):
    """out_i = grad_i + scale * residual_i."""
    out[i] = grad[i] + scale * residual[i]


@register_jitable
def magnitude_key(bits, i):
    """The int32 bits of a float32 with the sign cleared: ordered as the magnitude."""
    return np.int64(bits[i]) & SIGN_CLEARED


@register_jitable
def digit(key, prefix, shift):
    """The 8 bits of key at `shift`, or NO_BIN where the bits above them differ from
    prefix's."""
    if (key >> (shift + BITS)) != (prefix >> (shift + BITS)):
        return NO_BIN
    return (key >> shift) & (NO_BIN - 1)


@register_jitable
def choose_bin(hist, state, shift):
    """state = [prefix, need]: the highest bin b at which the count from the top reaches
    need; prefix gets b at `shift`, need loses what the bins above b held."""
    need = state[1]
    for b in range(NO_BIN - 1, -1, -1):
        if hist[b] >= need:
            state[0] |= b << shift
            state[1] = need
            return
        need -= hist[b]


@register_jitable
def count_chunk(bits, start, stop, threshold, counts, c):
    """counts[c] = (keys above threshold, keys equal to it) among elements start..stop-1."""
    above = 0
    ties = 0
    for i in range(start, stop):
        key = magnitude_key(bits, i)
        above += np.int64(key > threshold)     # an add of a bool would not vectorise
        ties += np.int64(key == threshold)
    counts[c, 0] = above
    counts[c, 1] = ties


@register_jitable
def chunk_end(c, chunk, n):
    """The end of chunk c of n elements: (c + 1) chunk, or n for the last chunk. (The bodies
    use no builtin min or max: numba-cuda can type min(a, b) of two integers as an
    overload that takes one argument, and the kernel then does not compile.)"""
    end = (c + 1) * chunk
    return end if end < n else n


def scan_chunks(counts, state):
    """starts[c] = (output position of chunk c's first pick, keys equal to T before chunk c):

        starts[c] = (above_<c + min(need, ties_<c),  ties_<c)

    with above_<c and ties_<c the sums of counts over the chunks before c (ties are taken
    from the front, so min(need, ties_<c) of them precede chunk c). NumPy or CuPy prefix
    sums; need = state[1] stays where state is."""
    xp = array_module(counts)
    starts = xp.cumsum(counts, axis=0) - counts
    starts[:, 0] += xp.minimum(starts[:, 1], state[1])
    return starts


@register_jitable
def write_chunk(acc, bits, start, stop, threshold, need, position, ties, inv_scale, out,
                values, indices):
    """The picks of elements start..stop-1 to values/indices from `position`; out_i = 0
    where picked, else acc_i * inv_scale (out may be acc). ties: keys equal to T before
    `start`."""
    for i in range(start, stop):
        key = magnitude_key(bits, i)
        take = key > threshold
        if key == threshold:
            take = ties < need
            ties += 1
        if take:
            values[position] = acc[i]
            indices[position] = i
            position += 1
            out[i] = 0
        else:
            out[i] = acc[i] * inv_scale


@register_jitable
def add_pair(bucket, indices, values, j):
    """bucket[indices_j] += values_j."""
    bucket[indices[j]] += values[j]


# ----- the entry points -----

def select(grad, residual, out, k, values, indices, scale=1.0, impl=None, parallel=True):
    """The k picks of acc = grad + scale * residual into values (grad's dtype) and indices
    (int32, relative to the bucket), in increasing index; out = the new residual (see the
    module docstring). grad, residual, out: flat float32 arrays of one size (out may be
    residual itself). parallel=False: the numba version runs on the calling thread only."""
    n = out.size
    if out.dtype != np.float32 or grad.dtype != np.float32 or residual.dtype != np.float32:
        raise ValueError(f"top-k selection takes float32 buckets, got {grad.dtype}, "
                         f"{residual.dtype}, {out.dtype}")
    if not 1 <= k <= n or values.size != k or indices.size != k or indices.dtype != np.int32:
        raise ValueError(f"need 1 <= k <= n and k values and int32 indices; got k={k}, "
                         f"n={n}, {values.size} values, {indices.size} {indices.dtype} indices")
    scale, inv_scale = as_dtype(out, scale, 1.0 / scale)
    _SELECT[pick(impl, out)](grad, residual, out, k, values, indices, scale, inv_scale,
                             parallel)


def scatter_sum(bucket, indices, values, impl=None, parallel=True):
    """bucket = 0, then every rank's pairs added in rank order: indices and values are
    (ranks, k), row r rank r's picks (indices relative to the bucket, distinct per row)."""
    _SCATTER[pick(impl, bucket)](bucket, indices, values, parallel)


# ----- NumPy: the reference -----

def select_numpy(grad, residual, out, k, values, indices, scale, inv_scale, parallel=True):
    """Reference: a full sort by (-key, index), the first k taken (NumPy or CuPy)."""
    xp = array_module(out)
    out[...] = grad + scale * residual
    key = out.view(np.int32).astype(np.int64) & SIGN_CLEARED
    chosen = xp.sort(xp.lexsort(xp.stack([xp.arange(out.size), -key]))[:k])
    values[...] = out[chosen]
    indices[...] = chosen
    out *= inv_scale
    out[chosen] = 0


def scatter_sum_numpy(bucket, indices, values, parallel=True):
    """Reference: bucket = 0; bucket[indices[r]] += values[r] for r in rank order."""
    bucket[...] = 0
    for r in range(indices.shape[0]):
        bucket[indices[r]] += values[r]


# ----- Numba CPU -----

def _threshold_loop(grad, residual, out, k, scale, chunk):
    """out = acc; returns state = [T, need] and each chunk's counts. Threads take whole
    chunks. Each chunk counts into HIST_LANES histograms in turn, so that consecutive keys
    of one bin (most keys share their top bits) do not wait for each other's increment,
    and counts the keys that are no candidate in a bin of their own (NO_BIN) rather than
    branch on them."""
    n = out.size
    bits = out.view(np.int32)
    chunks = (n + chunk - 1) // chunk
    for i in prange(n):
        accumulate(grad, residual, out, scale, i)
    state = np.zeros(2, np.int64)
    state[1] = k
    hists = np.zeros((chunks, HIST_LANES, NO_BIN + 1), np.int64)
    for shift in SHIFTS:
        prefix = state[0]
        for c in prange(chunks):
            hists[c] = 0
            for i in range(c * chunk, chunk_end(c, chunk, n)):
                hists[c, i % HIST_LANES, digit(magnitude_key(bits, i), prefix, shift)] += 1
        choose_bin(hists.sum(axis=0).sum(axis=0), state, shift)
    counts = np.empty((chunks, 2), np.int64)
    for c in prange(chunks):
        count_chunk(bits, c * chunk, chunk_end(c, chunk, n), state[0], counts, c)
    return state, counts


def _write_loop(out, chunk, state, starts, inv_scale, values, indices):
    """Each chunk's picks from its start; out = the new residual (out held acc)."""
    bits = out.view(np.int32)
    for c in prange(starts.shape[0]):
        write_chunk(out, bits, c * chunk, chunk_end(c, chunk, out.size), state[0], state[1],
                    starts[c, 0], starts[c, 1], inv_scale, out, values, indices)


def _scatter_loop(bucket, indices, values):
    """Each rank's pairs in parallel (distinct indices), the ranks one after another."""
    for i in prange(bucket.size):
        bucket[i] = 0
    for r in range(indices.shape[0]):
        for j in prange(indices.shape[1]):
            add_pair(bucket, indices[r], values[r], j)


# compiled for the thread pool and for the calling thread alone (as kernels/cast.py)
_threshold_cpu = {True: njit(parallel=True, cache=True)(_threshold_loop),
                  False: team.serial(_threshold_loop)}
_write_cpu = {True: njit(parallel=True, cache=True)(_write_loop),
              False: team.serial(_write_loop)}
_scatter_cpu = {True: njit(parallel=True, cache=True)(_scatter_loop),
                False: team.serial(_scatter_loop)}


def select_numba(grad, residual, out, k, values, indices, scale, inv_scale, parallel=True):
    """Numba CPU version of select_numpy."""
    state, counts = _threshold_cpu[bool(parallel)](grad, residual, out, k, scale, CPU_CHUNK)
    _write_cpu[bool(parallel)](out, CPU_CHUNK, state, scan_chunks(counts, state), inv_scale,
                               values, indices)


def scatter_sum_numba(bucket, indices, values, parallel=True):
    """Numba CPU version of scatter_sum_numpy."""
    _scatter_cpu[bool(parallel)](bucket, indices, values)


# ----- Numba CUDA -----

@cuda.jit
def _accumulate_cuda(grad, residual, out, scale):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        accumulate(grad, residual, out, scale, i)


@cuda.jit
def _histogram_cuda(bits, state, shift, hist):
    """hist[d] += 1 for the digit d of every key that agrees with the prefix: counted in
    the block's histogram in shared memory, which is added to hist once at the end (one
    global histogram taking every increment would serialise the many keys of one bin)."""
    block = cuda.shared.array(NO_BIN, np.int32)
    for b in range(cuda.threadIdx.x, NO_BIN, cuda.blockDim.x):
        block[b] = 0
    cuda.syncthreads()
    prefix = state[0]
    for i in range(cuda.grid(1), bits.size, cuda.gridsize(1)):
        d = digit(magnitude_key(bits, i), prefix, shift)
        if d != NO_BIN:
            cuda.atomic.add(block, d, 1)
    cuda.syncthreads()
    for b in range(cuda.threadIdx.x, NO_BIN, cuda.blockDim.x):
        if block[b]:
            cuda.atomic.add(hist, b, block[b])


@cuda.jit
def _choose_bin_cuda(hist, state, shift):
    """One thread: choose_bin, then the histogram cleared for the next pass."""
    if cuda.grid(1) == 0:
        choose_bin(hist, state, shift)
        for b in range(hist.size):
            hist[b] = 0


@cuda.jit
def _count_cuda(bits, chunk, state, counts):
    c = cuda.grid(1)
    if c < counts.shape[0]:
        count_chunk(bits, c * chunk, chunk_end(c, chunk, bits.size), state[0], counts, c)


@cuda.jit
def _write_cuda(acc, bits, chunk, state, starts, inv_scale, out, values, indices):
    c = cuda.grid(1)
    if c < starts.shape[0]:
        write_chunk(acc, bits, c * chunk, chunk_end(c, chunk, acc.size), state[0], state[1],
                    starts[c, 0], starts[c, 1], inv_scale, out, values, indices)


@cuda.jit
def _add_pairs_cuda(bucket, indices, values):
    j = cuda.grid(1)
    if j < indices.size:
        add_pair(bucket, indices, values, j)


def _cuda_sizes():
    """(threads per block, elements per chunk); the simulator's are small."""
    from numba import config
    return (32, 16) if config.ENABLE_CUDASIM else (256, 256)


def select_cuda(grad, residual, out, k, values, indices, scale, inv_scale, parallel=True):
    """Numba CUDA version of select_numpy; every launch on CuPy's current stream, nothing
    waits for the host. The sum goes to a buffer of its own, which the kernels only read
    (through two views), so that no kernel writes an array it also reads through another
    view (the simulator copies each argument back after a launch)."""
    xp = array_module(out)
    threads, chunk = _cuda_sizes()
    n = out.size
    grid = min((n + threads - 1) // threads, 1024)
    chunks = (n + chunk - 1) // chunk
    acc = xp.empty(n, np.float32)
    bits = acc.view(np.int32)
    state = xp.asarray(np.array([0, k], np.int64))
    hist = xp.zeros(NO_BIN, np.int32)
    launch(_accumulate_cuda, grid, threads, grad, residual, acc, scale)
    for shift in SHIFTS:
        launch(_histogram_cuda, grid, threads, bits, state, shift, hist)
        launch(_choose_bin_cuda, 1, 1, hist, state, shift)
    counts = xp.empty((chunks, 2), np.int64)
    chunk_grid = math.ceil(chunks / threads)
    launch(_count_cuda, chunk_grid, threads, bits, chunk, state, counts)
    starts = scan_chunks(counts, state)
    launch(_write_cuda, chunk_grid, threads, acc, bits, chunk, state, starts, inv_scale, out,
           values, indices)


def scatter_sum_cuda(bucket, indices, values, parallel=True):
    """Numba CUDA version of scatter_sum_numpy: one launch per rank, in rank order."""
    threads, _ = _cuda_sizes()
    bucket[...] = 0
    for r in range(indices.shape[0]):
        launch(_add_pairs_cuda, math.ceil(indices.shape[1] / threads), threads, bucket,
               indices[r], values[r])


_SELECT = {"numpy": select_numpy, "numba": select_numba, "cuda": select_cuda}
_SCATTER = {"numpy": scatter_sum_numpy, "numba": scatter_sum_numba, "cuda": scatter_sum_cuda}
