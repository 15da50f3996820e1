"""All-reduce algorithms: compositions of MPI (or NCCL) collectives.

Every function sums a contiguous 1-D array over all ranks IN PLACE and leaves
the same bits on every rank. mpitrain never moves bytes itself: each phase is
one collective of the MPI library (or of NCCL for CuPy buffers), called in
place wherever MPI allows it.

    flat          one Allreduce over the world
    hierarchical  Jia et al.: Reduce to the node leader, Allreduce among the
                  leaders, Bcast inside the node
    2d            ChainerMN's two-dimensional all-reduce: Reduce_scatter
                  inside the node, Allreduce of each shard among the ranks
                  with the same node-local index, Allgatherv inside the node
    hybrid        one of the above, chosen per buffer by `choose()`

Why the result is identical on every rank. IEEE addition is commutative but
not associative, so two ranks that add the same numbers in different orders
can disagree in the last bit. The MPI standard requires that "all processes
participating in these operations receive identical results" (the all-reduce
section since MPI 1.1), but that is a promise of the library, not something
mpitrain can see, so mpitrain relies on it in exactly one place, the
Allreduce; every other phase either reduces each element on one rank only
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
import numpy as np
from mpi4py import MPI

from mpitrain.backend import array_module

try:
    import numba
except ImportError:     # the float16 sum falls back to NumPy
    numba = None

ALGORITHMS = ("flat", "hierarchical", "2d", "hybrid")


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


if numba is not None:
    _widen = numba.njit(cache=True, nogil=True)(_widen)
    _narrow = numba.njit(cache=True, nogil=True)(_narrow)
    half_sum = numba.njit(cache=True, nogil=True)(_half_sum_kernel)
    _to_half = numba.njit(cache=True, nogil=True)(_to_half_kernel)
    _from_half = numba.njit(cache=True, nogil=True)(_from_half_kernel)
else:
    half_sum = _half_sum_numpy


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
    displs = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
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


# ----------------------------------------------------------------------------
# hybrid: the measured rule
# ----------------------------------------------------------------------------
# hybrid sends float16 buffers of at least this many bytes through 2d
FP16_2D_MIN_BYTES = 256 << 10


def choose(comm, nbytes, dtype=np.float32, device=False):
    """The algorithm `hybrid` uses for a buffer of `nbytes` of `dtype` on `comm`'s topology.

    The rule, from `python -m mpitrain.bench_comm` on this 2-core host (MPICH
    5.0.2, shared memory; minimum ms of interleaved runs; grouping by
    --ranks-per-node stands in for nodes; 4 ranks oversubscribe the 2 cores,
    so those numbers are noisier):

    * float32/float64 (MPI's built-in SUM): flat, at every size and topology.
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
    if np.dtype(dtype) == np.float16 and min(comm.node_sizes) > 1 and nbytes >= FP16_2D_MIN_BYTES:
        return "2d"
    return "flat"


HOST = {"flat": flat, "hierarchical": hierarchical, "2d": two_d}
