"""Fusion buckets of the gradient arena, and the reducer that sums them during backward.

Buckets. The gradient arena is laid out in the order backward produces the
gradients (last layer first), so a fusion bucket is a plain slice
`arena.grad[start:stop]`: nothing is packed or unpacked. `bucket_bounds` walks
the parameters in arena order and closes a bucket as soon as it holds at least
`threshold` bytes, so every cut is a parameter boundary, a tensor larger than
the threshold is a bucket of its own, and the layout depends only on the
segment table: identical on every rank. The default threshold, 4 MiB, is the
fastest slice size `python -m mpitrain bench comm` found (docs/benchmarks-record.md):
fewer, larger calls than one per tensor, yet early enough to start during
backward.

Knowing when a bucket is ready. A layer's backward calls `param.grad_ready()`
for each parameter as soon as its gradient is written (nets/conv.py, linear.py,
batchnorm.py), and the arena passes that on to its `on_grad_ready` listener:
the Reducer sets itself there when it is built and clears it on `close()`.
It counts the parameter off its bucket; a bucket whose count reaches zero is
ready. Buckets are handed to communication strictly in index order (a bucket
ready early waits for the ones before it), so every rank issues the same
collectives in the same order whatever order its layers finish in.

Overlap. MPICH progresses a non-blocking all-reduce only while some MPI call
runs, and NumPy's backward makes no MPI calls for long stretches at a
time. So with overlap the reducer runs one communication thread that takes
ready buckets from a queue and sums each through `Communicator.allreduce` (the
Communicator's own duplicated world communicator), while the main thread goes
on with backward (BLAS and the Numba kernels release the GIL). MPI must be
initialised with MPI_THREAD_MULTIPLE (mpi4py's default): the main thread may
meanwhile run collectives on other communicators (distributed BatchNorm's
group sums). `finish()` waits until every bucket is summed. With overlap off,
`finish()` sums all buckets in order in the calling thread after backward.

The thread must not spin: a blocking MPICH collective polls shared memory in a
busy loop until the other ranks arrive, and with one core per rank that loop
takes the core from backward. So the thread hands `allreduce` a `wait`
function: flat buckets start as Iallreduce and shm's node barriers as
Ibarrier, tested every POLL seconds with sleeps in between until backward is
over, when they simply wait (hierarchical and 2d are sequences of blocking
collectives and still block). MPITRAIN_COMM_POLL=0 restores blocking calls.
Even so, on a CPU host every rank's core is busy: the shared-memory sum is
itself copying and adding on that core, and the polling takes the GIL from
backward, so overlap does not pay there (measurements in docs/benchmarks-record.md).
It pays where the transport works without the CPU (NCCL on GPUs, a network
card). Hence `train`'s default, --overlap auto: overlapped for a GPU arena,
after backward for a host arena.

On a GPU nothing here blocks the host. Backward queues its kernels on the
compute stream (CuPy's current stream); when a bucket is complete the reducer
records an event there, makes the communication stream (backend.comm_stream)
wait for it, and queues the bucket's NCCL all-reduce on the communication
stream. NCCL calls only enqueue work and return, so with NCCL there is no
communication thread at all: the buckets are queued from the listener, in
index order, while backward goes on queueing its own kernels. `finish()`
records an event on the communication stream after the last bucket and makes
the compute stream wait for it, so the update, queued next on the compute
stream, runs after every sum without the host ever waiting. The fp16 wire
casts run there too (mpitrain.kernels launch on CuPy's current stream). Between
begin() and finish() the buckets' NCCL calls are the only ones queued on the
Communicator's NCCL communicators, so they cannot interleave with another
collective in another order on another rank.

Without NCCL, device buckets go through MPI, which reads host memory (or
device memory, but only once it is written): the communication thread, when
overlapping, makes the communication stream wait for the bucket's event and
`Communicator.staged` then synchronises that stream before MPI reads, which
waits for exactly the kernels that wrote the bucket while the main thread
goes on. The order of all these calls is written against
backend.HostStreams / CudaStreams; for host arrays every call is a no-op, so
a host arena behaves as without streams.

Each bucket's all-reduce is recorded as a span ("bucket i (n bytes)", category
"bucket") in the timeline: its total is the communication time of the step,
while the main thread's wait in `finish()` (category "comm" in train_step) is
the part that backward did not hide. With NCCL the span is only the time to
queue the bucket; the device time shows where the host next waits.

Top-k sparsification (density=D): instead of an all-reduce, each bucket goes through
mpitrain.comm.topk.TopK.exchange: every rank's k = ceil(D n) largest entries (after
adding its residual) all-gathered and added in rank order, the rest kept as the
residual for the next step. The step then ends with `settle(applied)`, which keeps
the new residuals only when the step was applied (not skipped on overflow); begin()
takes the loss scale, since the residual is kept unscaled.

Averaging. The reducer sums; dividing by the number of ranks is folded into
the update's inverse loss scale (`postscale`). With float16 on the wire the
gradients are divided before they are summed instead (Horovod's prescale), so
that the sum's range, and the chance of a float16 overflow, does not grow with
the number of ranks; `postscale` is then 1.
"""
import os
import queue
import threading
import time

import numpy as np

from mpitrain import backend
from mpitrain.kernels.update import nonfinite_flag
from mpitrain.metrics import Timeline

from .topk import TopK

DEFAULT_THRESHOLD = 4 << 20      # bytes


def poll_seconds(name="MPITRAIN_COMM_POLL", default=2e-4):
    """The seconds between tests of a started collective (0: blocking collectives): the
    environment variable `name` where set, else `default`. Anything but a number >= 0 is
    refused naming the variable (checks.ConfigError: one line, exit status 2)."""
    import argparse

    from mpitrain.argtypes import nonnegative_float
    from mpitrain.checks import ConfigError
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        return nonnegative_float(text)
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"{name}={text}: {e}; it takes the seconds between tests of a "
                          f"started all-reduce, a number >= 0 (0: blocking collectives): "
                          f"fix it, or unset it for {default:g}") from None


POLL = poll_seconds()


def bucket_bounds(arena, threshold=DEFAULT_THRESHOLD):
    """[(start, stop), ...] element ranges of arena.grad, in arena order, each from its
    first parameter's start to its last parameter's end, closed as soon as it reaches
    `threshold` bytes. The padding between two buckets belongs to neither."""
    itemsize = np.dtype(arena.grad.dtype).itemsize
    bounds, start = [], None
    for offset, size in zip(arena.segments["offset"], arena.segments["size"]):
        start = int(offset) if start is None else start
        stop = int(offset) + int(size)
        if (stop - start) * itemsize >= threshold:
            bounds.append((start, stop))
            start = None
    if start is not None:
        bounds.append((start, stop))
    return bounds


def share_gradients(arena, comm, algorithm):
    """Place a host arena's gradients in the node's shared memory (Communicator.shared_zeros),
    where the shm algorithm adds the node's copies in place. Done on every node, sharing
    memory or not, so that `hybrid` chooses alike everywhere; a no-op for device arenas
    and for algorithms that never use shm."""
    if algorithm in ("shm", "hybrid") and backend.array_module(arena.grad) is np \
            and comm.peers(arena.grad) is None:
        arena.rebind_grad(comm.shared_zeros(arena.size, arena.grad.dtype))


class Reducer:
    """Sums `arena.grad` over `comm` (an mpitrain.comm.Communicator) bucket by bucket.

        reducer = Reducer(model.arena, comm, threshold=4 << 20, algorithm="hybrid")
        reducer.begin()          # before backward
        model.backward(dy)       # buckets start summing as their gradients land
        reducer.finish()         # every bucket summed (in place), same bits on every rank
        grad * reducer.postscale # the mean over the ranks
        reducer.nonfinite_flag() # the loss scaler's overflow flag, alike on every rank
        reducer.close()          # the arena forgets the reducer

    wire_dtype=np.float16 sends each bucket as float16 (cast into the Communicator's
    reused wire buffer, summed there, cast back). overlap=False sums all buckets
    after backward, in the caller's thread. On a GPU, "summed" after finish() means
    "ordered before any later work on the compute stream" (see the module docstring).
    threaded: run the overlapped sums in a communication thread (default: when the
    collectives block the host, i.e. unless the arena is on a GPU with NCCL).
    streams: the backend.HostStreams-like object that orders the work (default: the
    arena's device's, backend.streams).
    density: top-k sparsification of every bucket at this density (mpitrain.comm.topk;
    None: dense sums), after `dense_epochs` epochs of dense sums (start_epoch says which
    epoch it is). The Reducer owns top-k's state: `residual` (checkpointed by the run),
    carried over to the next Reducer of the same arena by take_over().
    """

    def __init__(self, arena, comm, threshold=DEFAULT_THRESHOLD, algorithm="hybrid",
                 wire_dtype=None, overlap=True, timeline=None, threaded=None, streams=None,
                 density=None, dense_epochs=0):
        if arena.on_grad_ready is not None:
            raise ValueError("this arena already has a Reducer; close() it first")
        self.comm, self.algorithm, self.overlap = comm, algorithm, overlap
        self.wire_dtype = None if wire_dtype is None else np.dtype(wire_dtype)
        self.timeline = timeline or Timeline.off()
        self.arena = arena
        self.bounds = bucket_bounds(arena, threshold)
        if density is not None and self.wire_dtype not in (None, arena.grad.dtype):
            raise ValueError("top-k sends its values in the gradient's dtype; drop wire_dtype")
        self.topk = None if density is None else TopK(arena, self.bounds, density)
        self.dense_epochs = dense_epochs
        self.loss_scale = 1.0
        half = self.wire_dtype is not None and self.wire_dtype.itemsize < arena.grad.dtype.itemsize
        self.prescale = 1.0 / comm.size if half else None
        self.postscale = 1.0 if half else 1.0 / comm.size
        starts = [a for a, _ in self.bounds]
        self.bucket_of = {id(p): int(np.searchsorted(starts, p.offset, side="right")) - 1
                          for p in arena.params}
        self.counts = np.bincount(list(self.bucket_of.values()), minlength=len(self.bounds))
        self.pending = self.counts.copy()
        self.next = len(self.bounds)        # next bucket to hand over; all handed over: idle
        self.armed = False
        self.error = None
        on_device = backend.array_module(arena.grad) is not np
        self.streams = streams or backend.streams(arena.grad)
        if threaded is None:                # NCCL only queues work: nothing to wait for
            threaded = not (on_device and comm.nccl() is not None)
        self.threaded = threaded
        self._queue = self._thread = None
        arena.on_grad_ready = self.ready

    # ----- top-k's state across steps -----
    @property
    def residual(self):
        """What top-k held back of this rank's gradients (arena layout), None without top-k."""
        return None if self.topk is None else self.topk.residual

    def start_epoch(self, epoch):
        """Top-k sends sparse sums from epoch `dense_epochs` on, dense ones before it."""
        if self.topk is not None:
            self.topk.active = epoch >= self.dense_epochs

    def take_over(self, previous):
        """Go on from `previous`, the closed Reducer of this arena with other buckets
        (the fusion tuner trying another size): top-k's residuals carry over."""
        if self.topk is not None:
            self.topk.carry_over(previous.topk)

    def describe_compression(self):
        """A line on top-k for the run's start, None without it."""
        if self.topk is None:
            return None
        return (f"top-k: each bucket's {self.topk.density:g} largest fraction sent, the rest "
                f"kept as a residual ({self.topk.bytes_per_step():,} bytes sent per rank per "
                f"step); dense for the first {self.dense_epochs} epoch(s)")

    # ----- one step -----
    def begin(self, loss_scale=1.0):
        """Arm the listener for one backward pass, whose gradients are `loss_scale` times
        the loss's."""
        self.loss_scale = loss_scale
        self.pending[:] = self.counts
        self.next, self.error, self.armed = 0, None, True
        if self.overlap and self.threaded and self._thread is None:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._serve, name="mpitrain-allreduce",
                                            daemon=True)
            self._thread.start()

    def ready(self, param):
        """Backward has written `param`'s gradient (the arena's on_grad_ready)."""
        if not (self.armed and self.overlap):
            return
        self.pending[self.bucket_of[id(param)]] -= 1
        stop = self.next
        while stop < len(self.bounds) and self.pending[stop] == 0:
            stop += 1
        if stop > self.next:
            self._hand_over(stop)

    def finish(self):
        """Sum every bucket not yet summed and return once all are (same bits on every
        rank; on a GPU: once the compute stream is ordered after every sum)."""
        self.armed = False
        if not self.overlap:
            self.next = 0
        if self.next < len(self.bounds):
            self._hand_over(len(self.bounds))
        if self._thread is not None:
            self._queue.join()
            if self.error is not None:
                raise self.error
        s = self.streams
        s.wait(s.current(), s.record(s.comm()))     # the update comes after the last sum

    def nonfinite_flag(self):
        """1 when the summed gradient holds an inf or a NaN, else 0 (kernels.update's
        nonfinite_flag, left on the device): its bits are the same on every rank, so the
        verdict is too, without a vote."""
        return nonfinite_flag(self.arena.grad)

    def settle(self, applied):
        """The step's overflow verdict (applied: not skipped); top-k keeps this step's
        residuals only when it was applied."""
        if self.topk is not None:
            self.topk.settle(applied)

    def close(self):
        """Stop the communication thread (after a finish()) and detach from the arena."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self.arena.on_grad_ready == self.ready:
            self.arena.on_grad_ready = None

    # ----- handing buckets to communication -----
    def _hand_over(self, stop):
        """Buckets next..stop-1 are complete on the compute stream: sum them after it, in
        the communication thread if there is one, else queued from here."""
        done = self.streams.record(self.streams.current())
        for b in range(self.next, stop):
            if self._thread is not None:
                self._queue.put((b, done))
            else:
                self._reduce(b, done)
        self.next = stop

    def _reduce(self, b, written):
        """Sum bucket b on the communication stream, after the event `written`."""
        s = self.streams
        comm_stream = s.comm()
        s.wait(comm_stream, written)
        start, stop = self.bounds[b]
        t0 = time.perf_counter()
        buf = self.arena.grad[start:stop]
        polite = self._thread is not None and POLL and backend.array_module(buf) is np
        wait = self._wait if polite else None
        with s.using(comm_stream):
            if self.topk is not None and self.topk.active:
                nbytes = self.topk.exchange(self.comm, b, buf, self.loss_scale, wait)
            else:
                self.comm.allreduce(buf, self.algorithm, self.wire_dtype, self.prescale, wait=wait)
                nbytes = (stop - start) * (self.wire_dtype or self.arena.grad.dtype).itemsize
        self.timeline.add(f"bucket {b} ({nbytes} bytes)", "bucket", t0, time.perf_counter())

    def _wait(self, request):
        """Complete `request`, testing it every POLL seconds while backward runs."""
        while not request.Test():
            if not self.armed:          # backward is over: nothing left to make room for
                request.Wait()
                return
            time.sleep(POLL)

    # ----- the communication thread -----
    def _serve(self):
        if backend.array_module(self.arena.grad) is not np:
            self.arena.grad.device.use()    # CuPy's current device is per thread
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                if self.error is None:
                    self._reduce(*item)
            except BaseException as e:      # re-raised in the main thread by finish()
                self.error = e
            finally:
                self._queue.task_done()
