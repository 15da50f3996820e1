"""The thin cuDNN adapter: NHWC convolutions on CuPy arrays through nvidia-cudnn-frontend.

CuPy 14 no longer binds cuDNN, so the frontend's Python graph API (module
`cudnn`) is used directly on CuPy arrays, which it reads through DLPack.
cuDNN describes every tensor by NCHW-ordered dims; strides say the memory is
NHWC (activations) or OHWI (filters, cuDNN's NHWC filter layout):

    x  (N, H, W, C)   dims [N, C, H, W]   strides [HWC, 1, WC, C]
    w  (O, kh, kw, C) dims [O, C, kh, kw] strides [kh*kw*C, 1, kw*C, C]

    forward      y  = conv(x, w)                 (cross-correlation, as PyTorch)
    backward_data   dx = conv_dgrad(dy, w)          (the adjoint in x)
    backward_filter dw = conv_wgrad(x, dy)          (the adjoint in w)

Each graph is built once per (operation, shapes, dtype, stride, padding) and
cached; fp16 tensors are computed with fp32 accumulation (tensor cores).
Only float16 and float32 are routed here; float64 stays on the generic path.
"""
import numpy as np

_graphs = {}
_handle = None
_reason = None       # why cuDNN is unavailable, once known


def available():
    """True when CuPy sees a GPU and the cuDNN frontend imports; `reason()` says why not."""
    global _reason
    if _reason is None:
        try:
            import cupy
            if not cupy.is_available():
                _reason = "CuPy sees no GPU"
            else:
                import cudnn  # noqa: F401  (nvidia-cudnn-frontend)
                _reason = ""
        except Exception as e:     # not installed, or the libraries fail to load
            _reason = f"{type(e).__name__}: {e}"
    return _reason == ""


def reason():
    available()
    return _reason or "available"


def supports(dtype):
    return np.dtype(dtype) in (np.float16, np.float32)


def _nhwc(shape):
    """cuDNN dims and strides of a C-contiguous NHWC (or OHWI) array."""
    n, h, w, c = shape
    return [n, c, h, w], [h * w * c, 1, w * c, c]


def _graph(kind, a_shape, b_shape, out_shape, dtype, stride, pad):
    """The built graph for one convolution kind and geometry, with its two inputs and its output."""
    global _handle
    key = (kind, a_shape, b_shape, out_shape, np.dtype(dtype).str, stride, pad)
    if key in _graphs:
        return _graphs[key]
    import cudnn
    import cupy
    if _handle is None:
        _handle = cudnn.create_handle()
    io = cudnn.data_type.HALF if np.dtype(dtype) == np.float16 else cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=_handle)
    dims, strides = _nhwc(a_shape)
    a = g.tensor(name="a", dim=dims, stride=strides, data_type=io)
    dims, strides = _nhwc(b_shape)
    b = g.tensor(name="b", dim=dims, stride=strides, data_type=io)
    conv = {"padding": [pad, pad], "stride": [stride, stride], "dilation": [1, 1]}
    if kind == "fprop":          # a = x, b = w
        out = g.conv_fprop(image=a, weight=b, **conv)
    elif kind == "dgrad":        # a = dy, b = w
        out = g.conv_dgrad(loss=a, filter=b, **conv)
    else:                        # "wgrad": a = x, b = dy
        out = g.conv_wgrad(image=a, loss=b, **conv)
    dims, strides = _nhwc(out_shape)
    out.set_output(True).set_dim(dims).set_stride(strides).set_data_type(io)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    workspace = cupy.empty(max(g.get_workspace_size(), 1), cupy.uint8)
    _graphs[key] = entry = (g, a, b, out, workspace)
    return entry


def _run(kind, a, b, out, stride, pad):
    import cudnn
    import cupy
    g, ta, tb, tout, workspace = _graph(kind, a.shape, b.shape, out.shape, a.dtype, stride, pad)
    cudnn.set_stream(handle=_handle, stream=cupy.cuda.get_current_stream().ptr)
    g.execute({ta: a, tb: b, tout: out}, workspace, handle=_handle)
    return out


def conv_forward(x, w, stride, pad):
    """y (N, Ho, Wo, O) = conv(x (N, H, W, C), w (O, kh, kw, C))."""
    import cupy
    N, H, W, _ = x.shape
    O, kh, kw, _ = w.shape
    y = cupy.empty((N, (H + 2 * pad - kh) // stride + 1, (W + 2 * pad - kw) // stride + 1, O), x.dtype)
    return _run("fprop", cupy.ascontiguousarray(x), cupy.ascontiguousarray(w), y, stride, pad)


def conv_backward_data(dy, w, x_shape, stride, pad):
    """dx (x_shape) = dL/dx given dy = dL/dy."""
    import cupy
    dx = cupy.empty(x_shape, dy.dtype)
    return _run("dgrad", cupy.ascontiguousarray(dy), cupy.ascontiguousarray(w), dx, stride, pad)


def conv_backward_filter(x, dy, w_shape, stride, pad, out=None):
    """dw (O, kh, kw, C) = dL/dw, written into `out` (C-contiguous, x's dtype) when given."""
    import cupy
    if out is None:
        out = cupy.empty(w_shape, x.dtype)
    return _run("wgrad", cupy.ascontiguousarray(x), cupy.ascontiguousarray(dy), out, stride, pad)
