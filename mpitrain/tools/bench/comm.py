"""Benchmark of the gradient all-reduce: `mpirun -np N python -m mpitrain bench comm`
(or `python -m mpitrain.tools.bench.comm`).

For ResNet-50's gradient arena (25,557,032 values, 161 tensors) it times one
step's worth of summing, for each algorithm:

    whole        one all-reduce of the whole arena
    fused F      the arena in consecutive slices of F bytes (fusion buckets;
                 views of the one buffer, nothing copied)
    per-tensor   one all-reduce per parameter tensor (161 calls)

The arena is allocated as training allocates it, in the node's shared memory
(Communicator.shared_zeros), which the `shm` algorithm needs and the others
ignore. With the values on the wire in fp32 and in fp16 (an fp16 arena; "fp16+cast"
adds the casts from and back to an fp32 arena that training pays), and a sweep
of single buffers from 4 KiB to 64 MiB per algorithm (each call at a new offset of
the arena, so read from memory as a bucket is; a smaller arena's sweep ends at its
whole), the data behind the `hybrid` rule.
Each time is the slowest rank's, the median of `repeats` runs after one warm-up.
Bandwidth is the bus bandwidth, NCCL's busbw: 2 (p-1)/p * bytes / time (p ranks), the
rate each rank's link must sustain (bytes / time is NCCL's algorithm bandwidth).

Top-k sparsification (`densities`, mpitrain.comm.topk) against dense sums, over the
model's own bucket layout as training builds it (the Reducer on the arena, 4 MiB
buckets, summed after backward): for each, the bytes one rank sends per step (dense:
the 4 n bytes of the buffer it contributes, of which a ring all-reduce moves 2 (p-1)/p
per rank; top-k: 4 + 4 bytes per pick, k = ceil(D n) per bucket), the step's time,
and for top-k the time of the selection alone (no communication).
The figures, and the `hybrid` rule drawn from them: docs/benchmarks.md.
"""
import itertools
import json
import time

import numpy as np
from mpi4py import MPI

from mpitrain.comm import ALGORITHMS, Communicator, choose

MiB = 1 << 20


def resnet50_tensor_sizes():
    """The 161 parameter tensor sizes of torchvision's ResNet-50, in arena (backward) order.

    Forward order: conv1 (7x7x3x64) and bn1; for each stage (3, 4, 6, 3 blocks
    of width 64, 128, 256, 512) each bottleneck's 1x1, 3x3 and 1x1 (x4 width)
    convolutions each followed by BatchNorm (weight, bias), the first block of
    a stage with a 1x1 downsample convolution and its BatchNorm; fc 2048x1000
    and its bias. Total 25,557,032. Used when mpitrain.nets cannot build the model.
    """
    sizes = [7 * 7 * 3 * 64, 64, 64]
    cin = 64
    for blocks, width in ((3, 64), (4, 128), (6, 256), (3, 512)):
        for b in range(blocks):
            sizes += [cin * width, width, width, 9 * width * width, width, width,
                      width * 4 * width, 4 * width, 4 * width]
            if b == 0:
                sizes += [cin * 4 * width, 4 * width, 4 * width]
            cin = 4 * width
    sizes += [2048 * 1000, 1000]
    return sizes[::-1]


def model_tensor_sizes(model):
    """Tensor sizes in arena order: from the model's segment table when mpitrain.nets
    builds it, else (ResNet-50 only) the list above. Returns (sizes, source)."""
    try:
        from mpitrain.nets import build_model
        net = build_model(model)
        return [int(s) for s in net.arena.segments["size"]], f"{model} segment table"
    except (ImportError, AttributeError):
        if model != "resnet50":
            raise
        return (resnet50_tensor_sizes(),
                "resnet50 tensor list (mpitrain.tools.bench.comm.resnet50_tensor_sizes)")


def _time(comm, steps, repeats):
    """{name: (median, minimum)} over `repeats` runs of each step() (after one warm-up),
    each run timed on the slowest rank. The steps take turns within each repeat (in
    rotating order), so that a change of load on a shared machine hits them alike; there,
    the minimum is the better estimate of the cost."""
    names = list(steps)
    for name in names:
        steps[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            comm.barrier()
            t = time.perf_counter()
            steps[name]()
            times[name].append(comm.world.allreduce(time.perf_counter() - t, op=MPI.MAX))
    return {name: (float(np.median(v)), float(np.min(v))) for name, v in times.items()}


def _rotating(comm, x, count, algorithm):
    """A step summing `count` values of `x` with `algorithm`, each call at the next offset
    (the same on every rank), wrapping around: a bucket of training comes from an arena
    larger than the caches and is read from memory, and so is each call's buffer here
    once `x` is (a buffer summed again in place would be read from the cache)."""
    offsets = itertools.cycle(range(0, x.size - count + 1, count))

    def step():
        start = next(offsets)
        comm.allreduce(x[start:start + count], algorithm)
    return step


def _slices(n, itemsize, fusion_bytes):
    step = max(1, fusion_bytes // itemsize)
    return [slice(a, min(a + step, n)) for a in range(0, n, step)]


def run(model="resnet50", algorithms=("flat", "hierarchical", "2d", "shm", "hybrid"),
        fusion=(1 * MiB, 4 * MiB, 16 * MiB), repeats=5, ranks_per_node=None,
        sweep=True, json_out=False, mpi_comm=None, densities=(0.1, 0.01), wires=("fp32", "fp16")):
    """Time the all-reduce of `model`'s gradients with the values on the wire in each of
    `wires`; rank 0 prints a table (or one JSON object with json_out) and every rank
    returns the result dict."""
    comm = Communicator(mpi_comm or MPI.COMM_WORLD, ranks_per_node)
    for a in algorithms:
        if a not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {a!r}; choose from {ALGORITHMS}")
    sizes, source = model_tensor_sizes(model) if comm.rank == 0 else (None, None)
    sizes, source = comm.world.bcast((sizes, source), root=0)
    n = sum(sizes)
    p = comm.size
    # zeros: the cost of a sum does not depend on the values, and repeated in-place sums
    # of anything else would overflow (p**k grows past float16 within a few repeats)
    grads = {w: comm.shared_zeros(n, {"fp32": np.float32, "fp16": np.float16}[w]) for w in wires}
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    tensors = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    rows = []

    def measure(mode, wire, buf, parts, extra=None, wire_dtype=None):
        """One row per algorithm (and per extra step) for summing buf[parts]."""
        used = {a: [] for a in algorithms}

        def step(a):
            return lambda: [used[a].append(comm.allreduce(buf[s], a, wire_dtype=wire_dtype))
                            for s in parts]
        steps = {a: step(a) for a in algorithms}
        steps.update(extra or {})
        nbytes = n * np.dtype(np.float16 if wire.startswith("fp16") else np.float32).itemsize
        for name, (med, low) in _time(comm, steps, repeats).items():
            rows.append(dict(algorithm=name, mode=mode, wire=wire, bytes=int(nbytes),
                             calls=len(parts),
                             ms=round(med * 1e3, 3), min_ms=round(low * 1e3, 3),
                             busbw_GBps=round(2 * (p - 1) / p * nbytes / med / 1e9, 3),
                             ran=sorted(set(used.get(name, [name])))))

    for wire in wires:
        buf = grads[wire]
        modes = [("whole", [slice(0, n)])]
        modes += [(f"fused {f // MiB} MiB", _slices(n, buf.itemsize, f)) for f in fusion]
        modes.append(("per-tensor", tensors))
        for mode, parts in modes:
            extra = {}
            # MPICH's own half type (MPIX_C_FLOAT16), against the user-defined fp16 sum
            if (wire == "fp16" and mode in ("whole", "fused 4 MiB")
                    and MPI.FLOAT16_T != MPI.DATATYPE_NULL):
                extra["flat, MPI.FLOAT16_T"] = lambda parts=parts: [
                    comm.world.Allreduce(MPI.IN_PLACE, [buf[s], MPI.FLOAT16_T], op=MPI.SUM)
                    for s in parts]
            measure(mode, wire, buf, parts, extra)
    if set(wires) == {"fp32", "fp16"}:
        # what training pays for fp16 on the wire from an fp32 arena: cast, sum, cast back,
        # in buckets of 4 MiB of the arena (what --fusion-threshold counts)
        measure("fused 4 MiB", "fp16+cast", grads["fp32"], _slices(n, 4, 4 * MiB),
                wire_dtype=np.float16)

    sweep_rows = []
    if sweep:
        for wire in wires:
            x = grads[wire]
            # 4 KiB .. 64 MiB; a smaller arena's whole once, in place of the sizes beyond it
            for count in sorted({min(4096 * 4 ** k // x.itemsize, n) for k in range(8)}):
                nbytes = count * x.itemsize
                reps = max(repeats, int(min(200, 2e7 / nbytes)))
                t = _time(comm, {a: _rotating(comm, x, count, a)
                                 for a in ("flat", "hierarchical", "2d", "shm")}, reps)
                sweep_rows.append(dict(wire=wire, bytes=count * x.itemsize,
                                       hybrid=choose(comm, count * x.itemsize, x.dtype,
                                                     shared=comm.peers(x) is not None),
                                       **{a: round(v[1] * 1e3, 4) for a, v in t.items()},
                                       median={a: round(v[0] * 1e3, 4) for a, v in t.items()}))

    result = dict(model=model, tensors=len(sizes), values=n, source=source, ranks=p,
                  topology=comm.describe(), node_sizes=comm.node_sizes, repeats=repeats,
                  rows=rows, sweep=sweep_rows,
                  topk=sparse_rows(comm, model, densities, repeats) if densities else [])
    if comm.rank == 0:
        print(json.dumps(result) if json_out else format_table(result), flush=True)
    comm.free()
    return result


def sparse_rows(comm, model, densities, repeats, threshold=4 * MiB):
    """Dense sums against top-k at each density over `model`'s buckets, as training sums
    them (module docstring); one row each."""
    from mpitrain.comm.buckets import Reducer, share_gradients
    from mpitrain.kernels import topk
    from mpitrain.nets import build_model
    arena = build_model(model).arena
    share_gradients(arena, comm, "hybrid")
    # gradient-like values; a sum replaces them, so they change from one repeat to the next
    arena.grad[...] = np.random.default_rng(comm.rank).standard_normal(arena.size) * 1e-3
    rows = []
    for density in (None, *densities):
        reducer = Reducer(arena, comm, threshold, "hybrid", overlap=False, density=density)

        def step():
            reducer.begin()
            reducer.finish()
            reducer.settle(True)
        med, low = _time(comm, {"step": step}, repeats)["step"]
        row = dict(compress="dense" if density is None else f"top-k {density:g}",
                   buckets=len(reducer.bounds), ms=round(med * 1e3, 3), min_ms=round(low * 1e3, 3))
        if density is None:
            row["bytes"] = sum(b - a for a, b in reducer.bounds) * arena.grad.itemsize
        else:
            tk = reducer.topk
            row["bytes"] = tk.bytes_per_step()
            scratch = [(np.empty(k, np.float32), np.empty(k, np.int32), np.empty(b - a, np.float32))
                       for k, (a, b) in zip(tk.k, reducer.bounds)]

            def select():
                for (a, b), k, (v, i, out) in zip(reducer.bounds, tk.k, scratch):
                    topk.select(arena.grad[a:b], tk.residual[a:b], out, k, v, i)
            row["select_ms"] = round(_time(comm, {"select": select}, repeats)["select"][0] * 1e3, 3)
        reducer.close()
        rows.append(row)
    return rows


def format_table(r):
    lines = [f"all-reduce of {r['model']} gradients: {r['values']:,} values in {r['tensors']} "
             f"tensors ({r['source']})", r["topology"]]
    if sum(r["node_sizes"]) == 1:
        lines.append("one rank: nothing is sent, so these times are each algorithm's local "
                     "work; time the all-reduce under mpirun (./launch.sh bench comm: NP ranks)")
    lines += [f"ms: median of {r['repeats']} (and minimum), slowest rank; "
              f"busbw = 2(p-1)/p * bytes / median time",
              "",
              f"{'algorithm':<28} {'mode':<13} {'wire':<9} {'calls':>5} {'ms':>9} {'min ms':>9} "
              f"{'busbw GB/s':>10}  ran"]
    for row in r["rows"]:
        lines.append(f"{row['algorithm']:<28} {row['mode']:<13} {row['wire']:<9} {row['calls']:>5} "
                     f"{row['ms']:>9.2f} {row['min_ms']:>9.2f} {row['busbw_GBps']:>10.2f}  "
                     f"{','.join(row['ran'])}")
    if r["sweep"]:
        lines += ["", "single buffer, minimum ms:",
                  f"{'wire':<5} {'bytes':>10} {'flat':>9} {'hierarchical':>13} {'2d':>9} {'shm':>9}"
                  f"  hybrid picks"]
        for e in r["sweep"]:
            lines.append(f"{e['wire']:<5} {e['bytes']:>10} {e['flat']:>9.3f} "
                         f"{e['hierarchical']:>13.3f} "
                         f"{e['2d']:>9.3f} {e['shm']:>9.3f}  {e['hybrid']}")
    if r["topk"]:
        dense = r["topk"][0]
        lines += ["", f"dense against top-k over the buckets of {r['model']} (4 MiB, "
                  f"after backward; bytes: what one rank sends per step, dense: the buffer "
                  f"it contributes)",
                  f"{'compress':<12} {'buckets':>7} {'bytes':>12} {'x dense':>8} {'ms':>9} "
                  f"{'min ms':>9} {'select ms':>10}"]
        for row in r["topk"]:
            lines.append(f"{row['compress']:<12} {row['buckets']:>7} {row['bytes']:>12,} "
                         f"{row['bytes'] / dense['bytes']:>8.3f} {row['ms']:>9.2f} "
                         f"{row['min_ms']:>9.2f} {row.get('select_ms', float('nan')):>10.2f}")
    return "\n".join(lines)
