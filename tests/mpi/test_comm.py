"""The communication layer under `mpirun -np N python -m mpi4py -m pytest tests/mpi`, N = 1..4,
and on several emulated hosts (tests/test_nodes.py), whose names MPITRAIN_TEST_HOSTS gives.

Every rank fills its buffer from (seed, rank), so every rank can regenerate
all inputs and compute the float64 serial sum itself. A test never asserts
before all ranks have exchanged their outcomes (`agree`), so a failure on one
rank fails the test on every rank instead of leaving the others waiting in a
collective; a watchdog (conftest.py) aborts the job if a test blocks anyway.
"""
import hashlib
import os
import socket

import numpy as np
import pytest
from mpi4py import MPI

from mpitrain.comm import ALGORITHMS, Communicator
from mpitrain.comm import algorithms

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
P = WORLD.size
DTYPES = (np.float32, np.float64, np.float16)
GROUPINGS = (None, 1, 2, 3)     # None: the real topology (one node per host)


_comms = {}


def communicator(k):
    """One Communicator per grouping, created in the same test order on every rank."""
    if k not in _comms:
        _comms[k] = Communicator(WORLD, ranks_per_node=k)
    return _comms[k]


def agree(ok, detail=""):
    """Assert, identically on every rank, that `ok` holds on every rank."""
    outcomes = WORLD.allgather((bool(ok), str(detail)))
    bad = [f"rank {r}: {d}" for r, (o, d) in enumerate(outcomes) if not o]
    assert not bad, "; ".join(bad)


def digest(a):
    return hashlib.sha1(np.ascontiguousarray(a).view(np.uint8)).hexdigest()


def inputs(n, dtype, rank, seed=1234):
    """Rank `rank`'s buffer: values in [-1, 1) times powers of two from 2**-4 to 2**4."""
    rng = np.random.default_rng([seed, rank])
    x = rng.random(n, dtype=np.float32) * 2 - 1
    x *= _SCALES[rng.integers(0, _SCALES.size, n, dtype=np.uint8)]
    return x.astype(dtype)


_SCALES = np.exp2(np.arange(-4, 5)).astype(np.float32)


def check_sum(buf, n, dtype, seed=1234):
    """(ok, detail): `buf` is the sum of every rank's inputs within the dtype's rounding,
    and has the same bits on every rank."""
    xs = [inputs(n, dtype, r, seed).astype(np.float64) for r in range(P)]
    ref = np.sum(xs, axis=0)
    # P - 1 additions, each off by at most half an ulp of a partial sum <= sum |x|;
    # below the normal range, half a step of the subnormal grid per addition
    tiny = np.finfo(dtype).smallest_subnormal
    tol = (P - 1) * (np.finfo(dtype).eps * np.sum(np.abs(xs), axis=0) + tiny)
    err = np.abs(buf.astype(np.float64) - ref)
    ok_value = bool(np.all(err <= tol))
    same = len(set(WORLD.allgather(digest(buf)))) == 1
    if not n:
        return same, "an empty buffer"
    worst = int(np.argmax(err - tol))
    return ok_value and same, (f"value ok {ok_value} (worst index {worst}: error "
                               f"{err[worst]:.3g}, tolerance {tol[worst]:.3g}); bitwise "
                               f"identical on all ranks {same}")


_arenas = {}


def shared_arena(k, dtype):
    """One array in the node's shared memory per grouping and dtype (shared_zeros is
    collective: created in the same test order on every rank)."""
    key = (k, np.dtype(dtype).str)
    if key not in _arenas:
        _arenas[key] = communicator(k).shared_zeros(1_000_010, dtype)
    return _arenas[key]


def run_case(k, algorithm, dtype, n, shared=False, expect=None):
    """Sum every rank's inputs with `algorithm`; `shared`: the buffer is a slice, at an
    odd offset, of an array in shared memory. `expect`: the algorithm hybrid must pick."""
    comm = communicator(k)
    buf = shared_arena(k, dtype)[3:3 + n] if shared else np.empty(n, dtype)
    buf[...] = inputs(n, dtype, comm.rank)
    try:
        ran = comm.allreduce(buf, algorithm)
        ok, detail = check_sum(buf, n, dtype)
        detail = f"{algorithm} ran as {ran}: {detail}"
        ok = ok and expect in (None, ran)
    except Exception as e:      # noqa: BLE001 -- reported through agree()
        ok, detail = False, repr(e)
    agree(ok, detail)


# ----------------------------------------------------------------------------
# sums: every algorithm x grouping x dtype, small sizes; odd and MiB sizes on a subset
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 1001])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("k", GROUPINGS, ids=lambda k: f"rpn{k}")
def test_small_sums(k, algorithm, dtype, n):
    run_case(k, algorithm, dtype, n)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("k", GROUPINGS, ids=lambda k: f"rpn{k}")
def test_medium_sums(k, algorithm):
    # 100,003 is prime (no node size or rank count divides it); 400 KB takes MPI's
    # large-message algorithms
    run_case(k, algorithm, np.float32, 100_003)


# 1,000,003 is prime too; in float32 it is 3.8 MiB, the size of a fusion bucket
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype, k", [(np.float32, 3), (np.float16, 2), (np.float64, 1)],
                         ids=["float32-rpn3", "float16-rpn2", "float64-rpn1"])
def test_large_sums(algorithm, dtype, k):
    run_case(k, algorithm, dtype, 1_000_003)


@pytest.mark.parametrize("n", [0, 1, 7, 100_003, 1_000_003])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("algorithm", ["shm", "hybrid", "flat"])
@pytest.mark.parametrize("k", GROUPINGS, ids=lambda k: f"rpn{k}")
def test_sums_in_shared_memory(k, algorithm, dtype, n):
    """Buffers inside a shared window (the gradient arena's place in training): shm
    sums there directly, hybrid picks shm for those of 64 KiB and more (on more than
    one rank), the others are unaffected. Where a node's ranks share no memory, shm
    hands the sum to 2d and says so."""
    large = P > 1 and n * np.dtype(dtype).itemsize >= algorithms.SHM_MIN_BYTES
    shm_ran = "shm" if communicator(k).shares_memory else "2d"
    run_case(k, algorithm, dtype, n, shared=True,
             expect=shm_ran if algorithm == "shm" or algorithm == "hybrid" and large else None)


def test_repeated_calls_reuse_scratch():
    """A smaller buffer after a larger one (2d's shard scratch and shm's shared
    staging array are reused, then grown) and the same buffer twice give the correct sums."""
    comm = communicator(2)
    outcomes = []
    for algorithm in ("2d", "shm"):
        for n in (5000, 3, 5000, 20000):
            buf = inputs(n, np.float32, comm.rank)
            comm.allreduce(buf, algorithm)
            outcomes.append(check_sum(buf, n, np.float32))
    agree(all(o for o, _ in outcomes), [d for _, d in outcomes])


# ----------------------------------------------------------------------------
# topology
# ----------------------------------------------------------------------------
def launched_hosts():
    """The host of every rank: as tests/launcher.py placed them on emulated hosts
    (MPITRAIN_TEST_HOSTS, checked against each rank's host name), else as each rank's
    host name says."""
    mine = socket.gethostname()
    named = os.environ.get("MPITRAIN_TEST_HOSTS")
    hosts = named.split(",") if named else WORLD.allgather(mine)
    agree(len(hosts) == P and hosts[WORLD.rank] == mine,
          f"launched on {named!r}, {P} rank(s), this one on host {mine}")
    return hosts


@pytest.mark.parametrize("k", [1, 2, 3])
def test_topology_of_ranks_per_node(k):
    comm = communicator(k)
    hosts = launched_hosts()
    expect_sizes = [k] * (P // k) + ([P % k] if P % k else [])
    leaders = comm.leaders_comm
    one_host = len({hosts[r] for r in range(P) if r // k == comm.rank // k}) == 1
    facts = dict(
        node=comm.node == comm.rank // k,
        local_rank=comm.local_rank == comm.rank % k,
        local_size=comm.local_size == expect_sizes[comm.rank // k],
        node_sizes=comm.node_sizes == expect_sizes,
        num_nodes=comm.num_nodes == len(expect_sizes),
        leaders=(leaders != MPI.COMM_NULL) == (comm.local_rank == 0),
        leaders_group=leaders == MPI.COMM_NULL or (leaders.size == comm.num_nodes
                                                    and leaders.rank == comm.node),
        cross=comm.cross_comm.size == sum(s > comm.local_rank for s in expect_sizes)
        and comm.cross_comm.rank == comm.node,
        describe=all(f"node {j}: {s} rank(s)" in comm.describe()
                     for j, s in enumerate(expect_sizes)),
        # a group of ranks on several hosts shares no memory (shm runs 2d there)
        shares_memory=comm.shares_memory == (comm.local_size > 1 and one_host),
    )
    buf = np.ones(5, np.float32)
    ran = comm.allreduce(buf, "shm")            # says where it handed the sum
    facts["shm_ran"] = ran == ("shm" if comm.shares_memory else "2d") and np.all(buf == P)
    agree(all(facts.values()), [f for f, v in facts.items() if not v])


def test_topology_of_the_hosts():
    """Without ranks_per_node a node is a host: numbered by its lowest rank, its ranks in
    rank order, its first rank its leader; the cross communicators join the ranks of one
    local index, in node order; shared memory on every node of two ranks or more."""
    comm = communicator(None)
    hosts = launched_hosts()
    order = list(dict.fromkeys(hosts))                 # hosts by their lowest rank
    members = [[r for r in range(P) if hosts[r] == h] for h in order]
    node = order.index(hosts[comm.rank])
    local = members[node].index(comm.rank)
    cross = [m[local] for m in members if len(m) > local]
    leaders = comm.leaders_comm
    facts = dict(
        nodes=comm.num_nodes == len(order) and comm.node_sizes == [len(m) for m in members]
        and comm.node_of == [order.index(h) for h in hosts] and comm.node == node,
        node_comm=comm.node_comm.allgather(comm.rank) == members[node]
        and (comm.local_rank, comm.local_size) == (local, len(members[node])),
        host=(comm.host_rank, comm.host_size) == (local, len(members[node])),
        leaders=(leaders != MPI.COMM_NULL) == (local == 0)
        and (leaders == MPI.COMM_NULL or leaders.allgather(comm.rank) == [m[0] for m in members]),
        cross=comm.cross_comm.allgather(comm.rank) == cross,
        shares_memory=comm.shares_memory == (len(members[node]) > 1),
        describe=comm.describe().startswith(f"{P} rank(s) on {len(order)} node(s)"),
    )
    agree(all(facts.values()), f"{[f for f, v in facts.items() if not v]} on {hosts}:\n"
                               f"{comm.describe()}")


@pytest.mark.parametrize("k", [None, 2, 3], ids=lambda k: f"rpn{k}")
def test_shared_windows_hold_the_ranks_of_one_host(k):
    """A shared_zeros array is one window per node, mapping the copies of the node's ranks,
    in local-rank order, and no rank of another host; where a node (--ranks-per-node)
    spans hosts, each rank's array is its own."""
    comm = communicator(k)
    hosts = launched_hosts()
    node_ranks = comm.node_comm.allgather(comm.rank)
    one_host = len({hosts[r] for r in node_ranks}) == 1
    mine = comm.shared_zeros(1001, np.float64)
    mine[:] = comm.rank
    win, copies = comm.peers(mine)
    if win is not None:
        win.Sync()
    comm.node_comm.Barrier()        # every copy written
    if win is not None:
        win.Sync()
    seen = [sorted(set(c.tolist())) for c in copies]
    if win is not None:
        ok = one_host and comm.local_size > 1 and seen == [[r] for r in node_ranks]
    else:
        ok = not (one_host and comm.local_size > 1) and all(c.ctypes.data == mine.ctypes.data
                                                             for c in copies)
    comm.node_comm.Barrier()        # every copy read before any rank writes its next array
    agree(ok, f"window: {win is not None}, node's ranks {node_ranks} on {hosts}, "
              f"values seen in the copies {seen}")


@pytest.mark.parametrize("n, node_sizes, expect", [
    (7, [3, 3], [3, 2, 2]),          # equal nodes: one shard per local rank
    (7, [3, 1], [7, 0, 0]),          # a node of one rank: one shard, as hierarchical
    (10, [3, 3, 2], [5, 5, 0]),      # uneven nodes: min(node_sizes) shards everywhere
    (1, [4, 4], [1, 0, 0, 0]),       # fewer elements than shards
])
def test_shard_layout(n, node_sizes, expect):
    counts, displs = algorithms.shard_layout(n, node_sizes, len(expect))
    assert counts == expect
    assert displs == np.concatenate(([0], np.cumsum(expect)[:-1])).tolist()


# ----------------------------------------------------------------------------
# float16
# ----------------------------------------------------------------------------
def test_half_sum_matches_numpy_bitwise():
    """The MPI op's kernel equals NumPy's float16 addition bit for bit (NaN: any NaN):
    random bit patterns, near-cancellations, subnormals, and all 65536 halves against
    zeros, smallest/largest normals and subnormals, infinities and NaN."""
    rng = np.random.default_rng(7)
    a = rng.integers(0, 1 << 16, 1 << 18, dtype=np.uint16)
    b = rng.integers(0, 1 << 16, 1 << 18, dtype=np.uint16)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    cases = [(a, b), (a, a ^ 0x8000 ^ (b & 7)), (a & 0x83ff, b & 0x87ff)]
    for special in (0x0000, 0x8000, 0x0001, 0x03ff, 0x0400, 0x3c00, 0x7bff, 0xfbff, 0x7c00,
                    0xfc00, 0x7e00):
        cases.append((every, np.full(every.size, special, np.uint16)))
    bad = 0
    for x, y in cases[WORLD.rank::P]:        # the ranks share the cases
        with np.errstate(all="ignore"):
            expect = (x.view(np.float16) + y.view(np.float16)).view(np.uint16)
        got = x.copy()
        algorithms.add_into(got, y)
        nan = np.isnan(expect.view(np.float16))
        bad += int(np.sum((got != expect) & ~nan)) \
            + int(np.sum(~np.isnan(got.view(np.float16)) & nan))
    agree(bad == 0, f"{bad} sums differ from NumPy's")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_float16_overflow_is_inf_on_every_rank(algorithm):
    """A float16 sum past 65504 is inf everywhere, so the overflow check skips the step
    on all ranks together."""
    comm = communicator(2)
    buf = np.full(5, 40000.0, np.float16)
    buf[0] = 1.0
    comm.allreduce(buf, algorithm)
    overflow = not np.isfinite(buf).all()
    expect_inf = P >= 2
    agree(overflow == expect_inf and bool(np.isinf(buf[1:]).all()) == expect_inf
          and buf[0] == P and len(set(WORLD.allgather(digest(buf)))) == 1, buf)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fp16_on_the_wire(algorithm):
    """A float32 buffer sent as float16 equals the float16 sum of its float16-rounded
    values, cast back, on every rank."""
    comm = communicator(3)
    n = 3001
    buf = inputs(n, np.float32, comm.rank)
    comm.allreduce(buf, algorithm, wire_dtype=np.float16)
    half = inputs(n, np.float16, comm.rank)          # the same values rounded to half
    comm.allreduce(half, algorithm)
    agree(buf.dtype == np.float32 and np.array_equal(buf, half.astype(np.float32))
          and check_sum(half, n, np.float16)[0], "fp16 wire differs from the float16 sum")


# ----------------------------------------------------------------------------
# helpers and errors
# ----------------------------------------------------------------------------
def test_the_other_collectives_of_a_run():
    """broadcast (arrays, in place), average, allmax, the object collectives and a Group's
    sum, against values every rank can compute."""
    comm = communicator(2)
    root = P - 1
    b = np.full(9, float(comm.rank))
    comm.broadcast(b, root=root)
    m = np.full(4, float(comm.rank), np.float32)
    comm.average(m)
    flags = comm.allmax([comm.rank == root, 0, comm.rank * 3])
    timing = comm.allmax([0.5 * comm.rank])
    objects = dict(bcast=comm.bcast(("from", comm.rank), root=root),
                   gather=comm.gather(comm.rank * 2, root=0),
                   scatter=comm.scatter([r * 10 for r in range(P)] if comm.rank == 0 else None),
                   allgather=comm.allgather(comm.rank))
    group = comm.group(2)
    members = [r for r in range(P) if r // 2 == comm.rank // 2]
    summed = group.sum(np.full(3, comm.rank + 1.0))
    comm.barrier()
    facts = dict(
        broadcast=np.all(b == root), average=np.allclose(m, (P - 1) / 2),
        allmax=flags.tolist() == [1, 0, 3 * (P - 1)] and flags.dtype == np.int64
        and timing.tolist() == [0.5 * (P - 1)],
        bcast=objects["bcast"] == ("from", root),
        gather=objects["gather"] == ([2 * r for r in range(P)] if comm.rank == 0 else None),
        scatter=objects["scatter"] == 10 * comm.rank,
        allgather=objects["allgather"] == list(range(P)),
        group=group.size == len(members) and np.all(summed == sum(r + 1 for r in members)),
    )
    agree(all(facts.values()), [f for f, v in facts.items() if not v])


@pytest.mark.parametrize("k", [None, 1, 2])
def test_shared_arrays_are_aligned(k):
    """Every rank's copy in a shared window starts on a 256-byte boundary (the arena's
    contract), whatever the size asked for."""
    comm = communicator(k)
    bad = []
    for n, dtype in ((1, np.float16), (1001, np.float32), (3, np.float64)):
        arr = comm.shared_zeros(n, dtype)
        found = comm.peers(arr)
        copies = found[1] if found else (arr,)
        bad += [(n, q) for q, c in enumerate(copies) if c.ctypes.data % 256 or c.size != n]
    agree(not bad, bad)


def test_bad_buffers_raise_before_any_collective():
    """Errors are raised on every rank before a collective starts, so no rank is left
    waiting, and the communicator still works afterwards."""
    comm = communicator(1)
    errors = []
    for bad, algorithm in ((np.zeros((2, 3), np.float32), "flat"),
                           (np.zeros(10, np.float32)[::2], "flat"),
                           (np.zeros(4, np.int32), "2d"),
                           (np.zeros(4, np.float32), "ring")):
        try:
            comm.allreduce(bad, algorithm)
            errors.append(None)
        except (ValueError, TypeError) as e:
            errors.append(type(e).__name__)
    buf = np.ones(3, np.float32)
    comm.allreduce(buf, "hierarchical")
    agree(None not in errors and np.all(buf == P), errors)


@pytest.mark.parametrize("k", GROUPINGS, ids=lambda k: f"rpn{k}")
def test_hybrid_rule(k):
    """flat for float32/float64 and for device buffers at every size; 2d for float16
    from FP16_2D_MIN_BYTES up when every node has two ranks or more."""
    comm = communicator(k)
    sizes = [1 << s for s in range(2, 31)]
    split = min(comm.node_sizes) > 1
    facts = dict(
        fp32=all(algorithms.choose(comm, b, np.float32) == "flat" for b in sizes),
        fp64=all(algorithms.choose(comm, b, np.float64) == "flat" for b in sizes),
        device=all(algorithms.choose(comm, b, np.float16, device=True) == "flat" for b in sizes),
        fp16=all(algorithms.choose(comm, b, np.float16)
                 == ("2d" if split and b >= algorithms.FP16_2D_MIN_BYTES else "flat")
                 for b in sizes),
        ran=comm.allreduce(np.zeros(algorithms.FP16_2D_MIN_BYTES // 2, np.float16), "hybrid")
        == ("2d" if split else "flat"),
    )
    agree(all(facts.values()), [f for f, v in facts.items() if not v])


# ----------------------------------------------------------------------------
# GPU: the NCCL engine (skipped without a GPU)
# ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("k", [None, 2], ids=lambda k: f"rpn{k}")
def test_nccl_sums(k, algorithm, dtype):
    import cupy
    if P > cupy.cuda.runtime.getDeviceCount():
        pytest.skip("NCCL needs one GPU per rank")
    comm = communicator(k)
    cupy.cuda.Device(comm.rank).use()
    n = 100_003
    buf = cupy.asarray(inputs(n, dtype, comm.rank))
    comm.allreduce(buf, algorithm)
    cupy.cuda.get_current_stream().synchronize()
    ok, detail = check_sum(buf.get(), n, dtype)
    agree(ok, detail)
