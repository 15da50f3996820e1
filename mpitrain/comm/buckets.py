"""Fusion buckets of the gradient arena, and the reducer that sums them during backward.

Buckets. The gradient arena is laid out in the order backward produces the
gradients (last layer first), so a fusion bucket is a plain slice
`arena.grad[start:stop]`: nothing is packed or unpacked. `bucket_bounds` walks
the parameters in arena order and closes a bucket as soon as it holds at least
`threshold` bytes, so every cut is a parameter boundary, a tensor larger than
the threshold is a bucket of its own, and the layout depends only on the
segment table: identical on every rank. The default threshold, 4 MiB, is the
fastest slice size measured by `python -m mpitrain bench comm` on this host
(REFERENCES.md: ResNet-50's 25.6M fp32 gradients sum in 11 ms as 4 MiB slices,
39 ms as one all-reduce, 18 ms as 161 per-tensor calls).

Knowing when a bucket is ready. Every leaf module that owns parameters
(Conv2d, Linear, BatchNorm2d) gets its `backward` wrapped on the instance (as
mpitrain.inspect wraps `forward`): the wrapper calls the layer's own backward,
which has then written all of that layer's gradients, and counts those
parameters off their buckets. The layers themselves know nothing of it. A
bucket whose count reaches zero is ready; buckets are handed to communication
strictly in index order (a bucket ready early waits for the ones before it),
so every rank issues the same collectives in the same order whatever order
its layers finish in.

Overlap. MPICH progresses a non-blocking all-reduce only while some MPI call
runs (or with MPIR_CVAR_ASYNC_PROGRESS=1, which spins a core), and numpy's
backward makes no MPI calls for tens of milliseconds at a time. So the reducer
runs one communication thread that takes ready buckets from a queue and sums
each on the Communicator's own duplicated world communicator, while the main
thread goes on with backward (NumPy's BLAS and the Numba kernels release the
GIL). MPI must be initialised with MPI_THREAD_MULTIPLE (mpi4py's default): the
main thread may meanwhile run collectives on other communicators (distributed
BatchNorm's group sums). `finish()` waits until every bucket is summed. With
overlap off, `finish()` sums all buckets in order in the calling thread after
backward.

The thread must not spin. A blocking MPICH collective polls shared memory in
a busy loop until the other ranks arrive, and with one core per rank that loop
takes the core from backward. Measured with `mpirun -np 2 python -m mpitrain
bench step` (ResNet-50, 64x64, batch 32 per rank, 1 thread per rank, 19
buckets of 4 MiB, steps of both variants interleaved, on this 2-core host
shared with other jobs): a thread running blocking all-reduces made the step
260 ms LONGER than --no-overlap (the buckets took 440 ms instead of 50 ms),
while a flat all-reduce started with Iallreduce and tested every POLL seconds
with sleeps in between made it 53 ms shorter, of 95 ms of all-reduce in the
--no-overlap step (55% hidden; the wait after backward fell to 0.2 ms). So a
flat bucket goes that way, and shm (what `hybrid` picks for an arena in shared
memory, which is where the Reducer puts a host arena) waits for its node
barriers the same way, as tested Ibarriers; hierarchical and 2d are sequences
of blocking collectives and still block in the thread.
On the same host with little other load the all-reduce takes only 20-29 ms of
a 1.1 s step, and overlap did not pay: the wait after backward fell to 0.5-3 ms
but backward grew by 24-28 ms, the step by 13-36 ms (1-3%). With one core per
rank there is no idle core: the shared-memory all-reduce is itself copying and
adding on the rank's core, and the thread's Test calls take the GIL from
backward. Overlap pays where the transport works without the CPU (a network
card, NCCL on GPUs) or the host is oversubscribed; --no-overlap is the switch.
With shm (same benchmark, two runs on a busy host): the --no-overlap step
spent 10.6 and 41 ms in the all-reduce (1-2% of a 1.5-1.9 s step);
overlapped, 96-97% of it ran behind backward, yet the step was 74 and 9 ms
longer: on a rank's only core the polling thread costs backward more than
the little communication left to hide. Hence `train`'s default, --overlap
auto: overlapped for a GPU arena (NCCL runs on its own stream and links),
after backward for a host arena.
MPITRAIN_COMM_POLL=0 restores the blocking thread (to measure the difference).

On a GPU the hook first waits for the device stream, so the thread never
reads a gradient still being computed.

Each bucket's all-reduce is recorded as a span ("bucket i (n bytes)", category
"bucket") in the timeline: its total is the communication time of the step,
while the main thread's wait in `finish()` (category "comm" in train_step) is
the part that backward did not hide.

The reducer only sums; averaging over ranks is folded into the update's
inverse loss scale (train_step).
"""
import os
import queue
import threading
import time

import numpy as np

from mpitrain import backend
from mpitrain.arena import Param
from mpitrain.metrics import Timeline

from . import algorithms

DEFAULT_THRESHOLD = 4 << 20      # bytes
POLL = float(os.environ.get("MPITRAIN_COMM_POLL", 2e-4))   # seconds; 0: blocking collectives


def bucket_bounds(arena, threshold=DEFAULT_THRESHOLD):
    """[(start, stop), ...] element ranges of arena.grad, in arena order, each closed as
    soon as it reaches `threshold` bytes (cut at parameter boundaries)."""
    itemsize = np.dtype(arena.grad.dtype).itemsize
    bounds, start = [], 0
    for offset, size in zip(arena.segments["offset"], arena.segments["size"]):
        stop = int(offset) + int(size)
        if (stop - start) * itemsize >= threshold:
            bounds.append((start, stop))
            start = stop
    if start < arena.size or not bounds:
        bounds.append((start, int(arena.size)))
    return bounds


class Reducer:
    """Sums `model.arena.grad` over `comm` (an mpitrain.comm.Communicator) bucket by bucket.

        reducer = Reducer(model, comm, threshold=4 << 20, algorithm="hybrid")
        reducer.begin()          # before backward: arm the hooks
        model.backward(dy)       # buckets start summing as their gradients land
        reducer.finish()         # every bucket summed (in place), same bits on every rank

    wire_dtype=np.float16 sends each bucket as float16 (cast into the Communicator's
    reused wire buffer, summed there, cast back). overlap=False sums all buckets
    after backward, in the caller's thread.
    """

    def __init__(self, model, comm, threshold=DEFAULT_THRESHOLD, algorithm="hybrid",
                 wire_dtype=None, overlap=True, timeline=None):
        self.comm, self.algorithm, self.overlap = comm, algorithm, overlap
        self.wire_dtype = None if wire_dtype is None else np.dtype(wire_dtype)
        self.timeline = timeline or Timeline.off()
        arena = model.arena
        # on every node, sharing memory or not, so that hybrid chooses alike everywhere
        if algorithm in ("shm", "hybrid") and backend.array_module(arena.grad) is np \
                and comm.peers(arena.grad) is None:
            arena.rebind_grad(comm.shared_zeros(arena.size, arena.grad.dtype))
        self.arena = arena
        self.bounds = bucket_bounds(model.arena, threshold)
        starts = [a for a, _ in self.bounds]
        bucket_of = {id(p): int(np.searchsorted(starts, p.offset, side="right")) - 1
                     for p in model.arena.params}
        self.counts = np.zeros(len(self.bounds), np.int64)   # parameters per bucket
        for p in model.arena.params:
            self.counts[bucket_of[id(p)]] += 1
        self.pending = self.counts.copy()
        self.next = len(self.bounds)        # next bucket to hand over; all handed over: idle
        self.armed = False
        self.error = None
        self._queue = self._thread = None
        for _, m in model.named_modules():
            own = [p for _, p in m._items() if isinstance(p, Param)]     # its own, not its children's
            if own:
                _hook_backward(m, self, [bucket_of[id(p)] for p in own])

    # ----- one step -----
    def begin(self):
        """Arm the hooks for one backward pass."""
        self.pending[:] = self.counts
        self.next, self.error, self.armed = 0, None, True
        if self.overlap and self._thread is None:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._serve, name="mpitrain-allreduce",
                                            daemon=True)
            self._thread.start()

    def written(self, buckets):
        """Backward has written the gradients of one layer (its parameters' buckets)."""
        if not (self.armed and self.overlap):
            return
        for b in buckets:
            self.pending[b] -= 1
        if self.next < len(self.bounds) and self.pending[self.next] == 0:
            backend.synchronize()           # the gradients must be in memory before MPI reads them
            while self.next < len(self.bounds) and self.pending[self.next] == 0:
                self._queue.put(self.next)
                self.next += 1

    def finish(self):
        """Sum every bucket not yet summed and return once all are (same bits on every rank)."""
        self.armed = False
        if self.overlap:
            if self.next < len(self.bounds):
                backend.synchronize()
            for b in range(self.next, len(self.bounds)):
                self._queue.put(b)
            self.next = len(self.bounds)
            self._queue.join()
            if self.error is not None:
                raise self.error
        else:
            backend.synchronize()
            for b in range(len(self.bounds)):
                self._reduce(b)

    def close(self):
        """Stop the communication thread (after a finish())."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    # ----- the communication thread -----
    def _reduce(self, b):
        start, stop = self.bounds[b]
        t0 = time.perf_counter()
        buf = self.arena.grad[start:stop]
        if self.overlap and POLL and backend.array_module(buf) is np:
            self._reduce_politely(buf)
        else:
            self.comm.allreduce(buf, self.algorithm, wire_dtype=self.wire_dtype)
        nbytes = (stop - start) * (self.wire_dtype or self.arena.grad.dtype).itemsize
        self.timeline.add(f"bucket {b} ({nbytes} bytes)", "bucket", t0, time.perf_counter())

    def _reduce_politely(self, buf):
        """The communication thread's all-reduce of a host bucket, without spinning a core.

        A blocking MPICH collective polls the shared memory in a loop until the other
        ranks arrive: in the communication thread that loop takes the core from
        backward. A flat all-reduce is therefore started as Iallreduce, and shm's
        barriers as Ibarrier, and tested every POLL seconds, sleeping in between
        (each Test moves the collective on), until backward is over (finish()
        disarms the reducer), when they simply wait; hierarchical and 2d are
        compositions of blocking collectives and run as such.
        """
        from mpi4py import MPI
        wire = buf
        if self.wire_dtype is not None and self.wire_dtype != buf.dtype:
            wire = algorithms.cast_into(
                self.comm.scratch(self.wire_dtype, buf.size, like=buf, purpose="wire"), buf)
        algorithm = self.algorithm
        if algorithm == "hybrid":
            algorithm = algorithms.choose(self.comm, wire.nbytes, wire.dtype,
                                          shared=self.comm.peers(wire) is not None)
        if algorithm == "flat":
            dt, op = algorithms.wire(wire)
            self._wait(self.comm.world.Iallreduce(MPI.IN_PLACE, [wire, dt], op=op))
        elif algorithm == "shm":
            algorithms.shm(self.comm, wire, wait=self._wait)
        else:
            self.comm.allreduce(wire, algorithm)
        if wire is not buf:
            algorithms.cast_into(buf, wire)

    def _wait(self, request):
        """Complete `request`, testing it every POLL seconds while backward runs."""
        while not request.Test():
            if not self.armed:          # backward is over: nothing left to make room for
                request.Wait()
                return
            time.sleep(POLL)

    def _serve(self):
        if backend.array_module(self.arena.grad) is not np:
            self.arena.grad.device.use()    # CuPy's current device is per thread
        while True:
            b = self._queue.get()
            if b is None:
                self._queue.task_done()
                return
            try:
                if self.error is None:
                    self._reduce(b)
            except BaseException as e:      # re-raised in the main thread by finish()
                self.error = e
            finally:
                self._queue.task_done()


def _hook_backward(module, reducer, buckets):
    """Wrap module.backward on the instance: after it has written the module's gradients,
    tell the reducer which buckets they belong to."""
    backward = module.backward

    def backward_then_notify(dy):
        dx = backward(dy)
        reducer.written(buckets)
        return dx
    module.backward = backward_then_notify
