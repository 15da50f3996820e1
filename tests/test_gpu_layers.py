"""The GPU branches of BatchNorm2d, the pooling layers and Dropout (mpitrain.kernels.gpu).

Where a CPU can check them: the CUDA source compiles with nvcc for every
template instance the module asks NVRTC for (skipped without nvcc); the NumPy
Philox4x32-10 that defines the GPU dropout masks matches the published
known-answer vectors; and the very same kernel source, compiled by the host's
C++ compiler with a thin CUDA emulation (a block's CUDA threads one after
another on one host thread, as fibers that meet at __syncthreads;
`emulated_cupy`), runs the GPU branches of the layers on NumPy arrays against
their CPU paths. The `gpu`-marked tests (skipped without a GPU) compare every
kernel with the CPU path on the device, in float32 and float16.
"""
import ctypes
import hashlib
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from gradcheck import assert_close
from mpitrain.backend import array_module
from mpitrain.kernels import gpu, pool
from mpitrain.nets.activation import Dropout
from mpitrain.nets.batchnorm import BatchNorm2d
from mpitrain.nets.pool import AvgPool2d, GlobalAvgPool2d, MaxPool2d


def rand(shape, dtype=np.float32, seed=0, loc=0.0, scale=1.0):
    return (loc + scale * np.random.default_rng(seed).standard_normal(shape)).astype(dtype)


# ----- on the CPU -----

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernel_source_compiles_for_every_instance(tmp_path):
    """Every name expression the RawModule compiles instantiates without error (nvcc, C++17)."""
    names = gpu.name_expressions()
    # per dtype: 8 templates at two pack widths, 2 without one; 2 over the arithmetic type
    assert len(names) == len(set(names)) == 3 * (8 * 2 + 2) + 2 * 2
    pointers = ", ".join(f"(void*)&{n}" for n in names)
    src = gpu.source() + f"\nvoid instantiate_all() {{ void* k[] = {{{pointers}}}; (void)k; }}\n"
    (tmp_path / "k.cu").write_text(src)
    run = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_80", "-c", "k.cu", "-o", "k.o"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_philox_matches_the_known_answers():
    """Random123's known-answer vectors for Philox4x32-10."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2,
              (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, words in cases:
        np.testing.assert_array_equal(gpu.philox4x32(np.array([counter], np.uint32), key)[0], words)


def test_dropout_keep_rate_and_key_dependence():
    p = 0.3
    keep = gpu.dropout_keep(0x123456789ABCDEF, 100_003, p)      # not a multiple of 4
    assert keep.shape == (100_003,) and keep.dtype == bool
    assert abs(keep.mean() - (1 - p)) < 0.01
    assert not np.array_equal(keep, gpu.dropout_keep(0x123456789ABCDEF + 1, 100_003, p))
    np.testing.assert_array_equal(keep[:1000], gpu.dropout_keep(0x123456789ABCDEF, 1000, p))
    assert gpu.dropout_threshold(0.5) == 1 << 23 and gpu.dropout_threshold(0.0) == 0


def test_kernels_take_only_cupy_arrays_of_float_dtypes():
    assert not gpu.handles(np.zeros(3, np.float32))
    assert gpu.acc_dtype(np.float16) == np.float32 and gpu.acc_dtype(np.float64) == np.float64


def test_dropout_on_the_cpu_keeps_its_mask_and_no_key():
    d = Dropout(0.5, seed=3)
    x = np.ones((4, 6), np.float32)
    y = d.forward(x)
    assert d.key is None and not d.keyed and d.mask is not None
    np.testing.assert_array_equal(d.backward(x), y)


def test_a_dropout_key_is_two_words_low_first():
    words = gpu.key_words(np.uint64(0xFEDCBA9876543210))
    assert words.dtype == np.uint32
    np.testing.assert_array_equal(words, [0x76543210, 0xFEDCBA98])


# ----- on the CPU: the kernels' source emulated on the host -----

TOL = {np.float32: dict(rtol=2e-5, atol=2e-5), np.float16: dict(rtol=2e-3, atol=2e-3)}

EMULATION = r"""
#include <cmath>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#include <ucontext.h>
struct dim3 { unsigned x, y, z; };
dim3 threadIdx, blockIdx, blockDim, gridDim;    // those of the thread running now
// A block whose kernel synchronises runs its threads as fibers on this host thread: each
// runs up to its next __syncthreads and hands over to the next, so all have arrived when
// the last has (and a read of a slot that a later thread has yet to write, a missing
// barrier, reads the wrong value on every run).
static ucontext_t block_context, *fiber_context;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
inline void __syncthreads() { swapcontext(fiber_context, &block_context); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
using std::sqrt;
"""

LAUNCHER = r"""
static std::function<void()> thread_body;         // the kernel on the launch's arguments
static bool fiber_done;
static void fiber_entry() { thread_body(); fiber_done = true; }

// Blocks one after another; a block's threads one after another, as fibers when `synced`:
// each round runs every thread on to its next __syncthreads or its end.
template <typename... Args, std::size_t... I>
void run(void (*kernel)(Args...), void** argv, bool synced, std::index_sequence<I...>) {
    const std::tuple<Args...> args{*reinterpret_cast<std::remove_cv_t<Args>*>(argv[I])...};
    thread_body = [&] { std::apply(kernel, args); };
    const unsigned n = blockDim.x * blockDim.y, stack = 1 << 17;
    std::vector<ucontext_t> fibers(n);
    std::vector<bool> done(n);
    std::unique_ptr<char[]> stacks(new char[synced ? std::size_t(n) * stack : 0]);
    for (unsigned by = 0; by < gridDim.y; ++by) {
        for (unsigned bx = 0; bx < gridDim.x; ++bx) {
            blockIdx = {bx, by, 0};
            if (!synced) {
                for (unsigned t = 0; t < n; ++t) {
                    threadIdx = {t % blockDim.x, t / blockDim.x, 0};
                    thread_body();
                }
                continue;
            }
            for (unsigned t = 0; t < n; ++t) {
                getcontext(&fibers[t]);
                fibers[t].uc_stack = {stacks.get() + std::size_t(t) * stack, 0, stack};
                fibers[t].uc_link = &block_context;
                makecontext(&fibers[t], fiber_entry, 0);
            }
            done.assign(n, false);
            for (unsigned left = n; left;) {
                for (unsigned t = 0; t < n; ++t) {
                    if (done[t])
                        continue;
                    threadIdx = {t % blockDim.x, t / blockDim.x, 0};
                    fiber_context = &fibers[t];
                    fiber_done = false;
                    swapcontext(&block_context, &fibers[t]);
                    if (fiber_done) {
                        done[t] = true;
                        --left;
                    }
                }
            }
        }
    }
}
template <typename... Args>
void launch(void (*kernel)(Args...), void** argv, bool synced) {
    run(kernel, argv, synced, std::index_sequence_for<Args...>{});
}
"""


class EmulatedModule:
    """cupy.RawModule's interface on the host: the source compiled by g++ with EMULATION,
    one extern "C" launcher per name expression (cuLaunchKernel's argument convention).
    While `recording` is a list (Recording), a launch is appended to it instead of run."""
    _built = {}
    recording = None

    def __init__(self, code, options=(), name_expressions=()):
        self.names = list(name_expressions)
        key = hashlib.sha1((code + "|".join(self.names + list(options))).encode()).hexdigest()
        if key not in self._built:
            self._built[key] = self._build(code, options)
        self.lib = self._built[key]
        # kernels that call __syncthreads run their threads as fibers that meet there
        bodies = re.split(r"__global__ void ", code)[1:]
        self.synced = {b.split("(")[0] for b in bodies
                       if "__syncthreads" in b.split("__global__")[0]}

    def _build(self, code, options):
        """The host library. Multiply-adds are contracted into FMAs as NVRTC contracts them
        unless the options say --fmad=false, so that the bits the tests compare are the
        device's (where the host has FMA instructions)."""
        import tempfile
        folder = tempfile.mkdtemp(prefix="emulated_kernels_")
        wrappers = "".join(
            f'extern "C" void launch_{i}(unsigned gx, unsigned gy, unsigned bx, unsigned by, '
            f'void** argv, bool synced) {{ gridDim = {{gx, gy, 1}}; blockDim = {{bx, by, 1}}; '
            f'launch(&{name}, argv, synced); }}\n' for i, name in enumerate(self.names))
        src = f"{folder}/k.cpp"
        with open(src, "w") as f:
            f.write(EMULATION + code + LAUNCHER + wrappers)
        fma = ["-mfma"] if " fma " in open("/proc/cpuinfo").read().replace("\n", " ") else []
        contract = "-ffp-contract=off" if "--fmad=false" in options else "-ffp-contract=fast"
        run = subprocess.run(["g++", "-std=c++20", "-O2", *fma, contract, "-shared", "-fPIC",
                              src, "-o", f"{folder}/k.so"], capture_output=True, text=True,
                             timeout=600)
        try:
            assert run.returncode == 0, run.stderr[-4000:]
            return ctypes.CDLL(f"{folder}/k.so")
        finally:
            shutil.rmtree(folder)   # a loaded library stays mapped without its file

    def get_function(self, name):
        launcher = getattr(self.lib, f"launch_{self.names.index(name)}")
        synced = name.split("<")[0] in self.synced

        def kernel(grid, block, args):
            if EmulatedModule.recording is not None:
                EmulatedModule.recording.append((run, grid, block, args))
            else:
                run(grid, block, args)

        def run(grid, block, args):
            holders = [ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray)
                       else ctypes.create_string_buffer(np.asarray(a).tobytes()) for a in args]
            for a in args:
                assert not isinstance(a, np.ndarray) or a.flags.c_contiguous
            argv = (ctypes.c_void_p * len(args))(*(ctypes.addressof(h) for h in holders))
            gx, gy = (tuple(grid) + (1,))[:2]
            bx, by = (tuple(block) + (1,))[:2]
            launcher(ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(bx), ctypes.c_uint(by),
                     argv, ctypes.c_bool(synced))
        return kernel


@pytest.fixture
def emulated_cupy(monkeypatch):
    """`cupy` as far as mpitrain.kernels.gpu uses it, on NumPy arrays, with its kernels
    emulated on the host (skipped without g++)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        RawModule=EmulatedModule, empty=np.empty, empty_like=np.empty_like, zeros=np.zeros,
        ascontiguousarray=np.ascontiguousarray))
    monkeypatch.setattr(gpu, "_module", None)
    # a GPU's thousand blocks of a partial-sum pass run one after another here: 64 cover
    # the same code (several blocks, several rows a thread) at a sixteenth of the time
    monkeypatch.setattr(gpu, "TARGET_BLOCKS", 64)


def bn_layers(C, dtype, group, xp, relu=False):
    """(reference, device): a float64 BatchNorm2d and one with fp32 masters and statistics
    (fp16 working copy for fp16) on the module xp, with their ReLU fused when relu; gamma,
    beta and the running statistics away from 1 and 0, equal in both."""
    ref = BatchNorm2d(C, relu=relu).bind(dtype=np.float64)
    dev = BatchNorm2d(C, relu=relu).bind(dtype=np.float32, xp=xp,
                                         working_dtype=np.float16 if dtype == np.float16 else None)
    values = [1 + 0.5 * rand(C, seed=1), rand(C, seed=2), rand(C, seed=3), 1 + rand(C, seed=4) ** 2]
    for bn in (ref, dev):
        for view, v in zip((bn.weight.master, bn.bias.master, bn.running_mean.data,
                            bn.running_var.data), values):
            view[...] = array_module(view).asarray(v)
        bn.arena.sync_working()
        bn.group = group
    return ref, dev


def check_batchnorm(dtype, loc, group, steps, xp, forward, backward, to_host, relu=False):
    """y, dx, dgamma, dbeta and the running statistics of the device layer (on xp, run by
    forward(layer, x, train) and backward(layer, dy), x and dy NumPy) against the float64
    CPU layer on the same values, for each train flag of `steps`."""
    C = 24          # whole 16-byte packs of fp16 (8) and fp32 (4) channels, not a warp's 32
    ref, dev = bn_layers(C, dtype, group, xp, relu)
    out_tol = 1e-4 if dtype == np.float32 else 2e-3     # fp16 outputs: rounded to 11 bits
    for step, train in enumerate(steps):
        x = rand((4, 9, 7, C), dtype, seed=10 + step, loc=loc, scale=2.0)
        dy = rand(x.shape, dtype, seed=20 + step)
        y = ref.forward(x.astype(np.float64), train)
        dx = ref.backward(dy.astype(np.float64))
        y_d = forward(dev, x, train)
        dx_d = backward(dev, dy)
        assert y_d.dtype == dx_d.dtype == dtype and y_d.shape == dx_d.shape == x.shape
        assert_close(to_host(y_d).astype(np.float64), y, out_tol, 1e-6, f"y (train={train})")
        assert_close(to_host(dx_d).astype(np.float64), dx, out_tol, 1e-6, f"dx (train={train})")
        for name, p in ref.named_params():
            got = to_host(dict(dev.named_params())[name].grad)
            assert got.dtype == np.float32
            assert_close(got.astype(np.float64), p.grad, 1e-4, 1e-6, f"d{name} (train={train})")
        for name, b in ref.named_buffers():
            got = to_host(dict(dev.named_buffers())[name].data)
            np.testing.assert_allclose(got, b.data, rtol=1e-5, atol=1e-6, err_msg=name)


class SumGroup:
    """A group of `size` ranks whose batches equal this one's: sum(v) = size * v."""
    def __init__(self, size):
        self.size = size

    def sum(self, v):
        return v * self.size


@pytest.mark.parametrize("dtype,loc,group,relu", [
    (np.float32, 0.0, None, False), (np.float16, 300.0, None, False), (np.float32, 300.0, 1, False),
    (np.float16, 0.0, 3, False), (np.float32, 0.0, None, True), (np.float16, 0.0, 2, True)])
def test_batchnorm_gpu_branch_emulated(emulated_cupy, dtype, loc, group, relu):
    """The fused kernels run the layer's GPU branch on the host, against the float64 layer
    (with a group, both layers see the same group; with relu, its ReLU fused in both)."""
    def forward(bn, x, train):
        bn._kernels = lambda a: gpu                     # the CUDA kernels, on host arrays
        return bn.forward(x, train)
    check_batchnorm(dtype, loc, SumGroup(group) if group else None, [True, False], np,
                    forward, lambda bn, dy: bn.backward(dy), np.asarray, relu)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("N,H,W,C,k,s,p", [(2, 7, 9, 3, 3, 2, 1), (1, 5, 6, 2, 3, 1, 1),
                                           (1, 9, 9, 3, 5, 3, 2), (2, 7, 9, 16, 3, 2, 1),
                                           (1, 9, 9, 8, 5, 3, 2)])
def test_pool_kernels_emulated(emulated_cupy, N, H, W, C, k, s, p, dtype):
    """One channel a thread (C = 2, 3) and 16-byte packs of channels (C = 8, 16)."""
    compare_pooling(rand((N, H, W, C), dtype), k, s, p, lambda a: a, np.asarray,
                    gpu_forward=lambda x, avg: gpu.pool_forward(
                        x, pool._geometry(x.shape, k, s, p), k, s, p, avg),
                    gpu_backward=lambda dy, arg, shape: gpu.pool_backward(dy, arg, shape, k, s, p))


def test_max_pooling_on_a_gpu_refuses_a_window_whose_places_pass_a_byte(emulated_cupy):
    x = np.zeros((1, 40, 40, 8), np.float32)
    k = gpu.MAX_POOL_WINDOW
    assert gpu.pool_forward(x, pool._geometry(x.shape, k, 1, 0), k, 1, 0, False)[1].max() == 0
    with pytest.raises(ValueError, match=f"windows up to {k}x{k}"):
        gpu.pool_forward(x, pool._geometry(x.shape, k + 1, 1, 0), k + 1, 1, 0, False)
    gpu.pool_forward(x, pool._geometry(x.shape, k + 1, 1, 0), k + 1, 1, 0, True)   # avg: no places


def plane_index(place, W, k, s, p):
    """The device kernels' argmax, each maximum's place i*k + j in its window, as the CPU's
    index ih*W + iw into the plane."""
    _, Ho, Wo, _ = place.shape
    oh, ow = np.arange(Ho).reshape(1, Ho, 1, 1), np.arange(Wo).reshape(1, 1, Wo, 1)
    place = place.astype(np.int32)
    return (oh * s - p + place // k) * W + ow * s - p + place % k


def compare_pooling(x, k, s, p, to_device, to_host, gpu_forward=None, gpu_backward=None):
    """Max and average pooling of the device kernels against the CPU kernels: the maxima
    and their positions exactly (a tie and two NaNs planted: the first wins), the rest within the
    dtype's rounding. gpu_forward/backward: how the device kernels are reached (default:
    kernels.pool's dispatch on device arrays)."""
    x = x.copy()
    x[0, 0, 0, 0] = x[0, 0, 1, 0] = x.max()
    x[0, 0, 0, -1] = x[0, 0, 1, -1] = np.nan       # two NaNs in a window: the first wins
    fwd = gpu_forward or (lambda a, avg: (pool.avg_pool_forward if avg else pool.max_pool_forward)(
        a, k, s, p))
    bwd = gpu_backward or (lambda d, arg, shape: pool.max_pool_backward(d, arg, shape, k, s, p)
                           if arg is not None else pool.avg_pool_backward(d, shape, k, s, p))
    y, arg = pool.max_pool_forward(x, k, s, p)
    y_d, arg_d = fwd(to_device(x), False)
    np.testing.assert_array_equal(to_host(y_d), y)          # a maximum is exact
    assert arg_d.dtype == np.uint8
    np.testing.assert_array_equal(plane_index(to_host(arg_d), x.shape[2], k, s, p), arg)
    dy = rand(y.shape, x.dtype, seed=3)
    tol = TOL[x.dtype.type]
    np.testing.assert_allclose(to_host(bwd(to_device(dy), arg_d, x.shape)),
                               pool.max_pool_backward(dy, arg, x.shape, k, s, p), **tol)
    np.testing.assert_allclose(to_host(fwd(to_device(x), True)), pool.avg_pool_forward(x, k, s, p),
                               **tol)
    np.testing.assert_allclose(to_host(bwd(to_device(dy), None, x.shape)),
                               pool.avg_pool_backward(dy, x.shape, k, s, p), **tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dropout_kernel_emulated_draws_the_reference_mask(emulated_cupy, dtype):
    p, key = 0.3, 0xFEDCBA9876543210
    x = rand((7, 301), dtype, seed=1)                    # 2107 elements: not a multiple of 4
    keep = gpu.dropout_keep(key, x.size, p).reshape(x.shape)
    y = gpu.dropout(x, gpu.key_words(key), p)           # the key in (host) "device" memory
    np.testing.assert_array_equal(y, np.where(keep, x * dtype(1 / (1 - p)), 0))
    assert y.dtype == dtype


class Recording:
    """A CUDA graph's capture as far as the emulated kernels go: inside `with`, each launch
    of mpitrain.kernels.gpu is recorded, not run, with its arguments (arrays by pointer,
    numbers by value, as cuLaunchKernel takes them); replay() runs the recorded launches."""

    def __init__(self):
        self.launches = []

    def __enter__(self):
        EmulatedModule.recording = self.launches
        return self

    def __exit__(self, *exc):
        EmulatedModule.recording = None

    def replay(self):
        for kernel, grid, block, argv in self.launches:
            kernel(grid, block, argv)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dropout_replayed_as_a_graph_emulated_draws_the_eager_masks(emulated_cupy, monkeypatch,
                                                                      dtype):
    """A Dropout layer on the GPU path (its kernel emulated on the host) driven as
    mpitrain.graph.StepGraph drives it: an eager step; then key_drawn_ahead set, a key
    drawn, forward and backward captured and replayed; then a key drawn before each
    replay, on new x and dy written into the captured buffers. Every step's y and dx
    equal those of the layer that draws its key in forward, and the masks are those of
    gpu.dropout_keep of the keys that the seed's generator yields, a fresh one each
    step; both layers' generators stay in step with it (what checkpoints save)."""
    monkeypatch.setattr(gpu, "handles", lambda a: True)    # NumPy arrays take the GPU path
    p, seed, shape = 0.3, (7, 1, 0), (5, 103)            # 515 elements: not a multiple of 4
    scale = dtype(1 / (1 - p))
    eager, graphed = Dropout(p, seed=seed), Dropout(p, seed=seed)
    keys = np.random.default_rng(seed)
    x_buf, dy_buf = np.empty(shape, dtype), np.empty(shape, dtype)
    masks = []
    for step in range(4):
        x, dy = rand(shape, dtype, seed=step), rand(shape, dtype, seed=10 + step)
        keep = gpu.dropout_keep(int(keys.integers(1 << 64, dtype=np.uint64)), x.size,
                                p).reshape(shape)
        y, dx = eager.forward(x), eager.backward(dy)
        np.testing.assert_array_equal(y, np.where(keep, x * scale, 0))
        np.testing.assert_array_equal(dx, np.where(keep, dy * scale, 0))
        x_buf[...], dy_buf[...] = x, dy
        if step == 0:                                   # eager: forward draws the key
            y_g, dx_g = graphed.forward(x_buf), graphed.backward(dy_buf)
        elif step == 1:                                 # the capture, its key drawn ahead
            graphed.key_drawn_ahead = True
            graphed.draw_key(np)
            with Recording() as fwd:
                y_g = graphed.forward(x_buf)
            with Recording() as bwd:
                dx_g = graphed.backward(dy_buf)
            fwd.replay()
            bwd.replay()
        else:                                           # a replay, its key drawn first
            graphed.draw_key(np)
            fwd.replay()
            bwd.replay()
        np.testing.assert_array_equal(y_g, y, err_msg=f"step {step}: y")
        np.testing.assert_array_equal(dx_g, dx, err_msg=f"step {step}: dx")
        assert (eager.rng.bit_generator.state == graphed.rng.bit_generator.state
                == keys.bit_generator.state)
        masks.append(keep)
    assert all(not np.array_equal(a, b) for a, b in zip(masks, masks[1:]))
    assert len(fwd.launches) == len(bwd.launches) == 1


# ----- on the GPU: every kernel against the CPU path -----

def one_rank_group():
    from mpi4py import MPI
    from mpitrain.comm import Communicator
    return Communicator(MPI.COMM_SELF).group(1)


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("loc", [0.0, 300.0])          # 300: |mean| >> std, the shifted sums
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_batchnorm_kernels_match_the_float64_layer(dtype, loc, grouped):
    """Train, train, eval on CuPy arrays, with and without a (one-rank) group."""
    import cupy
    check_batchnorm(dtype, loc, one_rank_group() if grouped else None, [True, True, False],
                    cupy, lambda bn, x, train: bn.forward(cupy.asarray(x), train),
                    lambda bn, dy: bn.backward(cupy.asarray(dy)), cupy.asnumpy)


@pytest.mark.gpu
def test_batchnorm_kernels_on_a_large_batch_against_float64():
    """Partial sums over many chunks (M = 65536 rows): statistics within fp32 rounding
    of the float64 layer's."""
    import cupy
    C = 64
    x = rand((16, 64, 64, C), np.float32, seed=5, loc=3.0)
    ref = BatchNorm2d(C).bind(dtype=np.float64)
    dev = BatchNorm2d(C).bind(dtype=np.float32, xp=cupy)
    y = ref.forward(x.astype(np.float64))
    y_g = dev.forward(cupy.asarray(x))
    assert_close(cupy.asnumpy(y_g).astype(np.float64), y, 1e-5, 1e-6, "y")
    np.testing.assert_allclose(cupy.asnumpy(dev.running_var.data), ref.running_var.data, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("N,H,W,C,k,s,p", [(2, 7, 9, 3, 3, 2, 1), (2, 8, 8, 40, 2, 2, 0),
                                           (1, 5, 6, 2, 3, 1, 1), (2, 9, 9, 3, 5, 3, 2)])
def test_pool_kernels_match_the_cpu(N, H, W, C, k, s, p, dtype):
    import cupy
    compare_pooling(rand((N, H, W, C), dtype), k, s, p, cupy.asarray, cupy.asnumpy)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("layer", [lambda: MaxPool2d(3, 2, 1), lambda: AvgPool2d(2),
                                   GlobalAvgPool2d])
def test_pool_layers_on_cupy_match_numpy(layer, dtype):
    import cupy
    cpu, dev = layer(), layer()
    x = rand((2, 8, 6, 5), dtype, seed=1)
    y = cpu.forward(x)
    y_g = dev.forward(cupy.asarray(x))
    dy = rand(y.shape, dtype, seed=2)
    dx, dx_g = cpu.backward(dy), dev.backward(cupy.asarray(dy))
    assert y_g.dtype == dx_g.dtype == dtype
    np.testing.assert_allclose(cupy.asnumpy(y_g), y, **TOL[dtype])
    np.testing.assert_allclose(cupy.asnumpy(dx_g), dx, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dropout_masks_are_drawn_on_the_device_from_the_seed(dtype):
    import cupy
    p, seed = 0.3, (7, 1, 0)                                # (model seed, rank, layer)
    x = cupy.asarray(rand((64, 999), dtype, seed=1))
    d = Dropout(p, seed=seed)
    y = d.forward(x)
    key = int(np.random.default_rng(seed).integers(1 << 64, dtype=np.uint64))
    assert d.keyed and d.mask is None
    np.testing.assert_array_equal(cupy.asnumpy(d.key), gpu.key_words(key))
    keep = gpu.dropout_keep(key, x.size, p).reshape(x.shape)
    scale = dtype(1 / (1 - p))
    np.testing.assert_array_equal(cupy.asnumpy(y), np.where(keep, cupy.asnumpy(x) * scale, 0))
    dy = cupy.asarray(rand(x.shape, dtype, seed=2))
    np.testing.assert_array_equal(cupy.asnumpy(d.backward(dy)),
                                  np.where(keep, cupy.asnumpy(dy) * scale, 0))
    assert abs(keep.mean() - (1 - p)) < 0.01
    # the same seed draws the same masks; another rank's seed others; restoring the
    # generator's state (what a checkpoint saves) draws the next mask again
    twin, other = Dropout(p, seed=seed), Dropout(p, seed=(7, 2, 0))
    np.testing.assert_array_equal(cupy.asnumpy(twin.forward(x)), cupy.asnumpy(y))
    assert not np.array_equal(cupy.asnumpy(other.forward(x)), cupy.asnumpy(y))
    state = d.rng.bit_generator.state
    y2 = cupy.asnumpy(d.forward(x))
    assert not np.array_equal(y2, cupy.asnumpy(y))
    d.rng.bit_generator.state = state
    np.testing.assert_array_equal(cupy.asnumpy(d.forward(x)), y2)
    assert d.forward(x, train=False) is x and d.backward(dy) is dy


def unaligned(a):
    """a C-contiguous copy of `a` that starts one element past a 16-byte boundary"""
    buf = np.empty(a.size + 16, a.dtype)
    skip = (-buf.ctypes.data % 16) // a.itemsize + 1
    out = buf[skip:skip + a.size].reshape(a.shape)
    out[...] = a
    return out


# C = 11: one element a thread (V = 1); C = 24: 16-byte packs, unless an array is unaligned
SHAPES = [(11, False), (24, False), (24, True)]


@pytest.mark.parametrize("C,misaligned", SHAPES)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_batchnorm_element_passes_emulated_give_the_cpu_bits(emulated_cupy, dtype, relu, C,
                                                            misaligned):
    """BatchNorm's y = (x - mean) scale + beta, dx's coefficients (a, b, d) from the sums,
    and dx = a dy + b (x - mean) + d, as CUDA kernels run on the host, give the CPU
    kernels' bits: one formula on both devices, the coefficients rounded once to the
    statistics' dtype and dx's pass computed in it (float32 for fp16 and fp32). Whole
    16-byte packs of channels where the arrays allow, one element at a time elsewhere."""
    from mpitrain.kernels import batchnorm as cpu
    M = 37
    x, dy = rand((M, C), dtype, seed=1), rand((M, C), dtype, seed=2)
    if misaligned:
        x = unaligned(x)
    assert gpu._pack(C, x, dy) == (1 if C == 11 or misaligned else 16 // x.itemsize)
    stat = cpu.acc_dtype(dtype)
    mean, beta = rand(C, stat, seed=3, scale=0.3), rand(C, stat, seed=4)
    scale, invstd = 1 + rand(C, stat, seed=5) ** 2, 1 + rand(C, stat, seed=6) ** 2
    y = gpu.batchnorm_affine(x, mean, scale, beta, relu)
    assert y.dtype == dtype and (y == 0).any() == relu
    np.testing.assert_array_equal(y, cpu.batchnorm_affine(x, mean, scale, beta, relu))
    sums = rand((2, C), stat, seed=7)           # the GPU sums in stat, the CPU in float64
    coef = [k.batchnorm_backward_coefficients(s, s, scale, invstd, M, True,
                                              np.empty(C, stat), np.empty(C, stat))
            for k, s in ((gpu, sums), (cpu, sums.astype(np.float64)))]
    assert coef[1].dtype == stat
    np.testing.assert_array_equal(*coef)
    fused = (scale, beta) if relu else None
    np.testing.assert_array_equal(gpu.batchnorm_dx(dy, x, mean, coef[0], fused),
                                  cpu.batchnorm_dx(dy, x, mean, coef[1], fused))


@pytest.mark.parametrize("C,misaligned", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_batchnorm_affine_with_a_residual_emulated_gives_the_cpu_bits(emulated_cupy, dtype, C,
                                                                      misaligned):
    """A residual block's output from its last BN, max((x - mean) scale + beta + r, 0): the
    CUDA affine kernel with the residual added in it, run on the host, gives the bits of
    the CPU's one pass, and of the separate add of y's rounded values, NaN included."""
    from mpitrain.kernels import batchnorm as cpu
    M = 37
    x, r = rand((M, C), dtype, seed=1), rand((M, C), dtype, seed=2)
    r.flat[5] = np.nan
    if misaligned:
        r = unaligned(r)
    stat = cpu.acc_dtype(dtype)
    mean, beta = rand(C, stat, seed=3, scale=0.3), rand(C, stat, seed=4)
    scale = 1 + rand(C, stat, seed=5) ** 2
    y = gpu.batchnorm_affine(x, mean, scale, beta, residual=r)
    assert y.dtype == dtype and (y == 0).any() and (y > 0).any() and np.isnan(y.flat[5])
    np.testing.assert_array_equal(y, cpu.batchnorm_affine(x, mean, scale, beta, residual=r))
    alone = gpu.batchnorm_affine(x, mean, scale, beta)
    np.testing.assert_array_equal(y, np.maximum(alone + r, 0))      # NaN stays NaN


@pytest.mark.parametrize("shape", [(3, 5, 7, 11), (2, 3, 4, 8)])     # odd size; whole packs
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_relu_grad_kernel_emulated(emulated_cupy, dtype, shape):
    """The CUDA kernel of the ReLU's gradient, run on the host, gives the CPU pass's bits:
    dy where y > 0, else 0 (0 where y is NaN)."""
    from mpitrain.kernels import elementwise
    y, dy = rand(shape, dtype, seed=1), rand(shape, dtype, seed=2)
    y.flat[5] = np.nan
    assert gpu._pack(y.size, dy, y) == (1 if y.size % 2 else 16 // y.itemsize)
    dx = gpu.relu_grad(dy, y)
    assert dx.dtype == dtype and dx.flat[5] == 0 and (dx != 0).any() and (dx == 0).sum() > 1
    np.testing.assert_array_equal(dx, np.where(y > 0, dy, 0))
    np.testing.assert_array_equal(gpu.relu_grad(dy, y), elementwise.relu_grad(dy, y))


@pytest.mark.parametrize("M,C,misaligned", [(37, 11, False), (4099, 64, False), (300, 24, True)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_column_sums_kernel_emulated(emulated_cupy, dtype, M, C, misaligned):
    """A bias's gradient on a GPU, the sums over the rows of dy (M, C), as the CUDA kernels
    run on the host: within the float32 sums' rounding of the float64 sums (float64 of
    float64), in packs and one element at a time, and the same bits when run again."""
    a = rand((M, C), dtype, seed=1, loc=0.5)
    if misaligned:
        a = unaligned(a)
    got = gpu.column_sums(a)
    assert got.shape == (C,) and got.dtype == gpu.acc_dtype(dtype)
    exact = a.astype(np.float64).sum(axis=0)
    bound = (1e-12 if dtype == np.float64 else 1e-5) * np.abs(a.astype(np.float64)).sum(axis=0)
    assert (np.abs(got - exact) <= bound).all()
    np.testing.assert_array_equal(got, gpu.column_sums(a))


def fixed_order_sums(x, dy=None, mean=None):
    """batchnorm_sums' (2, C) in the order its kernels add, written out in NumPy: a block's
    thread ty adds rows r0 + ty, r0 + ty + TY, ... of its chunk one at a time in float32,
    a tree across ty (h = TY/2, ..., 1: s[ty] += s[ty + h]) gives the chunk's sums, and
    bn_fold's tree of FOLD float64 values (one chunk each, the rest 0) the column's."""
    M, C = x.shape
    V = 16 // x.itemsize if C % (16 // x.itemsize) == 0 else 1
    (_, P), (_, TY) = gpu._row_blocks(M, C, V, gpu.TARGET_BLOCKS)
    rows = -(-M // P)
    P = -(-M // rows)
    assert P <= gpu.FOLD
    f32 = x.astype(np.float32)
    shift = f32[0] if dy is None else mean
    fold = np.zeros((gpu.FOLD, 2, C))
    for p in range(P):
        s = np.zeros((TY, 2, C), np.float32)
        for ty in range(TY):
            for r in range(p * rows + ty, min(M, (p + 1) * rows), TY):
                xc = f32[r] - shift
                g = xc if dy is None else dy[r].astype(np.float32)
                s[ty, 0] += g
                s[ty, 1] += g * xc
        h = TY // 2
        while h:
            s[:h] += s[h:2 * h]
            h //= 2
        fold[p] = s[0]
    h = gpu.FOLD // 2
    while h:
        fold[:h] += fold[h:2 * h]
        h //= 2
    return fold[0].astype(np.float32)


@pytest.mark.parametrize("M,C", [(40000, 32), (1000, 24), (301, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_batchnorm_sums_add_in_a_fixed_order(emulated_cupy, dtype, M, C):
    """The statistics kernels' bits are those of one fixed order of additions (the same on
    every run, whatever the blocks' timing), forward and backward: reads may be issued
    ahead of the adds, never the adds reordered."""
    x, dy = rand((M, C), dtype, seed=1, loc=0.5), rand((M, C), dtype, seed=2)
    mean = rand(C, np.float32, seed=3)
    np.testing.assert_array_equal(gpu.batchnorm_sums(x), fixed_order_sums(x))
    np.testing.assert_array_equal(gpu.batchnorm_sums(x, dy, mean), fixed_order_sums(x, dy, mean))


def test_bias_gradients_on_the_cpu_keep_numpys_sums():
    """elementwise.column_sums on NumPy arrays is NumPy's sum over axis 0 in the gradient's
    dtype, bit for bit (the CPU step's bits are unchanged by the GPU's kernel)."""
    from mpitrain.kernels import elementwise
    for dtype in (np.float16, np.float32):
        a = rand((1000, 24), dtype, seed=2)
        out = np.empty(24, np.float32)
        assert elementwise.column_sums(a, out) is out
        np.testing.assert_array_equal(out, a.sum(axis=0, dtype=np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_conv_and_linear_bias_gradients_on_the_device(dtype):
    """AlexNet conv1's bias gradient shape (a large M, 64 channels) and a linear layer's,
    through elementwise.column_sums on CuPy arrays: within fp32 rounding of float64."""
    import cupy
    from mpitrain.kernels import elementwise
    for M, C in ((2 * 55 * 55 * 8, 64), (512, 4096), (37, 11)):
        a = rand((M, C), dtype, seed=3, loc=0.5)
        out = cupy.empty(C, np.float32)
        got = cupy.asnumpy(elementwise.column_sums(cupy.asarray(a), out))
        exact = a.astype(np.float64).sum(axis=0)
        assert (np.abs(got - exact) <= 1e-5 * np.abs(a.astype(np.float64)).sum(axis=0)).all()


@pytest.mark.parametrize("shape", [(3, 5, 7, 11), (2, 3, 4, 8)])     # odd size; whole packs
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_relu_and_add_kernels_emulated_give_the_cpu_bits(emulated_cupy, dtype, shape):
    """The CUDA kernels of the ReLU and of a += b, run on the host, give the CPU passes'
    bits, NaN and -0 included, through elementwise's dispatch."""
    from mpitrain.kernels import elementwise
    x, b = rand(shape, dtype, seed=1), rand(shape, dtype, seed=2)
    x.flat[5], x.flat[6] = np.nan, -0.0
    y = gpu.relu(x)
    assert y.dtype == dtype and np.isnan(y.flat[5]) and (y == 0).sum() > 1
    np.testing.assert_array_equal(y, elementwise.relu(x))
    assert np.signbit(y.flat[6]) == np.signbit(elementwise.relu(x).flat[6])
    expected = elementwise.add_into(x.copy(), b)
    a = x.copy()
    assert gpu.add_into(a, b) is a
    np.testing.assert_array_equal(a, expected)
