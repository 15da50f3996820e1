"""Weight-update sharding (mpitrain.shard) under `mpirun -np N` (any N): the sharded step
against the unsharded one (all-reduce, then the update of the whole arena on every rank),
the per-parameter norms across shard boundaries, the overflow verdict, and checkpoints
between sharded and unsharded runs and across rank counts.

The test arena has 35 ALIGN units, so its shards are uneven on 2, 3 and 4 ranks, and its
largest parameter (2000 elements) spans more than one shard there.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpitrain import checkpoint
from mpitrain.arena import ALIGN, Arena, Param
from mpitrain.backend import to_numpy
from mpitrain.comm import Communicator
from mpitrain.comm.buckets import Reducer
from mpitrain.kernels.update import segment_sums
from mpitrain.optim import make_optimizer
from mpitrain.shard import ShardedOptimizer, ShardedReducer
from mpitrain.train import broadcast_model
from test_data_parallel import agree, digest, small_net

WORLD = MPI.COMM_WORLD
SIZES = (300, 5, 1000, 77, 129, 2000, 1, 384)       # 35 units of ALIGN elements
DECAY = (1, 0, 1, 1, 0, 1, 0, 1)
LARS = (1, 0, 1, 0, 1, 1, 0, 1)
HYPER = {"sgd": dict(momentum=0.9, weight_decay=1e-3, nesterov=True),
         "lars": dict(momentum=0.9, weight_decay=1e-3, eta=0.01),
         "lamb": dict(weight_decay=1e-2),
         # burn-in, then resets at Neumann steps 1, 5 and 13 within 20 steps
         "neumann": dict(momentum=0.9, weight_decay=1e-3, sgd_steps=2, reset_steps=4),
         "nlcg": dict(weight_decay=1e-3, beta_rule="pr")}
LOSS_SCALE = 8.0


def arena(working_dtype=np.float16, xp=np):
    """The test arena: fp32 masters of different scales per parameter, an fp16 working copy
    (xp: NumPy, or CuPy for an arena on the GPU)."""
    params = [Param((n,), None, decay=bool(d), lars=bool(l)) for n, d, l in zip(SIZES, DECAY, LARS)]
    a = Arena(params, working_dtype=working_dtype, xp=xp)
    rng = np.random.default_rng(0)
    for p in params:
        p.master[...] = xp.asarray(rng.standard_normal(p.shape) * 10.0 ** rng.uniform(-2, 1))
    a.sync_working()
    return a


def gradient(arena, step):
    """This rank's loss-scaled gradient of `step` (different on every rank)."""
    rng = np.random.default_rng(1000 * step + WORLD.rank)
    return (rng.standard_normal(arena.size) * LOSS_SCALE).astype(np.float32)


def relative(a, ref):
    """The largest difference relative to the largest reference value (absolute where that
    is 0)."""
    diff, scale = np.abs(a.astype(np.float64) - ref).max(), np.abs(ref).max()
    return float(diff / scale if scale else diff)


def test_shards_are_aligned_uneven_and_cover_the_arena(comm):
    def check():
        bounds = ShardedOptimizer("sgd", arena(), comm).shard.bounds
        sizes = np.diff(bounds)
        if bounds[0] != 0 or bounds[-1] != sum(-(-n // ALIGN) * ALIGN for n in SIZES):
            return f"the shards {bounds} do not cover the arena"
        if any(b % ALIGN for b in bounds) or sizes.min() < 0:
            return f"shard bounds {bounds} are not increasing multiples of {ALIGN}"
        if comm.size > 1 and sizes.min() == sizes.max():
            return f"the shards {sizes} are even: the test would not cover uneven shards"
        return None
    agree(check)


@pytest.mark.parametrize("impl", ["numba", "numpy"])
@pytest.mark.parametrize("name", ["sgd", "lars", "lamb", "neumann", "nlcg"])
def test_sharded_updates_equal_unsharded_after_20_steps(comm, name, impl):
    """20 steps of the sharded path and of the unsharded one (all-reduce, whole-arena
    update) from the same weights and gradients, with the Numba kernels and with the
    NumPy references: masters, momentum (and the optimizer's own arrays: LAMB's second
    moment, Neumann's moving average, NLCG's second moment and preconditioned gradient),
    the per-parameter rates (Neumann's regulariser, NLCG's beta) and the optimizer's
    scalars agree to float32 rounding, the fp16 working
    copies to fp16 rounding (and are the cast of the gathered masters)."""
    def check():
        whole, sharded = arena(), arena()
        opt = make_optimizer(name, whole, impl=impl, **HYPER[name])
        shard_opt = ShardedOptimizer(name, sharded, comm, impl=impl, **HYPER[name])
        reducer = ShardedReducer(shard_opt.shard, comm)
        inv_scale = reducer.postscale / LOSS_SCALE
        for step in range(20):
            whole.grad[...] = sharded.grad[...] = gradient(whole, step)
            comm.allreduce(whole.grad, "flat")
            reducer.begin()
            reducer.finish()
            rates = opt.step(0.05, inv_scale)
            shard_rates = shard_opt.step(0.05, inv_scale)
        state, ref = shard_opt.state_dict(), {"momentum": whole.momentum, **opt.state_dict()}
        moved = relative(arena().master, whole.master)
        if moved < 1e-2:
            return f"the weights hardly moved ({moved:.1e}): the comparison would prove nothing"
        errors = {"master": relative(sharded.master, whole.master),
                  "working": relative(sharded.working, whole.working.astype(np.float64)),
                  "rates": relative(np.asarray(shard_rates), np.asarray(rates)),
                  **{key: relative(np.asarray(state[key]), np.asarray(ref[key]))
                     for key in ref if key != "t"}}
        # float32 rounding; the fp16 copies of two such masters may differ by an fp16 ulp
        bad = {k: v for k, v in errors.items()
               if not v <= (2 ** -10 if k == "working" else 1e-5)}      # NaN included
        if bad:
            return f"sharded differs from unsharded (relative to the largest value): {bad}"
        if not np.array_equal(sharded.working, sharded.master.astype(np.float16)):
            return "the working copy is not the fp16 cast of the gathered masters"
        digests = comm.allgather(digest(sharded.master))
        return None if len(set(digests)) == 1 else f"ranks hold different masters: {digests}"
    agree(check)


def test_norms_across_shard_boundaries_equal_float64_norms(comm):
    """Each rank's partial sums of squares over its clipped table, summed over the ranks,
    give every parameter's norm (float64 reference over the whole parameter)."""
    def check():
        a = arena()
        a.grad[...] = np.random.default_rng(3).standard_normal(a.size)     # the same everywhere
        shard = ShardedOptimizer("lars", a, comm).shard
        sums = segment_sums(shard.master, shard.grad, shard.segments)
        comm.allreduce(sums.reshape(-1), "flat")
        for p, w_norm, g_norm in zip(a.params, *np.sqrt(sums)):
            w = np.linalg.norm(p.master.astype(np.float64))
            g = np.linalg.norm(p.grad.astype(np.float64))
            if abs(w_norm - w) > 1e-12 * w or abs(g_norm - g) > 1e-12 * g:
                return f"{p}: norms {w_norm}, {g_norm}; float64 {w}, {g}"
        return None
    agree(check)


def test_an_overflow_on_one_rank_is_every_ranks_verdict(comm):
    def check():
        a = arena()
        opt = ShardedOptimizer("sgd", a, comm)
        reducer = ShardedReducer(opt.shard, comm)
        verdicts = []
        for bad_rank in (None, comm.size - 1):
            a.grad[...] = gradient(a, 0)
            if comm.rank == bad_rank:
                a.grad[opt.shard.lo] = np.inf       # in its own shard: no other rank sums it
            reducer.finish()
            verdicts.append(int(reducer.nonfinite_flag()[0]))
        return None if verdicts == [0, 1] else f"overflow verdicts {verdicts}, expected [0, 1]"
    agree(check)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sgd", "lars", "lamb", "neumann", "nlcg"])
def test_the_sharded_update_on_a_gpu_equals_the_host(comm, name):
    """20 sharded steps on a CuPy arena (NCCL's reduce-scatter and all-gather, the CUDA
    kernels, the norms' partial sums added through NCCL) against the same steps on the
    host (MPI, Numba): masters, per-parameter rates and optimizer state agree to float32
    rounding, the fp16 working copy is the cast of the gathered masters."""
    import cupy
    if WORLD.size > cupy.cuda.runtime.getDeviceCount():
        pytest.skip("NCCL needs one GPU per rank")
    cupy.cuda.Device(comm.rank).use()

    def check():
        host, device = arena(), arena(xp=cupy)
        opts = [ShardedOptimizer(name, a, comm, **HYPER[name]) for a in (host, device)]
        reducers = [ShardedReducer(opt.shard, comm) for opt in opts]
        inv_scale = reducers[0].postscale / LOSS_SCALE
        for step in range(20):
            host.grad[...] = gradient(host, step)
            device.grad[...] = cupy.asarray(host.grad)
            for reducer in reducers:
                reducer.finish()
            rates = [to_numpy(opt.step(0.05, inv_scale)) for opt in opts]
        cupy.cuda.get_current_stream().synchronize()
        moved = relative(arena().master, host.master)
        if moved < 1e-2:
            return f"the weights hardly moved ({moved:.1e}): the comparison would prove nothing"
        state = [opt.state_dict() for opt in opts]
        errors = {"master": relative(to_numpy(device.master), host.master),
                  "rates": relative(rates[1], rates[0]),
                  **{key: relative(to_numpy(state[1][key]), state[0][key])
                     for key in state[0] if np.ndim(state[0][key])}}
        bad = {k: v for k, v in errors.items() if v > 1e-5}
        if bad:
            return f"the GPU's sharded update differs from the host's: {bad}"
        if not bool((device.working == device.master.astype(np.float16)).all()):
            return "the working copy is not the fp16 cast of the gathered masters"
        return None
    agree(check)


# ----- checkpoints: the same file whether the run was sharded, and on any rank count -----
def trained(comm, name, sharded, steps):
    """A small model (uneven shards) after `steps` updates with this rank's gradients,
    sharded or not; returns (model, optimizer)."""
    model = small_net(seed=0)
    broadcast_model(model, comm)
    a = model.arena
    if sharded:
        opt = ShardedOptimizer(name, a, comm, **HYPER[name])
        reducer = ShardedReducer(opt.shard, comm)
    else:
        opt = make_optimizer(name, a, **HYPER[name])
        reducer = Reducer(a, comm, overlap=False)
    run_steps(a, opt, reducer, range(steps))
    reducer.close()
    return model, opt


def run_steps(a, opt, reducer, steps):
    for step in steps:
        a.grad[...] = gradient(a, step) / LOSS_SCALE
        reducer.begin()
        reducer.finish()
        opt.step(0.05, reducer.postscale)


def shared_path(tmp_path):
    return WORLD.bcast(str(tmp_path / "checkpoint.h5") if WORLD.rank == 0 else None, root=0)


def save(model, comm, opt, path):
    state = checkpoint.collect(model, comm, 0, 3, 3, {"model": "small"}, opt)
    if comm.rank == 0:
        checkpoint.write(path, state)
    comm.barrier()
    return checkpoint.read(path)


def held(model, opt, sharded):
    """{"master", "momentum", and the optimizer's own state: arrays and scalars} as this rank
    holds them; a sharded optimizer's arrays are its shard's, an unsharded one's the whole
    arena's."""
    a = model.arena
    inner = opt.inner.state_dict() if sharded else opt.state_dict()
    return {"master": a.master, "momentum": opt.shard.momentum if sharded else a.momentum,
            **inner}


def matches_file(model, opt, sharded, state):
    """None when this rank's master and optimizer state are the file's bits (its shard's
    part of them when sharded), else what differs."""
    a = model.arena
    lo, hi = (opt.shard.lo, opt.shard.hi) if sharded else (0, a.size)
    saved = {"master": state["master"], "momentum": state["momentum"], **state["optimizer"]}
    for key, mine in held(model, opt, sharded).items():
        if not np.ndim(mine):
            if mine != saved[key]:
                return f"{key} after restore is {mine}, the checkpoint's {saved[key]}"
            continue
        full = a.zeros()
        a.unpack(saved[key], full)
        part = full if key == "master" else full[lo:hi]
        if not np.array_equal(mine, part):
            return f"{key} after restore differs from the checkpoint's"
    return None


@pytest.mark.parametrize("name", ["lars", "lamb", "neumann", "nlcg"])
def test_checkpoints_move_between_sharded_and_unsharded_runs_and_rank_counts(comm, name,
                                                                             tmp_path):
    """A sharded run's checkpoint restores into an unsharded run and into a sharded one on
    one rank and on all of them, bit for bit; an unsharded run's into a sharded run."""
    def check():
        path = shared_path(tmp_path)
        solo = Communicator(MPI.COMM_SELF)
        failures = []
        for written_sharded in (True, False):
            model, opt = trained(comm, name, written_sharded, 3)
            state = save(model, comm, opt, path)
            if written_sharded and not np.array_equal(
                    state["momentum"], model.arena.pack(opt.state_dict()["momentum"])):
                failures.append("the file's momentum is not the gathered shards'")
            for restore_comm, sharded in ((comm, not written_sharded), (comm, written_sharded),
                                          (solo, True), (solo, False)):
                fresh = small_net(seed=5)
                opt2 = (ShardedOptimizer(name, fresh.arena, restore_comm, **HYPER[name])
                        if sharded else make_optimizer(name, fresh.arena, **HYPER[name]))
                checkpoint.restore(path, fresh, restore_comm, opt2)
                why = matches_file(fresh, opt2, sharded, state)
                if why:
                    failures.append(f"written {'sharded' if written_sharded else 'unsharded'} "
                                    f"on {comm.size}, restored {'sharded' if sharded else 'not'} "
                                    f"on {restore_comm.size}: {why}")
            comm.barrier()
        solo.free()
        return "; ".join(failures) or None
    agree(check)


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "unsharded"])
@pytest.mark.parametrize("name", ["lamb", "neumann", "nlcg"])
def test_a_resumed_run_continues_bit_for_bit(comm, tmp_path, name, sharded):
    """3 steps, a checkpoint (an HDF5 file), a fresh run restored from it and 3 more steps:
    the weights and every part of the optimizer state of 6 uninterrupted steps, bit for
    bit (Neumann: across its burn-in and first reset)."""
    def check():
        path = shared_path(tmp_path)
        straight, opt = trained(comm, name, sharded, 6)
        first, opt1 = trained(comm, name, sharded, 3)
        save(first, comm, opt1, path)
        resumed = small_net(seed=7)
        if sharded:
            opt2 = ShardedOptimizer(name, resumed.arena, comm, **HYPER[name])
            reducer = ShardedReducer(opt2.shard, comm)
        else:
            opt2 = make_optimizer(name, resumed.arena, **HYPER[name])
            reducer = Reducer(resumed.arena, comm, overlap=False)
        checkpoint.restore(path, resumed, comm, opt2)
        run_steps(resumed.arena, opt2, reducer, range(3, 6))
        reducer.close()
        want, got = held(straight, opt, sharded), held(resumed, opt2, sharded)
        for key in want:
            if not np.array_equal(got[key], want[key]):
                return f"{key} of the resumed run differs from the uninterrupted run's"
        return None if got["t"] == 6 else f"steps taken {got['t']}"
    agree(check)
