"""The thin cuDNN adapter: NHWC convolutions on CuPy arrays through nvidia-cudnn-frontend.

CuPy does not bind cuDNN, so the frontend's Python graph API (module
`cudnn`) is used directly, on the device pointers of CuPy arrays. cuDNN
describes every tensor by NCHW-ordered dims; strides say the memory is NHWC
(activations) or OHWI (filters, cuDNN's NHWC filter layout):

    x  (N, H, W, C)   dims [N, C, H, W]   strides [HWC, 1, WC, C]
    w  (O, kh, kw, C) dims [O, C, kh, kw] strides [kh*kw*C, 1, kw*C, C]

    forward      y  = conv(x, w)                 (cross-correlation, as PyTorch)
    backward_data   dx = conv_dgrad(dy, w)          (the adjoint in x)
    backward_filter dw = conv_wgrad(x, dy)          (the adjoint in w)

and fp16 matrix products, for the fully connected layers: `matmul(a, b)` = a @ b on
2-D arrays, transposed views included (a matrix is one of a batch of one: dims
[1, M, K], its strides as they are). CuPy refuses its own cuBLAS calls while a
CUDA graph is being captured (mpitrain/graph.py); cuDNN's graphs have no such limit.
cuDNN's fp32 products run on TF32 tensor cores whatever the plan's notes say, so
fp32 products stay with cuBLAS.

Each graph is built once per (operation, shapes, dtypes, stride, padding) and
cached; the computation is fp32 whatever the io type (fp16 on tensor cores,
accumulating in fp32). Only float16 and float32 are routed here; float64 stays
on the generic path. The weight gradient of fp16 activations is computed by
cuDNN in fp16 (fp32 sums, rounded once) and widened into the fp32 gradient
arena: cuDNN's engines that write fp32 from fp16 operands are many times
slower (docs/benchmarks-record.md). An fp16 dW beyond 65504 becomes inf, which the
step's overflow check sees (the dynamic loss scale then halves), as with
PyTorch's AMP. A geometry cuDNN cannot build raises `Unsupported`, which is
remembered: a weight gradient then takes the generic im2col + GEMM path and a product
CuPy's cuBLAS (nets/conv.py), and a forward or data gradient, which cuDNN serves
for every convolution of the networks here, ends the step with it.

Availability is probed, not assumed: the first `available()` imports CuPy and
the frontend, builds one tiny convolution in fp32 (and in fp16 where the device
has fp16 arithmetic), runs it and compares it with a direct computation on the
host; the outcome is cached for the process. `reason()` says why not,
`version()` which cuDNN, `report()` all of it for the run's environment record.

Which of cuDNN's plans runs each graph is measured, not guessed: the first
call of a geometry times the heuristics' best few plans on its own operands and
keeps the fastest (TUNE_PLANS; PyTorch's cudnn.benchmark does the same), every
plan where the input has few channels (the heuristics rank those worst), and
no more than a few plans that cuDNN compiles at run time (each costs seconds).
The choice is kept on disk by plan name (PLAN_CACHE), keyed by the geometry,
the GPU and the cuDNN and frontend versions, so a machine tunes once. A network's
first convolution, whose input has an image's 3 channels, may run faster on input
and filter zero-padded to PAD_CHANNELS (the pad's weight gradient is 0, and dropped):
`padded_channels` times its forward and weight gradient both ways once, the pad
included, and keeps the faster in the same file (`padding_report` says what it measured). TF32
says whether fp32 convolutions may use TF32 tensor cores, DETERMINISTIC whether
plans that may give other bits on another run are left out (by default they are).

Every graph runs on CuPy's current stream (the handle's stream is set before
each execution) and shares one workspace, grown when a graph needs more: the
graphs run one after another on that stream, so they never use it at once.
"""
import json
import os

import numpy as np

# Which plan runs a graph: the first `TUNE_PLANS` of the heuristics' ranked plans are each
# timed once on the first call's operands and the fastest is kept (as PyTorch's
# cudnn.benchmark or MXNet's cudnn_tune); 0 keeps the heuristics' first choice. Plans
# needing more workspace than TUNE_WORKSPACE bytes are passed over.
TUNE_PLANS = 8
TUNE_WORKSPACE = 1 << 30
# every plan is timed where the input has fewer channels than this (a first convolution's
# 3: the heuristics' first plans are slow there), and at most TUNE_COMPILED of the plans
# that are compiled at run time, wherever they rank
TUNE_ALL_BELOW_CHANNELS = 8
TUNE_COMPILED = 2
# the file of chosen plans (and of padded_channels' choices, keys starting "pad|"):
# $MPITRAIN_PLAN_CACHE, else ~/.cache/mpitrain/cudnn-plans.json; "" keeps choices in
# memory only
PLAN_CACHE = os.environ.get("MPITRAIN_PLAN_CACHE",
                            os.path.join(os.path.expanduser("~"), ".cache", "mpitrain",
                                         "cudnn-plans.json"))
# fp32 convolutions may run on TF32 tensor cores (10-bit mantissa products, fp32 sums),
# as PyTorch allows by default; False keeps them in full fp32 (an exact comparison).
TF32 = True
# plans whose results may differ from run to run (atomic adds) are left out, so a step's
# bits repeat; False lets cuDNN's heuristics offer them (bench step
# --nondeterministic-plans: what leaving them out costs)
DETERMINISTIC = True
# a first convolution's input with fewer channels than this may be zero-padded to it
# (NVIDIA's ResNet-50 pads its images to 4 channels), where that times faster; 0: never
PAD_CHANNELS = 4

_graphs = {}         # key -> (graph, tensor a, tensor b, tensor out), or the Unsupported raised
_handle = None
_workspace = None    # (bytes,) uint8 CuPy array shared by every graph
_probe = None        # the probe's outcome (see _probed)
_padding = {}        # geometry -> padded_channels' choice (see padding_report)


class Unsupported(RuntimeError):
    """cuDNN cannot build a graph for this operation, shapes and data types here."""


# ----- availability -----

def available(dtype=np.float32):
    """True when cuDNN convolutions in `dtype` (float32 or float16) passed the probe here.

    The first call probes (see the module docstring; it needs a GPU and takes a moment),
    later calls read the cached outcome. Any other dtype gives False."""
    dtype = np.dtype(dtype)
    if not supports(dtype):
        return False
    return _probed()[dtype.name] is None


def reason():
    """None when available() is True; else one line saying why cuDNN is not used,
    starting with one of "not installed:", "no GPU:", "graph build failed:",
    "failed to run:", "wrong result:"."""
    return _probed()["float32"]


def report():
    """The probe's outcome and the versions, JSON-able, for the run's environment record:
    available (fp32 convolutions), reason (as reason()), float16 (fp16 convolutions),
    float16_reason, and version()'s keys."""
    state = _probed()
    return dict(available=state["float32"] is None, reason=state["float32"],
                float16=state["float16"] is None, float16_reason=state["float16"], **version())


def version():
    """{"cudnn": cuDNN's backend version (an int such as 91300), "cudnn_frontend": the
    frontend's version string}; None where not importable."""
    out = {"cudnn": None, "cudnn_frontend": None}
    try:
        import cudnn
    except Exception:
        return out
    out["cudnn_frontend"] = getattr(cudnn, "__version__", None)
    try:
        out["cudnn"] = int(cudnn.backend_version())
    except Exception:
        pass
    return out


def supports(dtype):
    """Whether `dtype` is one cuDNN is asked for at all (float16, float32)."""
    return np.dtype(dtype) in (np.float16, np.float32)


def _probed():
    """{"float32": None or why not, "float16": likewise}, once."""
    global _probe
    if _probe is None:
        _probe = {"float32": _check_install(), "float16": None}
        if _probe["float32"] is None:
            _probe["float32"] = _try_conv(np.float32)
        if _probe["float32"] is not None:
            _probe["float16"] = _probe["float32"]
        else:
            _probe["float16"] = _try_conv(np.float16) if _has_fp16() else \
                "no GPU: the device has no fp16 arithmetic (compute capability below 5.3)"
    return _probe


def _check_install():
    """None when CuPy sees a GPU and the frontend imports, else why not."""
    try:
        import cupy
    except Exception as e:
        return f"not installed: CuPy ({type(e).__name__}: {e})"
    try:
        if not cupy.is_available():
            return "no GPU: CuPy sees no CUDA device"
    except Exception as e:
        return f"no GPU: {type(e).__name__}: {e}"
    try:
        import cudnn  # noqa: F401  (nvidia-cudnn-frontend)
    except Exception as e:       # not installed, or libcudnn fails to load
        return f"not installed: nvidia-cudnn-frontend ({type(e).__name__}: {e})"
    return None


def _has_fp16():
    import cupy
    return int(cupy.cuda.Device().compute_capability) >= 53


def _probe_case():
    """A tiny 3x3 convolution (padding 1) whose every value is a small integer, so that
    fp16, fp32 and TF32 compute it exactly: (x, w, y = conv(x, w)) as float64 NumPy
    arrays."""
    from .im2col import im2col_generic
    rng = np.random.default_rng(0)
    x = rng.integers(-2, 3, (1, 5, 5, 3)).astype(np.float64)
    w = rng.integers(-2, 3, (4, 3, 3, 3)).astype(np.float64)
    col = im2col_generic(x, 3, 3, 1, 1)                       # (25, 27)
    y = (col @ w.reshape(4, -1).T).reshape(1, 5, 5, 4)
    return x, w, y


def _try_conv(dtype):
    """None when a tiny fprop in dtype builds, runs and equals the direct result."""
    import cupy
    x, w, y = _probe_case()
    name = np.dtype(dtype).name
    try:
        got = conv_forward(cupy.asarray(x, dtype), cupy.asarray(w, dtype), 1, 1)
    except Unsupported as e:
        return f"graph build failed: {name} convolution: {e}"
    except Exception as e:
        return f"failed to run: {name} convolution: {type(e).__name__}: {e}"
    got = cupy.asnumpy(got).astype(np.float64)
    if not np.array_equal(got, y):
        return (f"wrong result: {name} convolution differs from the direct computation "
                f"by up to {np.nanmax(np.abs(got - y)):.3g}")
    return None


# ----- graphs -----

def _nhwc(a):
    """cuDNN dims and strides of a C-contiguous NHWC (or OHWI) array."""
    n, h, w, c = a.shape
    return [n, c, h, w], [h * w * c, 1, w * c, c]


def _matrix(a):
    """cuDNN dims and strides of a 2-D array (M, K) as it lies in memory (a transposed
    view too), as the one matrix of a batch."""
    m, k = a.shape
    s0, s1 = (s // a.itemsize for s in a.strides)
    return [1, m, k], [m * k, s0, s1]


def _data_type(dtype):
    import cudnn
    return cudnn.data_type.HALF if np.dtype(dtype) == np.float16 else cudnn.data_type.FLOAT


def _graph(kind, a, b, out, stride, pad):
    """The built graph for one convolution kind and geometry, with its two inputs and its
    output (cached; so is a failure to build, raised again as Unsupported)."""
    global _handle
    key = (kind, a.shape, b.shape, out.shape, a.dtype.str, b.dtype.str, out.dtype.str,
           stride, pad, TF32, DETERMINISTIC)
    entry = _graphs.get(key)
    if entry is None:
        import cudnn
        import cupy
        if _handle is None:
            _handle = cudnn.create_handle()
        # the handle works on the current stream (a graph's capture may have left another)
        cudnn.set_stream(handle=_handle, stream=cupy.cuda.get_current_stream().ptr)
        try:
            entry = _build(cudnn, kind, a, b, out, stride, pad)
            _tune(entry, a, b, out, plan_key(kind, a, b, out, stride, pad, _device_name()))
        except Exception as e:    # cudnnGraphNotSupportedError, or a refusal in validate()
            entry = Unsupported(f"{kind} {a.dtype.name} x {b.dtype.name} -> {out.dtype.name}, "
                                f"{a.shape} {b.shape}: {type(e).__name__}: {e}")
        _graphs[key] = entry
    if isinstance(entry, Unsupported):
        raise entry
    return entry


def _build(cudnn, kind, a, b, out, stride, pad):
    g = cudnn.pygraph(io_data_type=_data_type(a.dtype),
                      intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=_handle)
    layout = _matrix if kind == "matmul" else _nhwc
    dims, strides = layout(a)
    ta = g.tensor(name="a", dim=dims, stride=strides, data_type=_data_type(a.dtype))
    dims, strides = layout(b)
    tb = g.tensor(name="b", dim=dims, stride=strides, data_type=_data_type(b.dtype))
    conv = {"padding": [pad, pad], "stride": [stride, stride], "dilation": [1, 1]}
    if kind == "fprop":          # a = x, b = w
        tout = g.conv_fprop(image=ta, weight=tb, **conv)
    elif kind == "dgrad":        # a = dy, b = w
        tout = g.conv_dgrad(loss=ta, filter=tb, **conv)
    elif kind == "wgrad":        # a = x, b = dy
        tout = g.conv_wgrad(image=ta, loss=tb, **conv)
    else:                        # "matmul": a (M, K) @ b (K, N)
        tout = g.matmul(A=ta, B=tb, compute_data_type=cudnn.data_type.FLOAT)
    dims, strides = layout(out)
    tout.set_output(True).set_dim(dims).set_stride(strides).set_data_type(_data_type(out.dtype))
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    if DETERMINISTIC:                           # same bits each run
        g.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
    if not TF32 and a.dtype == np.float32:      # as torch.backends.cudnn.allow_tf32 = False
        g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE,
                                  cudnn.numerical_note.DOWN_CONVERT_INPUTS])
    g.check_support()
    g.build_plans()
    return g, ta, tb, tout


def plans_to_time(count, channels, compiled):
    """The indices of the heuristics' ranked plans (count of them) to time: the first
    TUNE_PLANS, or all where the input has fewer than TUNE_ALL_BELOW_CHANNELS channels,
    less the plans compiled at run time (compiled(index) -> bool) beyond the first
    TUNE_COMPILED of them."""
    limit = count if channels < TUNE_ALL_BELOW_CHANNELS else min(TUNE_PLANS, count)
    chosen, seen = [], 0
    for index in range(limit):
        if compiled(index):
            seen += 1
            if seen > TUNE_COMPILED:
                continue
        chosen.append(index)
    return chosen


def plan_key(kind, a, b, out, stride, pad, device):
    """The disk cache's key of a graph: its geometry, dtypes, TF32, DETERMINISTIC, the
    GPU's name and compute capability, and the cuDNN and frontend versions (a plan chosen
    under one may not exist or be best under another)."""
    return _key(kind, a.shape, b.shape, out.shape, a.dtype.str, b.dtype.str, out.dtype.str,
                stride, pad, TF32, DETERMINISTIC, device)


def _key(*parts):
    """A disk cache key: the parts, then the cuDNN and frontend versions."""
    v = version()
    return "|".join(str(part) for part in (*parts, v["cudnn"], v["cudnn_frontend"]))


def load_plans(path=None):
    """{key: plan name, or padded_channels' channel count} from the cache file ({} where
    there is none, or it is unreadable: the plans are then timed again)."""
    path = PLAN_CACHE if path is None else path
    if not path:
        return {}
    try:
        with open(path) as f:
            plans = json.load(f)
    except (OSError, ValueError):
        return {}
    return plans if isinstance(plans, dict) else {}


def save_plan(key, name, path=None):
    """Add key -> plan name (or channel count) to the cache file, replacing the file
    whole (a reader never sees half of it). Every rank of every node may share the file:
    a writer holds PATH.lock (flock) from its read to its rename, so that each adds its
    entry to the others'."""
    import fcntl
    path = PLAN_CACHE if path is None else path
    if not path:
        return
    from mpitrain.files import save_json
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            plans = load_plans(path)
            plans[key] = name
            save_json(path, plans)
    except OSError:                 # a read-only home: the choice stays in this process
        pass


def _device_name():
    import cupy
    device = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
    return f"{name.decode() if isinstance(name, bytes) else name} sm_{device.compute_capability}"


def _plan_names(g, count):
    """The ranked plans' names (None for one that cannot be named)."""
    names = []
    for index in range(count):
        try:
            names.append(g.get_plan_name_at_index(index))
        except Exception:
            names.append(None)
    return names


def _compiled(cudnn, g, index):
    """Whether cuDNN compiles the plan at `index` at run time (unknown: no)."""
    try:
        notes = g.get_behavior_notes_for_plan_at_index(index)
    except Exception:
        return False
    return cudnn.behavior_note.RUNTIME_COMPILATION in notes


def _tune(entry, a, b, out, key):
    """Pin the plan the cache names for `key`, else the fastest of plans_to_time's, timed
    on these operands (each built, run once to warm up, then three times between CUDA
    events), and remember it. A plan that fails to build or run is passed over; with
    none timed the heuristics' choice stays."""
    import cudnn
    import cupy
    g, ta, tb, tout = entry
    count = g.get_execution_plan_count()
    names = _plan_names(g, count)
    cached = load_plans().get(key)
    if cached is not None and cached in names:
        g.select_plan(names.index(cached))
        g.build_plans()
        return
    pointers = {ta: a.data.ptr, tb: b.data.ptr, tout: out.data.ptr}
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = {}
    channels = min(a.shape[-1], out.shape[-1])      # the image's (fprop, wgrad) or dx's
    for index in plans_to_time(count, channels, lambda i: _compiled(cudnn, g, i)):
        try:
            g.build_plan_at_index(index)
            need = g.get_workspace_size_plan_at_index(index)
            if need > TUNE_WORKSPACE:
                continue
            workspace = _workspace_ptr(need)
            g.execute_plan_at_index(pointers, workspace, index=index, handle=_handle)
            start.record()
            for _ in range(3):
                g.execute_plan_at_index(pointers, workspace, index=index, handle=_handle)
            stop.record()
            stop.synchronize()
            times[index] = cupy.cuda.get_elapsed_time(start, stop)
        except Exception:           # this engine declines these shapes: try the next
            continue
    if times:
        best = min(times, key=times.get)
        g.select_plan(best)
        if names[best] is not None:
            save_plan(key, names[best])
    g.build_plans()                 # the plan that runs: the fastest, else the first that builds


def padded_channels(x, w, stride, pad):
    """The input channels a first convolution (no input gradient) of x (N, H, W, C) and w
    (O, kh, kw, C) runs on: C, or PAD_CHANNELS where C is fewer and forward plus weight
    gradient on the zero-padded input and filter, the pad included, timed faster at the
    first call of this geometry on this GPU (kept on disk as the plans are)."""
    C = x.shape[3]
    if C >= PAD_CHANNELS:
        return C
    geometry = (x.shape, w.shape, x.dtype.str, stride, pad, PAD_CHANNELS, TF32, DETERMINISTIC)
    entry = _padding.get(geometry)
    if entry is None:
        key = _key("pad", *geometry, _device_name())
        entry = {"x": list(x.shape), "w": list(w.shape), "dtype": x.dtype.name}
        cached = load_plans().get(key)
        if cached in (str(C), str(PAD_CHANNELS)):
            entry.update(channels=int(cached), ms=None)
        else:
            ms = {c: _first_conv_ms(x, w, stride, pad, c) for c in (C, PAD_CHANNELS)}
            entry.update(channels=min(ms, key=ms.get), ms=ms)
            save_plan(key, str(entry["channels"]))
        _padding[geometry] = entry
    return entry["channels"]


def padding_report():
    """[{"x": x's shape, "w": w's shape, "dtype", "channels": the chosen, "ms": {channels:
    ms of pad + forward + weight gradient} or None where the choice came from the disk
    cache}], one for each first convolution padded_channels has decided in this process."""
    return list(_padding.values())


def _first_conv_ms(x, w, stride, pad, channels):
    """ms of zero-padding x and w to `channels`, forward, and the weight gradient (of the
    forward's output as dy), the mean of 3 after one that builds and tunes the plans;
    inf where cuDNN cannot build one of them."""
    import cupy
    from .elementwise import zero_padded

    def run():
        xc, wc = zero_padded(x, channels), zero_padded(w, channels)
        conv_backward_filter(xc, conv_forward(xc, wc, stride, pad), wc.shape, stride, pad)
    try:
        run()
    except Unsupported:
        return float("inf")
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(3):
        run()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / 3


def workspace():
    """The shared workspace as it is now (a CUDA graph keeps the one it was captured with)."""
    return _workspace


def _workspace_ptr(nbytes):
    """The device pointer of the shared workspace, at least nbytes long."""
    global _workspace
    import cupy
    if _workspace is None or _workspace.size < nbytes:
        _workspace = cupy.empty(max(int(nbytes), 1), cupy.uint8)
    return _workspace.data.ptr


def _run(kind, a, b, out, stride, pad):
    """out = the convolution `kind` of a and b, queued on CuPy's current stream."""
    import cudnn
    import cupy
    g, ta, tb, tout = _graph(kind, a, b, out, stride, pad)
    workspace = _workspace_ptr(g.get_workspace_size())
    cudnn.set_stream(handle=_handle, stream=cupy.cuda.get_current_stream().ptr)
    # plain device pointers: no DLPack export (and its stream hand-over) per tensor
    g.execute({ta: a.data.ptr, tb: b.data.ptr, tout: out.data.ptr}, workspace, handle=_handle)
    return out


def matmul(a, b, out=None):
    """out (M, N) = a (M, K) @ b (K, N), summed in fp32, in out's dtype (default: a's;
    out C-contiguous); a and b fp16, and may be transposed views. Raises Unsupported for
    other dtypes and where cuDNN cannot build this product."""
    import cupy
    if a.dtype != np.float16 or b.dtype != np.float16:
        raise Unsupported(f"matmul of {a.dtype.name} x {b.dtype.name}: fp16 only (cuDNN's "
                          f"fp32 products run on TF32 tensor cores)")
    if out is None:
        out = cupy.empty((a.shape[0], b.shape[1]), a.dtype)
    elif not out.flags.c_contiguous:
        raise Unsupported(f"matmul into a {out.shape} array that is not C-contiguous")
    layout = tuple(s // x.itemsize for x in (a, b) for s in x.strides)
    return _run("matmul", a, b, out, layout, None)


def conv_forward(x, w, stride, pad):
    """y (N, Ho, Wo, O) = conv(x (N, H, W, C), w (O, kh, kw, C)), in x's dtype."""
    import cupy
    N, H, W, _ = x.shape
    O, kh, kw, _ = w.shape
    y = cupy.empty((N, (H + 2 * pad - kh) // stride + 1, (W + 2 * pad - kw) // stride + 1, O),
                   x.dtype)
    return _run("fprop", cupy.ascontiguousarray(x), cupy.ascontiguousarray(w), y, stride, pad)


def conv_backward_data(dy, w, x_shape, stride, pad):
    """dx (x_shape) = dL/dx given dy = dL/dy, in dy's dtype."""
    import cupy
    dx = cupy.empty(x_shape, dy.dtype)
    return _run("dgrad", cupy.ascontiguousarray(dy), cupy.ascontiguousarray(w), dx, stride, pad)


def conv_backward_filter(x, dy, w_shape, stride, pad, out=None):
    """dw (O, kh, kw, C) = dL/dw in x's dtype, written into `out` when given (C-contiguous):
    x's dtype, or float32 for fp16 x and dy (the fp32 arena view), which the fp16 result
    is widened into; else a new array. Raises Unsupported where this geometry's build
    failed."""
    if out is not None and out.dtype not in (x.dtype, np.float32):
        raise Unsupported(f"wgrad {x.dtype.name} -> {out.dtype.name}: "
                          f"only an fp32 output may differ from the inputs")
    import cupy
    dw = out if out is not None and out.dtype == x.dtype else cupy.empty(w_shape, x.dtype)
    _run("wgrad", cupy.ascontiguousarray(x), cupy.ascontiguousarray(dy), dw, stride, pad)
    if out is None or dw is out:
        return dw
    out[...] = dw
    return out
