"""The one place that chooses NumPy or CuPy, and the one place that makes CUDA streams.

Layers and kernels never import CuPy themselves: they ask `array_module(x)`
for the module that owns an array (Chainer's `get_array_module`), so one code
path serves both devices. `use_device()` is called once per process, before
the model is built, and decides where new arrays live (`xp`).

Streams. The compute stream is CuPy's current stream (the layers, cuDNN and
the kernels queue their work there). Communication has a stream of its own,
`comm_stream()`, made once per device and non-blocking, so that it never waits
for the legacy default stream, nor that stream for it: the two are ordered
only by the events the gradient reducer records (mpitrain/comm/buckets.py).
The reducer reaches them through a small interface, `streams(array)`:
`CudaStreams` for CuPy arrays, and `HostStreams`, whose every call does
nothing, for NumPy arrays, whose work runs in program order. That interface is
also what the tests record, to check the order on a machine without a GPU.
"""
import contextlib
import os

import numpy

xp = numpy          # where new arrays are allocated; numpy until use_device() says otherwise
device = "cpu"      # "cpu" or "cuda:<id>"
gpu_collectives = "nccl"   # how device arrays are summed: NCCL where installed, or "mpi"

GPU_EXTRAS = "pip install 'mpitrain[gpu-cu12]' or 'mpitrain[gpu-cu13]' (docs/gpu.md)"


class DeviceError(RuntimeError):
    """The device asked for cannot be used; the message says what is missing."""


def gpu_problem():
    """None when CuPy sees a GPU, else a sentence naming what is missing. Importing CuPy
    succeeds on a machine without a GPU, so that alone proves nothing."""
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e}); {GPU_EXTRAS}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:          # no driver, or a broken one
        return (f"CuPy {cupy.__version__} finds no usable CUDA driver ({type(e).__name__}: "
                f"{e}); check nvidia-smi")
    if count < 1 or not cupy.is_available():
        return (f"CuPy {cupy.__version__} sees no GPU (nvidia-smi lists none, or "
                f"CUDA_VISIBLE_DEVICES hides them)")
    return None


def _cupy():
    """CuPy if it is importable *and* sees a GPU, else None."""
    if gpu_problem() is not None:
        return None
    import cupy
    return cupy


def gpu_available():
    return _cupy() is not None


def pick_device(kind, gpus, local_rank=0, local_size=1, env=None, ranks_per_gpu=None):
    """The GPU index this process takes, or None for the CPU (no side effects).

    kind: "cpu", "gpu" or "auto" ("auto": the GPU when one is visible; the environment
    variable MPITRAIN_DEVICE, in `env`, overrides it). gpus: the number of GPUs CuPy
    sees (0 without CuPy). On the GPU, the node-local rank picks the device: local_rank
    modulo the visible devices; more ranks on a node than GPUs would put two ranks on
    one GPU, which is refused (NCCL refuses two ranks on one device) unless
    ranks_per_gpu K is given: then K consecutive node-local ranks share each GPU
    (local_rank // K; K must divide local_size), and their collectives go through MPI
    (collectives_for).
    """
    env = os.environ if env is None else env
    if kind == "auto":
        kind = env.get("MPITRAIN_DEVICE", "auto")
    if kind not in ("cpu", "gpu", "auto"):
        raise DeviceError(f"unknown device {kind!r}; choose cpu, gpu or auto")
    if ranks_per_gpu is not None and ranks_per_gpu < 1:
        raise DeviceError(f"--ranks-per-gpu must be a positive integer, got {ranks_per_gpu}")
    if ranks_per_gpu is not None and (kind == "cpu" or (kind == "auto" and gpus < 1)):
        why = "--device cpu or MPITRAIN_DEVICE=cpu" if kind == "cpu" else "no GPU can be used"
        raise DeviceError(f"--ranks-per-gpu {ranks_per_gpu} shares GPUs among ranks, but this "
                          f"run is on the CPU ({why}); drop --ranks-per-gpu")
    if kind == "cpu" or (kind == "auto" and gpus < 1):
        return None
    if gpus < 1:
        raise DeviceError("--device gpu was asked for, but no GPU can be used: "
                          f"{gpu_problem() or 'CuPy sees no GPU'}; or use --device cpu")
    if ranks_per_gpu is None:
        if local_size > gpus:
            raise DeviceError(f"{local_size} ranks on this node but only {gpus} visible GPU(s): "
                              f"two ranks would share a GPU; start at most {gpus} ranks per "
                              f"node, or let K ranks share each GPU with --ranks-per-gpu K "
                              f"(their collectives then go through MPI, not NCCL)")
        return local_rank % gpus
    if local_size % ranks_per_gpu:
        raise DeviceError(f"--ranks-per-gpu {ranks_per_gpu} does not divide the {local_size} "
                          f"ranks on this node: every GPU takes the same number of ranks; "
                          f"start a multiple of {ranks_per_gpu} ranks per node, or choose a "
                          f"--ranks-per-gpu that divides {local_size}")
    if local_size // ranks_per_gpu > gpus:
        raise DeviceError(f"{local_size} ranks on this node at --ranks-per-gpu {ranks_per_gpu} "
                          f"need {local_size // ranks_per_gpu} GPUs, but only {gpus} are "
                          f"visible; raise --ranks-per-gpu, or start at most "
                          f"{gpus * ranks_per_gpu} ranks per node")
    return local_rank // ranks_per_gpu


def collectives_for(ranks_per_gpu=None):
    """How device (CuPy) arrays are summed when ranks_per_gpu ranks share each GPU: "nccl"
    for a GPU per rank (where NCCL is installed), else "mpi": NCCL refuses two ranks on
    one device, so their arrays are staged through host memory for MPI."""
    return "nccl" if (ranks_per_gpu or 1) == 1 else "mpi"


def use_device(kind="auto", local_rank=0, local_size=1, ranks_per_gpu=None):
    """Select the device for this process (pick_device) and how its device arrays are
    summed (collectives_for); return its array module."""
    global xp, device, gpu_collectives
    cupy = _cupy() if kind != "cpu" else None
    gpus = cupy.cuda.runtime.getDeviceCount() if cupy is not None else 0
    index = pick_device(kind, gpus, local_rank, local_size, ranks_per_gpu=ranks_per_gpu)
    gpu_collectives = collectives_for(ranks_per_gpu)
    if index is None:
        xp, device = numpy, "cpu"
        return xp
    cupy.cuda.Device(index).use()
    xp, device = cupy, f"cuda:{index}"
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


def synchronize(like=None):
    """Wait for the current stream's queued GPU work (a no-op on the CPU); needed before
    timing, or before MPI reads device memory. like: an array whose device is meant
    (default: the device use_device chose)."""
    module = xp if like is None else array_module(like)
    if module is not numpy:
        module.cuda.get_current_stream().synchronize()


# ----- streams -----
_comm_streams = {}      # device id -> its communication stream


def comm_stream():
    """The current device's communication stream, made on first use. Non-blocking: it
    does not synchronise with the legacy default stream, where the compute work may run."""
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _comm_streams:
        _comm_streams[dev] = cupy.cuda.Stream(non_blocking=True)
    return _comm_streams[dev]


class HostStreams:
    """The stream interface for host (NumPy) arrays: work runs in program order, so
    there is nothing to record or wait for. Streams and events are None here."""

    def current(self):
        """The compute stream (the one current in the calling thread)."""
        return None

    def comm(self):
        """The communication stream."""
        return None

    def record(self, stream):
        """An event marking the work queued on `stream` so far."""
        return None

    def wait(self, stream, event):
        """Make later work on `stream` wait for `event`, without blocking the host."""

    def using(self, stream):
        """A context in which `stream` is the current stream."""
        return contextlib.nullcontext()


class CudaStreams(HostStreams):
    """The stream interface for CuPy arrays: real CUDA streams and events."""

    def __init__(self):
        import cupy
        self._cupy = cupy

    def current(self):
        return self._cupy.cuda.get_current_stream()

    def comm(self):
        return comm_stream()

    def record(self, stream):
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def wait(self, stream, event):
        stream.wait_event(event)

    def using(self, stream):
        return stream           # a CuPy stream is a context manager that makes it current


def streams(array):
    """The stream interface for `array`'s device."""
    return HostStreams() if array_module(array) is numpy else CudaStreams()


def to_host_scalars(*values):
    """Python floats of 0-d or one-element arrays (None stays None), with one
    device-to-host copy for all of them on a GPU instead of one each."""
    present = [v for v in values if v is not None]
    xp = array_module(*present)
    if xp is numpy:
        host = [float(numpy.asarray(v).reshape(-1)[0]) for v in present]
    else:
        host = xp.concatenate([xp.asarray(v, numpy.float64).reshape(-1)[:1]
                               for v in present]).get().tolist()
    it = iter(host)
    return tuple(None if v is None else next(it) for v in values)
