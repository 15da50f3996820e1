"""Where a training step's time and memory go: `bench step --profile`, the GEMM peak,
and the peak resident memory of a run.

    profile_steps(step, steps)   ms per step by kind of work (GEMM, im2col, col2im,
                                 Winograd transforms, BatchNorm, ReLU and residual
                                 add, pooling, loss, copies and casts, update,
                                 the rest), each GEMM shape
                                 with its calls, time and GFLOP/s, and the share of
                                 the step outside GEMMs
    gemm_peak()                  GFLOP/s of a large float32 GEMM on this machine, now
    PeakMemory                   the peak resident memory of a block of work, above the
                                 resident memory at its start (Linux)

The kinds come from cProfile's exclusive time of each function, assigned by the
file and function it is in. cProfile adds time to every Python call, the GEMMs'
included, so the profiled steps run longer than the timed ones and the kinds'
shares are what to read. The GEMMs are timed one by one through nets/conv.py's
GEMM_LOG in as many steps again without cProfile: their times, GFLOP/s and share of
the step are those of an unprofiled step.
"""
import cProfile
import collections
import math
import os
import pstats
import time

import numpy as np

# (kind, a path fragment of the file, the function or None for every function of it)
KINDS = (("GEMM", "nets/conv.py", "matmul"), ("GEMM", "nets/conv.py", "_matmul"),
         ("GEMM", "kernels/gemm.py", None),
         ("im2col", "kernels/im2col.py", "im2col"), ("col2im", "kernels/im2col.py", "col2im"),
         ("Winograd transforms", "kernels/winograd.py", None),
         ("BatchNorm", "kernels/batchnorm.py", None), ("BatchNorm", "nets/batchnorm.py", None),
         ("ReLU, residual add", "kernels/elementwise.py", None),
         ("ReLU, residual add", "nets/activation.py", None),
         ("ReLU, residual add", "nets/resnet.py", None),
         ("pooling", "kernels/pool.py", None), ("pooling", "nets/pool.py", None),
         ("loss", "nets/losses.py", None),
         ("update", "kernels/update.py", None), ("update", "kernels/lamb.py", None),
         ("update", "mpitrain/optim.py", None), ("update", "mpitrain/precision.py", None))
# NumPy's methods that copy or convert arrays (profiled as C methods of ndarray)
COPIES = ("astype", "copy", "ascontiguousarray", "empty", "zeros", "empty_like", "zeros_like",
          "concatenate", "stack", "reshape")


def kind_of(filename, function):
    for kind, path, name in KINDS:
        if path in filename.replace(os.sep, "/") and name in (None, function):
            return kind
    if any(f"'{c}'" in function or function == c for c in COPIES):
        return "copies, casts"
    return "other (Python, NumPy glue)"


def profile_steps(step, steps):
    """Run step() `steps` times with the GEMM log on, then `steps` times under cProfile;
    returns {"ms": {kind: ms per step under cProfile}, "profiled_step_ms", "step_ms",
    "gemms": [...], "gemm_ms", "gemm_gflops", "outside_gemm"} (the last five from the
    steps without cProfile)."""
    from mpitrain.nets import conv
    conv.GEMM_LOG = []
    start = time.perf_counter()
    try:
        for _ in range(steps):
            step()
        took = time.perf_counter() - start
        log = conv.GEMM_LOG
    finally:
        conv.GEMM_LOG = None
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    profiled = time.perf_counter() - start
    ms = collections.Counter()
    for (filename, _, function), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        ms[kind_of(filename, function)] += 1e3 * tottime / steps
    gemms = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for a, b, seconds, _ in log:
        g = gemms[(tuple(a), tuple(b))]
        g[0] += 1
        g[1] += seconds
        g[2] += 2.0 * math.prod(a) * b[-1]
    rows = sorted(({"a": list(a), "b": list(b), "calls": n // steps, "ms": 1e3 * t / steps,
                    "gflops": f / t / 1e9 if t else 0.0} for (a, b), (n, t, f) in gemms.items()),
                  key=lambda r: -r["ms"])
    flops = sum(f for _, _, f in gemms.values()) / steps
    gemm_ms = sum(r["ms"] for r in rows)
    step_ms = 1e3 * took / steps
    return {"ms": dict(ms.most_common()), "profiled_step_ms": 1e3 * profiled / steps,
            "step_ms": step_ms, "gemms": rows,
            "gemm_ms": gemm_ms, "gemm_gflops": flops / gemm_ms / 1e6 if gemm_ms else 0.0,
            "flops_per_step": flops, "outside_gemm": 1.0 - gemm_ms / step_ms}


def step_flops(step):
    """The floating-point operations of one step's layers, 2 m n k for each GEMM of the
    direct form (Winograd's GEMMs count as the direct convolution they replace): one extra
    step, with the GEMM log on."""
    from mpitrain.nets import conv
    conv.GEMM_LOG = []
    try:
        step()
        return sum(flops for _, _, _, flops in conv.GEMM_LOG)
    finally:
        conv.GEMM_LOG = None


def gemm_peak(n=2048, repeats=5):
    """GFLOP/s of an n x n x n float32 GEMM (best of `repeats`) on the threads the step's
    GEMMs run on (kernels.gemm.matmul)."""
    from mpitrain.kernels.gemm import matmul
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    out = matmul(a, b)
    best = min(_timed(lambda: matmul(a, b, out)) for _ in range(repeats))
    return 2.0 * n ** 3 / best / 1e9


def _timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


class PeakMemory:
    """`with PeakMemory() as m: ...` -> m.bytes: the peak resident memory of the block
    above the resident memory at its start (Linux: the high-water mark, reset through
    /proc/self/clear_refs; None where that is not available)."""

    def __enter__(self):
        self.bytes = None
        self.start = _status("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                    # resets VmHWM to the current RSS
        except OSError:
            self.start = None
        return self

    def __exit__(self, *exc):
        peak = _status("VmHWM")
        if self.start is not None and peak is not None:
            self.bytes = peak - self.start
        return False


def _status(key):
    """A memory line of /proc/self/status, in bytes (None where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
