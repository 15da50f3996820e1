"""Fusion buckets and the Reducer under `mpirun -np N` (any N).

Every rank computes its verdict, the verdicts are gathered and every rank asserts
on all of them (test_data_parallel.agree), so no rank is left waiting in a collective.
"""
import contextlib
import threading

import numpy as np
import pytest
from mpi4py import MPI

from mpitrain.backend import HostStreams
from mpitrain.comm import ALGORITHMS, Communicator
from mpitrain.comm.buckets import bucket_bounds, share_gradients
from mpitrain.nets import build_model
from mpitrain.nets.losses import softmax_cross_entropy
from mpitrain.optim import SGD
from mpitrain.precision import LossScaler
from mpitrain.train import broadcast_model, train_step
from test_data_parallel import agree, digest, reducer_for, serial_steps, small_net

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("threshold", [1, 4096, 300_000, 1 << 30])
def test_buckets_cover_every_parameter_once_in_order_and_agree_across_ranks(threshold):
    def check():
        arena = build_model("resnet_small", num_classes=10).arena
        bounds = bucket_bounds(arena, threshold)
        starts = [int(o) for o in arena.segments["offset"]]
        ends = [int(o + n) for o, n in arena.segments[["offset", "size"]]]
        if bounds[0][0] != starts[0] or bounds[-1][1] != ends[-1]:
            return (f"buckets span {bounds[0][0]}..{bounds[-1][1]}, parameters "
                    f"{starts[0]}..{ends[-1]}")
        if any(a[1] > b[0] for a, b in zip(bounds, bounds[1:])):
            return "buckets overlap"
        if any(a >= b or a not in starts or b not in ends for a, b in bounds):
            return "a bucket is empty or cuts a parameter"
        covered = sum(any(a <= s and e <= b for a, b in bounds) for s, e in zip(starts, ends))
        if covered != len(starts):
            return f"{len(starts) - covered} parameter(s) in no bucket"
        small = [b - a for a, b in bounds[:-1] if (b - a) * 4 < threshold]
        if small:
            return f"buckets below the threshold before the last: {small}"
        if threshold == 1 and len(bounds) != len(arena.segments):
            return "a 1-byte threshold must give one bucket per parameter"
        if WORLD.allgather(bounds) != [bounds] * WORLD.size:
            return "bucket layouts differ between ranks"
        return None
    agree(check)


def _backward(model, x, y):
    loss, dlogits = softmax_cross_entropy(model.forward(x, train=True), y)
    model.backward(dlogits)


def test_shared_gradients_stay_aligned_and_keep_their_values(comm):
    """share_gradients moves a host arena's gradients into the node's shared memory
    (what shm sums in place), aligned as every arena buffer, and backward writes there."""
    def check():
        model = small_net(seed=0)
        model.arena.grad[...] = np.arange(model.arena.size) % 7
        before = model.arena.grad.copy()
        share_gradients(model.arena, comm, "hybrid")
        grad = model.arena.grad
        if comm.peers(grad) is None:
            return "the arena is not registered as shared (hybrid would choose unlike other nodes)"
        if (comm.peers(grad)[0] is not None) != comm.shares_memory:
            return f"arena in a window: {comm.peers(grad)[0] is not None}, node shares memory: " \
                   f"{comm.shares_memory}"
        if not np.array_equal(grad, before):
            return "the gradients changed when the arena moved"
        misaligned = [p.name for p in model.arena.params if p.grad.ctypes.data % 256
                      or not np.shares_memory(p.grad, grad)]
        if misaligned:
            return f"grad views not 256-byte aligned in the shared arena: {misaligned}"
        rng = np.random.default_rng(WORLD.rank)
        grad[...] = 0
        _backward(model, rng.standard_normal((2, 8, 8, 3)).astype(np.float32),
                  rng.integers(0, 5, 2))
        if not np.any(grad):
            return "backward did not write into the shared arena"
        return None
    agree(check)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("wire", [None, np.float16], ids=["fp32-wire", "fp16-wire"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reducer_sums_every_ranks_gradients(comm, algorithm, overlap, wire):
    """After finish(), grad * postscale is the mean of every rank's backward gradients
    (float64 reference; fp16 on the wire: within its rounding), with the same bits on
    every rank, whatever the algorithm; with overlap the buckets start during backward,
    without it after."""
    def check():
        model = small_net(seed=0)
        reducer = reducer_for(model, comm, algorithm, threshold=100, wire_dtype=wire,
                              overlap=overlap)
        if len(reducer.bounds) < 3:
            return f"only {len(reducer.bounds)} bucket(s): the test would prove little"
        grads = []
        for r in range(WORLD.size):             # every rank's gradient, computed here
            rng = np.random.default_rng(r)
            _backward(model, rng.standard_normal((2, 8, 8, 3)).astype(np.float32),
                      rng.integers(0, 5, 2))
            grads.append(model.arena.grad.astype(np.float64))
        rng = np.random.default_rng(WORLD.rank)
        reducer.begin()
        _backward(model, rng.standard_normal((2, 8, 8, 3)).astype(np.float32),
                  rng.integers(0, 5, 2))
        handed_over = reducer.next
        reducer.finish()
        reducer.close()
        mean = np.mean(grads, axis=0)
        got = model.arena.grad * reducer.postscale
        scale = np.abs(grads).max()
        error = np.abs(got - mean).max() / scale
        tolerance = 1e-6 if wire is None else 2e-3
        if error > tolerance:
            return f"mean of the ranks' gradients off by {error:.2e} of max |g|"
        if len(set(comm.allgather(digest(model.arena.grad)))) != 1:
            return "the sum differs between ranks"
        expected_early = len(reducer.bounds) if overlap else 0
        if handed_over != expected_early:
            return f"{handed_over}/{len(reducer.bounds)} buckets started during backward"
        if model.arena.on_grad_ready is not None:
            return "close() left the reducer attached to the arena"
        return None
    agree(check)


def whole_arena_sum_check(model, reducer):
    """None if the reducer sums integer-valued gradients (exact in any order) to the
    whole-arena sum bit for bit (every element summed once, none left out), else why not."""
    local = {p.name: (np.arange(p.size).reshape(p.shape) % 13) * (WORLD.rank + 1) - p.size % 5
             for p in model.arena.params}
    whole = np.zeros_like(model.arena.grad)
    for p in model.arena.params:
        whole[p.offset:p.offset + p.size] = local[p.name].ravel()
    WORLD.Allreduce(MPI.IN_PLACE, whole, op=MPI.SUM)
    reducer.begin()
    for p in model.arena.params:             # as backward would, layer by layer
        p.grad[...] = local[p.name]
        p.grad_ready()                       # the bucket may be summed from here on
    reducer.finish()
    reducer.close()
    return None if np.array_equal(model.arena.grad, whole) else "differs from the whole-arena sum"


@pytest.mark.parametrize("k", [None, 1, 2])
def test_reducer_sums_large_buckets_on_any_grouping(k):
    """Buckets of 64 KiB and more go through shm on nodes that share memory and 2d on
    those that do not (one-rank nodes): the ranks must still agree on every call (else
    the job hangs) and the sum be exact."""
    grouped = Communicator(WORLD, ranks_per_node=k)

    def check():
        model = build_model("resnet_small", num_classes=10)
        reducer = reducer_for(model, grouped, threshold=256 << 10)
        if not any((b - a) * 4 >= 64 << 10 for a, b in reducer.bounds):
            return "no bucket of 64 KiB: the test would prove little"
        return whole_arena_sum_check(model, reducer)
    agree(check)
    grouped.free()


def test_fp16_wire_sum_does_not_grow_with_the_ranks(comm):
    """Loss-scaled gradients near the top of the float16 range (40000; the limit is 65504)
    on every rank: summed as float16 they would overflow on two ranks or more, but
    prescaled by 1 / ranks their mean comes back finite."""
    def check():
        model = small_net(seed=0)
        reducer = reducer_for(model, comm, threshold=100, wire_dtype=np.float16, overlap=False)
        reducer.begin()
        model.arena.grad[...] = 0
        for p in model.arena.params:
            p.grad[...] = 40000.0
        reducer.finish()
        reducer.close()
        mean = np.concatenate([p.grad.ravel() for p in model.arena.params]) * reducer.postscale
        if not np.isfinite(mean).all():
            return f"the float16 sum overflowed on {WORLD.size} rank(s)"
        error = np.abs(mean - 40000.0).max() / 40000.0
        return None if error <= 2e-3 else f"mean off by {error:.1e}"
    agree(check)


@pytest.mark.parametrize("overlap,wire", [(True, None), (False, None), (True, np.float16)])
def test_bucketed_ranks_match_one_process_with_the_whole_batch(comm, overlap, wire):
    local, steps = 2, 4
    global_batch = local * WORLD.size

    def optimizer(arena):
        return SGD(arena, momentum=0.9, weight_decay=1e-3)

    def check():
        rng = np.random.default_rng(42)
        x = rng.standard_normal((steps * global_batch, 10, 10, 3)).astype(np.float32)
        y = rng.integers(0, 5, steps * global_batch)
        parallel = small_net(seed=WORLD.rank)
        broadcast_model(parallel, comm)
        reducer = reducer_for(parallel, comm, threshold=100, wire_dtype=wire, overlap=overlap)
        opt = optimizer(parallel.arena)
        for s in range(steps):
            part = slice(s * global_batch + WORLD.rank * local,
                         s * global_batch + (WORLD.rank + 1) * local)
            train_step(parallel, opt, reducer, x[part], y[part], lr=0.1)
        reducer.close()
        serial = serial_steps(small_net(seed=0), x, y, steps, global_batch, optimizer)
        w, ref = parallel.arena.master, serial.arena.master
        error = np.abs(w - ref).max() / np.abs(ref).max()
        tolerance = 1e-5 if wire is None else 3e-3      # fp16 on the wire: 11-bit sums
        if error > tolerance:
            return f"weights differ from the serial run by {error:.2e} (relative to max |w|)"
        return None
    agree(check)


def _counted(name):
    def call(self, *args, **kw):
        self.calls.append(name)
        return getattr(Communicator, name)(self, *args, **kw)
    return call


class CountingCommunicator(Communicator):
    """A real Communicator that records which of its collectives a step calls."""
    calls = []
    allreduce, allmax = _counted("allreduce"), _counted("allmax")
    broadcast, allgather = _counted("broadcast"), _counted("allgather")


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")   # the forced overflow
def test_an_overflow_on_one_rank_is_skipped_everywhere_without_a_vote():
    """An inf in one rank's input makes the summed gradient non-finite on every rank, so
    every rank skips the same step; the step's only collectives are the bucket sums."""
    counting = CountingCommunicator(WORLD)
    bad_step = 2

    def check():
        model = small_net(seed=WORLD.rank, working_dtype=np.float16)
        broadcast_model(model, counting)
        reducer = reducer_for(model, counting, threshold=300)
        opt = SGD(model.arena, momentum=0.9, weight_decay=1e-4)
        scaler = LossScaler("dynamic", init_scale=1024.0, growth_interval=1000)
        rng = np.random.default_rng(WORLD.rank)          # different data on each rank
        record = []
        for step in range(5):
            x = rng.standard_normal((2, 6, 6, 3)).astype(np.float16)
            if step == bad_step and WORLD.rank == WORLD.size - 1:
                x[0, 1, 1, 1] = np.inf                   # this rank alone overflows
            before = model.arena.master.copy()
            counting.calls = []
            train_step(model, opt, reducer, x, rng.integers(0, 5, 2), lr=0.1, scaler=scaler)
            if counting.calls != ["allreduce"] * len(reducer.bounds):
                return f"a step called {counting.calls}, not one sum per bucket"
            moved = bool(np.any(model.arena.master != before))
            record.append((moved, scaler.scale, scaler.skipped))
        reducer.close()
        expected = [(True, 1024.0, 0), (True, 1024.0, 0), (False, 512.0, 1),
                    (True, 512.0, 1), (True, 512.0, 1)]
        if record != expected:
            return f"steps (moved, scale, skipped) {record}, expected {expected}"
        if len(set(counting.allgather(digest(model.arena.master)))) != 1:
            return "the replicas differ"
        return None
    agree(check)
    counting.free()


# ----- the order of the stream calls (what a GPU runs on CUDA streams and events) -----
class RecordingStreams(HostStreams):
    """The host stream interface (backend.HostStreams), with every call written to `log`:
    streams are named "compute" and "comm", events e1, e2, ... The current stream is per
    thread, as CuPy's is."""

    def __init__(self, log):
        self.log, self.events, self.local = log, 0, threading.local()
        self.lock = threading.Lock()

    def current(self):
        return getattr(self.local, "stream", "compute")

    def comm(self):
        return "comm"

    def record(self, stream):
        with self.lock:
            self.events += 1
            event = f"e{self.events}"
        self.log.append(("record", stream, event))
        return event

    def wait(self, stream, event):
        self.log.append(("wait", stream, event))

    @contextlib.contextmanager
    def using(self, stream):
        before, self.local.stream = self.current(), stream
        try:
            yield
        finally:
            self.local.stream = before


class StreamLoggingCommunicator(Communicator):
    """A real Communicator that logs each all-reduce with the bucket it sums (its first
    element in the arena) and the stream current at the call."""
    log, streams, arena = [], None, None

    def allreduce(self, buf, *args, **kw):
        start = (buf.ctypes.data - self.arena.grad.ctypes.data) // buf.itemsize
        self.log.append(("allreduce", int(start), self.streams.current()))
        return Communicator.allreduce(self, buf, *args, **kw)


def stream_order_problem(log, reducer, overlap):
    """None if every bucket's all-reduce ran on the communication stream after an event
    recorded on the compute stream once the bucket's last gradient was written, and the
    compute stream waits, before finish() returns, on an event recorded on the
    communication stream after the last all-reduce; else what is wrong."""
    index = {}
    for i, entry in enumerate(log):
        index.setdefault(entry, i)
    ready = {b: max(i for i, e in enumerate(log) if e == ("ready", b))
             for b in range(len(reducer.bounds))}
    finished = log.index(("finished",))
    sums = [(i, e) for i, e in enumerate(log) if e[0] == "allreduce"]
    starts = [a for a, _ in reducer.bounds]
    if [e[1] for _, e in sums] != starts:
        return f"buckets summed {[e[1] for _, e in sums]}, expected {starts}"
    for b, (i, (_, _, stream)) in enumerate(sums):
        if stream != "comm":
            return f"bucket {b} summed on the {stream} stream"
        if i < ready[b]:
            return f"bucket {b} summed before its last gradient was written"
        waits = [e for j, e in enumerate(log[:i]) if e[:2] == ("wait", "comm")
                 and index.get(("record", "compute", e[2]), -1) > ready[b]]
        if not waits:
            return f"bucket {b}: the communication stream waited for no event recorded after " \
                   f"its gradients"
        if overlap and i > finished:
            return f"bucket {b} summed after backward although overlapped"
    last = sums[-1][0]
    tail = [e for e in log[last:finished] if e[0] in ("record", "wait")]
    if len(tail) != 2 or tail[0][:2] != ("record", "comm") \
            or tail[1] != ("wait", "compute", tail[0][2]):
        return f"after the last sum: {tail}, not an event of the communication stream that " \
               f"the compute stream waits for"
    return None


@pytest.mark.parametrize("overlap,threaded", [(True, False), (True, True), (False, False)],
                         ids=["queued", "thread", "after-backward"])
def test_reducer_orders_buckets_by_events_between_streams(overlap, threaded):
    """The Reducer's stream calls, recorded: "queued" is what a GPU with NCCL runs (no
    thread: the all-reduce is queued on the communication stream from the listener),
    "thread" the MPI path, "after-backward" --no-overlap. The sums stay exact."""
    log = []
    comm = StreamLoggingCommunicator(WORLD)

    def check():
        model = small_net(seed=0)
        streams = RecordingStreams(log)
        comm.log, comm.streams, comm.arena = log, streams, model.arena
        reducer = reducer_for(model, comm, threshold=300, overlap=overlap, threaded=threaded,
                              streams=streams)
        if len(reducer.bounds) < 3:
            return f"only {len(reducer.bounds)} bucket(s): the test would prove little"
        grads = {p.name: (np.arange(p.size).reshape(p.shape) % 5) * (WORLD.rank + 1)
                 for p in model.arena.params}
        reducer.begin()
        for p in model.arena.params:             # as backward would, layer by layer
            p.grad[...] = grads[p.name]
            log.append(("ready", reducer.bucket_of[id(p)]))
            p.grad_ready()
        reducer.finish()
        log.append(("finished",))
        reducer.close()
        total = WORLD.size * (WORLD.size + 1) // 2
        if any(not np.array_equal(p.grad, grads[p.name] // (WORLD.rank + 1) * total)
               for p in model.arena.params):
            return "the sums are wrong"
        return stream_order_problem(log, reducer, overlap)
    agree(check)
    comm.free()
