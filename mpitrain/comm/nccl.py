"""The NCCL engine: the same algorithms on CuPy buffers, every phase one NCCL collective.

NCCL communicators mirror the MPI ones of the Communicator (world, node,
same-local-index); each is created from a unique id that its rank 0 draws and
broadcasts over the matching MPI communicator (CuPy draws it as bytes).
Collectives are queued on CuPy's current stream, in place, and return at once:
the gradient Reducer makes its communication stream current around them and
orders that stream by CUDA events (mpitrain/comm/buckets.py); any other caller
keeps queueing work on the same stream, or synchronises before it reads the
result on the host. NCCL sums float16 natively and, like the MPI path, leaves
the same bits on every rank: each element is reduced once and then distributed
(ring, tree and NVLS algorithms alike).

Needs CuPy with `cupy.cuda.nccl` (the nvidia-nccl-cu12 or -cu13 wheel beside CuPy).
"""
import numpy as np


def available():
    """Whether CuPy loads NCCL (`cupy.cuda.nccl.available`) and sees a GPU."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", False)) and cupy.is_available()


def version():
    """The NCCL library's version as "major.minor.patch", or None without NCCL."""
    if not available():
        return None
    from cupy.cuda import nccl
    code = nccl.get_version()       # major * 10000 + minor * 100 + patch
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def _communicator(nccl, mpi_comm):
    uid = nccl.get_unique_id() if mpi_comm.rank == 0 else None
    uid = mpi_comm.bcast(uid, root=0)
    return nccl.NcclCommunicator(mpi_comm.size, uid, mpi_comm.rank)


class NcclEngine:
    def __init__(self, comm):
        import cupy
        from cupy.cuda import nccl
        self._cupy, self._nccl = cupy, nccl
        self.comm = comm
        # the same order on every rank: each creation blocks until its members have all joined
        self.world = _communicator(nccl, comm.world)
        self.node = _communicator(nccl, comm.node_comm)
        self.cross = _communicator(nccl, comm.cross_comm)
        self._types = {np.dtype(np.float16): nccl.NCCL_FLOAT16,
                       np.dtype(np.float32): nccl.NCCL_FLOAT32,
                       np.dtype(np.float64): nccl.NCCL_FLOAT64,
                       np.dtype(np.int32): nccl.NCCL_INT32}       # top-k's indices

    # ---------------- the algorithms ----------------
    def allreduce(self, buf, algorithm):
        if algorithm == "flat":
            self.all_reduce(self.world, buf)
        elif algorithm == "hierarchical":
            self.hierarchical(buf)
        else:
            self.two_d(buf)

    def hierarchical(self, buf):
        """reduce to local rank 0, all-reduce among node leaders, broadcast in the node."""
        c = self.comm
        if c.local_size > 1:
            self.reduce(self.node, buf, root=0)
        if c.local_rank == 0 and c.num_nodes > 1:
            self.all_reduce(self.cross, buf)
        if c.local_size > 1:
            self.broadcast(self.node, buf, root=0)

    def two_d(self, buf):
        """reduceScatter in the node, all-reduce each shard across nodes, allGather in the node.

        NCCL's reduceScatter cuts equal shards, and is in place when rank r's
        output is the r-th shard of the input; the n % L tail elements go
        through `hierarchical` (as Horovod does). With uneven nodes the
        same-local-index groups would not span every node, so the whole buffer
        goes through `hierarchical`.
        """
        c = self.comm
        if len(set(c.node_sizes)) > 1:
            self.hierarchical(buf)
            return
        count = buf.size // c.local_size
        if count:
            body = buf[:count * c.local_size]
            shard = body[c.local_rank * count:(c.local_rank + 1) * count]
            self.reduce_scatter(self.node, body, shard, count)
            if c.num_nodes > 1:
                self.all_reduce(self.cross, shard)
            self.all_gather(self.node, shard, body, count)
        if count * c.local_size < buf.size:
            self.hierarchical(buf[count * c.local_size:])

    # ---------------- NCCL collectives, in place, on the current stream ----------------
    def _stream(self):
        return self._cupy.cuda.get_current_stream().ptr

    def all_reduce(self, nc, buf):
        nc.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._types[buf.dtype],
                     self._nccl.NCCL_SUM, self._stream())

    def reduce(self, nc, buf, root):
        nc.reduce(buf.data.ptr, buf.data.ptr, buf.size, self._types[buf.dtype],
                  self._nccl.NCCL_SUM, root, self._stream())

    def broadcast(self, nc, buf, root):
        nc.broadcast(buf.data.ptr, buf.data.ptr, buf.size, self._types[buf.dtype], root,
                     self._stream())

    def reduce_scatter(self, nc, src, shard, count):
        nc.reduceScatter(src.data.ptr, shard.data.ptr, count, self._types[src.dtype],
                         self._nccl.NCCL_SUM, self._stream())

    def all_gather(self, nc, shard, dst, count):
        nc.allGather(shard.data.ptr, dst.data.ptr, count, self._types[dst.dtype], self._stream())

    # ---------------- uneven shards (the sharded update) ----------------
    def reduce_scatter_shards(self, buf, bounds):
        """Rank r gets the sum of buf[bounds[r]:bounds[r+1]] there, in place: ncclReduceScatter
        cuts equal shards only, so one reduce per shard to its owner, in one NCCL group."""
        self._nccl.groupStart()
        for r in range(len(bounds) - 1):
            if bounds[r + 1] > bounds[r]:
                self.reduce(self.world, buf[bounds[r]:bounds[r + 1]], root=r)
        self._nccl.groupEnd()

    def all_gather_shards(self, buf, bounds):
        """buf[bounds[r]:bounds[r+1]] from rank r to every rank, in place: ncclAllGather
        when the shards are equal (it takes equal counts only), else one broadcast per
        shard, in one NCCL group."""
        sizes = {bounds[r + 1] - bounds[r] for r in range(len(bounds) - 1)}
        if len(sizes) == 1:
            count, r = sizes.pop(), self.world.rank_id()
            self.all_gather(self.world, buf[r * count:(r + 1) * count], buf, count)
            return
        self._nccl.groupStart()
        for r in range(len(bounds) - 1):
            if bounds[r + 1] > bounds[r]:
                self.broadcast(self.world, buf[bounds[r]:bounds[r + 1]], root=r)
        self._nccl.groupEnd()
