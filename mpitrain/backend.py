"""The one place that chooses NumPy or CuPy.

Layers and kernels never import CuPy themselves: they ask `array_module(x)`
for the module that owns an array (Chainer's `get_array_module`), so one code
path serves both devices. `use_device()` is called once per process, before
the model is built, and decides where new arrays live (`xp`).
"""
import os

import numpy

xp = numpy          # where new arrays are allocated; numpy until use_device() says otherwise
device = "cpu"      # "cpu" or "cuda:<id>"


def _cupy():
    """CuPy if it is importable *and* sees a GPU; importing alone succeeds without one."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        return cupy if cupy.is_available() else None
    except Exception:   # a broken driver is the same as no GPU
        return None


def gpu_available():
    return _cupy() is not None


def use_device(kind="auto", local_rank=0, local_size=1):
    """Select the device for this process and return its array module.

    kind: "cpu", "gpu" or "auto" (the GPU when one is visible; the environment
    variable MPITRAIN_DEVICE overrides "auto"). On the GPU, the node-local rank
    picks the device: local_rank modulo the visible devices. More ranks on a
    node than GPUs would put two ranks on one GPU, which is refused.
    """
    global xp, device
    if kind == "auto":
        kind = os.environ.get("MPITRAIN_DEVICE", "auto")
    cupy = _cupy() if kind in ("gpu", "auto") else None
    if kind == "gpu" and cupy is None:
        raise RuntimeError("--device gpu was asked for, but CuPy sees no GPU "
                           "(install the 'gpu' extra and check nvidia-smi), or use --device cpu")
    if cupy is None:
        xp, device = numpy, "cpu"
        return xp
    n = cupy.cuda.runtime.getDeviceCount()
    if local_size > n:
        raise RuntimeError(f"{local_size} ranks on this node but only {n} visible GPU(s): "
                           f"two ranks would share a GPU; start at most {n} ranks per node")
    dev = local_rank % n
    cupy.cuda.Device(dev).use()
    xp, device = cupy, f"cuda:{dev}"
    return xp


def array_module(*arrays):
    """numpy or cupy, whichever owns the arrays (numpy for plain Python values)."""
    for a in arrays:
        if type(a).__module__.startswith("cupy"):
            import cupy
            return cupy
    return numpy


def to_numpy(a):
    """A host (NumPy) copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else numpy.asarray(a)


def synchronize():
    """Wait for queued GPU work (a no-op on the CPU); needed before timing or host-side MPI."""
    if xp is not numpy:
        xp.cuda.get_current_stream().synchronize()
