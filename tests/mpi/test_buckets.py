"""Fusion buckets and the overlapped reducer under `mpirun -np N` (any N).

Every rank computes its verdict, the verdicts are gathered and every rank asserts
on all of them (test_data_parallel.agree), so no rank is left waiting in a collective.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpitrain.comm import Communicator
from mpitrain.comm.buckets import Reducer, bucket_bounds
from mpitrain.nets import build_model
from mpitrain.optim import SGD
from mpitrain.train import broadcast_model, train_step
from test_data_parallel import agree, small_net

WORLD = MPI.COMM_WORLD


@pytest.fixture(scope="module")
def comm():
    c = Communicator(WORLD)
    yield c
    c.free()


@pytest.mark.parametrize("threshold", [1, 4096, 300_000, 1 << 30])
def test_buckets_cover_the_arena_once_in_order_and_agree_across_ranks(threshold):
    def check():
        arena = build_model("resnet_small", num_classes=10).arena
        bounds = bucket_bounds(arena, threshold)
        cuts = {int(o) for o in arena.segments["offset"]} | {arena.size}
        if bounds[0][0] != 0 or bounds[-1][1] != arena.size:
            return f"buckets span {bounds[0][0]}..{bounds[-1][1]}, arena has {arena.size}"
        if any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
            return "buckets overlap or leave a gap"
        if any(a >= b or a not in cuts or b not in cuts for a, b in bounds):
            return "a bucket is empty or cuts a parameter"
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
    from mpitrain.nets.losses import softmax_cross_entropy
    loss, dlogits = softmax_cross_entropy(model.forward(x, train=True), y)
    model.backward(dlogits)


def test_reducer_puts_a_host_arena_in_shared_memory(comm):
    """Where the node's ranks share memory, the Reducer moves the gradient arena into
    a shared window (for shm), keeping its values, and backward writes there."""
    def check():
        model = small_net(seed=0)
        before = model.arena.grad.copy()
        Reducer(model, comm, threshold=100).close()
        grad = model.arena.grad
        if comm.peers(grad) is None:
            return "the arena is not registered as shared (hybrid would choose unlike other nodes)"
        if (comm.peers(grad)[0] is not None) != comm.shares_memory:
            return f"arena in a window: {comm.peers(grad)[0] is not None}, node shares memory: " \
                   f"{comm.shares_memory}"
        if not np.array_equal(grad, before):
            return "the gradients changed when the arena moved"
        if not all(np.shares_memory(p.grad, grad) for p in model.arena.params):
            return "a parameter's grad view still points at the old buffer"
        rng = np.random.default_rng(WORLD.rank)
        _backward(model, rng.standard_normal((2, 8, 8, 3)).astype(np.float32),
                  rng.integers(0, 5, 2))
        if not np.any(grad):
            return "backward did not write into the shared arena"
        return None
    agree(check)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("wire", [None, np.float16])
def test_reducer_sums_exactly_what_a_plain_allreduce_sums(comm, overlap, wire):
    def check():
        model = small_net(seed=0)
        reducer = Reducer(model, comm, threshold=100, algorithm="hybrid", wire_dtype=wire,
                          overlap=overlap)
        rng = np.random.default_rng(WORLD.rank)
        x = rng.standard_normal((2, 8, 8, 3)).astype(np.float32)
        y = rng.integers(0, 5, 2)
        _backward(model, x, y)                  # hooks disarmed: nothing summed
        local = model.arena.grad.copy()
        reducer.begin()
        _backward(model, x, y)
        handed_over = reducer.next              # buckets started during backward
        reducer.finish()
        reducer.close()
        # the same buckets summed one by one after the fact (same calls: same bits),
        # from shared memory as the reducer's arena (hybrid's choice depends on it)
        expected = comm.shared_zeros(local.size, local.dtype)
        expected[...] = local
        for a, b in reducer.bounds:
            comm.allreduce(expected[a:b], "hybrid", wire_dtype=wire)
        if not np.array_equal(model.arena.grad, expected):
            return f"differs from the bucket-wise sum by {np.abs(model.arena.grad - expected).max()}"
        if len(reducer.bounds) < 3:
            return f"only {len(reducer.bounds)} bucket(s): the test would prove little"
        if overlap and handed_over != len(reducer.bounds):
            return f"only {handed_over}/{len(reducer.bounds)} buckets started during backward"
        if not overlap and handed_over != 0:
            return "--no-overlap started buckets during backward"
        return None
    agree(check)


def whole_arena_sum_check(model, reducer):
    """None if the reducer sums integer-valued gradients (exact in any order) to the
    whole-arena sum bit for bit (every element summed once, none left out), else why not."""
    reducer.begin()
    for p in model.arena.params:             # as backward would, layer by layer
        p.grad[...] = (np.arange(p.size).reshape(p.shape) % 13) * (WORLD.rank + 1) - p.size % 5
    whole = model.arena.grad.copy()
    WORLD.Allreduce(MPI.IN_PLACE, whole, op=MPI.SUM)
    reducer.finish()
    reducer.close()
    return None if np.array_equal(model.arena.grad, whole) else "differs from the whole-arena sum"


def test_reducer_equals_one_allreduce_of_the_whole_arena(comm):
    def check():
        model = small_net(seed=0)
        return whole_arena_sum_check(model, Reducer(model, comm, threshold=100))
    agree(check)


@pytest.mark.parametrize("k", [None, 1, 2])
def test_reducer_sums_large_buckets_on_any_grouping(k):
    """Buckets of 64 KiB and more go through shm on nodes that share memory and 2d on
    those that do not (one-rank nodes): the ranks must still agree on every call (else
    the job hangs) and the sum be exact."""
    grouped = Communicator(WORLD, ranks_per_node=k)

    def check():
        model = build_model("resnet_small", num_classes=10)
        reducer = Reducer(model, grouped, threshold=256 << 10)
        if not any((b - a) * 4 >= 64 << 10 for a, b in reducer.bounds):
            return "no bucket of 64 KiB: the test would prove little"
        return whole_arena_sum_check(model, reducer)
    agree(check)
    grouped.free()


@pytest.mark.parametrize("overlap,wire", [(True, None), (False, None), (True, np.float16)])
def test_bucketed_ranks_match_one_process_with_the_whole_batch(comm, overlap, wire):
    local, steps = 2, 4
    global_batch = local * WORLD.size

    def check():
        rng = np.random.default_rng(42)
        x = rng.standard_normal((steps * global_batch, 10, 10, 3)).astype(np.float32)
        y = rng.integers(0, 5, steps * global_batch)
        parallel = small_net(seed=WORLD.rank)
        broadcast_model(parallel, WORLD)
        reducer = Reducer(parallel, comm, threshold=100, wire_dtype=wire, overlap=overlap)
        opt = SGD(parallel.arena, momentum=0.9, weight_decay=1e-3)
        for s in range(steps):
            part = slice(s * global_batch + WORLD.rank * local,
                         s * global_batch + (WORLD.rank + 1) * local)
            train_step(parallel, opt, WORLD, x[part], y[part], lr=0.1, reducer=reducer)
        reducer.close()
        serial = small_net(seed=0)
        opt = SGD(serial.arena, momentum=0.9, weight_decay=1e-3)
        for s in range(steps):
            part = slice(s * global_batch, (s + 1) * global_batch)
            train_step(serial, opt, MPI.COMM_SELF, x[part], y[part], lr=0.1)
        w, ref = parallel.arena.master, serial.arena.master
        error = np.abs(w - ref).max() / np.abs(ref).max()
        tolerance = 1e-5 if wire is None else 3e-3      # fp16 on the wire: 11-bit sums
        if error > tolerance:
            return f"weights differ from the serial run by {error:.2e} (relative to max |w|)"
        root = w.copy()
        WORLD.Bcast(root, root=0)
        return None if np.array_equal(w, root) else "replicas differ"
    agree(check)
