"""The parameter arena: every parameter of a model in a few flat buffers.

    master    fp32 (or float64 for checks)  the weights the optimizer updates
    working   the dtype the layers compute in: the master itself in fp32, an
              fp16 copy under mixed precision (refreshed by the update kernel)
    grad      the dtype of master; backward writes each gradient straight here
    momentum  the dtype of master; optimizer state

Parameters sit in the order backward produces their gradients (last layer
first), so a fusion bucket is a contiguous slice that is complete as soon as
backward passes its first parameter. Every `Param` holds views of its slice.

The segment table (offset, size, decay, lars per parameter) is what the
optimizer kernels read; it is a pure function of the model, hence identical on
every rank.
"""
import numpy as np

from . import backend


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
        self.master = self.data = self.grad = self.momentum = None

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

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


class Arena:
    """Flat buffers for `params`, given in arena order (the order of backward)."""

    def __init__(self, params, dtype=np.float32, working_dtype=None, xp=None):
        xp = xp or backend.xp
        self.params = list(params)
        self.dtype = np.dtype(dtype)
        self.working_dtype = np.dtype(working_dtype or dtype)
        self.size = sum(p.size for p in self.params)
        self.master = xp.zeros(self.size, self.dtype)
        self.grad = xp.zeros(self.size, self.dtype)
        self.momentum = xp.zeros(self.size, self.dtype)
        self.working = (self.master if self.working_dtype == self.dtype
                        else xp.zeros(self.size, self.working_dtype))
        self.segments = np.zeros(len(self.params), SEGMENT_DTYPE)
        offset = 0
        for i, p in enumerate(self.params):
            p.offset = offset
            sl = slice(offset, offset + p.size)
            p.master = self.master[sl].reshape(p.shape)
            p.data = self.working[sl].reshape(p.shape)
            p.grad = self.grad[sl].reshape(p.shape)
            p.momentum = self.momentum[sl].reshape(p.shape)
            self.segments[i] = (offset, p.size, p.decay, p.lars)
            offset += p.size

    def rebind_grad(self, buf):
        """Move the gradients into `buf` (same size and dtype, e.g. the node's shared
        memory), pointing every parameter's `grad` view at it."""
        if buf.shape != self.grad.shape or buf.dtype != self.grad.dtype:
            raise ValueError(f"gradient buffer must be {self.grad.shape} {self.grad.dtype}, "
                             f"got {buf.shape} {buf.dtype}")
        buf[...] = self.grad
        self.grad = buf
        for p in self.params:
            p.grad = buf[p.offset:p.offset + p.size].reshape(p.shape)

    def sync_working(self):
        """Refresh the working copy from the master weights (a no-op when they are one buffer)."""
        if self.working is not self.master:
            self.working[...] = self.master

    def __repr__(self):
        return (f"Arena({len(self.params)} params, {self.size:,} elements, "
                f"master {self.dtype}, working {self.working_dtype})")


class BufferArena:
    """One flat buffer for the model's non-learnable tensors, so that they can be
    broadcast, averaged across ranks and checkpointed as one array."""

    def __init__(self, buffers, dtype=np.float32, xp=None):
        xp = xp or backend.xp
        self.buffers = list(buffers)
        self.size = sum(b.size for b in self.buffers)
        self.data = xp.zeros(self.size, dtype)
        offset = 0
        for b in self.buffers:
            b.data = self.data[offset:offset + b.size].reshape(b.shape)
            b.data[...] = b.fill
            offset += b.size
