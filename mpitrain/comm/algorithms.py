"""All-reduce algorithms: compositions of MPI (or NCCL) collectives.

Every function sums a contiguous 1-D array over all ranks IN PLACE and leaves
the same bits on every rank. Between nodes mpitrain never moves bytes itself:
each phase is one collective of the MPI library (or of NCCL for CuPy
buffers), called in place wherever MPI allows it. Inside a node, `shm` adds
the node's arrays where MPI-3 has mapped them into every rank's memory.

    flat          one Allreduce over the world
    hierarchical  Jia et al.: Reduce to the node leader, Allreduce among the
                  leaders, Bcast inside the node
    2d            ChainerMN's two-dimensional all-reduce: Reduce_scatter
                  inside the node, Allreduce of each shard among the ranks
                  with the same node-local index, Allgatherv inside the node
    shm           2d with its node phases done in an MPI-3 shared-memory
                  window: each rank of the node sums its shard of all the
                  node's arrays and writes the sum into all of them (see shm())
    hybrid        one of the above, chosen per buffer by `choose()`

Why the result is identical on every rank. IEEE addition is commutative but
not associative, so two ranks that add the same numbers in different orders
can disagree in the last bit. The MPI standard requires that "all processes
participating in these operations receive identical results" (the standard's
all-reduce section), but that is a promise of the library, not something
mpitrain can see, so mpitrain relies on it in exactly one place, the
Allreduce; every other phase (shm's node phases included) either reduces each
element on one rank only (Reduce, Reduce_scatter) or copies bits (Bcast,
Allgatherv). MPICH keeps
the promise: its all-reduce algorithms either reduce each element once and
distribute it (reduce-scatter + all-gather, ring, tree) or have each pair of
ranks add the same two operands (recursive doubling: a + b == b + a bitwise);
docs/design-notes.md records the check of each of them.
tests/mpi/test_comm.py checks the bits of every algorithm on every run; with
an MPI library that broke the promise they would fail, and the remedy is to
build each Allreduce by construction from Reduce (or Reduce_scatter) and Bcast
(or Allgatherv), so that every element has one owner. NCCL's all-reduce (ring,
tree, NVLS) likewise reduces each element once and then distributes it.

float16. MPI has no standard half type (MPICH's MPIX_C_FLOAT16 is slower
than the operation below and other libraries lack it; docs/benchmarks-record.md).
So float16 travels as MPI.UINT16_T (the bits) and is summed by
`fp16_sum_op()`, a commutative user-defined MPI.Op whose Numba kernel widens
each half to float32 exactly, adds, and rounds once to the nearest half (the
conversions of mpitrain.kernels.cast): bit for bit NumPy's float16 addition,
which is a scalar loop several times slower.
"""
import itertools

import numpy as np
from mpi4py import MPI
from numba import njit

from mpitrain.kernels.cast import load, store

ALGORITHMS = ("flat", "hierarchical", "2d", "shm", "hybrid")


# ----------------------------------------------------------------------------
# The kernels: sums of float32, float64 and float16 (as uint16 bits) arrays
# ----------------------------------------------------------------------------
_BLOCK = 2048   # elements per step of the shm kernel: its scratch stays in L1


@njit(cache=True, nogil=True)
def add_into(acc, x):
    """acc += x elementwise; float16 (uint16 bits) is widened to float32, added and
    rounded once, which is the correctly rounded half sum (24 >= 2 * 11 + 2
    significand bits make the double rounding exact)."""
    for i in range(acc.size):
        store(acc, i, load(acc, i) + load(x, i))


@njit(cache=True, nogil=True)
def shm_sum(peers, lo, hi, me, spread, acc):
    """peers[me][lo:hi] = the sum of every peers[q][lo:hi], q in local-rank order, added in
    acc's dtype (float32 for float16 and float32, float64 for float64) and rounded once;
    then, when `spread`, the sum copied into every other peers[q].

    Block by block through acc (_BLOCK elements), so the block of the sum is still in
    L1 when it is copied: each element of every copy is read once and written once.
    (The loops run over slices handed to helpers: indexing the tuple of peers, or an
    array at an offset, inside a loop keeps LLVM from vectorising it.)
    """
    for start in range(lo, hi, _BLOCK):
        stop = min(start + _BLOCK, hi)
        block = acc[:stop - start]
        _load_block(block, peers[0][start:stop])
        for q in range(1, len(peers)):
            _add_block(block, peers[q][start:stop])
        _store_block(peers[me][start:stop], block)
        for q in range(len(peers)):
            if spread and q != me:
                _copy_block(peers[q][start:stop], peers[me][start:stop])


@njit(cache=True, nogil=True)
def _load_block(acc, x):
    for i in range(acc.size):
        acc[i] = load(x, i)


@njit(cache=True, nogil=True)
def _add_block(acc, x):
    for i in range(acc.size):
        acc[i] += load(x, i)


@njit(cache=True, nogil=True)
def _store_block(y, acc):
    for i in range(y.size):
        store(y, i, acc[i])


@njit(cache=True, nogil=True)
def _copy_block(y, x):
    for i in range(y.size):
        y[i] = x[i]


_fp16_sum = None


def fp16_sum_op():
    """The commutative MPI.Op that sums float16 data sent as MPI.UINT16_T.

    mpi4py 4 calls the function with (invec, inoutvec, datatype), the vectors
    as mpi4py buffers over the raw bytes; MPI may call it on any piece of the
    message, several times per collective.
    """
    global _fp16_sum
    if _fp16_sum is None:
        def add(invec, inoutvec, datatype):
            add_into(np.frombuffer(inoutvec, np.uint16), np.frombuffer(invec, np.uint16))
        _fp16_sum = MPI.Op.Create(add, commute=True)
    return _fp16_sum


def wire(buf):
    """(MPI datatype, MPI reduction op) that sum `buf`'s dtype."""
    dt = buf.dtype
    if dt == np.float16:
        return MPI.UINT16_T, fp16_sum_op()
    if dt == np.float32:
        return MPI.FLOAT, MPI.SUM
    if dt == np.float64:
        return MPI.DOUBLE, MPI.SUM
    raise TypeError(f"all-reduce sums float16, float32 or float64 buffers, got {dt}")


# ----------------------------------------------------------------------------
# The algorithms, on host (NumPy) buffers through MPI
# ----------------------------------------------------------------------------
def flat(comm, buf, wait=None):
    """One MPI Allreduce over all ranks (an Iallreduce handed to `wait`, if given)."""
    dt, op = wire(buf)
    if wait is None:
        comm.world.Allreduce(MPI.IN_PLACE, [buf, dt], op=op)
    else:
        wait(comm.world.Iallreduce(MPI.IN_PLACE, [buf, dt], op=op))


def hierarchical(comm, buf, wait=None):
    """Reduce to the node leader, Allreduce among leaders, Bcast inside the node.

    Only one rank per node sends across nodes, which is Jia et al.'s answer to
    many GPUs sharing one network card; the price is that the leaders do all
    the cross-node work while the others wait. Its phases are blocking (`wait`
    is not used).
    """
    dt, op = wire(buf)
    node = comm.node_comm
    if comm.local_size > 1:
        if comm.local_rank == 0:
            node.Reduce(MPI.IN_PLACE, [buf, dt], op=op, root=0)
        else:
            node.Reduce([buf, dt], None, op=op, root=0)
    if comm.local_rank == 0 and comm.num_nodes > 1:
        comm.leaders_comm.Allreduce(MPI.IN_PLACE, [buf, dt], op=op)
    if comm.local_size > 1:
        node.Bcast([buf, dt], root=0)


def shard_layout(n, node_sizes, local_size):
    """(counts, displacements) of the 2d shards of an n-element buffer on one node.

    The buffer is cut into S = min(node_sizes) near-equal shards (the first
    n % S one element longer); local ranks 0..S-1 own one each and the ranks
    beyond S own an empty shard. With equal nodes that is the textbook 2d
    layout (S = node size). With uneven nodes, every node cuts the same S
    shards, so shard j meets shard j of every other node in the "same local
    index" communicator j, which spans all nodes precisely because j < S.
    A node of one rank makes S = 1, and 2d degenerates into hierarchical.
    """
    shards = min(node_sizes)
    base, extra = divmod(n, shards)
    counts = [base + (j < extra) if j < shards else 0 for j in range(local_size)]
    displs = [0, *itertools.accumulate(counts[:-1])]
    return counts, displs


def two_d(comm, buf, wait=None):
    """Reduce_scatter in the node, Allreduce across nodes per shard, Allgatherv in the node.

    Every rank of a node carries 1/S of the cross-node traffic (hierarchical
    puts all of it on the leader). The reduced shard lands in a scratch
    buffer: an in-place Reduce_scatter would leave it at the front of `buf`
    rather than at its place, so MPI writes it to scratch and the Allgatherv
    writes every shard, this rank's included, straight to its place in `buf`.
    Its phases are blocking (`wait` is not used).
    """
    dt, op = wire(buf)
    counts, displs = shard_layout(buf.size, comm.node_sizes, comm.local_size)
    mine = counts[comm.local_rank]
    shard = comm.scratch(buf.dtype, mine)
    comm.node_comm.Reduce_scatter([buf, dt], [shard, dt], recvcounts=counts, op=op)
    # every member of the cross communicator holds the same shard index, hence the same count
    if mine and comm.num_nodes > 1:
        comm.cross_comm.Allreduce(MPI.IN_PLACE, [shard, dt], op=op)
    comm.node_comm.Allgatherv([shard, dt], [buf, counts, displs, dt])


def shm(comm, buf, wait=None):
    """2d with the node phases in shared memory: the node's arrays are mapped into
    every rank of the node (an MPI-3 window, Communicator.shared_zeros).

        1. the node's ranks wait for each other (Win.Sync, a node barrier, Win.Sync:
           every array is written and visible);
        2. local rank j adds shard j (shard_layout) of the other arrays of the
           node into its own, in local-rank order, and on a single node copies
           the sum straight into all of them, block by block (reduce-scatter and
           all-gather in one pass);
        3. on several nodes, shard j is summed across nodes by one Allreduce among
           the ranks with local index j (as 2d), then copied into the node's arrays;
        4. a second wait, after which every array holds the whole sum.

    Each element is summed by one rank and copied, so every rank has the same bits.
    On 2 ranks a rank reads and writes each element of its half of both arrays
    once; MPICH's shared-memory all-reduce copies through its own buffers. A buffer
    outside a shared window is staged through a shared scratch array (a copy in
    and out); a node whose ranks do not share memory (or of one rank), or a
    shared_zeros array that did not fit in /dev/shm, runs 2d. Returns the algorithm that
    ran: "shm" or "2d".
    With `wait`, the node barriers are Ibarriers completed by `wait(request)`, so
    the communication thread can wait for the other ranks of its node without
    spinning; by default they are blocking Barriers (faster: MPICH's own
    shared-memory barrier rather than the non-blocking schedule).
    """
    if not comm.shares_memory:
        two_d(comm, buf)
        return "2d"
    if not buf.size:                # every rank has the same size: nothing to sum anywhere
        return "shm"
    found = comm.peers(buf)
    if found is None:
        stage = comm.shared_scratch(buf.dtype, buf.size)
        stage[...] = buf
        ran = shm(comm, stage, wait)
        buf[...] = stage
        return ran
    win, peers = found
    if win is None:                 # no room was left in shared memory for this array
        two_d(comm, buf)
        return "2d"
    dt, op = wire(buf)
    if buf.dtype == np.float16:
        peers = tuple(p.view(np.uint16) for p in peers)
    counts, displs = shard_layout(buf.size, comm.node_sizes, comm.local_size)
    lo = displs[comm.local_rank]
    hi = lo + counts[comm.local_rank]
    across = comm.num_nodes > 1

    def node_barrier():
        win.Sync()
        if wait is None:
            comm.node_comm.Barrier()        # MPICH's shared-memory barrier
        else:
            wait(comm.node_comm.Ibarrier())
        win.Sync()

    node_barrier()
    if hi > lo:
        acc = comm.scratch(np.float64 if buf.dtype == np.float64 else np.float32, _BLOCK,
                           purpose="shm")
        shm_sum(peers, lo, hi, comm.local_rank, not across, acc)
        if across:
            # blocking, as in 2d: a node without shared memory runs 2d, and MPI never
            # matches a blocking collective with a non-blocking one
            comm.cross_comm.Allreduce(MPI.IN_PLACE, [buf[lo:hi], dt], op=op)
            for q, p in enumerate(peers):
                if q != comm.local_rank:
                    p[lo:hi] = peers[comm.local_rank][lo:hi]
    node_barrier()
    return "shm"


# ----------------------------------------------------------------------------
# hybrid: the measured rule
# ----------------------------------------------------------------------------
# hybrid sends float16 buffers of at least this many bytes through 2d
FP16_2D_MIN_BYTES = 256 << 10
# and buffers in the node's shared memory of at least this many bytes through shm
SHM_MIN_BYTES = 64 << 10


def choose(comm, nbytes, dtype=np.float32, device=False, shared=False):
    """The algorithm `hybrid` uses for a buffer of `nbytes` of `dtype` on `comm`'s topology.

    The rule comes from `python -m mpitrain bench comm` on a 2-core host with
    MPICH (figures in docs/benchmarks-record.md; a real cluster should be re-measured
    and this function changed to match):

    * a buffer in the node's shared memory (the gradient arena of a CPU run,
      Communicator.shared_zeros) of at least SHM_MIN_BYTES, on more than one
      rank: shm, any dtype and topology. It reads and writes each element of
      the rank's shard of every copy once, in place, where MPICH's
      shared-memory all-reduce copies through its own cells; below SHM_MIN_BYTES
      its two barriers cost more than the copies saved. On a node without shared
      memory shm runs 2d, which is why the rule keys on the buffer, not the node.
    * float32/float64 elsewhere: flat. MPICH's own all-reduce already uses
      shared memory inside a host; splitting it into phases only adds steps.
      (Jia et al. pick hierarchical for small tensors on 1,024 GPUs, where a
      slow network is there to spare.)
    * float16 (the user-defined op): 2d from FP16_2D_MIN_BYTES up when every
      node has at least two ranks, else flat. MPI runs a user-defined op on the
      whole buffer on every rank, so the half additions dominate, and 2d's
      reduce-scatter splits them among the node's ranks. With a one-rank node
      2d has one shard per node and nothing to split.
    * CuPy buffers (NCCL): flat; NCCL's own all-reduce is topology-aware
      (rings and trees over NVLink and the network).
    """
    if device:
        return "flat"
    if shared and comm.size > 1 and nbytes >= SHM_MIN_BYTES:
        return "shm"
    if np.dtype(dtype) == np.float16 and min(comm.node_sizes) > 1 and nbytes >= FP16_2D_MIN_BYTES:
        return "2d"
    return "flat"


HOST = {"flat": flat, "hierarchical": hierarchical, "2d": two_d, "shm": shm}
