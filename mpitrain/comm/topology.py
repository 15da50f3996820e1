"""Communicator: the one object through which every collective of a run goes.

A run makes one Communicator and passes it wherever ranks must agree: the
model broadcast at the start, the gradient sums (`allreduce`, through the
algorithms of algorithms.py), the per-step flags (`allmax`), the BatchNorm
averages and groups, the evaluation counts, the checkpoint's gather and
restore. Device (CuPy) arrays go to NCCL where it serves, else through
`staged()`, the one place that copies a device array through host memory.

Topology, the communicators the algorithms use:

    world          every rank (a duplicate of the communicator given, so that
                   mpitrain's collectives never match the caller's own)
    node_comm      the ranks of this rank's node, ordered by world rank
    leaders_comm   local rank 0 of every node, ordered by node (COMM_NULL on
                   the other ranks): the middle phase of `hierarchical`
    cross_comm     the ranks with this rank's local index, one per node that
                   has that many ranks, ordered by node: the middle phase of
                   `2d` (for local index 0 it is the leaders' group)

Arrays from `shared_zeros` live in an MPI-3 shared-memory window of the
node: each rank of the node can read and write every other's, which the `shm`
all-reduce uses (the gradient arena goes there, see buckets.Reducer).

Nodes are numbered by their lowest world rank. A node is what
`Split_type(COMM_TYPE_SHARED)` finds (ranks sharing memory), or, with
`ranks_per_node=K`, the ranks with equal `rank // K`, so that one host can
play several nodes; the last node may be smaller than K.
"""
import contextlib
import os
import sys
import threading

import numpy as np
from mpi4py import MPI

from mpitrain import backend
from mpitrain.arena import ALIGN_BYTES
from mpitrain.backend import array_module
from mpitrain.control import ABORT_FALLBACK, end_job
from mpitrain.kernels import cast

from . import algorithms


class Communicator:
    def __init__(self, mpi_comm=None, ranks_per_node=None):
        self.world = (mpi_comm or MPI.COMM_WORLD).Dup()
        self.rank, self.size = self.world.rank, self.world.size
        # the ranks of this host (shared memory), whatever --ranks-per-node says: they share
        # its cores and GPUs
        host = self.world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.host_rank, self.host_size = host.rank, host.size
        host.Free()
        if ranks_per_node is None:
            self.node_comm = self.world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        else:
            if int(ranks_per_node) < 1:
                raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node}")
            self.node_comm = self.world.Split(color=self.rank // int(ranks_per_node), key=self.rank)
        self.ranks_per_node = ranks_per_node
        self.local_rank, self.local_size = self.node_comm.rank, self.node_comm.size

        # name each node by its leader's world rank; nodes are numbered in that order
        leader = self.node_comm.bcast(self.rank, root=0)
        leader_of = self.world.allgather(leader)
        leaders = sorted(set(leader_of))
        self.node_of = [leaders.index(r) for r in leader_of]     # node of every world rank
        self.node = self.node_of[self.rank]
        self.num_nodes = len(leaders)
        self.node_sizes = [self.node_of.count(k) for k in range(self.num_nodes)]

        self.cross_comm = self.world.Split(color=self.local_rank, key=self.node)
        self.leaders_comm = self.cross_comm if self.local_rank == 0 else MPI.COMM_NULL
        # --ranks-per-node may group ranks of different hosts: then no shared memory
        shared = self.node_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.shares_memory = self.local_size > 1 and shared.size == self.local_size
        shared.Free()
        self._windows = []      # [(MPI.Win or None, (every local rank's array in it))]
        self._scratch = {}
        self._groups = []
        self._nccl = None

    # ------------------------------------------------------------------
    def describe(self):
        """A few lines naming the nodes and their ranks (rank 0 prints it at start)."""
        how = ("ranks sharing memory (MPI COMM_TYPE_SHARED)" if self.ranks_per_node is None
               else f"rank // {self.ranks_per_node} (--ranks-per-node {self.ranks_per_node})")
        lines = [f"{self.size} rank(s) on {self.num_nodes} node(s), nodes grouped by {how}"]
        for k in range(self.num_nodes):
            ranks = [r for r, n in enumerate(self.node_of) if n == k]
            lines.append(f"  node {k}: {len(ranks)} rank(s): {_ranges(ranks)}")
        return "\n".join(lines)

    def free(self):
        """Release the groups, the shared windows and the MPI communicators (collective);
        arrays from shared_zeros (a shared gradient arena) must not be used afterwards."""
        for group in self._groups:
            group.free()
        self._groups = []
        for win, views in list(self._windows):
            self._free_window(win, views)
        for c in (self.cross_comm, self.node_comm, self.world):
            if c != MPI.COMM_NULL:
                c.Free()
        self.leaders_comm = MPI.COMM_NULL

    # ----- the gradient sum -----
    def allreduce(self, buf, algorithm="hybrid", wire_dtype=None, prescale=None, wait=None):
        """Sum the contiguous 1-D array `buf` over all ranks, in place; the same bits everywhere.

        algorithm: "flat", "hierarchical", "2d", "shm" or "hybrid" (see algorithms.py).
        wire_dtype: send the values in this dtype (np.float16 halves the bytes
        of a float32 buffer): `buf` is cast into a reused wire buffer, summed
        there and cast back. MPI's sums (flat, hierarchical, 2d, and shm across
        nodes) add in the wire dtype, so partial sums round to it; shm adds a
        node's copies in float32 and rounds once. A float16 sum that exceeds
        65504 becomes inf on every rank, which the overflow check then sees.
        prescale: multiply by this first (in the cast, when there is one): with
        1 / size the result is the mean, whose range does not grow with the
        number of ranks (what float16 on the wire needs).
        wait: a function that completes an MPI request; given, the flat and
        shm algorithms start non-blocking operations and hand them to it (the
        Reducer's communication thread polls instead of spinning a core).
        Returns the algorithm that ran.
        """
        if buf.ndim != 1 or not buf.flags.c_contiguous:
            raise ValueError(f"all-reduce needs a contiguous 1-D array, got shape {buf.shape} "
                             f"(contiguous: {buf.flags.c_contiguous}); pass a flat slice of "
                             f"the arena")
        if algorithm not in algorithms.ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; "
                             f"choose one of {', '.join(algorithms.ALGORITHMS)}")
        if wire_dtype is None or np.dtype(wire_dtype) == buf.dtype:
            if prescale is not None:
                buf *= buf.dtype.type(prescale)
            return self._sum(buf, algorithm, wait)
        # Numba's parallel regions are entered from one thread only: a communication
        # thread casts on its own
        parallel = threading.current_thread() is threading.main_thread()
        wire = self.scratch(wire_dtype, buf.size, like=buf, purpose="wire")
        _cast(buf, wire, 1.0 if prescale is None else prescale, parallel)
        ran = self._sum(wire, algorithm, wait)
        _cast(wire, buf, 1.0, parallel)
        return ran

    def _sum(self, buf, algorithm, wait):
        algorithms.wire(buf)      # reject an unsupported dtype before any collective starts
        on_device = array_module(buf) is not np
        if algorithm == "hybrid":
            algorithm = algorithms.choose(self, buf.nbytes, buf.dtype, on_device,
                                          shared=self.peers(buf) is not None)
        if not on_device:           # shm says where it handed a node without shared memory
            return algorithms.HOST[algorithm](self, buf, wait) or algorithm
        if algorithm == "shm":      # device memory is in no shared window: the 2d it is shaped like
            algorithm = "2d"
        engine = self.nccl()
        if engine is not None:
            engine.allreduce(buf, algorithm)
        else:
            with self.staged(buf) as host:
                algorithms.HOST[algorithm](self, host)
        return algorithm

    # ----- the sharded update's collectives (mpitrain.shard) -----
    def reduce_scatter(self, buf, bounds):
        """Sum the contiguous 1-D array `buf` over all ranks into this rank's shard: rank r
        ends with the sum in buf[bounds[r]:bounds[r + 1]] (`bounds`: size + 1 increasing
        offsets from 0 to buf.size, the same on every rank; shards may differ in size);
        the rest of buf is left as it was. Each element is summed by its shard's owner
        alone. MPI: Reduce_scatter with per-rank counts into a scratch shard (an in-place
        one would leave the sum at the front of buf); NCCL: one reduce per shard."""
        engine = self.nccl() if array_module(buf) is not np else None
        if engine is not None:
            engine.reduce_scatter_shards(buf, bounds)
            return
        dt, op = algorithms.wire(buf)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        with self.staged(buf) as host:
            mine = self.scratch(host.dtype, hi - lo, like=host, purpose="reduce-scatter")
            self.world.Reduce_scatter([host, dt], [mine, dt],
                                      recvcounts=np.diff(bounds).tolist(), op=op)
            host[lo:hi] = mine

    def all_gather(self, buf, bounds, wait=None):
        """Every rank's shard of the contiguous 1-D array `buf` (rank r's:
        buf[bounds[r]:bounds[r + 1]]) copied into every rank's buf, in place: MPI
        Iallgatherv; NCCL's all-gather for equal shards, else one broadcast per shard.
        The sharded update's masters (mpitrain.shard) and the top-k exchange
        (comm/topk.py). wait: as for allreduce. (Non-blocking because MPICH's blocking
        in-place Allgatherv is far slower than its Iallgatherv on one host:
        docs/design-notes.md.)"""
        engine = self.nccl() if array_module(buf) is not np else None
        if engine is not None:
            engine.all_gather_shards(buf, bounds)
            return
        offsets = np.asarray(bounds) * buf.itemsize     # as bytes: a copy, any dtype
        with self.staged(buf) as host:
            request = self.world.Iallgatherv(MPI.IN_PLACE, [host.view(np.uint8),
                                                            np.diff(offsets).tolist(),
                                                            offsets[:-1].tolist(), MPI.BYTE])
            (wait or MPI.Request.Wait)(request)

    def nccl(self):
        """The NCCL engine for CuPy buffers, created on first use (collectively); None without
        NCCL, and where ranks share a GPU (backend.gpu_collectives "mpi")."""
        if self._nccl is None:
            from . import nccl
            self._nccl = nccl.NcclEngine(self) if (backend.gpu_collectives == "nccl"
                                                   and nccl.available()) else False
        return self._nccl or None

    # ----- the other collectives of a run -----
    def broadcast(self, buf, root=0):
        """Overwrite the array `buf` on every rank with root's, in place (NCCL for CuPy
        arrays where there is NCCL)."""
        engine = self.nccl() if array_module(buf) is not np else None
        if engine is not None:
            engine.broadcast(engine.world, buf, root)
            return buf
        with self.staged(buf, write_back=self.rank != root) as host:
            self.world.Bcast(host, root=root)
        return buf

    def average(self, buf):
        """Replace the array `buf` by its mean over the ranks, in place (BatchNorm running
        statistics before an evaluation)."""
        self.allreduce(buf, "flat")
        buf *= buf.dtype.type(1.0 / self.size)
        return buf

    def allmax(self, values):
        """The elementwise maximum over all ranks of a few numbers (flags agreed once per
        step, timings), as a NumPy array; ints stay int64, anything else becomes float64."""
        values = np.asarray(values)
        out = values.astype(np.int64 if values.dtype.kind in "biu" else np.float64).reshape(-1)
        self.world.Allreduce(MPI.IN_PLACE, out, op=MPI.MAX)
        return out

    def group(self, size):
        """A Group of `size` consecutive ranks containing this one (distributed BatchNorm)."""
        group = Group(self, size)
        self._groups.append(group)
        return group

    def bcast(self, obj, root=0):
        """A Python object from root (pickled; small things: names, paths, metadata)."""
        return self.world.bcast(obj, root=root)

    def gather(self, obj, root=0):
        """Every rank's Python object, as a list on root (None elsewhere)."""
        return self.world.gather(obj, root=root)

    def scatter(self, objs, root=0):
        """Rank r's item of root's list `objs`."""
        return self.world.scatter(objs, root=root)

    def allgather(self, obj):
        """Every rank's Python object, as a list on every rank."""
        return self.world.allgather(obj)

    def barrier(self):
        self.world.Barrier()

    def abort(self, status, fallback=ABORT_FALLBACK):
        """End every rank of the job at once (MPI Abort) with `status`, from any
        thread: control.end_job (`fallback`: its seconds before the process ends itself)."""
        end_job(self.world, status, fallback)

    @contextlib.contextmanager
    def staged(self, buf, write_back=True):
        """`buf` in a form MPI takes: itself for host memory, and for device memory when MPI
        is CUDA-aware (float16 excepted: its op runs on the host); else a host copy,
        written back into `buf` on leaving when `write_back`. The current stream's
        queued work is finished first, so MPI reads what the kernels wrote (the Reducer
        makes its communication stream current, after an event of the compute stream);
        the copy back is queued on that stream too."""
        if array_module(buf) is np:
            yield buf
            return
        backend.synchronize(buf)
        if _cuda_aware() and buf.dtype != np.float16:
            yield buf
            return
        host = backend.to_numpy(buf)
        yield host
        if write_back:
            buf.set(host)

    # ----- memory the algorithms use -----
    def shared_zeros(self, n, dtype):
        """n zeros of `dtype` in an MPI-3 shared-memory window of the node (collective
        over the node), which every rank of the node can read and write; each rank's
        array starts on an ALIGN_BYTES boundary. Where the node's ranks do not share
        memory (or the node has one rank) a private array, still registered, so that
        every rank agrees the buffer is "shared" (the hybrid rule) and runs `shm`,
        which is 2d on such a node."""
        from mpitrain.arena import aligned_zeros
        dtype = np.dtype(dtype)
        if not (self.shares_memory and self._room_in_shared_memory(n * dtype.itemsize)):
            mine = aligned_zeros(n, dtype, np)
            self._windows.append((None, (mine,) * self.local_size))
            return mine
        nbytes = n * dtype.itemsize
        win = MPI.Win.Allocate_shared(nbytes + ALIGN_BYTES, 1, comm=self.node_comm)
        win.Lock_all(MPI.MODE_NOCHECK)    # one passive epoch for the window's life: Win.Sync works
        views = []
        for q in range(self.local_size):
            raw = np.frombuffer(win.Shared_query(q)[0], np.uint8)
            skip = -raw.ctypes.data % ALIGN_BYTES
            views.append(raw[skip:skip + nbytes].view(dtype))
        views[self.local_rank][:] = 0
        self._windows.append((win, tuple(views)))
        return views[self.local_rank]

    def _room_in_shared_memory(self, nbytes):
        """Whether /dev/shm, where MPICH keeps shared windows, holds the node's copies
        (decided by the node's first rank for all); a container's default 64 MiB does
        not, and running out later would kill the job with SIGBUS."""
        room = True
        if self.local_rank == 0 and os.path.isdir("/dev/shm"):
            fs = os.statvfs("/dev/shm")
            free, need = fs.f_bavail * fs.f_frsize, nbytes * self.local_size
            room = free >= need + (64 << 20)
            if not room:
                print(f"mpitrain: node {self.node}: /dev/shm has {free >> 20} MiB free, a shared "
                      f"array of {self.local_size} x {nbytes >> 20} MiB does not fit: summing it "
                      f"through MPI's collectives instead (give the job a larger /dev/shm, "
                      f"e.g. docker run --shm-size)", file=sys.stderr, flush=True)
        return self.node_comm.bcast(room, root=0)

    def peers(self, buf):
        """(window, arrays): buf's place in the shared_zeros array holding it, in every
        local rank's copy (indexed by local rank; window None where the node does not
        share memory); None when buf is not in such an array."""
        if not isinstance(buf, np.ndarray) or not buf.size:
            return None
        address = buf.ctypes.data
        for win, views in self._windows:
            mine = views[self.local_rank]
            start = mine.ctypes.data
            if buf.dtype == mine.dtype and start <= address < start + mine.nbytes:
                i = (address - start) // buf.itemsize
                return win, tuple(v[i:i + buf.size] for v in views)
        return None

    def _free_window(self, win, views):
        self._windows = [(w, v) for w, v in self._windows if v is not views]
        if win is not None:
            win.Unlock_all()
            win.Free()

    def shared_scratch(self, dtype, n):
        """A reused shared_zeros array of n elements (grown collectively: every rank
        must ask for the same sizes in the same order, as the all-reduce calls do)."""
        key = ("shared", np.dtype(dtype).str)
        buf = self._scratch.get(key)
        if buf is None or buf.size < n:
            for win, views in self._windows:
                if views[self.local_rank] is buf:
                    self._free_window(win, views)
                    break
            buf = self._scratch[key] = self.shared_zeros(max(n, 1), dtype)
        return buf[:n]

    def scratch(self, dtype, n, like=None, purpose="shard"):
        """A reused buffer of n elements (grown, never shrunk) on the device of `like`."""
        xp = array_module(like) if like is not None else np
        key = (purpose, np.dtype(dtype).str, xp.__name__)
        buf = self._scratch.get(key)
        if buf is None or buf.size < n:
            buf = self._scratch[key] = xp.empty(max(n, 1), dtype)
        return buf[:n]


class Group:
    """`size` consecutive ranks of a Communicator (0..size-1, size..2 size-1, ...; the last
    group may be smaller): .size, and .sum(v), the sum over the group of a per-channel
    vector (distributed BatchNorm)."""

    def __init__(self, comm, size):
        if int(size) < 1:
            raise ValueError(f"the group size must be positive, got {size}")
        self.comm = comm
        self._mpi = comm.world.Split(color=comm.rank // int(size), key=comm.rank)
        self.size = self._mpi.size

    def sum(self, v):
        """A new array (on v's device) holding the sum of v over the group."""
        total = v.copy()
        with self.comm.staged(total) as host:
            self._mpi.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        return total

    def free(self):
        self._mpi.Free()


def _cast(src, dst, scale, parallel):
    """dst = src * scale in dst's dtype: the kernels of mpitrain.kernels.cast between fp32
    and fp16 (NumPy's own casts between them are scalar loops), NumPy or CuPy otherwise."""
    if src.dtype == np.float32 and dst.dtype == np.float16:
        cast.to_half(src, dst, scale=scale, parallel=parallel)
    elif src.dtype == np.float16 and dst.dtype == np.float32 and scale == 1.0:
        cast.to_float(src, dst, parallel=parallel)
    else:
        dst[...] = src * src.dtype.type(scale) if scale != 1.0 else src


def _cuda_aware():
    """Whether the MPI library takes CUDA device buffers (MPI 4.1 memory allocation kinds)."""
    info = MPI.COMM_WORLD.Get_info()
    kinds = (info.Get("mpi_memory_alloc_kinds") or "").split(",")
    info.Free()
    return "cuda" in kinds or "cuda:device" in kinds


def _ranges(ranks):
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ", ".join(out)
