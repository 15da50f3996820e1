"""`python -m mpitrain bench update`: one optimizer step over a real model's arena, per
kernel implementation, against this machine's memory bandwidth measured in the same run.

The step is a LARS step (kernels.update.sgd_update with trust=True) on the
model's own segment table (`build_model`: ResNet-50 has 25,557,032 parameters
in 161 segments), with fp32 master weights and an fp16 working copy, a loss
scale of 1024 to undo, momentum and weight decay. It is the per-parameter norm
pass followed by the fused pass. Every figure is the median of `repeats` runs
after one untimed run (which also compiles the Numba kernels); the kernels and
the bandwidth measurements run interleaved, round by round, so that other load
on the machine touches them alike.

Bytes the step must move, per parameter:
    norm pass    read master, grad                         4 + 4
    fused pass   read master, grad, momentum               4 + 4 + 4
                 write master, momentum, working (fp16)    4 + 4 + 2
    total                                                  30 bytes
The bandwidth floor is the best of three measurements on arena-sized fp32
arrays: a NumPy copy (8 bytes per element), a NumPy triad a = b + s*c (12
bytes; NumPy makes it two passes) and a Numba parallel triad (12 bytes).
Bytes are counted as the program asks for them, for the floor and the kernels
alike (the cache's extra reads before writes are not counted for either).
floor_ms = bytes / best bandwidth; "x floor" is the kernel's time over floor_ms
(the kernels' target; the figures: docs/benchmarks.md).

Before the timing, every implementation takes one step from copies of the same
state, and the report gives how far its master weights, momentum and working copy
land from the NumPy step's ("max_diff_vs_numpy", relative to each array's largest
value); a warning is printed when that exceeds DIFF_WARN, as the time of a kernel
that computes something else means nothing.

With a GPU visible to CuPy, the "cuda" implementation runs on a copy of the
arena on the device, against a CuPy copy on the device as its floor.
"""
import json
import os
import time

import numpy as np

STEP = dict(lr=0.1, momentum=0.9, weight_decay=5e-5, inv_scale=1 / 1024, trust=True, eta=0.001)
BYTES_PER_PARAM = (4 + 4) + (4 + 4 + 4) + (4 + 4 + 2)
DIFF_WARN = 1e-4    # fp32 rounding and summation order stay far below it


def _times(fns, repeats, sync=lambda: None):
    """name -> seconds of each of `repeats` calls of fns[name], after one untimed call of
    each. The calls are interleaved round by round, so that a change in the machine's load
    during the run touches every measurement alike."""
    for fn in fns.values():
        fn()
    sync()
    out = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            out[name].append(time.perf_counter() - t0)
    return out


def _numba_triad():
    from numba import njit, prange

    @njit(parallel=True)
    def triad(a, b, c, s):
        for i in prange(a.size):
            a[i] = b[i] + s * c[i]
    return triad


def _bandwidth_runs(n):
    """name -> (fn, bytes per element) for a NumPy copy, a NumPy triad and a Numba parallel
    triad on n-element fp32 arrays."""
    rng = np.random.default_rng(0)
    a = np.zeros(n, np.float32)
    b = rng.random(n, np.float32)
    c = rng.random(n, np.float32)
    s = np.float32(3.0)
    triad = _numba_triad()

    def numpy_triad():
        np.multiply(c, s, out=a)
        np.add(a, b, out=a)

    return {"numpy_copy": (lambda: np.copyto(a, b), 8),
            "numpy_triad": (numpy_triad, 12),
            "numba_triad": (lambda: triad(a, b, c, s), 12)}


def _step(arrays, segments, impl):
    from mpitrain.kernels.update import sgd_update
    master, working, grad, momentum = arrays
    return lambda: sgd_update(master, working, grad, momentum, segments, impl=impl, **STEP)


def _after_one_step(arrays, segments, impl, xp=np):
    """(master, working, momentum) on the host after one step of `impl` from copies of
    `arrays` (which stay as they are)."""
    from mpitrain.backend import to_numpy
    copies = tuple(xp.array(a, copy=True) for a in arrays)
    _step(copies, segments, impl)()
    master, working, _, momentum = copies
    return tuple(to_numpy(a).astype(np.float32) for a in (master, working, momentum))


def _max_diff(state, reference):
    """The largest difference between two (master, working, momentum) states, relative to
    each reference array's largest magnitude."""
    return max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
               for a, b in zip(state, reference))


def run(model="resnet50", repeats=7, json_out=False):
    """Time one LARS step per implementation; print a table (or one JSON object) and
    return the figures as a dict. Every figure is a median over `repeats`."""
    import numba

    from mpitrain import backend
    from mpitrain.nets import build_model

    net = build_model(model, num_classes=1000, dtype=np.float32, working_dtype=np.float16)
    arena = net.arena
    n = arena.size
    arena.grad[...] = np.random.default_rng(1).standard_normal(n, np.float32) * 1e-3 * 1024
    arrays = (arena.master, arena.working, arena.grad, arena.momentum)
    step_bytes = BYTES_PER_PARAM * n

    impls = ("numpy", "numba")
    reference = _after_one_step(arrays, arena.segments, "numpy")
    diffs = {impl: _max_diff(_after_one_step(arrays, arena.segments, impl), reference)
             for impl in impls}

    copies = _bandwidth_runs(n)
    fns = {**{name: fn for name, (fn, _) in copies.items()},
           **{impl: _step(arrays, arena.segments, impl) for impl in impls}}
    times = _times(fns, repeats)
    bandwidth = {name: per * n / float(np.median(times[name])) / 1e9
                 for name, (_, per) in copies.items()}
    floor_gbs = max(bandwidth.values())
    results = {impl: {"median_ms": 1e3 * float(np.median(times[impl])),
                      "min_ms": 1e3 * min(times[impl]), "floor_gbs": floor_gbs}
               for impl in impls}
    if backend.gpu_available():
        import cupy
        diffs["cuda"] = _max_diff(_after_one_step(arrays, arena.segments, "cuda", cupy),
                                  reference)
        results["cuda"] = _gpu_run(arrays, arena.segments, repeats)

    for r in results.values():
        r["gbs"] = step_bytes / (r["median_ms"] / 1e3) / 1e9
        r["fraction_of_bandwidth"] = r["gbs"] / r["floor_gbs"]
        r["floor_ms"] = 1e3 * step_bytes / (r["floor_gbs"] * 1e9)
        r["x_floor"] = r["median_ms"] / r["floor_ms"]
        r["speedup_vs_numpy"] = results["numpy"]["median_ms"] / r["median_ms"]
    for impl, r in results.items():
        r["max_diff_vs_numpy"] = diffs[impl]

    report = {"model": model, "params": int(net.num_params()), "num_classes": net.num_classes,
              "arena_elements": int(n), "segments": int(len(arena.segments)),
              "step": "LARS (norms + fused update), fp32 master, fp16 working",
              "bytes_per_step": int(step_bytes), "bytes_per_param": BYTES_PER_PARAM,
              "repeats": repeats, "cpu_count": os.cpu_count(),
              "numba_threads": numba.get_num_threads(),
              "bandwidth_gbs": bandwidth, "floor_gbs": floor_gbs,
              "floor_ms": 1e3 * step_bytes / (floor_gbs * 1e9), "results": results}
    print(json.dumps(report) if json_out else _table(report))
    return report


def _gpu_run(arrays, segments, repeats):
    """The "cuda" implementation on a device copy of the arena, and a CuPy copy of
    arena-sized fp32 arrays on the device as its floor."""
    import cupy
    dev = tuple(cupy.asarray(a) for a in arrays)
    src = cupy.ones(dev[0].size, cupy.float32)
    dst = cupy.empty_like(src)
    times = _times({"cuda": _step(dev, segments, "cuda"),
                    "copy": lambda: cupy.copyto(dst, src)},
                   repeats, cupy.cuda.get_current_stream().synchronize)
    return {"median_ms": 1e3 * float(np.median(times["cuda"])), "min_ms": 1e3 * min(times["cuda"]),
            "floor_gbs": 8 * src.size / float(np.median(times["copy"])) / 1e9}


def _table(r):
    bw = r["bandwidth_gbs"]
    lines = [
        f"bench update: {r['model']}, {r['params']:,} parameters ({r['num_classes']} classes) "
        f"in {r['segments']} segments, {r['arena_elements']:,} arena elements with their "
        f"padding; {r['step']}",
        f"bytes per step: {r['bytes_per_step'] / 1e6:.1f} MB ({r['bytes_per_param']} B/param: "
        f"norms read 8, update reads 12 and writes 10)",
        f"memory bandwidth (medians of {r['repeats']}): numpy copy {bw['numpy_copy']:.1f} GB/s, "
        f"numpy triad {bw['numpy_triad']:.1f} GB/s, numba triad {bw['numba_triad']:.1f} GB/s "
        f"({r['numba_threads']} threads)",
        f"floor: {r['floor_gbs']:.1f} GB/s -> {r['floor_ms']:.1f} ms per step",
        "",
        f"{'impl':6s} {'median ms':>10s} {'min ms':>8s} {'GB/s':>7s} {'of bandwidth':>13s} "
        f"{'x floor':>8s} {'vs numpy':>9s}",
    ]
    for name, x in r["results"].items():
        lines.append(f"{name:6s} {x['median_ms']:10.1f} {x['min_ms']:8.1f} {x['gbs']:7.1f} "
                     f"{100 * x['fraction_of_bandwidth']:12.0f}% {x['x_floor']:7.2f}x "
                     f"{x['speedup_vs_numpy']:8.1f}x")
    if "cuda" in r["results"]:
        lines.append("(cuda: against a CuPy copy on the device as its floor)")
    for name, x in r["results"].items():
        if x["max_diff_vs_numpy"] > DIFF_WARN:
            lines.append(f"WARNING: {name}'s step differs from NumPy's by "
                         f"{x['max_diff_vs_numpy']:.1e} (relative): its time is not that of "
                         f"the same step")
    return "\n".join(lines)


# ----- --shard-update: the optimizer per rank, sharded and not (under mpirun) -----
SHARD_HYPER = {"sgd": dict(momentum=0.9, weight_decay=5e-5),
               "lars": dict(momentum=0.9, weight_decay=5e-5, eta=0.001),
               "lamb": dict(weight_decay=5e-5),
               "neumann": dict(momentum=0.9, weight_decay=5e-5),
               "nlcg": dict(weight_decay=5e-5)}


def run_sharded(model="resnet50", optimizer="lars", repeats=7, json_out=False):
    """Under mpirun: per rank, the optimizer step over a model's whole arena (unsharded:
    what every rank runs after the all-reduce) and over this rank's shard (mpitrain.shard:
    the shard's update with the norms' all-reduce, then the masters' all-gather and the
    working-copy refresh), fp32 master and fp16 working copy; the gradient sums that go
    with each (a flat all-reduce of the arena; the reduce-scatter); and the bytes of
    optimizer state each rank holds either way. Two arenas of the same model, every call
    after a barrier, timed interleaved round by round; medians of `repeats`. Prints a
    table on rank 0 (or one JSON object) and returns the figures there (None elsewhere)."""
    from mpi4py import MPI

    from mpitrain.comm import Communicator
    from mpitrain.nets import build_model
    from mpitrain.optim import make_optimizer
    from mpitrain.shard import ShardedOptimizer

    comm = Communicator(MPI.COMM_WORLD)
    hyper = SHARD_HYPER[optimizer]
    whole, sharded = (build_model(model, num_classes=1000, dtype=np.float32,
                                  working_dtype=np.float16).arena for _ in range(2))
    grad = np.random.default_rng(1).standard_normal(whole.size, np.float32) * 1e-3 * 1024
    whole.grad[...] = sharded.grad[...] = grad
    opt = make_optimizer(optimizer, whole, **hyper)
    shard_opt = ShardedOptimizer(optimizer, sharded, comm, **hyper)
    bounds = shard_opt.shard.bounds
    step = dict(lr=0.1, inv_scale=1 / 1024)

    def timed(fn):
        def call():
            comm.barrier()
            fn()
        return call
    times = _times({"update": timed(lambda: opt.step(**step)),
                    "sharded": timed(lambda: shard_opt.step(**step)),
                    "shard_update": timed(lambda: shard_opt.inner.step(**step)),
                    "all_gather": timed(lambda: comm.all_gather(sharded.master, bounds)),
                    "allreduce": timed(lambda: comm.allreduce(grad, "flat")),
                    "reduce_scatter": timed(lambda: comm.reduce_scatter(grad, bounds))},
                   repeats)
    mine = {f"{k}_ms": 1e3 * float(np.median(v)) for k, v in times.items()}
    mine.update(shard_elements=shard_opt.shard.size, sharded_state_bytes=shard_opt.state_bytes(),
                unsharded_state_bytes=whole.momentum.nbytes + sum(
                    v.nbytes for v in opt.state_dict().values() if np.ndim(v)))
    mine["time_ratio"] = mine["sharded_ms"] / mine["update_ms"]
    mine["with_sums_ratio"] = ((mine["reduce_scatter_ms"] + mine["sharded_ms"])
                               / (mine["allreduce_ms"] + mine["update_ms"]))
    mine["memory_ratio"] = mine["sharded_state_bytes"] / mine["unsharded_state_bytes"]
    ranks = comm.gather(mine)
    comm.free()
    if ranks is None:
        return None
    report = {"model": model, "optimizer": optimizer, "params": int(whole.size),
              "ranks": len(ranks), "repeats": repeats, "per_rank": ranks,
              **{f"max_{k}": max(r[k] for r in ranks)
                 for k in ("time_ratio", "with_sums_ratio", "memory_ratio")}}
    print(json.dumps(report) if json_out else _sharded_table(report))
    return report


def _sharded_table(r):
    lines = [f"bench update --shard-update: {r['model']} ({r['params']:,} arena elements), "
             f"{r['optimizer']}, fp32 master, fp16 working, {r['ranks']} rank(s), medians of "
             f"{r['repeats']} (ms; state in MB)",
             "unsharded: update of the whole arena; after a flat all-reduce",
             "sharded: shard update (norms' all-reduce included) + all-gather + working-copy "
             "refresh; after a reduce-scatter",
             "",
             f"{'rank':>4s} {'shard':>11s} | {'update':>7s} {'sharded':>8s} {'(shard':>7s} "
             f"{'gather)':>7s} {'x':>5s} | {'all-red':>7s} {'red-sc':>7s} {'x':>5s} | "
             f"{'state':>6s} {'sharded':>7s} {'x':>5s}"]
    for rank, x in enumerate(r["per_rank"]):
        lines.append(f"{rank:4d} {x['shard_elements']:11,d} | {x['update_ms']:7.1f} "
                     f"{x['sharded_ms']:8.1f} {x['shard_update_ms']:7.1f} "
                     f"{x['all_gather_ms']:7.1f} {x['time_ratio']:5.2f} | "
                     f"{x['allreduce_ms']:7.1f} {x['reduce_scatter_ms']:7.1f} "
                     f"{x['with_sums_ratio']:5.2f} | {x['unsharded_state_bytes'] / 1e6:6.1f} "
                     f"{x['sharded_state_bytes'] / 1e6:7.1f} {x['memory_ratio']:5.2f}")
    lines.append(f"worst rank: optimizer time x{r['max_time_ratio']:.2f}, with the gradient "
                 f"sums x{r['max_with_sums_ratio']:.2f}, optimizer state "
                 f"x{r['max_memory_ratio']:.2f} of the unsharded")
    return "\n".join(lines)
