"""Where a step's device time goes, layer by layer: `bench step --device gpu --profile N`.

Every module's forward and backward is bracketed by two clock marks, recorded
in the order the work is queued. On a GPU a mark is a CUDA event recorded on
the compute stream: nothing waits for the device until the step's end, so the
time between a module's marks is the device's time for the kernels that module
queued, not the host's. A module's *own* time is its marks' interval less its
children's (a residual block's own backward is its ReLU gradient); the rows sum
them by layer type and phase. The host's time to queue one step is measured
apart: where it exceeds the device's time, the step waits on Python and launch
overhead, not on the GPU.

Each row's rate is read against the card's peaks, measured here at the start:
a memory-bound layer by the bytes it must move (BYTES: its passes over its
input and output, the floor a fused kernel design reaches) per second against
a device-to-device copy; a convolution or linear layer by its floating-point
operations (2 x multiply-adds, three products in backward) against a large
fp16 product. Where PyTorch is importable its profiler (CUPTI) also counts the
kernels one step launches and names the longest ones.

On the CPU the same marks are host clock reads (`HostClock`): there host time
is the work's time, and the tests check the accounting there.
"""
import collections
import time

from mpitrain.nets.module import run_layer

# Bytes a layer's passes must move, as multiples of (its argument's bytes, its result's
# bytes) per phase; in backward the argument is dy and the result dx. BatchNorm forward:
# the statistics read x, the affine pass reads x (and the residual, counted once where
# given) and writes y; backward: the sums read dy and x, the dx pass reads dy and x and
# writes dx. A residual block's own backward is its ReLU gradient: it reads dy and the
# block's output and writes the gradient, three times dy's bytes.
BYTES = {
    ("BatchNorm2d", "forward"): (2, 1), ("BatchNorm2d", "backward"): (2, 3),
    ("MaxPool2d", "forward"): (1, 1), ("MaxPool2d", "backward"): (1, 1),
    ("AvgPool2d", "forward"): (1, 1), ("AvgPool2d", "backward"): (1, 1),
    ("GlobalAvgPool2d", "forward"): (1, 1), ("GlobalAvgPool2d", "backward"): (1, 1),
    ("ReLU", "forward"): (1, 1), ("ReLU", "backward"): (1, 2),
    ("Dropout", "forward"): (1, 1), ("Dropout", "backward"): (1, 1),
    ("Bottleneck", "backward"): (3, 0), ("BasicBlock", "backward"): (3, 0),
}
class HostClock:
    """Marks that are host clock reads; the interval between two is in ms."""

    def mark(self):
        return time.perf_counter()

    def finish(self):
        pass

    def ms(self, a, b):
        return 1e3 * (b - a)


class EventClock:
    """Marks that are CUDA events recorded on CuPy's current stream; intervals are read
    once the step's end has been reached (`finish`), never while it runs. Events are
    reused from step to step."""

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.pool, self.used = [], 0

    def mark(self):
        if self.used == len(self.pool):
            self.pool.append(self.cupy.cuda.Event())
        event = self.pool[self.used]
        self.used += 1
        event.record()
        return event

    def finish(self):
        self.pool[self.used - 1].synchronize()
        self.used = 0

    def ms(self, a, b):
        return self.cupy.cuda.get_elapsed_time(a, b)


class Recorder:
    """Brackets every layer of `model` with clock marks while in a `with` block.

    The marks go around each call a container makes to one of its layers, through the
    containers' run_layer hook (nets/module.py), set on the model's modules for the
    block's duration and removed at its end. `intervals` collects, per call: (module,
    phase, start, end, io), start and end as (sequence number, mark), io: (argument bytes,
    result bytes, the shapes of the module's last forward input and output, residual
    bytes, products: a layer's backward computes dW and, unless its input needs no
    gradient (dx None), dx)."""

    def __init__(self, model, clock):
        self.clock, self.intervals, self.count, self.shapes = clock, [], 0, {}
        self.modules = [m for _, m in model.named_modules()]

    def mark(self):
        self.count += 1
        return self.count, self.clock.mark()

    def __enter__(self):
        for m in self.modules:
            m.run_layer = self.bracketed
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            del m.run_layer             # the class's own again
        return False

    def bracketed(self, module, phase, x, *args, **options):
        start = self.mark()
        y = run_layer(module, phase, x, *args, **options)
        if phase == "forward":
            self.shapes[module] = (x.shape, y.shape)
        io = (_bytes(x), _bytes(y), *self.shapes.get(module, (None, None)),
              _bytes(options.get("residual")), 1 if phase == "forward" else 1 + (y is not None))
        self.intervals.append((module, phase, start, self.mark(), io))
        return y


def _bytes(a):
    return 0 if a is None else int(a.nbytes)


def own_times(intervals, ms):
    """[(module, phase, own ms, io)] in call order: each interval's time less that of
    the intervals directly inside it (its children). ms(a, b): the time between two
    marks. Intervals are taken in the order they opened, with a stack of those still
    open: the top one that has not closed yet is the parent."""
    rows, stack = [], []
    for module, phase, (s, a), (e, b), io in sorted(intervals, key=lambda t: t[2][0]):
        row = [module, phase, ms(a, b), io, e]
        while stack and stack[-1][4] < s:
            stack.pop()
        if stack:
            stack[-1][2] -= row[2]
        rows.append(row)
        stack.append(row)
    return [tuple(r[:4]) for r in rows]


def profile_layers(step, x, y, steps, clock):
    """Profile `steps` training steps of a bench.step.OneStep on the batch (x, y).

    Returns {"rows": [{"layer", "phase", "ms", "calls", "bytes", "flops"}, ...] (per step,
    longest first), "device_ms" (the step's device time, first mark to last),
    "host_queue_ms" (the host's time to queue forward, loss and backward; the update's
    overflow check reads the device, so it is left out), "steps"}, means over the steps.
    Rows "loss" and "update" are the work outside the model's own modules."""
    recorder = Recorder(step.model, clock)
    totals = collections.defaultdict(lambda: [0.0, 0, 0, 0])     # ms, calls, bytes, flops
    device = host = 0.0
    with recorder:
        for _ in range(steps):
            recorder.intervals = []
            t = time.perf_counter()
            a = recorder.mark()
            step.forward(x, y)
            b = recorder.mark()
            step.backward()
            queued = time.perf_counter() - t
            c = recorder.mark()
            step.update()
            d = recorder.mark()
            clock.finish()
            host += 1e3 * queued
            device += clock.ms(a[1], d[1])
            none = (0, 0, None, None, 0, 0)
            whole = [(None, "loss", a, b, none), (None, "update", c, d, none)]
            for module, phase, ms, io in own_times(recorder.intervals + whole, clock.ms):
                name = phase if module is None else type(module).__name__
                row = totals[(name, phase)]
                row[0] += ms
                row[1] += 1
                row[2] += _moved(name, phase, io)
                row[3] += _flops(module, phase, io)
    rows = [{"layer": name, "phase": phase, "ms": ms / steps, "calls": calls // steps,
             "bytes": nbytes / steps, "flops": flops / steps}
            for (name, phase), (ms, calls, nbytes, flops) in totals.items()]
    rows.sort(key=lambda r: -r["ms"])
    return {"rows": rows, "device_ms": device / steps, "host_queue_ms": host / steps,
            "steps": steps}


def _moved(name, phase, io):
    """The bytes `name`'s `phase` must move (BYTES), 0 where it is not listed."""
    arg, result, _, _, residual, _ = io
    k_arg, k_result = BYTES.get((name, phase), (0, 0))
    return k_arg * arg + k_result * result + (residual if (name, phase) in BYTES else 0)


def _flops(module, phase, io):
    """2 x multiply-adds per product of a layer that says its multiply-adds (macs)."""
    if module is None or io[2] is None:
        return 0
    return 2 * io[5] * module.macs(io[2], io[3])


def peaks(xp, clock, copy_bytes=1 << 30, n=8192, dtype="float16", repeats=5):
    """The card's rates measured now: {"copy_gbs": GB/s of an array copy, bytes read and
    written counted, "product_tflops": TFLOP/s of an n x n x n product in `dtype`}."""
    a = xp.ones(copy_bytes // 4, xp.float32)
    b = xp.empty_like(a)
    m = xp.ones((n, n), dtype)
    p = xp.matmul(m, m)

    def rate(work, f):
        f()                                     # first call: library set-up, not timed
        start = clock.mark()
        for _ in range(repeats):
            f()
        end = clock.mark()
        clock.finish()
        return work * repeats / (clock.ms(start, end) / 1e3)
    out = {"copy_gbs": rate(2 * a.nbytes, lambda: b.__setitem__(Ellipsis, a)) / 1e9,
           "product_tflops": rate(2 * n ** 3, lambda: xp.matmul(m, m, out=p)) / 1e12,
           "product_dtype": dtype}
    del a, b, m, p
    return out


def kernels(run_step, top=15):
    """The kernels one call of run_step() launches, from CUPTI through PyTorch's profiler:
    {"launches", "ms" (their summed time), "longest": [{"name", "calls", "ms"}, ...]}, or
    {"error": why not} where PyTorch or its CUDA profiler is not at hand."""
    try:
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_step()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    except Exception as e:                      # ImportError, or no CUPTI
        return {"error": f"{type(e).__name__}: {e}"}
    if not events:
        return {"error": "PyTorch's profiler recorded no kernel of this process"}
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.elapsed_us() / 1e3
    longest = sorted(({"name": k, "calls": c, "ms": ms} for k, (c, ms) in by_name.items()),
                     key=lambda r: -r["ms"])
    return {"launches": len(events), "ms": sum(r["ms"] for r in longest),
            "longest": longest[:top]}


def format_profile(p):
    """The profile as lines of text: each row's time, share, and rate against the peaks."""
    peak = p.get("peaks", {})
    lines = [f"device time per step by layer type and phase ({p['clock']}, mean of "
             f"{p['steps']} steps): {p['device_ms']:.1f} ms per step; the host queued forward, "
             f"loss and backward in {p['host_queue_ms']:.1f} ms"]
    if peak:
        lines.append(f"  peaks measured now: copy {peak['copy_gbs']:,.0f} GB/s (read + written), "
                     f"{peak['product_dtype']} product {peak['product_tflops']:,.1f} TFLOP/s")
    lines.append(f"  {'layer':<18}{'phase':<10}{'ms':>8}{'share':>7}{'calls':>6}"
                 f"{'GB/s':>9}{'of copy':>8}{'TFLOP/s':>9}{'of peak':>8}")
    for r in p["rows"]:
        seconds = r["ms"] / 1e3
        rate = ""
        if r["bytes"] and seconds > 0:
            gbs = r["bytes"] / seconds / 1e9
            share = f"{gbs / peak['copy_gbs']:.0%}" if peak else ""
            rate = f"{gbs:9,.0f}{share:>8}"
        elif r["flops"] and seconds > 0:
            tflops = r["flops"] / seconds / 1e12
            share = f"{tflops / peak['product_tflops']:.0%}" if peak else ""
            rate = f"{'':17}{tflops:9.1f}{share:>8}"
        lines.append(f"  {r['layer']:<18}{r['phase']:<10}{r['ms']:8.2f}"
                     f"{r['ms'] / p['device_ms']:7.1%}{r['calls']:6d}{rate}")
    k = p.get("kernels")
    if k and "error" in k:
        lines.append(f"  kernels per step: not counted ({k['error']})")
    elif k:
        lines.append(f"  kernels per step: {k['launches']} launches, {k['ms']:.1f} ms of kernel "
                     f"time (CUPTI, through PyTorch's profiler); the longest:")
        lines += [f"    {r['ms']:8.2f} ms {r['calls']:4d}x  {r['name'][:100]}"
                  for r in k["longest"]]
    return lines
