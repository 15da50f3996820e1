"""`python -m mpitrain bench step`: how fast one training step runs, against PyTorch.

One process, random data, no all-reduce: the step is forward + loss, backward
and the SGD update, each timed separately (median over the timed steps, after
untimed warm-up steps). Under mpirun -np N > 1 it times data-parallel steps
instead, and their scaling against one rank (bench_step_parallel). With
`--reference torch` the same network with the same weights
(mpitrain.tools.bench.reference_torch) takes the same batch through the same step
with torch.optim.SGD, in the same run (in a child process with the user's own
environment), with torch's thread count matched to NumPy's BLAS; the ratio
ours / torch is what to quote. Both report the loss of their first step
(`first_loss`, before any update), which agree when both ran the same network
on the same batch (not with Dropout, whose masks differ). `--rounds N` repeats
both N times, taking turns at going first, and quotes the median of the rounds'
ratios (_median_rounds).

`--device gpu` runs the same on a GPU (CuPy, cuDNN), the device synchronised
before every clock read; `--precision fp16` takes the training path's mixed
precision (fp16 compute, fp32 master weights, dynamic loss scale with its
overflow check). On a GPU the PyTorch side runs there too, on the same batch, with
cudnn.benchmark on and, for fp16, automatic mixed precision (torch.autocast +
GradScaler); on either device its twin is in channels_last (NHWC, as mpitrain).

OpenBLAS reads OPENBLAS_CORETYPE when it loads. Where a machine forces an older
core type, `--native-openblas` re-runs the command without it (and without
OPENBLAS_L2_SIZE) and says so.

The figures, and how to read them: docs/benchmarks.md.
"""
import json
import os
import sys
import time

OPENBLAS_FORCING = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
REEXEC_MARK = "MPITRAIN_NATIVE_OPENBLAS"     # set in the re-run: what was removed


def blas_info():
    """The BLAS NumPy runs on (library, version, core type, its own threads: threadpoolctl,
    if installed), the BLAS the team's GEMMs call (kernels.gemm.team_blas: name, version),
    and the threads a step runs on: Numba's team, which also runs the GEMMs where
    kernels.gemm.team_gemms says so, else BLAS's own threads."""
    import numba

    from mpitrain.kernels import blas_choice, gemm
    threads = numba.get_num_threads()
    team = gemm.team_blas()
    passed_over = (team and team.name == "openblas" and blas_choice.blas_choice() == "openblas"
                   and blas_choice.mkl_installed() and not os.environ.get("MPITRAIN_BLAS"))
    info = {"forced": {k: os.environ[k] for k in OPENBLAS_FORCING if k in os.environ},
            "thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
            "spin": {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
                     if k in os.environ},
            "threads": threads, "numba_pool": numba.config.NUMBA_NUM_THREADS,
            "gemms_on_team": gemm.team_gemms(threads),
            "gemm_library": team and f"{team.name} {team.version}",
            "gemm_note": passed_over and (f"MKL is installed, but taken only on "
                                          f"{' and '.join(blas_choice.MKL_VENDORS)} CPUs, and "
                                          f"this one is {blas_choice.cpu_vendor()}: "
                                          f"MPITRAIN_BLAS=mkl takes it")}
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return {**info, "library": "unknown (install threadpoolctl)"}
    infos = threadpool_info()               # NumPy's: not SciPy's, nor the MKL of the team
    lib = gemm.numpys_openblas(infos) or next(
        (i for i in infos if i["user_api"] == "blas" and i["internal_api"] != "mkl"), None)
    if lib is None:
        return {**info, "library": "none found"}
    return {**info, "library": lib["internal_api"], "version": lib.get("version"),
            "core_type": lib.get("architecture"), "blas_threads": lib["num_threads"]}


def _median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def _summary(batch, phases, first_loss=None):
    """phases: name -> per-step seconds. Medians in ms, and images/s from the median step.
    first_loss: the loss of the first step, before any update (both frameworks start from
    the same weights and batch, so it shows that they ran the same network)."""
    step = _median([sum(t) for t in zip(*phases.values())])
    out = {"images_per_s": batch / step, "step_ms": 1e3 * step,
           **{f"{name}_ms": 1e3 * _median(t) for name, t in phases.items()}}
    if first_loss is not None:
        out["first_loss"] = first_loss
    return out


class OneStep:
    """One process's training step as train_step runs it, without communication:
    forward + softmax cross-entropy (its gradient times the loss scale), backward,
    then the overflow check and the SGD update (momentum 0.9, weight decay 1e-4),
    skipped when the scaled gradient overflowed. precision "fp16" takes the dynamic
    loss scale of training (mpitrain.precision.make_scaler); "fp32" neither scales
    nor checks. The model's working dtype says what it computes in. graph: forward and
    backward replayed from CUDA graphs (mpitrain.graph.StepGraph) where the model
    allows it; `graph_note` says whether they were, or why not."""

    def __init__(self, model, precision="fp32", lr=0.01, momentum=0.9, weight_decay=1e-4,
                 graph=False):
        from mpitrain.graph import StepGraph, refusal
        from mpitrain.optim import SGD
        from mpitrain.precision import make_scaler
        self.model, self.lr = model, lr
        self.optimizer = SGD(model.arena, momentum=momentum, weight_decay=weight_decay)
        self.scaler = make_scaler(None, precision)
        self.graph_note = refusal(model) if graph else None
        self.graph = StepGraph(model) if graph and self.graph_note is None else None

    def forward(self, x, y):
        """(logits, loss) of the batch; keeps the loss gradient for backward. From a
        graph: (None, loss)."""
        from mpitrain.nets.losses import softmax_cross_entropy
        if self.graph is not None:
            return None, self.graph.forward(x, y, self.scaler.scale)
        logits = self.model.forward(x, train=True)
        loss, self.dlogits = softmax_cross_entropy(logits, y, scale=self.scaler.scale)
        return logits, loss

    def backward(self):
        if self.graph is not None:
            self.graph.backward()
        else:
            self.model.backward(self.dlogits)

    def graph_outcome(self):
        """What the graph option came to: None (not asked for), "captured", or why the
        step ran eagerly."""
        if self.graph is not None:
            return "captured" if self.graph.captured else self.graph.refused or "not captured"
        return self.graph_note

    def update(self):
        """The update unless the gradient overflowed; returns whether it was applied."""
        from mpitrain.kernels.update import has_overflow
        scale = self.scaler.scale           # the scale the gradient carries
        overflow = self.scaler.check and has_overflow(self.model.arena.grad)
        applied = self.scaler.update(overflow)
        if applied:
            self.optimizer.step(self.lr, inv_scale=1.0 / scale)
        return applied


def _clock():
    """time.perf_counter() once the device's queued work is done."""
    from mpitrain import backend
    backend.synchronize()
    return time.perf_counter()


def time_ours(model, x, y, steps, warmup, precision="fp32", profile=0, gflops=True,
              graph=False):
    """Median phase times of `steps` steps after `warmup`, with gflops on the CPU the
    GFLOP/s of the median step (its layers' floating-point operations as the direct form
    counts them, counted in one more step), and with
    profile=N a profile of N more steps (mpitrain.tools.bench.profile). graph: OneStep's."""
    from .profile import profile_steps, step_flops
    step = OneStep(model, precision, graph=graph)
    phases = {"forward_loss": [], "backward": [], "update": []}
    first_loss = None
    for i in range(warmup + steps):
        t0 = _clock()
        _, loss = step.forward(x, y)
        t1 = _clock()
        step.backward()
        t2 = _clock()
        step.update()
        t3 = _clock()
        if i == 0:
            first_loss = float(loss)
        if i >= warmup:
            for name, t in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(t)
    out = _summary(len(y), phases, first_loss)
    if graph:
        out["cuda_graph"] = step.graph_outcome()

    def whole_step():
        step.forward(x, y)
        step.backward()
        step.update()
    from mpitrain import backend
    if gflops and backend.device == "cpu":  # on a GPU cuDNN's convolutions pass no GEMM to count
        out["gflops"] = step_flops(whole_step) / out["step_ms"] / 1e6
    if profile and backend.device == "cpu":
        out["profile"] = profile_steps(whole_step, profile)
    elif profile:
        out["layer_profile"] = gpu_profile(step, x, y, profile, whole_step)
    return out


def gpu_profile(step, x, y, steps, whole_step):
    """mpitrain.tools.bench.layers' profile of `steps` steps on the GPU (CUDA events), with the
    card's peaks and the kernels of one more step."""
    from mpitrain import backend

    from .layers import EventClock, kernels, peaks, profile_layers
    clock = EventClock()
    out = profile_layers(step, x, y, steps, clock)
    out.update(clock="CUDA events", peaks=peaks(backend.xp, clock), kernels=kernels(whole_step))
    return out


def time_torch(model, x, y, steps, warmup, threads, lr=0.01, momentum=0.9, weight_decay=1e-4,
               device="cpu", precision="fp32"):
    """The same steps in PyTorch, the twin in channels_last (NHWC, as mpitrain's layers, in
    which PyTorch's CPU step too runs faster than in NCHW). On a GPU: cudnn.benchmark on (its
    convolutions timed and the fastest kept, as mpitrain times its cuDNN plans) and, for
    fp16, torch.autocast with a GradScaler (PyTorch's own mixed precision). On the CPU,
    for fp16, torch.autocast to bfloat16 (PyTorch's CPU mixed precision: its CPU kernels
    have no fast float16; bfloat16 keeps float32's range and needs no loss scale)."""
    import contextlib

    import torch
    from mpitrain.tools.bench.reference_torch import input_to_torch, to_torch
    torch.set_num_threads(threads)
    gpu = device != "cpu"
    where = "cuda" if gpu else "cpu"
    layout = torch.channels_last
    torch.backends.cudnn.benchmark = gpu
    amp = gpu and precision == "fp16"
    cpu_amp = not gpu and precision == "fp16"
    tmodel = to_torch(model).to(where, memory_format=layout).train()
    tx = input_to_torch(x).to(where).contiguous(memory_format=layout)
    ty = torch.from_numpy(y).to(where)
    optimizer = torch.optim.SGD(tmodel.parameters(), lr=lr, momentum=momentum,
                                weight_decay=weight_decay)
    scaler = torch.amp.GradScaler("cuda") if amp else None
    autocast = (lambda: torch.autocast(device_type="cuda", dtype=torch.float16)) if amp \
        else (lambda: torch.autocast(device_type="cpu", dtype=torch.bfloat16)) if cpu_amp \
        else contextlib.nullcontext
    loss_fn = torch.nn.CrossEntropyLoss()

    def clock():
        if gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    phases = {"forward_loss": [], "backward": [], "update": []}
    first_loss = None
    for i in range(warmup + steps):
        t0 = clock()
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(tmodel(tx), ty)
        t1 = clock()
        (scaler.scale(loss) if amp else loss).backward()
        t2 = clock()
        if amp:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        t3 = clock()
        if i == 0:
            first_loss = loss.item()
        if i >= warmup:
            for name, t in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(t)
    out = {"version": torch.__version__, "threads": torch.get_num_threads(),
           "memory_format": "channels_last"}
    if cpu_amp:
        out["precision"] = "autocast bfloat16"
    if gpu:
        out.update(device=torch.cuda.get_device_name(), precision="amp fp16" if amp else "fp32",
                   cudnn_benchmark=True)
    return {**out, **_summary(len(y), phases, first_loss)}


def torch_in_child(spec):
    """time_torch in a fresh process that imports torch before mpitrain.

    mpitrain sets how idle OpenMP and OpenBLAS threads wait (mpitrain/__init__.py); torch's
    OpenMP runtime would read that too, so the child gets the environment the user gave.
    The same seed rebuilds the same weights and batch.
    """
    import subprocess
    import mpitrain
    env = dict(os.environ)
    for name in mpitrain.SET_HERE:
        env.pop(name, None)
    code = ("import torch, json, sys; from mpitrain.tools.bench.step import _torch_child; "
            "print(json.dumps(_torch_child(json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the PyTorch reference failed (exit {out.returncode}):\n"
                           f"{out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _torch_child(spec):
    from mpitrain.nets import build_model

    from .profile import PeakMemory
    model = build_model(spec["model_name"], num_classes=spec["num_classes"], seed=spec["seed"])
    x, y = random_batch(model, spec["batch"], spec["image_size"], spec["num_classes"], spec["seed"])
    with PeakMemory() as memory:
        out = time_torch(model, x, y, spec["steps"], spec["warmup"], spec["threads"],
                         device=spec.get("device", "cpu"), precision=spec.get("precision", "fp32"))
    return {**out, "peak_memory": memory.bytes}


def random_batch(model, batch, image_size, num_classes, seed):
    import numpy as np
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, image_size, image_size, 3)).astype(model.dtype)
    return x, rng.integers(0, num_classes, batch)


def bench_step(model_name, image_size=64, batch=32, steps=10, warmup=2, num_classes=1000,
               seed=0, reference=None, device="cpu", precision="fp32", profile=0, rounds=1,
               graph=False):
    """Time training steps of `model_name` on a random batch; returns a dict (see main_step).
    device: "cpu", "gpu" or "auto" (backend.use_device; a missing GPU raises DeviceError).
    profile: profile this many more steps (mpitrain.tools.bench.profile), in the first round.
    rounds: time mpitrain (and the reference) this many times, taking turns at going
    first; each side's figures are then those of its median round (peak memory: the
    largest) and the ratio is the median of the rounds' ratios (_median_rounds).
    graph: mpitrain's forward and backward replayed from CUDA graphs (OneStep)."""
    from mpitrain import backend
    backend.use_device(device)
    result = {"model": model_name, "image_size": image_size, "batch": batch, "steps": steps,
              "warmup": warmup, "device": backend.device, "precision": precision,
              "blas": blas_info()}
    if backend.device != "cpu":
        from mpitrain.config import gpu_environment
        result["gpu"] = gpu_environment()

    def time_reference(run):
        if reference == "torch" and "torch_error" not in result:
            try:
                run["torch"] = _time_torch(model_name, image_size, batch, num_classes, seed,
                                           steps, warmup, result["blas"]["threads"], precision)
            except RuntimeError as e:       # mpitrain's figures stand without the reference
                result["torch_error"] = str(e)
    runs = []
    for r in range(rounds):
        torch_first = reference == "torch" and r % 2 == 1
        run = {"first": "torch" if torch_first else "mpitrain"}
        if torch_first:
            time_reference(run)
        run["mpitrain"] = _time_fresh(model_name, image_size, batch, num_classes, seed, steps,
                                      warmup, precision, profile if r == 0 else 0, graph)
        if not torch_first:
            time_reference(run)
        runs.append(run)
    result.update(_median_rounds(runs))
    if backend.device != "cpu":
        from mpitrain.kernels import cudnn
        result["padded_inputs"] = cudnn.padding_report()
    if backend.device == "cpu":
        # after the rounds: memory this process has freed stays resident and a round
        # reuses it unseen, so the first round must come before any other large work
        from .profile import gemm_peak
        result["gemm_peak_gflops"] = gemm_peak()
    return result


def _time_torch(model_name, image_size, batch, num_classes, seed, steps, warmup, threads,
                precision):
    """The PyTorch reference's figures (torch_in_child) on the current device."""
    from mpitrain import backend
    if backend.device != "cpu":         # the child's PyTorch needs the memory CuPy keeps pooled
        backend.xp.get_default_memory_pool().free_all_blocks()
    return torch_in_child(dict(model_name=model_name, image_size=image_size, batch=batch,
                               num_classes=num_classes, seed=seed, steps=steps, warmup=warmup,
                               threads=threads, device=backend.device, precision=precision))


def _median_rounds(runs):
    """The figures of one or more rounds, each {"first": side, "mpitrain": figures[,
    "torch": figures]}: per side the figures of its median round by images/s (the lower
    middle one for an even count), with the largest peak memory and the first round's
    profile; "ratio", the median of the rounds' ratios; with more than one round,
    "rounds", each round's images/s and ratio. mpitrain's peak memory is in effect the
    first round's: the later ones reuse memory the process freed and still holds, which
    PeakMemory does not see. A shared host's speed drifts from minute to minute, so a
    ratio is quoted from one round, where both sides ran within a minute of each other,
    and its median over rounds."""
    out = {}
    for side in ("mpitrain", "torch"):
        figures = [run[side] for run in runs if side in run]
        if not figures:
            continue
        chosen = dict(sorted(figures, key=lambda f: f["images_per_s"])[(len(figures) - 1) // 2])
        chosen["peak_memory"] = max(f["peak_memory"] for f in figures)
        for key in ("profile", "layer_profile"):
            if key in figures[0]:
                chosen[key] = figures[0][key]
        out[side] = chosen
    rounds = [{"first": run["first"], **{side: run[side]["images_per_s"]
                                         for side in ("mpitrain", "torch") if side in run}}
              for run in runs]
    for entry in rounds:
        if "torch" in entry:
            entry["ratio"] = entry["mpitrain"] / entry["torch"]
    ratios = [entry["ratio"] for entry in rounds if "ratio" in entry]
    if ratios:
        out["ratio"] = _median(ratios)
    if len(runs) > 1:
        out["rounds"] = rounds
    return out


def _time_fresh(model_name, image_size, batch, num_classes, seed, steps, warmup, precision,
                profile=0, graph=False):
    """time_ours on a model and batch made here on the current device (freed on return),
    with the peak resident memory of the model and its steps."""
    from .profile import PeakMemory
    with PeakMemory() as memory:
        model, x, y = build_on_device(model_name, image_size, batch, num_classes, seed, precision)
        out = time_ours(model, x, y, steps, warmup, precision, profile, graph=graph)
    return {**out, "peak_memory": memory.bytes}


def new_model(model_name, num_classes, seed, precision="fp32"):
    """The network from `seed` on backend.xp's device, with fp16 working weights under fp16."""
    import numpy as np

    from mpitrain.nets import build_model
    return build_model(model_name, num_classes=num_classes, seed=seed,
                       working_dtype=np.float16 if precision == "fp16" else None)


def build_on_device(model_name, image_size, batch, num_classes, seed, precision="fp32",
                    batch_seed=None):
    """(model, x, y) on backend.xp's device: the network from `seed` (fp16 working weights
    under fp16) and random_batch's batch from `batch_seed` (default: seed), the same on
    every device for the same seeds."""
    from mpitrain import backend
    model = new_model(model_name, num_classes, seed, precision)
    x, y = random_batch(model, batch, image_size, num_classes,
                        seed if batch_seed is None else batch_seed)
    return model, backend.xp.asarray(x), backend.xp.asarray(y)


# ----- under mpirun: data-parallel steps, scaling against one rank -----
def under_mpirun():
    """Whether an MPI launcher started this process (checked without initialising MPI)."""
    return any(k in os.environ for k in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
                                         "PMIX_RANK"))


class ParallelSteps:
    """Data-parallel training steps (mpitrain.train.train_step with a Reducer), each timed
    on the slowest rank. Phases per step (ms): forward (with loss), backward, comm_wait
    (the wait for the gradient sum after backward: what backward did not hide),
    comm_total (the buckets' all-reduce time, measured where it runs), update: rank 0's.
    allreduce: the buckets' all-reduce time on the rank that reached it last, which waits
    for no other rank's backward: the collectives' own time (comm_total less the skew).
    reducer_args: the mpitrain.comm.buckets.Reducer arguments after the arena (comm,
    threshold, algorithm, wire dtype, overlap). An arena takes one Reducer at a time, so
    each step makes its own and closes it after the step (outside the timing); with
    `density` its buckets are top-k sparsified, the residual carried from step to step.
    optimizer and reducer: a pair used instead of SGD and the per-step Reducer (the
    sharded update's, mpitrain.shard). On a GPU the step ends when the device is done
    with it; comm_wait is then only the host's wait (the all-reduce is ordered by
    events), and saved_ms tells what overlap gained."""
    NAMES = {"forward": "forward", "backward": "backward", "comm": "comm_wait",
             "bucket": "comm_total", "update": "update"}

    def __init__(self, model, reducer_args, world, lr=0.01, precision="fp32", density=None,
                 optimizer=None, reducer=None):
        from mpitrain.metrics import Timeline
        from mpitrain.optim import SGD
        from mpitrain.precision import make_scaler
        self.model, self.reducer_args, self.world, self.lr = model, reducer_args, world, lr
        self.density, self.reducer = density, reducer
        self.last = None            # the Reducer of the last step, whose top-k state goes on
        self.optimizer = optimizer or SGD(model.arena, momentum=0.9, weight_decay=1e-4)
        self.scaler = make_scaler(None, precision)
        self.timeline = Timeline()
        self.phases = {v: [] for v in [*self.NAMES.values(), "allreduce"]}
        self.steps = []

    def step(self, x, y, record=True):
        from mpi4py import MPI
        from mpitrain.comm.buckets import Reducer
        from mpitrain.train import train_step
        reducer = self.reducer or Reducer(self.model.arena, *self.reducer_args,
                                          timeline=self.timeline, density=self.density)
        if self.last is not None and reducer is not self.reducer:
            reducer.take_over(self.last)
        self.world.Barrier()
        t0 = _clock()
        try:
            train_step(self.model, self.optimizer, reducer, x, y, self.lr,
                       scaler=self.scaler, timeline=self.timeline)
        finally:
            took = _clock() - t0
            if reducer is not self.reducer:
                reducer.close()
        self.last = reducer
        took = self.world.allreduce(took, op=MPI.MAX)
        totals = self.timeline.take_totals()
        last = self.world.allreduce(totals.get("bucket", 0.0), op=MPI.MIN)
        if record:
            self.steps.append(took)
            for k, v in self.NAMES.items():
                self.phases[v].append(totals.get(k, 0.0))
            self.phases["allreduce"].append(last)

    def summary(self, images):
        step = _median(self.steps)
        return {"images_per_s": images / step, "step_ms": 1e3 * step,
                **{f"{name}_ms": 1e3 * _median(t) for name, t in self.phases.items()}}


def _sleep_until(request):
    """Wait for a non-blocking MPI request without spinning a core (MPICH's blocking waits
    poll): the ranks that wait must not slow down the one being timed."""
    while not request.Test():
        time.sleep(0.005)


def bench_step_parallel(model_name, image_size=64, batch=32, steps=10, warmup=2,
                        num_classes=1000, seed=0, threshold=4 << 20, algorithm="hybrid",
                        comm_dtype="fp32", device="cpu", precision="fp32", density=None,
                        shard_update=False):
    """Under mpirun: N ranks x `batch` images each, with the gradient buckets summed during
    backward and after it (--no-overlap), against one rank with the same batch and the
    threads of all the node's ranks, at most one per core, timed first in a process of its
    own (one_rank_baseline; the other ranks sleep meanwhile). The N-rank variants take
    turns step by step, so that a change of load on a shared machine hits them alike.
    Scaling efficiency = N-rank images/s / one-rank images/s. hidden_fraction: the share
    of the all-reduce time that ran while backward was still running; saved_ms: how much
    shorter the overlapped step is than the --no-overlap one (medians). On GPUs each rank
    takes the GPU of its local rank (backend.use_device), and "one rank" is rank 0 alone
    on its GPU.
    density: also steps with top-k sparsified buckets (train --compress topk), and
    shard_update: with the sharded update (train --shard-update, SGD on a second copy of
    the model), each against the dense, unsharded step training would take here (its
    --overlap auto): bytes sent per rank per step, times, optimizer state per rank."""
    import numpy as np
    from mpi4py import MPI

    from mpitrain import backend
    from mpitrain.comm import Communicator
    from mpitrain.comm.buckets import DEFAULT_THRESHOLD, bucket_bounds, share_gradients
    from mpitrain.checks import check_image_size
    from mpitrain.launcher import node_cores
    from mpitrain.train import limit_threads
    world = MPI.COMM_WORLD
    comm = Communicator(world)
    backend.use_device(device, comm.host_rank, comm.host_size)
    limit_threads(comm)
    threads = blas_info()["threads"]
    # the same weights on every rank, a different batch on each
    model, x, y = build_on_device(model_name, image_size, batch, num_classes, seed, precision,
                                  batch_seed=seed + world.rank)
    check_image_size(model, model_name, image_size)     # on every rank alike, as train's
    result = {"model": model_name, "image_size": image_size, "batch_per_rank": batch,
              "ranks": world.size, "threads_per_rank": threads, "steps": steps, "warmup": warmup,
              "fusion_threshold": threshold, "allreduce": algorithm, "comm_dtype": comm_dtype,
              "device": backend.device, "precision": precision, "blas": blas_info()}
    wire = np.float16 if comm_dtype == "fp16" else None
    share_gradients(model.arena, comm, algorithm)       # as training places them
    trained = "overlap" if backend.xp is not np else "no_overlap"   # train's --overlap auto
    tuner = None
    if threshold == "auto":
        tuner = tune_fusion(ParallelSteps(model, None, world, precision=precision), x, y, comm,
                            algorithm, wire, trained == "overlap")
        threshold = result["fusion_threshold"] = tuner.chosen
    modes = [("overlap", True), ("no_overlap", False)]
    runs = {key: ParallelSteps(model, (comm, threshold, algorithm, wire, overlap), world,
                               precision=precision) for key, overlap in modes}
    if density is not None:
        runs["topk"] = ParallelSteps(model, (comm, threshold, algorithm, wire,
                                             trained == "overlap"), world, precision=precision,
                                     density=density)
    if shard_update:
        from mpitrain.shard import ShardedOptimizer, ShardedReducer
        twin, _, _ = build_on_device(model_name, image_size, batch, num_classes, seed, precision)
        sharded = ShardedOptimizer("sgd", twin.arena, comm, momentum=0.9, weight_decay=1e-4)
        runs["sharded"] = ParallelSteps(twin, None, world, precision=precision,
                                        optimizer=sharded,
                                        reducer=ShardedReducer(sharded.shard, comm))
    if tuner:       # the choice against the fixed default, as training would run both
        runs["default_threshold"] = ParallelSteps(
            model, (comm, DEFAULT_THRESHOLD, algorithm, wire, trained == "overlap"), world,
            precision=precision)
    # one rank with the threads of all its node's ranks, on the cores they may run on
    cores = node_cores(world)
    one = None
    if world.rank == 0:
        one = one_rank_baseline(min(threads * comm.host_size, len(cores)), cores, device,
                                model_name, image_size, batch, num_classes, seed, steps,
                                warmup, precision)
    _sleep_until(world.Ibarrier())
    for i in range(warmup + steps):
        for key in (list(runs) if i % 2 else list(runs)[::-1]):
            runs[key].step(x, y, record=i >= warmup)
    if tuner:
        default = runs.pop("default_threshold").summary(world.size * batch)
    for key, run in runs.items():
        result[key] = run.summary(world.size * batch)
    result["buckets"] = len(bucket_bounds(model.arena, threshold))
    result["trained"] = trained
    result["dense_bytes"] = model.arena.grad.nbytes                 # sent per rank per step
    result["state_bytes"] = model.arena.momentum.nbytes             # SGD's velocity
    if density is not None:
        result["topk"].update(density=density, bytes=runs["topk"].last.topk.bytes_per_step())
    if shard_update:
        result["sharded"]["state_bytes"] = runs["sharded"].optimizer.state_bytes()
    if tuner:
        result["autotune"] = {**tuner.state_dict(), "describe": tuner.describe(),
                              "compared": trained, "chosen_ms": result[trained]["step_ms"],
                              "default_ms": default["step_ms"],
                              "default_threshold": DEFAULT_THRESHOLD,
                              "default_buckets": len(bucket_bounds(model.arena,
                                                                   DEFAULT_THRESHOLD))}
    if world.rank == 0:
        result["one_rank"] = {key: one[key]
                              for key in ("threads", "cores", "images_per_s", "step_ms")}
        for key in runs:
            result[key]["efficiency"] = (result[key]["images_per_s"]
                                         / result["one_rank"]["images_per_s"])
        o = result["overlap"]
        result["hidden_fraction"] = hidden_fraction(o["comm_wait_ms"], o["comm_total_ms"])
        result["saved_ms"] = result["no_overlap"]["step_ms"] - o["step_ms"]
    comm.free()
    return result


def one_rank_baseline(threads, cores, device, *figures_of):
    """The figures of _time_fresh(*figures_of) on `device` and `threads` threads, in a
    process of its own on `cores` (the cores of all the node's ranks, which a launcher
    may have pinned each to its own), without the launcher's variables: Numba and OpenMP
    fix their pools' sizes when they load, and a rank's pools are its share of the
    host's cores (launcher.size_thread_pools). "threads" and "cores": those it ran on."""
    import subprocess

    from mpitrain.launcher import outside_environment
    env = {**outside_environment(), "NUMBA_NUM_THREADS": str(threads),
           "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, "-c", "from mpitrain.tools.bench.step import "
                        "_one_rank; _one_rank()",
                        json.dumps([threads, cores, device, *figures_of])],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"the one-rank baseline failed (status {r.returncode}):\n"
                           f"{r.stdout[-2000:]}{r.stderr[-4000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def _one_rank():
    """one_rank_baseline's process: its arguments the JSON list of sys.argv[1], its figures
    a JSON line on stdout."""
    threads, cores, device, *figures_of = json.loads(sys.argv[1])
    if hasattr(os, "sched_setaffinity"):    # before Numba and OpenMP start their threads
        os.sched_setaffinity(0, cores)
    import numba

    from mpitrain import backend
    from mpitrain.launcher import affinity, set_threads
    backend.use_device(device)
    set_threads(threads)
    print(json.dumps({**_time_fresh(*figures_of), "threads": numba.get_num_threads(),
                      "cores": affinity()}))


def hidden_fraction(wait_ms, allreduce_ms):
    """The share of the all-reduce time that ran behind backward: 1 - wait / all-reduce,
    at least 0. The main thread's wait includes handing the buckets to the communication
    thread, so where the all-reduce itself takes a fraction of a millisecond (a tiny
    model) the wait can be the longer of the two; nothing was hidden then."""
    return max(0.0, 1.0 - wait_ms / max(allreduce_ms, 1e-9))


def tune_fusion(steps, x, y, comm, algorithm, wire, overlap):
    """--fusion-threshold auto as training runs it: ParallelSteps `steps` take training
    steps, each with the tuner's current size, until the tuner has chosen. Returns it."""
    from mpitrain.comm.autotune import FusionTuner
    tuner = FusionTuner(steps.model.arena, comm)
    while tuner.chosen is None:
        steps.reducer_args = (comm, tuner.threshold, algorithm, wire, overlap)
        steps.step(x, y)
        tuner.record(steps.steps[-1])
    return tuner


def format_parallel(r):
    lines = [f"bench step: {r['model']} at {r['image_size']}x{r['image_size']}, {r['ranks']} ranks "
             f"x batch {r['batch_per_rank']} x {r['threads_per_rank']} thread(s), median of "
             f"{r['steps']} steps after {r['warmup']} warm-up; {r['buckets']} gradient buckets "
             f"of ~{r['fusion_threshold']:,} bytes, all-reduce {r['allreduce']}, "
             f"{r['comm_dtype']} on the wire",
             f"1 rank x {r['one_rank']['threads']} threads, batch {r['batch_per_rank']}: "
             f"{r['one_rank']['images_per_s']:.1f} images/s, step "
             f"{r['one_rank']['step_ms']:.1f} ms"]
    for key, label in (("overlap", "overlapped"), ("no_overlap", "--no-overlap")):
        t = r[key]
        lines.append(f"{r['ranks']} ranks, {label}: {t['images_per_s']:.1f} images/s, step "
                     f"{t['step_ms']:.1f} ms (forward+loss {t['forward_ms']:.1f}, backward "
                     f"{t['backward_ms']:.1f}, comm wait {t['comm_wait_ms']:.1f} of "
                     f"{t['comm_total_ms']:.1f} all-reduce on rank 0 ({t['allreduce_ms']:.1f} "
                     f"the collectives' own, the rest waiting for other ranks), update "
                     f"{t['update_ms']:.1f}); "
                     f"scaling efficiency {t['efficiency']:.2f} (vs 1 rank x "
                     f"{r['one_rank']['threads']} threads)")
    lines.append(f"overlap: {r['hidden_fraction']:.0%} of the all-reduce time ran behind "
                 f"backward; the overlapped step is {abs(r['saved_ms']):.1f} ms "
                 f"{'shorter' if r['saved_ms'] >= 0 else 'longer'} than the --no-overlap step, "
                 f"whose all-reduce took {r['no_overlap']['comm_total_ms']:.1f} ms")
    dense = r[r["trained"]]
    mode = "overlapped" if r["trained"] == "overlap" else "--no-overlap"
    if "topk" in r:
        t = r["topk"]
        lines.append(f"top-k {t['density']:g} ({mode}): step {t['step_ms']:.1f} ms (all-reduce "
                     f"{t['comm_total_ms']:.1f}, update {t['update_ms']:.1f}), {t['bytes']:,} "
                     f"bytes sent per rank per step; dense: step {dense['step_ms']:.1f} ms "
                     f"(all-reduce {dense['comm_total_ms']:.1f}), {r['dense_bytes']:,} bytes: "
                     f"{t['step_ms'] / dense['step_ms']:.2f}x the time, "
                     f"{t['bytes'] / r['dense_bytes']:.3f}x the bytes")
    if "sharded" in r:
        t = r["sharded"]
        lines.append(f"--shard-update: step {t['step_ms']:.1f} ms (reduce-scatter "
                     f"{t['comm_wait_ms']:.1f}, update + all-gather {t['update_ms']:.1f}), "
                     f"optimizer state {t['state_bytes'] / 2**20:.1f} MiB per rank; dense "
                     f"{mode}: step {dense['step_ms']:.1f} ms (all-reduce wait "
                     f"{dense['comm_wait_ms']:.1f}, update {dense['update_ms']:.1f}), "
                     f"{r['state_bytes'] / 2**20:.1f} MiB: {t['step_ms'] / dense['step_ms']:.2f}x "
                     f"the step, {t['update_ms'] / dense['update_ms']:.2f}x the update, "
                     f"{t['state_bytes'] / r['state_bytes']:.2f}x the memory")
    if "autotune" in r:
        a = r["autotune"]
        mode = "overlapped" if a["compared"] == "overlap" else "--no-overlap"
        lines.append(f"{a['describe']}; {mode} step {a['chosen_ms']:.1f} ms at the choice "
                     f"({r['buckets']} bucket(s)) against {a['default_ms']:.1f} ms at the fixed "
                     f"default {a['default_threshold']:,} bytes ({a['default_buckets']} "
                     f"bucket(s)): {a['default_ms'] / a['chosen_ms']:.2f}x")
    return "\n".join(lines)


class OneProcessOnly(ValueError):
    """An option of the one-process benchmark (--reference, --profile, --rounds) given to
    the data-parallel one under mpirun."""


def _reexec_without_openblas_forcing(argv, to_stderr):
    """Replace this process by the same command with OPENBLAS_CORETYPE/_L2_SIZE unset
    (they must be gone before NumPy loads OpenBLAS, hence a fresh process)."""
    removed = {k: os.environ[k] for k in OPENBLAS_FORCING if k in os.environ}
    env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_FORCING}
    env[REEXEC_MARK] = " ".join(f"{k}={v}" for k, v in removed.items())
    print(f"--native-openblas: re-running without "
          f"{', '.join(f'{k}={v}' for k, v in removed.items())}",
          file=sys.stderr if to_stderr else sys.stdout, flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "mpitrain", *argv], env)


def main_step(args, argv):
    """The `bench step` command: parse result of cli.build_parser, and the raw argv (for the
    re-run)."""
    from mpitrain.backend import DeviceError
    from mpitrain.checks import ConfigError
    if args.native_openblas and REEXEC_MARK not in os.environ \
            and any(k in os.environ for k in OPENBLAS_FORCING):
        _reexec_without_openblas_forcing(argv, to_stderr=args.json)
    if under_mpirun():          # each rank on its share of the cores, as train's ranks
        from mpi4py import MPI      # (after the re-exec: MPI starts once in a process)

        from mpitrain.launcher import size_thread_pools
        size_thread_pools(MPI.COMM_WORLD)        # before Numba loads
    try:
        result = _run_step(args)
    except (DeviceError, OneProcessOnly, ConfigError) as e:   # every rank alike: rank 0 says it
        from mpitrain.launcher import launched_rank
        if launched_rank() == 0:
            sys.stderr.write(f"python -m mpitrain bench step: error: {e}\n")
        sys.exit(2)
    if result is None:
        return
    if "ranks" in result:
        print(json.dumps(result) if args.json else format_parallel(result))
        return
    if args.native_openblas:
        result["native_openblas"] = {"removed": os.environ.get(REEXEC_MARK) or "nothing was set"}
    result["cudnn_deterministic"] = not args.nondeterministic_plans
    print(json.dumps(result) if args.json else format_result(result))
    if "torch_error" in result:         # asked for, and missing: the figures alone, and say so
        sys.exit(1)


def _run_step(args):
    """bench_step's result in one process; bench_step_parallel's under mpirun -np N > 1
    (None on the ranks other than 0, which print nothing)."""
    if args.nondeterministic_plans:
        from mpitrain.checks import ConfigError
        from mpitrain.kernels import cudnn
        if args.device != "gpu":
            raise ConfigError("--nondeterministic-plans chooses among cuDNN's plans, on a GPU: "
                              "add --device gpu")
        cudnn.DETERMINISTIC = False
    if under_mpirun():
        from mpi4py import MPI
        if MPI.COMM_WORLD.size > 1:
            given = [name for name, value in (("--reference", args.reference),
                                              ("--profile", args.profile),
                                              ("--cuda-graph", args.cuda_graph),
                                              ("--rounds", args.rounds > 1)) if value]
            if given:
                one = len(given) == 1
                raise OneProcessOnly(f"{', '.join(given)} appl{'ies' if one else 'y'} to the "
                                     f"one-process benchmark, not to the data-parallel steps "
                                     f"timed under mpirun: drop {'it' if one else 'them'}, or "
                                     f"run without mpirun")
            result = bench_step_parallel(args.model, args.image_size, args.batch, args.steps,
                                         args.warmup, args.num_classes, args.seed,
                                         args.fusion_threshold, args.allreduce, args.comm_dtype,
                                         args.device, args.precision,
                                         args.density if args.compress == "topk" else None,
                                         args.shard_update)
            return result if MPI.COMM_WORLD.rank == 0 else None
    if args.cuda_graph and args.profile:
        from mpitrain.checks import ConfigError
        raise ConfigError("--profile times every layer of eager steps, and a replayed graph "
                          "has no layers to time: drop --cuda-graph or --profile")
    return bench_step(args.model, args.image_size, args.batch, args.steps, args.warmup,
                      args.num_classes, args.seed, args.reference, args.device, args.precision,
                      args.profile, args.rounds, args.cuda_graph)


def format_profile(p, top=12):
    total = p["profiled_step_ms"]
    lines = [f"profile ({total:.0f} ms per step under cProfile; ms per step by kind):"]
    lines += [f"  {kind:<28} {ms:8.1f}  {ms / total:5.1%}" for kind, ms in p["ms"].items()]
    lines.append(f"  without cProfile ({p['step_ms']:.0f} ms per step): "
                 f"GEMMs {p['gemm_ms']:.0f} ms "
                 f"at {p['gemm_gflops']:.0f} GFLOP/s on average, outside GEMMs "
                 f"{p['outside_gemm']:.0%} of the step")
    lines.append(f"  the {min(top, len(p['gemms']))} longest GEMM shapes (a @ b, calls per step, "
                 f"without cProfile):")
    lines += [f"    {str(tuple(g['a'])):>16} @ {str(tuple(g['b'])):<16} x{g['calls']:<3} "
              f"{g['ms']:7.1f} ms {g['gflops']:6.0f} GFLOP/s" for g in p["gemms"][:top]]
    return lines


def padding_line(p):
    """What cudnn.padded_channels chose for a first convolution, and its timings."""
    shape = "x".join(str(d) for d in p["x"])
    if p["ms"] is None:
        return (f"first convolution ({shape}, {p['dtype']}): input on {p['channels']} "
                f"channels, as chosen before (plan cache)")
    ms = " against ".join(f"{c} channels {t:.3f} ms" for c, t in p["ms"].items())
    return (f"first convolution ({shape}, {p['dtype']}): input on {p['channels']} channels "
            f"(pad, forward and weight gradient: {ms})")


def threads_line(b):
    """How the step's threads are arranged, from blas_info()."""
    spin = ", ".join(f"{k}={v}" for k, v in b["spin"].items()) or "libgomp's default"
    if b["gemms_on_team"]:
        return (f"{b['threads']} threads: one OpenMP team for every kernel, each GEMM cut "
                f"among it, one {b['gemm_library'].split()[0]} call per band; idle team "
                f"threads spin ({spin}), then sleep")
    return (f"{b['threads']} thread(s); GEMMs on BLAS's own {b.get('blas_threads', '?')} "
            f"thread(s), idle OpenBLAS threads spinning 2^{b.get('thread_timeout') or 28} "
            f"cycles (OPENBLAS_THREAD_TIMEOUT); idle OpenMP threads: {spin}")


def format_result(r):
    b = r["blas"]
    forced = ", ".join(f"{k}={v}" for k, v in b["forced"].items()) or "none"
    rounds = (f"; each side's median round of {len(r['rounds'])}, taking turns at going first"
              if "rounds" in r else "")
    lines = [f"bench step: {r['model']} at {r['image_size']}x{r['image_size']}, batch "
             f"{r['batch']}, median of {r['steps']} steps after {r['warmup']} warm-up "
             f"(one process, no all-reduce){rounds}",
             f"NumPy BLAS: {b['library']} {b.get('version') or ''} core type "
             f"{b.get('core_type') or '?'}; forced by environment: {forced}",
             f"the team's GEMMs: {b.get('gemm_library') or 'none: NumPy alone'}"
             + (f"; {b['gemm_note']}" if b.get("gemm_note") else ""),
             threads_line(b)]
    if r.get("device", "cpu") != "cpu" or r.get("precision", "fp32") != "fp32":
        g = r.get("gpu", {})
        cudnn = g.get("cudnn") if g.get("cudnn_reason") is None else \
            f"not used: {g['cudnn_reason']}"
        where = (f"{r['device']} ({g.get('gpu')}, CuPy {g.get('cupy')}, CUDA "
                 f"{g.get('cuda_runtime')}, cuDNN {cudnn})" if "gpu" in r else r["device"])
        lines.append(f"device {where}, precision {r['precision']}"
                     + ("" if r.get("cudnn_deterministic", True) else
                        ", cuDNN's non-deterministic plans allowed"))
    lines += [padding_line(p) for p in r.get("padded_inputs", ())]
    if "native_openblas" in r:
        lines.append(f"--native-openblas: removed from the environment: "
                     f"{r['native_openblas']['removed']}")
    for name in ("mpitrain", "torch"):
        if name in r:
            t = r[name]
            label = f"torch {t['version']} ({t['threads']} threads)" if name == "torch" else name
            if name == "mpitrain" and "cuda_graph" in t:
                label = ("mpitrain (CUDA graphs)" if t["cuda_graph"] == "captured" else
                         f"mpitrain (eager: {t['cuda_graph']})")
            if name == "torch" and "device" in t:
                label = (f"torch {t['version']} ({t['device']}, {t['precision']}, "
                         f"{t['memory_format']})")
            if name == "torch" and "precision" in t and "device" not in t:
                label = f"torch {t['version']} ({t['threads']} threads, {t['precision']})"
            memory = (f", peak memory {t['peak_memory'] / 2**20:,.0f} MiB"
                      if t.get("peak_memory") else "")
            lines.append(f"{label}: {t['images_per_s']:.1f} images/s, step {t['step_ms']:.1f} ms "
                         f"(forward+loss {t['forward_loss_ms']:.1f}, backward "
                         f"{t['backward_ms']:.1f}, update {t['update_ms']:.1f}){memory}")
    if "rounds" in r:
        lines.append("rounds, images/s: " + "; ".join(
            f"{i}: {o['mpitrain']:.1f}" + (f" / torch {o['torch']:.1f} = {o['ratio']:.2f}x "
                                           f"({o['first']} first)" if "torch" in o else "")
            for i, o in enumerate(r["rounds"], 1)))
    if "ratio" in r:
        of = f" (the median of {len(r['rounds'])} rounds' ratios)" if "rounds" in r else ""
        lines.append(f"ratio mpitrain / torch: {r['ratio']:.2f}x images/s{of}")
    if "gemm_peak_gflops" in r:
        ours = r["mpitrain"]["gflops"]
        lines.append(f"mpitrain's step: {ours:.0f} GFLOP/s of its layers' arithmetic (Winograd's "
                     f"convolutions counted as the direct form), "
                     f"{ours / r['gemm_peak_gflops']:.0%} of this machine's GEMM peak now "
                     f"({r['gemm_peak_gflops']:.0f} GFLOP/s, a 2048^3 float32 GEMM"
                     + (f", with the forced {forced}: --native-openblas measures the CPU's "
                        f"own kernels" if b["forced"] else "") + ")")
    if "profile" in r["mpitrain"]:
        lines += format_profile(r["mpitrain"]["profile"])
    if "layer_profile" in r["mpitrain"]:
        from .layers import format_profile as format_layers
        lines += format_layers(r["mpitrain"]["layer_profile"])
    if "torch_error" in r:
        lines.append(r["torch_error"])
    return "\n".join(lines)
