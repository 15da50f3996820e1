"""The parameter arena: every parameter of a model in a few flat buffers.

    master    fp32 (or float64 for checks)  the weights the optimizer updates
    working   the dtype the layers compute in: the master itself in fp32, an
              fp16 copy under mixed precision (refreshed by the update kernel)
    grad      the dtype of master; backward writes each gradient straight here
    momentum  the dtype of master; optimizer state (None under a sharded update,
              whose optimizer holds its shard's: mpitrain.shard)

Parameters sit in the order backward produces their gradients (last layer
first), so a fusion bucket is a contiguous slice that is complete as soon as
backward passes its first parameter. Every `Param` holds views of its slice.

Every parameter starts on an ALIGN_BYTES (256-byte) boundary of every buffer:
cuDNN's graph API assumes 16-byte aligned tensors and vector loads prefer 64.
The elements between two parameters are padding: zero, never a parameter,
skipped by the kernels and left out of checkpoints (`pack` / `unpack`).

The segment table (offset, size, decay, lars per parameter) is what the
optimizer kernels read; it is a pure function of the model, hence identical on
every rank.

When backward has written a parameter's gradient, the layer calls
`param.grad_ready()`, which calls the arena's `on_grad_ready(param)` if one is
set: that is how the gradient Reducer (mpitrain.comm.buckets) learns that a
bucket is complete. Nothing else is hooked.
"""
import numpy as np

from . import backend

ALIGN_BYTES = 256
# the smallest dtype a buffer can have is fp16: offsets in multiples of this many
# elements are ALIGN_BYTES-aligned in every buffer (master, working, grad, momentum)
ALIGN = ALIGN_BYTES // 2


def aligned_zeros(n, dtype, xp=None):
    """n zeros of `dtype` starting on an ALIGN_BYTES boundary (CuPy's allocator
    aligns by itself; NumPy's only to 16 bytes, so a NumPy array is a view into a
    slightly larger one)."""
    xp = xp or backend.xp
    dtype = np.dtype(dtype)
    if xp is not np:
        return xp.zeros(n, dtype)
    raw = np.zeros(n * dtype.itemsize + ALIGN_BYTES, np.uint8)
    skip = -raw.ctypes.data % ALIGN_BYTES
    return raw[skip:skip + n * dtype.itemsize].view(dtype)


def aligned_offsets(sizes):
    """(offsets, total): each size placed at the next multiple of ALIGN elements."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + size
    return offsets, -(-end // ALIGN) * ALIGN


class Param:
    """A learnable tensor: its shape, its flags, and (once bound) its arena views.

    decay: weight decay applies; lars: the LARS/LAMB trust ratio applies.
    init: callable (rng, shape) -> numpy array, run once when the arena is built.
    """

    def __init__(self, shape, init, decay=True, lars=True):
        self.shape = tuple(int(s) for s in shape)
        self.init = init
        self.decay = decay
        self.lars = lars
        self.name = None
        self.offset = None
        self.arena = None
        self.master = self.data = self.grad = self.momentum = None

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    def grad_ready(self):
        """Backward has written this parameter's gradient: tell the arena's listener."""
        if self.arena.on_grad_ready is not None:
            self.arena.on_grad_ready(self)

    def __repr__(self):
        return f"Param({self.name!r}, shape={self.shape}, decay={self.decay}, lars={self.lars})"


class Buffer:
    """A non-learnable tensor kept with the model (BatchNorm running statistics)."""

    def __init__(self, shape, fill):
        self.shape = tuple(int(s) for s in shape)
        self.fill = fill
        self.name = None
        self.data = None

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))


SEGMENT_DTYPE = np.dtype([("offset", np.int64), ("size", np.int64),
                          ("decay", np.bool_), ("lars", np.bool_)])


class _Packing:
    """Aligned offsets of `items` (Params or Buffers) in a flat buffer, and the
    conversion between that padded buffer and the packed (unpadded) layout."""

    def _place(self, items):
        offsets, self.size = aligned_offsets([t.size for t in items])
        self.offsets = np.asarray(offsets, np.int64)
        self.sizes = np.asarray([t.size for t in items], np.int64)
        return offsets

    def pack(self, buf):
        """A host copy of `buf` (this layout) without the padding: the items one after
        another, as checkpoints store them."""
        host = backend.to_numpy(buf)
        if not self.sizes.size:
            return host[:0].copy()
        return np.concatenate([host[o:o + n] for o, n in zip(self.offsets, self.sizes)])

    def unpack(self, packed, buf):
        """Write `packed` (as from `pack`) into `buf`, leaving the padding as it is."""
        xp = backend.array_module(buf)
        starts = np.concatenate([[0], np.cumsum(self.sizes)])
        if packed.size != starts[-1]:
            raise ValueError(f"{packed.size} packed values for a layout of {starts[-1]}")
        for o, n, s in zip(self.offsets, self.sizes, starts):
            buf[o:o + n] = xp.asarray(packed[s:s + n])


class Arena(_Packing):
    """Flat buffers for `params`, given in arena order (the order of backward)."""

    def __init__(self, params, dtype=np.float32, working_dtype=None, xp=None):
        self.xp = xp or backend.xp
        self.params = list(params)
        self.dtype = np.dtype(dtype)
        self.working_dtype = np.dtype(working_dtype or dtype)
        offsets = self._place(self.params)
        self.master = self.zeros()
        self.grad = self.zeros()
        self.momentum = self.zeros()
        self.working = (self.master if self.working_dtype == self.dtype
                        else self.zeros(self.working_dtype))
        self.segments = np.zeros(len(self.params), SEGMENT_DTYPE)
        self.on_grad_ready = None       # callable(param), set by a gradient Reducer
        for i, (p, offset) in enumerate(zip(self.params, offsets)):
            p.offset, p.arena = offset, self
            sl = slice(offset, offset + p.size)
            p.master = self.master[sl].reshape(p.shape)
            p.data = self.working[sl].reshape(p.shape)
            p.grad = self.grad[sl].reshape(p.shape)
            p.momentum = self.momentum[sl].reshape(p.shape)
            self.segments[i] = (offset, p.size, p.decay, p.lars)

    def zeros(self, dtype=None):
        """A zero buffer of the arena's size (aligned), e.g. optimizer state beside momentum."""
        return aligned_zeros(self.size, dtype or self.dtype, self.xp)

    def rebind_grad(self, buf):
        """Move the gradients into `buf` (same size and dtype, ALIGN_BYTES-aligned; e.g.
        the node's shared memory), pointing every parameter's `grad` view at it."""
        if buf.shape != self.grad.shape or buf.dtype != self.grad.dtype:
            raise ValueError(f"gradient buffer must be {self.grad.shape} {self.grad.dtype}, "
                             f"got {buf.shape} {buf.dtype}")
        if _address(buf) % ALIGN_BYTES:
            raise ValueError(f"gradient buffer must start on a {ALIGN_BYTES}-byte boundary")
        buf[...] = self.grad
        self.grad = buf
        for p in self.params:
            p.grad = buf[p.offset:p.offset + p.size].reshape(p.shape)

    def release_momentum(self):
        """Free the momentum buffer: a sharded update (mpitrain.shard) keeps the optimizer
        state of its shard only. arena.momentum and every param.momentum become None."""
        self.momentum = None
        for p in self.params:
            p.momentum = None

    def sync_working(self):
        """Refresh the working copy from the master weights (a no-op when they are one buffer)."""
        if self.working is not self.master:
            self.working[...] = self.master

    def __repr__(self):
        return (f"Arena({len(self.params)} params, {self.size:,} elements, "
                f"master {self.dtype}, working {self.working_dtype})")


class BufferArena(_Packing):
    """One flat buffer for the model's non-learnable tensors, so that they can be
    broadcast, averaged across ranks and checkpointed as one array."""

    def __init__(self, buffers, dtype=np.float32, xp=None):
        self.buffers = list(buffers)
        offsets = self._place(self.buffers)
        self.data = aligned_zeros(self.size, dtype, xp)
        for b, offset in zip(self.buffers, offsets):
            b.data = self.data[offset:offset + b.size].reshape(b.shape)
            b.data[...] = b.fill


def _address(a):
    """The device or host address of an array's first element."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data
