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
participating in these operations receive identical results" (the all-reduce
section since MPI 1.1), but that is a promise of the library, not something
mpitrain can see, so mpitrain relies on it in exactly one place, the
Allreduce; every other phase (shm's node phases included) either reduces each element on one rank only
(Reduce, Reduce_scatter) or copies bits (Bcast, Allgatherv). MPICH 5.0.2 keeps
the promise: its all-reduce algorithms either reduce each element once and
distribute it (reduce-scatter + all-gather, ring, tree) or have each pair of
ranks add the same two operands (recursive doubling: a + b == b + a bitwise).
Measured here with MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM set to each of
recursive_doubling, reduce_scatter_allgather, ring, tree, recexch,
k_reduce_scatter_allgather, recursive_multiplying and ccl, on 3 and 4 ranks,
float32 and float64, sizes 7 to 10^6: identical on every rank in every case.
tests/mpi/test_comm.py checks the bits of every algorithm on every run; with
an MPI library that broke the promise they would fail, and the remedy is to
build each Allreduce by construction from Reduce (or Reduce_scatter) and Bcast
(or Allgatherv), so that every element has one owner. NCCL's all-reduce (ring,
tree, NVLS) likewise reduces each element once and then distributes it.

float16. MPI has no standard half type. MPICH 5 offers MPIX_C_FLOAT16
(mpi4py's MPI.FLOAT16_T) with a native SUM, which is correct but slower than
the user-defined operation below (bench_comm, 2 ranks, ResNet-50 in fp16,
minimum of 7: 315 ms native against 122 ms for the same flat all-reduce with
this op, 287 against 86 ms in 4 MiB slices), and other MPI libraries lack it. So float16
travels as MPI.UINT16_T (the bits) and is summed by `fp16_sum_op()`, a
commutative user-defined MPI.Op whose Numba kernel adds IEEE halves exactly
as NumPy's float16 addition does (bit for bit, checked by the tests); NumPy's
own float16 addition is a scalar loop, 3-5x slower here.
"""
import itertools

import numpy as np
from mpi4py import MPI

from mpitrain.backend import array_module

try:
    import numba
except ImportError:     # the float16 sum falls back to NumPy
    numba = None

ALGORITHMS = ("flat", "hierarchical", "2d", "shm", "hybrid")


# ----------------------------------------------------------------------------
# float16 summation for MPI
# ----------------------------------------------------------------------------
_BLOCK = 2048   # elements per step of the kernels: their scratch stays in L1


def _half_sum_numpy(inout, other):
    """inout += other on float16 values held as uint16 bits (the reference)."""
    a = inout.view(np.float16)
    np.add(a, other.view(np.float16), out=a)


def _widen(half, start, m, bits, value):
    """value[:m] = float32 of the halves half[start:start+m] (bits: uint32 view of value).

    The sign, exponent and mantissa of h move to float32 position
    ((h & 0x7fff) << 13); the exponent-31 codes (inf, NaN) get float32's
    all-ones exponent; multiplying by 2**112 (= 2**(127-15), the difference of
    the exponent biases) then gives the exact value, half subnormals included.
    """
    for i in range(m):
        h = np.uint32(half[start + i])
        bits[i] = (((h & 0x8000) << 16) | ((h & 0x7fff) << 13)
                   | (np.uint32(0x7f800000) if (h & 0x7c00) == 0x7c00 else np.uint32(0)))
    for i in range(m):
        value[i] = value[i] * np.float32(2.0 ** 112)


def _narrow(value, bits, m, aux, aux_bits, half, start):
    """half[start:start+m] = value[:m] rounded to the nearest half, ties to even
    (bits: uint32 view of value; aux, aux_bits: scratch float32 and its uint32 view).

      normal results:    rebias the exponent (-112 << 23), add 0xfff plus the
                         lowest kept bit, drop 13 bits (a carry may bump the
                         exponent, correctly, up to infinity);
      subnormal results: |v| + 0.5 puts |v| in units of 2**-24 (the float32
                         spacing at 0.5) in the low mantissa bits, rounded to
                         even by the float32 addition itself;
      |v| >= 65520:      infinity (65520 is halfway to 2**16: the tie goes up, to even);
      NaN:               a quiet NaN.
    """
    for i in range(m):
        aux[i] = np.abs(value[i]) + np.float32(0.5)
    for i in range(m):
        f = bits[i]
        mag = f & np.uint32(0x7fffffff)
        r = mag - np.uint32(112 << 23)
        normal = (r + np.uint32(0xfff) + ((r >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        subnormal = aux_bits[i] - np.uint32(0x3f000000)
        h = normal if mag >= np.uint32(0x38800000) else subnormal
        h = np.uint32(0x7c00) if mag >= np.uint32(0x477ff000) else h
        h = np.uint32(0x7e00) if mag > np.uint32(0x7f800000) else h
        half[start + i] = np.uint16(((f >> np.uint32(16)) & np.uint32(0x8000)) | h)


def _half_sum_kernel(inout, other):
    """inout += other on float16 values held as uint16 bits, bit for bit as NumPy.

    Both halves are widened to float32 exactly, added, and rounded to half: a
    float32 has 24 >= 2*11 + 2 significand bits, so rounding twice (exact sum
    -> float32 -> half) gives the correctly rounded half sum.
    """
    a_bits = np.empty(_BLOCK, np.uint32)
    b_bits = np.empty(_BLOCK, np.uint32)
    a, b = a_bits.view(np.float32), b_bits.view(np.float32)
    for start in range(0, inout.size, _BLOCK):
        m = min(_BLOCK, inout.size - start)
        _widen(inout, start, m, a_bits, a)
        _widen(other, start, m, b_bits, b)
        for i in range(m):
            a[i] += b[i]
        _narrow(a, a_bits, m, b, b_bits, inout, start)


def _to_half_kernel(src, dst):
    """dst (uint16 bits) = src (float32) rounded to half, as NumPy's astype(float16)."""
    a_bits = np.empty(_BLOCK, np.uint32)
    b_bits = np.empty(_BLOCK, np.uint32)
    a, b = a_bits.view(np.float32), b_bits.view(np.float32)
    for start in range(0, src.size, _BLOCK):
        m = min(_BLOCK, src.size - start)
        for i in range(m):
            a[i] = src[start + i]
        _narrow(a, a_bits, m, b, b_bits, dst, start)


def _from_half_kernel(src, dst):
    """dst (float32) = src (uint16 bits of halves), exactly."""
    bits = np.empty(_BLOCK, np.uint32)
    value = bits.view(np.float32)
    for start in range(0, src.size, _BLOCK):
        m = min(_BLOCK, src.size - start)
        _widen(src, start, m, bits, value)
        for i in range(m):
            dst[start + i] = value[i]


def _add_into(acc, x):
    """acc += x, elementwise."""
    for i in range(x.size):
        acc[i] += x[i]


def _copy_into(y, x):
    """y[:] = x."""
    for i in range(x.size):
        y[i] = x[i]


def _shm_sum_kernel(peers, lo, hi, me, spread):
    """peers[me][lo:hi] += peers[q][lo:hi] for every other q in order (float32 or
    float64), then, when `spread`, the sum copied into every peers[q].

    Block by block, so the block of the sum is still in L1 when it is copied:
    each element of every copy is read once and written once. (The loops are
    over slices passed to helpers: indexing the tuple inside a loop would keep
    LLVM from vectorising.)
    """
    mine = peers[me]
    for start in range(lo, hi, _BLOCK):
        stop = min(start + _BLOCK, hi)
        for q in range(len(peers)):
            if q != me:
                _add_into(mine[start:stop], peers[q][start:stop])
        for q in range(len(peers)):
            if spread and q != me:
                _copy_into(peers[q][start:stop], mine[start:stop])


def _shm_half_sum_kernel(peers, lo, hi, me, spread):
    """_shm_sum_kernel for float16 held as uint16 bits: the halves are widened to
    float32 exactly, summed in float32 and rounded to half once."""
    a_bits = np.empty(_BLOCK, np.uint32)
    b_bits = np.empty(_BLOCK, np.uint32)
    a, b = a_bits.view(np.float32), b_bits.view(np.float32)
    for start in range(lo, hi, _BLOCK):
        m = min(_BLOCK, hi - start)
        _widen(peers[0], start, m, a_bits, a)
        for q in range(1, len(peers)):
            _widen(peers[q], start, m, b_bits, b)
            _add_into(a[:m], b[:m])
        _narrow(a, a_bits, m, b, b_bits, peers[me], start)
        for q in range(len(peers)):
            if spread and q != me:
                _copy_into(peers[q][start:start + m], peers[me][start:start + m])


if numba is not None:
    _widen = numba.njit(cache=True, nogil=True)(_widen)
    _narrow = numba.njit(cache=True, nogil=True)(_narrow)
    half_sum = numba.njit(cache=True, nogil=True)(_half_sum_kernel)
    _to_half = numba.njit(cache=True, nogil=True)(_to_half_kernel)
    _from_half = numba.njit(cache=True, nogil=True)(_from_half_kernel)
    _add_into = numba.njit(cache=True, nogil=True)(_add_into)
    _copy_into = numba.njit(cache=True, nogil=True)(_copy_into)
    _shm_sum = numba.njit(cache=True, nogil=True)(_shm_sum_kernel)
    _shm_half_sum = numba.njit(cache=True, nogil=True)(_shm_half_sum_kernel)
else:
    half_sum = _half_sum_numpy
    _shm_sum, _shm_half_sum = _shm_sum_kernel, _shm_half_sum_kernel


def cast_into(dst, src):
    """dst[...] = src for host float32 <-> float16 with the kernels above (NumPy's own
    casts between them are scalar loops, about 10x slower here); anything else by NumPy."""
    if numba is not None and array_module(dst, src) is np and dst.flags.c_contiguous \
            and src.flags.c_contiguous and dst.size == src.size:
        if src.dtype == np.float32 and dst.dtype == np.float16:
            _to_half(src.reshape(-1), dst.reshape(-1).view(np.uint16))
            return dst
        if src.dtype == np.float16 and dst.dtype == np.float32:
            _from_half(src.reshape(-1).view(np.uint16), dst.reshape(-1))
            return dst
    dst[...] = src
    return dst


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
            half_sum(np.frombuffer(inoutvec, np.uint16), np.frombuffer(invec, np.uint16))
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
def flat(comm, buf):
    """One MPI Allreduce over all ranks."""
    dt, op = wire(buf)
    comm.world.Allreduce(MPI.IN_PLACE, [buf, dt], op=op)


def hierarchical(comm, buf):
    """Reduce to the node leader, Allreduce among leaders, Bcast inside the node.

    Only one rank per node sends across nodes, which is Jia et al.'s answer to
    many GPUs sharing one network card; the price is that the leaders do all
    the cross-node work while the others wait.
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


def two_d(comm, buf):
    """Reduce_scatter in the node, Allreduce across nodes per shard, Allgatherv in the node.

    Every rank of a node carries 1/S of the cross-node traffic (hierarchical
    puts all of it on the leader). The reduced shard lands in a scratch
    buffer: an in-place Reduce_scatter would leave it at the front of `buf`
    rather than at its place, so MPI writes it to scratch and the Allgatherv
    writes every shard, this rank's included, straight to its place in `buf`.
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
    shared_zeros array that did not fit in /dev/shm, runs 2d.
    With `wait`, the node barriers are Ibarriers completed by `wait(request)`, so
    the communication thread can wait for the other ranks of its node without
    spinning; by default they are blocking Barriers (faster: MPICH's own
    shared-memory barrier rather than the non-blocking schedule).
    """
    if not comm.shares_memory:
        return two_d(comm, buf)
    if not buf.size:                # every rank has the same size: nothing to sum anywhere
        return
    found = comm.peers(buf)
    if found is None:
        stage = comm.shared_scratch(buf.dtype, buf.size)
        stage[...] = buf
        shm(comm, stage, wait)
        buf[...] = stage
        return
    win, peers = found
    if win is None:                 # no room was left in shared memory for this array
        return two_d(comm, buf)
    dt, op = wire(buf)
    half = buf.dtype == np.float16
    if half:
        peers = tuple(p.view(np.uint16) for p in peers)
    counts, displs = shard_layout(buf.size, comm.node_sizes, comm.local_size)
    lo = displs[comm.local_rank]
    hi = lo + counts[comm.local_rank]
    across = comm.num_nodes > 1

    def node_barrier():
        win.Sync()
        if wait is None:
            comm.node_comm.Barrier()        # MPICH's shared-memory barrier: a few microseconds
        else:
            wait(comm.node_comm.Ibarrier())
        win.Sync()

    node_barrier()
    if hi > lo:
        (_shm_half_sum if half else _shm_sum)(peers, lo, hi, comm.local_rank, not across)
        if across:
            # blocking, as in 2d: a node without shared memory runs 2d, and MPI never
            # matches a blocking collective with a non-blocking one
            comm.cross_comm.Allreduce(MPI.IN_PLACE, [buf[lo:hi], dt], op=op)
            for q, p in enumerate(peers):
                if q != comm.local_rank:
                    p[lo:hi] = peers[comm.local_rank][lo:hi]
    node_barrier()


# ----------------------------------------------------------------------------
# hybrid: the measured rule
# ----------------------------------------------------------------------------
# hybrid sends float16 buffers of at least this many bytes through 2d
FP16_2D_MIN_BYTES = 256 << 10
# and buffers in the node's shared memory of at least this many bytes through shm
SHM_MIN_BYTES = 64 << 10


def choose(comm, nbytes, dtype=np.float32, device=False, shared=False):
    """The algorithm `hybrid` uses for a buffer of `nbytes` of `dtype` on `comm`'s topology.

    The rule, from `python -m mpitrain.bench_comm` on this 2-core host (MPICH
    5.0.2, shared memory; minimum ms of interleaved runs; grouping by
    --ranks-per-node stands in for nodes; 4 ranks oversubscribe the 2 cores,
    so those numbers are noisier):

    * a buffer in the node's shared memory (the gradient arena in training,
      Communicator.shared_zeros), of at least 64 KiB, on more than one rank:
      shm, any dtype and topology. Single buffers, flat / 2d / shm, 2 ranks, fp32: 4 KiB 0.015 /
      0.027 / 0.035; 16 KiB 0.033 / 0.052 / 0.040; 64 KiB 0.048 / 0.077 /
      0.042; 1 MiB 0.31 / 0.57 / 0.22; 4 MiB 1.36 / 2.28 / 0.49; 64 MiB 45 /
      60 / 4.3. fp16: 16 KiB 0.090 / 0.114 / 0.098; 64 KiB 0.230 / 0.205 /
      0.175; 4 MiB 9.1 / 5.9 / 3.7. ResNet-50's arena in 4 MiB buckets: 7.8 /
      54.6 / 33.8 ms (shm / 2d / flat), per tensor 11.6 / 57.9 / 36.2 ms; on
      4 ranks (oversubscribed) 25.6 ms for shm, 140 for flat. shm reads and
      writes each element of the rank's shard of every copy once, in place;
      MPICH's shared-memory all-reduce copies the data through its own cells.
      Below 64 KiB the two barriers cost more than the copies saved. On a
      node without shared memory shm runs 2d, which is why the rule keys on
      the buffer, not the node.
    * float32/float64 (MPI's built-in SUM) elsewhere: flat, at every size and topology.
      Single buffers, flat / hierarchical / 2d, 2 ranks on one node:
      4 KiB 0.012 / 0.015 / 0.043; 1 MiB 0.29 / 0.42 / 0.50;
      4 MiB 1.07 / 2.09 / 2.03; 64 MiB 48 / 118 / 66. 4 MiB on 4 ranks, one
      node: 4.4 / 7.3 / 8.0; as 2 nodes of 2: 12.3 / 14.8 / 20.7. MPICH's own
      all-reduce already uses shared memory inside a host; splitting it into
      phases only adds steps, and these "nodes" share one memory, so there is
      no slow network for the hierarchy to spare. (Jia et al. pick
      hierarchical for small tensors on 1,024 GPUs; a real cluster should be
      re-measured with bench_comm, and this function changed to match.)
    * float16 (the user-defined op, `fp16_sum_op`): 2d from 256 KiB up when
      every node has at least two ranks, else flat. MPICH runs a user-defined
      op on the whole buffer on every rank (the op is called once with all n
      elements), so the half additions, not the copies, dominate; 2d's
      reduce-scatter splits them among the node's ranks. flat / 2d, 2 ranks:
      256 KiB 0.82 / 0.61; 4 MiB 13.1 / 8.4; 49 MiB 123 / 69. 4 ranks, one
      node: 256 KiB 2.2 / 1.5; 1 MiB 8.1 / 4.8; 4 MiB 38 / 24. 2 nodes of 2:
      4 MiB 51 / 39; 16 MiB 185 / 120. At 64 KiB and below they are within
      noise (2 ranks 0.236 / 0.233) and flat makes one call instead of three.
      With a one-rank node, 2d has one shard per node and no split to gain.
    * CuPy buffers (NCCL): flat. NCCL's own all-reduce is already
      topology-aware (rings and trees over NVLink and the network); not
      measured here, as this host has no GPU.
    """
    if device:
        return "flat"
    if shared and comm.size > 1 and nbytes >= SHM_MIN_BYTES:
        return "shm"
    if np.dtype(dtype) == np.float16 and min(comm.node_sizes) > 1 and nbytes >= FP16_2D_MIN_BYTES:
        return "2d"
    return "flat"


HOST = {"flat": flat, "hierarchical": hierarchical, "2d": two_d, "shm": shm}
