"""The training loop, readable top to bottom.

Every rank holds a full replica of the model. One step, `train_step`:

    batch      this rank's shard of the global batch, read, decoded and augmented
               ahead of the step by the loader's workers (mpitrain.datasets.loader)
    forward    model.forward(x, train=True) (--layers plain: forward and backward are
               nets/plain.py's plain NumPy layers, in the model's own arena and buffers)
    loss       softmax cross-entropy in fp32 (optional label smoothing), its gradient
               multiplied by the loss scale; the top-1 hits counted on the device
               (the training accuracy of each progress line)
    backward   model.backward(dlogits) writes every gradient into arena.grad; each
               layer says when a gradient is final (param.grad_ready())
    all-reduce the Reducer sums the gradient arena over the ranks in fusion buckets,
               slices of it (mpitrain.comm.buckets), during backward on a GPU; with
               --compress topk each rank contributes only its largest entries and
               keeps the rest for its next step (mpitrain.comm.topk)
               (--shard-update: a reduce-scatter into each rank's shard, mpitrain.shard)
    overflow   under loss scaling: an inf or NaN anywhere in the summed gradient, which
               holds the same bits on every rank, so every rank reaches the same
               verdict without a vote; such a step is skipped everywhere and its
               BatchNorm statistics are put back (mpitrain.precision)
    update     SGD / LARS / LAMB over the arena (mpitrain.optim), one fused kernel that
               unscales and averages over the ranks, updates the fp32 master and
               refreshes the (fp16) working weights (--shard-update: over this rank's
               shard, then the masters all-gathered)

After the step the ranks agree, in one summed all-reduce (`agree`), on a stop
signal received, a non-finite loss, the loss itself and the bad records skipped.

The run around the steps (`Run`): set-up (options, Communicator, device, data,
model, optimizer, run directory, resume), the epochs, and the end of each
epoch: BatchNorm statistics averaged over the ranks, each rank evaluating a
shard of the validation set with the correct counts summed, a checkpoint.
Every collective goes through the run's one Communicator (mpitrain.comm).
Every rank takes the same number of steps, so no rank waits in a collective
for one that ran out of data. Only rank 0 prints. What is refused before any
work lives in mpitrain.checks; stopping on signals, heartbeats, the stall
watchdog and the divergence watch in mpitrain.control.
"""
import contextlib
import math
import os
import sys
import time
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from . import backend, checkpoint
from .backend import array_module
from .checks import (ConfigError, agreed, check_activations_fit, check_batch,
                     check_batchnorm_values, check_decode, check_free_space, check_image_size,
                     check_launch, check_threads, check_validation_file, describe_data,
                     find_resume, free_space, prepare_run_dir, refuse_options, resolve_data)
from .comm import Communicator, syncbn
from .comm.autotune import FusionTuner
from .comm.buckets import Reducer, share_gradients
from .comm.replicas import ReplicaMismatch, check_replicas
from .config import describe, environment, link_latest
from .control import Heartbeats, LauncherWatch, LossWatch, StopSignals, Watchdog, stop_signal
from .datasets.loader import Loader, pinned_for
from .files import save_json
from .graph import StepGraph, refusal
from .launcher import set_threads, thread_share
from .metrics import LossMean, MetricsLog, StepProgress, Timeline, trace_path
from .nets import build_model, describe_parameters
from .nets.losses import accuracy_counts, nonfinite_rows, softmax_cross_entropy
from .nets.plain import PlainNetwork
from .optim import learning_rate, make_optimizer, scaled_lr
from .options import DEFAULTS, Config
from .precision import DTYPES, LossScaleError, LossScaler, make_scaler
from .shard import ShardedOptimizer, ShardedReducer


class RunData(NamedTuple):
    """The run's data, found and checked (Run.find_data)."""
    train_file: str
    val_file: str
    transform: dict         # the loader's augmentation and crop options
    decode: str             # "cpu" or "gpu"
    class_names: list
    image_size: int         # the square side the network takes
    normalise: dict         # the training file's {mean, std, pixel_max}
    loader_bytes: int       # a rank's loader buffers


NO_TIMELINE = Timeline.off()      # train_step's default: no timing

def sharing(cfg):
    """How ranks share a GPU, for the start line ("" for a device per rank)."""
    k = cfg.ranks_per_gpu
    if backend.device == "cpu" or (k or 1) == 1:
        return ""
    return f" ({k} ranks per GPU, collectives through MPI)"


def epochs(n, kind=""):
    """'1 epoch', '8 epochs', '0.5 warm-up epochs': a number of epochs as the run's lines
    say it."""
    return f"{n:g} {kind}epoch{'s' * (n != 1)}"


def limit_threads(comm):
    """Share a host's cores among its ranks, for BLAS, OpenMP and Numba: each rank runs
    its share (launcher.thread_share), unless the user chose a thread count through the
    environment. Collective."""
    share = thread_share(comm)
    if share is not None:
        set_threads(share)


# The Neumann optimizer's reset period K starts at 10 epochs (Krishnan et al., Table 1)
NEUMANN_RESET_EPOCHS = 10
# arena-sized state an optimizer keeps beyond master and momentum (a checkpoint's size)
EXTRA_STATE = {"lamb": 1, "neumann": 1, "nlcg": 2}


def optimizer_options(cfg, steps_per_epoch):
    """The keyword arguments of mpitrain.optim.make_optimizer for the run's --optimizer.
    Neumann: --momentum caps mu(t), the --warmup-epochs are its vanilla-SGD burn-in, and
    the reset period starts at NEUMANN_RESET_EPOCHS epochs."""
    name = cfg.optimizer
    if name in ("lamb", "nlcg"):
        return dict(weight_decay=cfg.weight_decay)
    if name == "neumann":
        return dict(momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                    sgd_steps=round(cfg.warmup_epochs * steps_per_epoch),
                    reset_steps=NEUMANN_RESET_EPOCHS * steps_per_epoch)
    hyper = dict(momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                 nesterov=cfg.nesterov)
    if name == "lars":
        hyper.update(eta=cfg.lars_eta, eps=cfg.lars_eps)
    return hyper


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss in fp32); raised on every rank alike."""


# ----- model state across ranks -----
def broadcast_model(model, comm):
    """Start every replica from rank 0's master weights and buffers."""
    comm.broadcast(model.arena.master)
    model.arena.sync_working()
    comm.broadcast(model.buffer_arena.data)


def average_buffers(model, comm):
    """Average the BatchNorm running statistics of all replicas (before evaluation)."""
    comm.average(model.buffer_arena.data)


# ----- one step -----
def train_step(model, optimizer, reducer, x, y, lr, label_smoothing=0.0, scaler=None,
               timeline=NO_TIMELINE, graph=None, correct=None):
    """Forward, loss, backward, gradient sum, overflow check, update.

    x: this rank's images (n, H, W, 3) in the model's working dtype, y: its labels (n,),
    with n = global batch / ranks. Returns this rank's mean loss over its images.
    reducer: the mpitrain.comm.buckets.Reducer of model.arena; averaging its sum over the
    ranks gives the gradient of the loss averaged over the global batch, so the update
    equals a single process's on the whole batch, for a network without BatchNorm or with
    a BatchNorm group of all the ranks (--bn-group): by default each rank's BatchNorm
    normalises its own images.
    scaler: a precision.LossScaler (None: no scaling, no overflow check). dlogits are
    multiplied by its scale before backward; a step whose summed gradient overflowed is
    skipped on every rank (scaler.skipped counts them), BatchNorm statistics included.
    timeline (mpitrain.metrics.Timeline) times each phase.
    graph: an mpitrain.graph.StepGraph of this model, which replays forward, loss and
    backward from CUDA graphs (with label_smoothing its own); None: they run eagerly.
    correct: None, or an int64 array of one element on the model's device, to which the
    step adds how many of its images have their label as the top logit (training top-1),
    without reading it back; a graph adds into the array it was made with instead.
    """
    scaler = scaler or LossScaler(1.0)
    # running statistics may move only on a step that is applied: keep them to put back
    saved_stats = model.buffer_arena.data.copy() if scaler.check else None
    # under loss scaling an overflow is expected now and then: it is found and the step
    # skipped below, so NumPy's warnings about it would only be noise
    quiet = (np.errstate(over="ignore", invalid="ignore") if scaler.check
             else contextlib.nullcontext())
    with quiet:
        with timeline.span("forward", "forward"):
            if graph is None:
                logits = model.forward(x, train=True)
                loss, dlogits = softmax_cross_entropy(logits, y, label_smoothing=label_smoothing,
                                                      scale=scaler.scale)
                if correct is not None:
                    correct += accuracy_counts(logits, y, topk=(1,))
            else:
                loss = graph.forward(x, y, scaler.scale)
        with timeline.span("backward", "backward"):
            if graph is None:
                reducer.begin(scaler.scale)
                model.backward(dlogits)         # each bucket's sum starts as it lands
            else:
                graph.backward()                # a replay calls no hooks: finish() below
                reducer.begin(scaler.scale)     # sums every bucket
    with timeline.span("all-reduce", "comm"):
        reducer.finish()
    # the same flag on every rank (reducer.nonfinite_flag); the loss and the flag come to
    # the host together, the step's one device-to-host copy
    flag = reducer.nonfinite_flag() if scaler.check else None
    loss, overflow = backend.to_host_scalars(loss, flag)
    inv_scale = reducer.postscale / scaler.scale    # the scale this gradient was made with
    applied = scaler.update(bool(overflow))
    reducer.settle(applied)             # top-k keeps the step's residuals only if applied
    if applied:
        with timeline.span("update", "update"):
            optimizer.step(lr, inv_scale=inv_scale)
    else:
        model.buffer_arena.data[...] = saved_stats
    return loss


class Agreement(NamedTuple):
    """What the ranks agree on after a step (agree)."""
    stop: str | None        # the stop signal every rank acts on, or None
    not_finite: int         # how many ranks' losses are inf or NaN
    loss_sum: float         # the ranks' finite losses, summed
    skipped: int            # bad records the ranks have skipped so far


def agree(comm, pending, loss, skipped):
    """The one agreement of a step, a single summed all-reduce (the same bits on every
    rank, so every rank decides alike): this rank's stop signals (`pending`, in
    STOP_SIGNALS order), whether its loss is not finite, the loss itself (0 when not), and
    the bad records it has skipped so far."""
    finite = math.isfinite(loss)
    values = np.array([*pending, not finite, loss if finite else 0.0, skipped], np.float64)
    comm.allreduce(values, "flat")
    *signals, not_finite, loss_sum, skipped = values
    return Agreement(stop_signal(signals), int(not_finite), float(loss_sum), int(skipped))


def evaluate(model, comm, loader, topk=(1, 5)):
    """Top-k accuracy and loss of the whole validation set: each rank scores its shard of
    every (padded) step and the counts and loss sums are summed over the ranks. Returns
    {"top1": fraction, ..., "loss": mean cross-entropy (without label smoothing; None
    when some logits were not finite), "nonfinite": images whose logits held an inf or a
    NaN (counted wrong), "bad_records": records skipped by --skip-bad-records, which are
    not scored (nor the records that stood in for them), "scored": the images scored}."""
    xp = backend.xp
    counts = xp.zeros(len(topk) + 1, np.int64)  # correct at each k, non-finite rows, and the
    loss_sum = xp.zeros((), np.float64)         # summed loss: on the device until the end
    scored = bad = 0
    for x, y in loader:
        n = loader.last_valid                   # the rest of the batch pads the last step
        stand_in = loader.last_stand_in[:n]     # where a bad record was: not scored
        bad += int(stand_in.sum())
        rows = np.flatnonzero(~stand_in)
        if len(rows) < n:
            x, y, n = x[:n][array_module(x).asarray(rows)], y[:n][rows], len(rows)
        if n:
            logits = model.forward(xp.asarray(x[:n]), train=False)
            labels = xp.asarray(y[:n])
            counts[:-1] += accuracy_counts(logits, labels, topk=topk)
            counts[-1] += nonfinite_rows(logits)
            with np.errstate(all="ignore"):     # non-finite logits: counted above
                loss_sum += softmax_cross_entropy(logits, labels)[0] * n
            scored += n
    counts = np.append(backend.to_numpy(counts).astype(np.float64),
                       (float(loss_sum), bad, scored))
    comm.allreduce(counts, "flat")
    result = {f"top{k}": float(counts[i] / counts[-1]) for i, k in enumerate(topk)}
    nonfinite = int(counts[-4])
    loss = counts[-3] / counts[-1]
    result.update(loss=float(loss) if not nonfinite and math.isfinite(loss) else None,
                  nonfinite=nonfinite, bad_records=int(counts[-2]), scored=int(counts[-1]))
    return result


def describe_images(result):
    """The images an evaluation (`result` of evaluate) scored, and the bad records it left
    out of them."""
    bad = result["bad_records"]
    return (f"{result['scored']} images" if not bad else
            f"{result['scored']} images scored, {bad} bad record(s) left out")


def describe_nonfinite(result):
    """What to say of an evaluation (`result` of evaluate) that met non-finite logits."""
    return (f"{result['nonfinite']} of {result['scored']} images gave non-finite logits "
            f"(inf or NaN) and were counted wrong: the model's outputs are not numbers")


# ----- the run around the steps -----
def open_run(cfg, comm, say):
    """Save and print the resolved configuration and the environment in the run
    directory (after every check has passed: a refused run overwrites nothing)."""
    env = environment(comm, backend.device)
    problem = None
    if comm.rank == 0:
        try:
            link_latest(cfg.run_dir)
            save_json(os.path.join(cfg.run_dir, "config.json"), cfg.as_dict())
            save_json(os.path.join(cfg.run_dir, "environment.json"), env)
        except OSError as e:
            problem = (f"cannot write the run's reports into --run-dir {cfg.run_dir} "
                       f"({e.strerror}); free space there or choose another directory")
    problem = comm.bcast(problem, root=0)
    if problem:
        raise ConfigError(problem)
    changed = cfg.changed()
    say(describe(f"configuration: {len(DEFAULTS) - len(changed)} options at their defaults, these "
                 f"not (all in {cfg.run_dir}/config.json)", changed), flush=True)
    say(describe("environment", env), flush=True)


def describe_buckets(bounds, itemsize):
    """'N bucket(s) of A to B bytes' (or 'of A bytes'): the gradient buckets' real sizes,
    from their element ranges (comm.buckets.bucket_bounds) and the gradient's itemsize."""
    sizes = [(stop - start) * itemsize for start, stop in bounds]
    span = f"{min(sizes):,}" if min(sizes) == max(sizes) else f"{min(sizes):,} to {max(sizes):,}"
    return f"{len(sizes)} bucket(s) of {span} bytes"


class Run:
    """One training run: `__init__` sets it up, `epoch()` runs the steps of an epoch,
    `end_of_epoch()` evaluates and checkpoints, `stop()` ends on a signal, `close()`
    releases everything. `result` collects what train() returns."""

    def __init__(self, cfg, mpi_comm, log):
        self.lock = None
        try:
            self.set_up(cfg, mpi_comm, log)
        except BaseException:
            self.close(collective=False)        # the run directory's lock above all
            raise

    def set_up(self, cfg, mpi_comm, log):
        """The run's set-up in the order it must happen: what cannot work is refused
        before anything is made, the run directory before anything is written, the
        checkpoint to resume before the gradients' Reducer (whose state it holds)."""
        self.cfg = cfg
        self.reducer = self.signals = self.watchdog = self.heartbeats = None
        self.metrics = self.progress = self.train_data = self.val_data = self.comm = None
        self.timeline = NO_TIMELINE
        launcher = LauncherWatch()              # its processes, before any of them can go
        self.refuse_what_cannot_work(mpi_comm.size)
        self.join_ranks(mpi_comm, log)
        data = self.find_data()
        self.build_model(data)
        self.open_run_directory()
        resume_from = find_resume(cfg, self.comm, self.say, data)
        self.make_loaders(data)
        self.make_optimizer()
        self.say_what_runs(data)
        self.start_counters(data)
        self.capture_graph()                    # counts into start_counters' `correct`
        self.resume(resume_from)
        # config.json and environment.json, once the checkpoint has been read: a
        # checkpoint refused then leaves the run directory as it was
        open_run(cfg, self.comm, self.say)
        self.make_reducer(resume_from)
        self.start_watching(launcher)

    def refuse_what_cannot_work(self, world_size):
        """Options, MPI and the launcher checked before any work (mpitrain.checks)."""
        check_threads()
        check_launch(world_size)
        refuse_options(self.cfg, world_size)

    def join_ranks(self, mpi_comm, log):
        """The run's one Communicator, this rank's device and its share of the cores;
        only rank 0 says anything."""
        cfg = self.cfg
        self.comm = comm = Communicator(mpi_comm, cfg.ranks_per_node)
        self.say = log if comm.rank == 0 else (lambda *a, **k: None)
        try:
            cpu_only = cfg.layers == "plain" or cfg.precision == "fp64"
            backend.use_device("cpu" if cpu_only else cfg.device,
                               comm.host_rank, comm.host_size, cfg.ranks_per_gpu)
        except backend.DeviceError as e:
            raise ConfigError(str(e)) from None
        limit_threads(comm)

    def find_data(self):
        """The run's data (RunData): its files, checked, and what they hold."""
        cfg, size = self.cfg, self.comm.size
        train_file, val_file, transform = resolve_data(cfg, self.comm)
        check_validation_file(train_file, val_file)
        # every rank refuses alike, though each reads its own host's free memory
        num_train, class_names, image_size, normalise, loader_bytes = agreed(
            self.comm, describe_data, train_file, val_file, cfg.image_size,
            cfg.batch_size // size, cfg.workers, cfg.prefetch, DTYPES[cfg.precision][1],
            self.comm.host_size)
        decode = check_decode(cfg, backend.device, (train_file, val_file))
        check_batch(cfg.batch_size, size, num_train)
        return RunData(train_file, val_file, transform, decode, class_names, image_size,
                       normalise, loader_bytes)

    def build_model(self, data):
        """The model from the seed, and what the steps run forward and backward
        (`self.net`): the model's own layers, or their plain twins computing in the
        model's arena and buffers."""
        cfg = self.cfg
        self.batch, self.epochs = cfg.batch_size, cfg.epochs
        master, working = DTYPES[cfg.precision]
        self.model = model = build_model(cfg.model, num_classes=len(data.class_names),
                                         seed=cfg.seed, rank=self.comm.rank, dtype=master,
                                         working_dtype=working)
        shapes = check_image_size(model, cfg.model, data.image_size,
                                  data=None if cfg.image_size else data.train_file)
        check_batchnorm_values(shapes, cfg.model, data.image_size, cfg.batch_size,
                               self.comm.size, cfg.bn_group)
        if backend.device == "cpu":             # a GPU's memory is another matter
            agreed(self.comm, check_activations_fit, shapes, cfg.model, data.image_size,
                   cfg.batch_size // self.comm.size, self.comm.host_size,
                   np.dtype(DTYPES[cfg.precision][1]).itemsize, data.loader_bytes)
        self.net = model
        if cfg.layers == "plain":
            try:
                self.net = PlainNetwork(model)
            except TypeError as e:
                raise ConfigError(f"--layers plain cannot run {cfg.model}: {e}; use "
                                  f"--layers fast") from None

    def open_run_directory(self):
        """The run directory, locked for this job, with room for a checkpoint."""
        cfg, size = self.cfg, self.comm.size
        self.run_dir, self.lock = prepare_run_dir(cfg, self.comm)
        # master, momentum, the optimizer's further state, each rank's top-k residual
        arrays = 2 + EXTRA_STATE.get(cfg.optimizer, 0) + size * (cfg.compress == "topk")
        check_free_space(self.run_dir, checkpoint.expected_size(self.model, size, arrays),
                         self.comm)

    def make_loaders(self, data):
        """The training and validation loaders, each rank reading its shard."""
        cfg, comm = self.cfg, self.comm
        shared = dict(rank=comm.rank, size=comm.size, image_size=data.image_size,
                      workers=cfg.workers, prefetch=cfg.prefetch, dtype=self.model.dtype,
                      seed=cfg.seed, num_classes=len(data.class_names),
                      skip_bad_records=cfg.skip_bad_records,
                      pinned=pinned_for(backend.xp, cfg.decode), decode=data.decode)
        self.train_data = Loader(data.train_file, self.batch, train=True, **data.transform,
                                 **shared)
        # validation on the training file's normalisation, which the model learns
        self.val_data = Loader(data.val_file, self.batch, train=False,
                               crop_fraction=data.transform["crop_fraction"],
                               normalise=data.normalise, **shared)
        self.steps = self.train_data.steps_per_epoch

    def make_optimizer(self):
        """Every replica from rank 0's weights, BatchNorm groups, the optimizer, the loss
        scaler and the peak learning rate."""
        cfg, comm, model = self.cfg, self.comm, self.model
        broadcast_model(model, comm)
        self.say(comm.describe(), flush=True)
        self.bn_group = syncbn.attach(model, comm, cfg.bn_group)
        hyper = optimizer_options(cfg, self.steps)
        if cfg.shard_update:
            self.optimizer = ShardedOptimizer(cfg.optimizer, model.arena, comm, **hyper)
        else:
            self.optimizer = make_optimizer(cfg.optimizer, model.arena, **hyper)
        self.scaler = make_scaler(cfg.loss_scale, cfg.precision, cfg.comm_dtype)
        self.base_lr = scaled_lr(cfg.lr, self.batch, cfg.lr_ref_batch)

    def say_what_runs(self, data):
        cfg, size, scaler = self.cfg, self.comm.size, self.scaler
        chosen = "" if cfg.image_size else " from the data"
        plain = " on the plain layers of nets/plain.py" if self.net is not self.model else ""
        px = data.image_size
        self.say(f"mpitrain: {cfg.model}{plain}, {describe_parameters(self.model)}, on "
                 f"{data.train_file} ({len(self.train_data.labels)} train / "
                 f"{len(self.val_data.labels)} val images, {px}x{px}{chosen}), {size} rank(s) "
                 f"on {backend.device}{sharing(cfg)}, global batch {self.batch} "
                 f"({self.batch // size} per rank), {self.steps} steps/epoch, "
                 f"{epochs(self.epochs)}", flush=True)
        short = (f": longer than the run's {epochs(self.epochs)}, so the learning rate never "
                 f"reaches its peak" if cfg.warmup_epochs > self.epochs else "")
        self.say(f"optimizer {cfg.optimizer}, peak lr {self.base_lr:g} ({cfg.schedule} after "
                 f"{epochs(cfg.warmup_epochs, 'warm-up ')}{short}), precision {cfg.precision}, "
                 f"loss scale {'dynamic from ' if scaler.dynamic else ''}{scaler.scale:g}",
                 flush=True)

    def capture_graph(self):
        """--cuda-graph: the StepGraph that replays forward, loss and backward, or None
        (the run says why a model runs eagerly)."""
        self.graph = None
        if not self.cfg.cuda_graph:
            return
        why_not = refusal(self.model, self.comm.size)
        if why_not is None:
            self.graph = StepGraph(self.model, self.cfg.label_smoothing, say=self.say,
                                   correct=self.correct)
        self.say("--cuda-graph: " + (f"the step runs eagerly: {why_not}" if why_not else
                                     f"forward, loss and backward replayed from CUDA graphs "
                                     f"from step {self.graph.eager_steps + 1}"), flush=True)

    def start_counters(self, data):
        """What the run counts from step to step, and what its checkpoints say of it."""
        self.result = dict(run_dir=self.run_dir, stopped=None, checkpoint=None,
                           traces=[trace_path(self.cfg.trace, r) for r in (0, self.comm.size - 1)]
                           if self.cfg.trace else None)
        # start_dir: what the data paths are relative to (eval and predict find them there)
        self.saved_cfg = {**self.cfg.as_dict(), "num_classes": len(data.class_names),
                          "class_names": data.class_names, "image_size": data.image_size,
                          "start_dir": os.getcwd(), **data.normalise}
        self.losses = LossMean()                # since the last log line
        self.timed_steps = 0                    # steps this process ran since the last log
        self.loss_watch = LossWatch()
        # this rank's top-1 hits on the device and images counted since the last log line
        # (always written in place: a CUDA graph adds into this very array)
        self.correct = backend.xp.zeros(1, np.int64)
        self.counted = 0
        self.saved_step = None                  # global step of the newest checkpoint written
        self.resumed = None                     # (epoch, step) a resume started this job at
        self.skipped = 0                        # bad training records skipped by all ranks
        self.skipped_logged = 0                 # of them, counted in earlier log lines
        self.skipped_before = 0                 # of them, before the resume (the loaders'
                                                # counts start at 0)
        self.last_good = None                   # the newest written before a divergence began
        # where a divergence the loss watch cannot see began (global steps; None: none now):
        self.overflow_since = None      # the first of the overflows in a row, just before
        self.nonfinite_since = None     # the first evaluation with non-finite logits in a row
        self.tuner = (FusionTuner(self.model.arena, self.comm)
                      if self.cfg.fusion_threshold == "auto" else None)
        self.stop_on_nan = not self.scaler.check    # under loss scaling an overflow skips
        # the validation's top-k accuracies
        self.accuracy_at = (1, 5) if len(data.class_names) >= 5 else (1,)

    def make_reducer(self, resume_from):
        """The timeline, and the Reducer that sums the gradients (its top-k residual
        restored from the checkpoint resumed)."""
        cfg, comm, model = self.cfg, self.comm, self.model
        self.timeline = timeline = Timeline(cfg.trace, comm.rank)
        if cfg.trace:
            timeline.trace_layers(self.net, model)
        overlap = backend.xp is not np if cfg.overlap == "auto" else bool(cfg.overlap)
        if cfg.shard_update:
            self.reducer = ShardedReducer(self.optimizer.shard, comm)
            sizes = np.diff(self.optimizer.shard.bounds)
            how = (f"reduce-scatter into {comm.size} shard(s) of {sizes.min():,}-"
                   f"{sizes.max():,} elements after backward, each rank's update on its "
                   f"shard, all-gather")
        else:
            share_gradients(model.arena, comm, cfg.allreduce)
            wire = np.float16 if cfg.comm_dtype == "fp16" else None   # None: the gradients'
            self.new_reducer = lambda threshold: Reducer(
                model.arena, comm, threshold, cfg.allreduce, wire, overlap, timeline,
                density=cfg.density if cfg.compress == "topk" else None,
                dense_epochs=cfg.compress_warmup)
            tuner = self.tuner
            threshold = tuner.threshold if tuner else cfg.fusion_threshold
            self.reducer = self.new_reducer(threshold)
            tuning = ("" if tuner is None else ", chosen by --fusion-threshold auto"
                      if tuner.chosen else
                      f"; --fusion-threshold auto tries {len(tuner.candidates)} sizes from "
                      f"{tuner.candidates[0]:,} bytes first, {tuner.steps} steps each")
            how = (f"{describe_buckets(self.reducer.bounds, model.arena.grad.itemsize)} (each "
                   f"closed at {threshold:,} bytes{tuning}), all-reduce {cfg.allreduce}, "
                   f"fp{8 * np.dtype(wire or model.arena.grad.dtype).itemsize} on the wire, "
                   f"{'overlapped with' if overlap else 'after'} backward")
        self.say(f"gradients: {how}" + (f"; BatchNorm statistics over groups of {cfg.bn_group} "
                                        f"rank(s)" if self.bn_group else ""), flush=True)
        compression = self.reducer.describe_compression()
        if compression:
            self.say(compression, flush=True)
        if self.reducer.residual is not None and resume_from:
            checkpoint.restore_residual(resume_from, model.arena, self.reducer.residual, comm,
                                        self.say)
        elif (resume_from and comm.rank == 0
              and checkpoint.read_config(resume_from).get("compress") == "topk"):
            self.say(f"warning: the top-k residuals of {resume_from} are dropped: this run "
                     f"sums its gradients densely (it was written with --compress topk)",
                     flush=True)

    def start_watching(self, launcher):
        """metrics.jsonl, the progress line, the stop signals, the heartbeats and the
        stall watchdog."""
        cfg, comm, steps, timeline = self.cfg, self.comm, self.steps, self.timeline
        rank0 = comm.rank == 0
        # a resume cuts the records past its checkpoint; one that found none starts afresh
        through = 0 if cfg.resume and self.saved_step is None else self.saved_step
        self.metrics = MetricsLog(os.path.join(self.run_dir, "metrics.jsonl"),
                                  through=through) if rank0 else None
        position = self.train_data.state_dict()
        self.first_epoch = position["epoch"]
        self.progress = StepProgress(self.epochs * steps,
                                     position["epoch"] * steps + position["step"],
                                     stream=sys.stdout) if rank0 else None
        self.log_every = cfg.log_every or (-(-steps // 4) if steps >= 100 else steps)
        self.signals = StopSignals(comm, grace=cfg.stop_grace, launcher=launcher)
        self.heartbeats = Heartbeats(os.path.join(self.run_dir, "heartbeat"), comm)
        self.position = "start"
        timeline.listener = lambda phase: self.heartbeats.post(
            f"in '{phase}' after {self.position}")
        if cfg.collective_timeout:
            self.watchdog = Watchdog(cfg.collective_timeout, comm, self.heartbeats,
                                     activity=timeline.activity)
        self.start = time.perf_counter()

    def resume(self, path):
        """Restore the run from checkpoint `path` (None: start afresh)."""
        if path is None:
            if self.cfg.resume:
                self.say(f"no checkpoint in {self.run_dir}: starting from the beginning",
                         flush=True)
            return
        try:
            meta = checkpoint.restore(path, self.model, self.comm, self.optimizer, self.scaler)
        except checkpoint.CheckpointError as e:
            raise ConfigError(str(e)) from None
        self.train_data.load_state_dict({"epoch": meta["epoch"], "step": meta["step"]})
        self.skipped = self.skipped_before = meta["progress"].get("skipped", 0)
        self.skipped_logged = meta["progress"].get("skipped_logged", 0)
        self.losses.load_state_dict(meta["progress"].get("loss_sum", ()), meta["world_size"])
        counts = meta["progress"].get("top1_counts")
        if counts and self.comm.rank == 0:     # all ranks' sums
            self.correct[...] = int(counts[0])
            self.counted = int(counts[1])
        self.loss_watch.load_state_dict(meta["progress"])
        self.overflow_since = meta["progress"].get("overflow_since")
        self.nonfinite_since = meta["progress"].get("nonfinite_since")
        if self.tuner and "fusion" in meta["progress"]:
            self.tuner.load_state_dict(meta["progress"]["fusion"])
        self.result["checkpoint"] = path
        if self.overflow_since is None and self.nonfinite_since is None:
            self.last_good = path
        self.saved_step = meta["global_step"]
        self.resumed = meta["epoch"], meta["step"]
        where = (f"the end of its {epochs(meta['epoch'])}, nothing more to train"
                 if meta["epoch"] >= self.epochs else
                 f"epoch {meta['epoch'] + 1}, step {meta['step']}")
        self.say(f"resumed from {path}: {where} (written by {meta['world_size']} rank(s))",
                 flush=True)

    def beat(self, where):
        """A step boundary, an evaluation or a checkpoint is behind this rank."""
        self.position = where
        self.heartbeats.post(f"after {where}")
        if self.watchdog:
            self.watchdog.beat(where)

    # ----- the epochs -----
    def epoch(self, epoch):
        """The steps of `epoch` from the loader's position. Returns the name of the stop
        signal when the ranks agreed to stop after a step, else None."""
        cfg, comm, data, steps = self.cfg, self.comm, self.train_data, self.steps
        self.last_log = time.perf_counter()
        self.wait_start = data.wait_time
        self.line = ""
        self.reducer.start_epoch(epoch)         # top-k: dense sums for its warm-up epochs
        for s, (x, y) in enumerate(data, data.state_dict()["step"]):
            now = time.perf_counter()
            self.timeline.add("data wait", "data", now - data.last_wait, now)
            lr = learning_rate(epoch + (s + 1) / steps, self.base_lr, self.epochs,
                               cfg.warmup_epochs, cfg.schedule, cfg.milestones,
                               power=cfg.poly_power)
            started = time.perf_counter()
            global_step, skipped = epoch * steps + s + 1, self.scaler.skipped
            try:
                loss = train_step(self.net, self.optimizer, self.reducer,
                                  backend.xp.asarray(x), backend.xp.asarray(y), lr,
                                  cfg.label_smoothing, self.scaler, self.timeline, self.graph,
                                  self.correct)
            except LossScaleError as e:         # on every rank alike: the flag is agreed
                last = self.set_aside(self.overflow_since or global_step)
                if e.diverged:                  # else a static scale too large: said so
                    self.record_divergence(global_step, self.overflow_since or global_step)
                raise TrainingError(f"{e}. Nothing was saved after the overflows began (step "
                                    f"{self.overflow_since or global_step}); the last good "
                                    f"checkpoint is {last or 'none'}") from None
            overflowed = self.scaler.skipped > skipped
            self.overflow_since = (self.overflow_since or global_step) if overflowed else None
            self.counted += len(y)
            if self.tuner:
                self.tune_fusion(time.perf_counter() - started, global_step)
            self.beat(f"step {global_step}")
            if cfg.check_replicas and global_step % cfg.check_replicas == 0:
                self.check_replicas(global_step)
            agreed = agree(comm, self.signals.pending(), loss, data.skipped)
            self.skipped = self.skipped_before + agreed.skipped
            self.signals.mark()
            if self.stop_on_nan and agreed.not_finite:
                raise TrainingError(self.diverged(loss, epoch, s, "is not finite",
                                                  not_finite=not math.isfinite(loss)))
            mean_loss = agreed.loss_sum / comm.size
            if not agreed.not_finite and self.loss_watch.update(mean_loss, global_step):
                raise TrainingError(self.diverged(mean_loss, epoch, s, "has exploded", False))
            self.losses.add(agreed.loss_sum, comm.size, agreed.not_finite)
            self.timed_steps += 1
            if (s + 1) % self.log_every == 0 or s + 1 == steps:
                self.log_step(epoch, s, lr, global_step)
            if self.progress:
                self.progress.update(global_step, self.line if (s + 1) % self.log_every == 0
                                     and s + 1 < steps else None)
            if agreed.stop:
                self.signals.acted()
                return agreed.stop
        return None

    def tune_fusion(self, seconds, global_step):
        """--fusion-threshold auto: count the step's time; when the tuner moves on to another
        size, or to its choice, the next step sums through a Reducer of that size."""
        if not self.tuner.record(seconds):
            return
        previous = self.reducer
        previous.close()
        self.reducer = self.new_reducer(self.tuner.threshold)
        self.reducer.take_over(previous)
        if self.tuner.chosen is not None and self.progress:
            self.progress.line(f"{self.tuner.describe()}; {len(self.reducer.bounds)} bucket(s) "
                               f"from step {global_step + 1}")
            if self.metrics:
                self.metrics.write(dict(kind="fusion", global_step=global_step,
                                        **self.tuner.state_dict()))

    def scaler_record(self):
        """A step record's loss scale (the next step's) and steps skipped so far; None
        where the run does not scale its loss."""
        check = self.scaler.check
        return dict(loss_scale=self.scaler.scale if check else None,
                    skipped_steps=self.scaler.skipped if check else None)

    def log_step(self, epoch, s, lr, global_step):
        """The mean loss over the ranks and the steps since the last log, and the top-1
        accuracy of the images they trained on: the progress text and a metrics.jsonl
        record. Collective."""
        loss, finite, not_finite = self.losses.take()
        self.result["loss"] = loss
        top1 = self.training_accuracy()
        now = time.perf_counter()
        # what this process timed: after a resume, the interval's earlier steps ran in
        # another (their losses and hits were restored, their time was not)
        steps = max(self.timed_steps, 1)
        images_per_s = self.timed_steps * self.batch / (now - self.last_log)
        phases = {k: v / steps for k, v in self.timeline.take_totals().items()}
        wait = (self.train_data.wait_time - self.wait_start) / (now - self.last_log)
        self.wait_start = self.train_data.wait_time
        skipped = self.skipped - self.skipped_logged     # by every rank since the last log line
        self.skipped_logged = self.skipped
        loss_text = "loss not finite" if loss is None else f"loss {loss:.4f}" + (
            f" ({not_finite} of {finite + not_finite} not finite, left out)" if not_finite else "")
        self.line = (f"epoch {epoch + 1}/{self.epochs}  step {s + 1}/{self.steps}  {loss_text}"
                     + (f"  top1 {top1:.1%}" if top1 is not None else "")
                     + f"  lr {lr:.4g}  {images_per_s:,.0f} images/s  data wait {wait:.0%}"
                     + (f"  {skipped} bad record(s) skipped" if skipped else ""))
        if self.metrics:
            self.metrics.write(dict(kind="step", epoch=epoch + 1, step=s + 1,
                                    global_step=global_step, loss=loss,
                                    losses_not_finite=not_finite, top1=top1, lr=lr,
                                    **self.scaler_record(),
                                    images_per_s=images_per_s, skipped_records=skipped,
                                    time=phases))
        self.timed_steps = 0
        self.last_log = now

    def training_accuracy(self):
        """Collective: the fraction of the images trained on since the last call, over
        all ranks, whose label was the top logit (None when none were counted); the counts
        start again from zero."""
        hits, images = self.top1_counts()
        self.correct[...] = 0
        self.counted = 0
        return float(hits / images) if images else None

    def top1_counts(self):
        """Collective: (top-1 hits, images) of all ranks since the last log line."""
        tally = np.array([float(backend.to_numpy(self.correct)[0]), self.counted])
        self.comm.allreduce(tally, "flat")
        return tally

    def end_of_epoch(self, epoch):
        """BatchNorm statistics averaged and the validation set scored (every --eval-every
        epochs and after the last), a checkpoint (every --checkpoint-every epochs and after
        the last), the epoch's summary line."""
        with self.signals.busy():               # a stop signal waits for the next step
            self.evaluate_and_save(epoch)
        self.timeline.take_totals()             # evaluation and checkpoint time is not a step's
        self.signals.mark()

    def evaluate_and_save(self, epoch):
        """end_of_epoch's work, which may take longer than a stop signal's grace."""
        cfg, line = self.cfg, self.line
        if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == self.epochs:
            with self.timeline.span("evaluate", "evaluate"):
                accuracy = self.evaluate()
            self.beat(f"evaluation after epoch {epoch + 1}")
            if accuracy["loss"] is not None:
                line += f"  val loss {accuracy['loss']:.4f}"
            line += "".join(f"  val top{k} {accuracy[f'top{k}']:.2%}" for k in self.accuracy_at)
            if accuracy["nonfinite"]:
                line += f"  {accuracy['nonfinite']} non-finite"
            self.nonfinite_since = ((self.nonfinite_since or (epoch + 1) * self.steps)
                                    if accuracy["nonfinite"] else None)
            if self.metrics:
                self.metrics.write(dict(kind="eval", epoch=epoch + 1,
                                        global_step=(epoch + 1) * self.steps,
                                        skipped_steps=self.scaler.skipped, **accuracy))
        every = cfg.checkpoint_every
        if every and ((epoch + 1) % every == 0 or epoch + 1 == self.epochs):
            self.save_checkpoint()
            self.beat(f"checkpoint after epoch {epoch + 1}")
        if self.progress:
            self.progress.line(f"{line}  ({time.perf_counter() - self.start:.1f} s since the "
                               f"start)")

    def evaluate(self):
        average_buffers(self.model, self.comm)
        accuracy = evaluate(self.net, self.comm, self.val_data, self.accuracy_at)
        # result["loss"] stays the training loss
        self.result.update({k: v for k, v in accuracy.items() if k != "loss"},
                           val_loss=accuracy["loss"])
        return accuracy

    def save_checkpoint(self):
        """Rank 0 writes the state at the loader's position (keeping the newest
        --keep-checkpoints, and the last one written before a divergence began); every
        rank returns once the file is in place. Nothing is written twice for one position."""
        pos = self.train_data.state_dict()
        global_step = pos["epoch"] * self.steps + pos["step"]
        if global_step == self.saved_step:
            return
        progress = {"loss_sum": self.losses.state_dict(), "skipped": self.skipped,
                    "skipped_logged": self.skipped_logged, **self.loss_watch.state_dict(),
                    "overflow_since": self.overflow_since, "nonfinite_since": self.nonfinite_since}
        progress["top1_counts"] = self.top1_counts().tolist()
        if self.tuner:
            progress["fusion"] = self.tuner.state_dict()
        residual = self.reducer.residual
        with self.timeline.span("checkpoint", "checkpoint"):
            state = checkpoint.collect(self.model, self.comm, pos["epoch"], pos["step"],
                                       global_step, self.saved_cfg, self.optimizer, self.scaler,
                                       progress, residual)
            path = problem = None
            if self.comm.rank == 0:
                path, problem = self.write_checkpoint(state, global_step)
            # no rank leaves before the file is complete
            path, problem = self.comm.bcast((path, problem), root=0)
        if problem:
            raise TrainingError(problem)
        self.result["checkpoint"] = path
        self.saved_step = global_step

    def write_checkpoint(self, state, global_step):
        """Rank 0: (path, None) once the checkpoint is written and the old ones pruned, or
        (None, why) when the run directory's file system cannot hold it: checked before
        writing, and a write that fails leaves no part of the file behind."""
        path = os.path.join(self.run_dir, checkpoint.PATTERN.format(global_step=global_step))
        image = checkpoint.file_image(state)
        need, have = len(image), free_space(self.run_dir)
        full = (f"the file system of --run-dir {self.run_dir} cannot hold the checkpoint of "
                f"step {global_step}")
        last = f"the last checkpoint is {self.result['checkpoint'] or 'none'}"
        if have is not None and have < need:
            return None, (f"{full}: it needs {need / 2**20:.1f} MiB, {have / 2**20:.1f} MiB "
                          f"are free. Stopped without writing it; {last}. Free space (delete "
                          f"older checkpoint-*.h5 there, and lower --keep-checkpoints) and "
                          f"continue with --resume auto")
        try:
            checkpoint.write(path, state, image=image)
        except OSError as e:
            return None, (f"{full} ({e.strerror or e}); nothing of it was left behind; {last}. "
                          f"Free space and continue with --resume auto")
        if self.loss_watch.calm() and self.overflow_since is None \
                and self.nonfinite_since is None:
            self.last_good = path
        checkpoint.prune(self.run_dir, self.cfg.keep_checkpoints, protect={self.last_good})
        return path, None

    def stop(self, signal_name):
        """The ranks agreed to stop on `signal_name`: checkpoint, say how to continue."""
        self.result["stopped"] = signal_name
        self.save_checkpoint()
        pos = self.train_data.state_dict()
        self.say(f"{signal_name}: stopped at epoch {pos['epoch'] + 1}, step {pos['step']}; "
                 f"checkpoint {self.result['checkpoint']}; continue with "
                 f"--run-dir {self.run_dir} --resume auto", flush=True)

    def check_replicas(self, global_step):
        try:
            check_replicas(self.model.arena, self.comm, global_step)
        except ReplicaMismatch as e:
            raise TrainingError(str(e)) from None

    def diverged(self, loss, epoch, s, how, not_finite):
        """Collective: the message for a diverged run (not_finite: this rank's own loss is
        not finite). Checkpoints written since the divergence began are renamed
        diverged-*, so that `--resume auto` takes the last good one."""
        bad = [r for r, b in enumerate(self.comm.allgather(not_finite)) if b]
        where = (f" on rank(s) {bad}" if bad else
                 f" (the mean over the ranks; above {self.loss_watch.FACTOR:g} x its running "
                 f"median since step {self.loss_watch.since})")
        began = [step for step in (self.loss_watch.since, self.overflow_since,
                                   self.nonfinite_since) if step is not None]
        last = self.set_aside(min(began) if began else None)
        global_step = epoch * self.steps + s + 1
        self.record_divergence(global_step, min(began, default=global_step))
        shown = f" ({loss:.4g})" if not bad else ""
        return (f"the training loss {how}{shown} at epoch {epoch + 1}, step {s + 1}{where}: "
                f"training diverged (try a lower --lr or more --warmup-epochs). Nothing was "
                f"saved after the divergence began; the last good checkpoint is "
                f"{last or 'none'}")

    def record_divergence(self, global_step, since):
        """Rank 0: the last record of a run that a divergence ends, {"kind": "diverged",
        global_step (where it ended), since (where it began)}: what a program reads (the
        study), where the error's words are for people."""
        if self.metrics:
            self.metrics.write(dict(kind="diverged", global_step=global_step, since=since))

    def set_aside(self, since):
        """Rank 0: the checkpoints written at or after global step `since` (None: none)
        renamed diverged-*, so that `--resume auto`, eval and export take the one before;
        returns that one (None on the other ranks)."""
        if self.comm.rank != 0:
            return None
        if since is not None:
            for path in checkpoint.checkpoints(self.run_dir):
                name = os.path.basename(path)
                if int(checkpoint.step_of(name)) >= since:
                    os.replace(path, os.path.join(self.run_dir, "diverged-" + name))
        return checkpoint.latest(self.run_dir)

    def close(self, collective=True):
        """Release the run. After an error on this rank alone (collective=False) nothing
        may wait for the other ranks: the job is being aborted."""
        if self.reducer and collective:
            self.reducer.close()
        if self.signals:
            self.signals.restore()
        if self.watchdog:
            self.watchdog.close()
        if self.heartbeats:
            self.heartbeats.close()
        for loader in (self.train_data, self.val_data):
            if loader:
                loader.close()
        try:
            self.timeline.save()
        finally:                        # a trace that cannot be written still lets go of the run
            if self.metrics:
                self.metrics.close()
            if self.progress:
                self.progress.close()
            if self.comm and collective:
                self.comm.free()
            if self.lock:
                self.lock.release()


def train(comm=None, log=print, **options):
    """Train with `options` (mpitrain.options: each checked as its flag is) on `comm` (an mpi4py
    communicator, MPI.COMM_WORLD by default).

    Returns a dict with the final validation accuracy ("top1", "top5") and loss
    ("val_loss"), the mean training loss since the last progress line ("loss"), the
    number of steps and the seconds taken, the run directory, the checkpoint of the final
    model ("checkpoint"; None, and "older_checkpoint" the one it resumed from, when
    --checkpoint-every 0 saved none), the bad records skipped by all ranks in training
    ("skipped_records") and left out of the last evaluation ("bad_records"), the images it
    scored ("scored"), those whose logits were not finite ("nonfinite", counted wrong; the
    command fails when there are any), and the stop signal's name ("stopped") when a
    signal ended the run early.
    """
    try:
        cfg = Config(**options)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    run, finished = None, False
    try:
        run = Run(cfg, comm or MPI.COMM_WORLD, log)
        for epoch in range(run.first_epoch, run.epochs):
            stopped = run.epoch(epoch)
            if stopped is None or run.train_data.state_dict()["step"] == 0:
                run.end_of_epoch(epoch)         # a stop on an epoch's last step ends it first
            if stopped:
                run.stop(stopped)
                finished = True
                return run.result
        if "top1" not in run.result:            # resumed from the end of the last epoch
            run.evaluate()
        finished = True
    finally:
        if run is not None:
            run.close(collective=finished)
    result, scaler = run.result, run.scaler
    end = run.train_data.state_dict()
    if run.saved_step != end["epoch"] * run.steps + end["step"]:
        # --checkpoint-every 0 after a resume: the checkpoint it resumed from is not the
        # final model, which no file holds
        result["older_checkpoint"] = result.pop("checkpoint", None)
        result["checkpoint"] = None
    if result["nonfinite"] and run.nonfinite_since is not None and result["checkpoint"]:
        # not a model to resume, evaluate or export
        result["set_aside"] = (run.nonfinite_since, run.set_aside(run.nonfinite_since))
        result["checkpoint"] = None
    result.update(steps=run.steps * run.epochs, seconds=time.perf_counter() - run.start,
                  loss_scale=scaler.scale, skipped_steps=scaler.skipped,
                  skipped_records=run.skipped)
    top5 = f", {result['top5']:.2%} top-5" if "top5" in result else ""
    # a resumed run's seconds are this job's: from the position it resumed at
    since = ("" if run.resumed is None else " since the resume at the run's end"
             if run.resumed[0] >= run.epochs else
             f" since the resume at epoch {run.resumed[0] + 1}, step {run.resumed[1]}")
    run.say(f"final validation accuracy: {result['top1']:.2%} top-1{top5} "
            f"({describe_images(result)}, {epochs(run.epochs)}, {result['seconds']:.1f} s"
            f"{since})"
            + (" -- not a result: see below" if result["nonfinite"] else ""), flush=True)
    if scaler.check:
        run.say(f"loss scale {scaler.scale:g} at the end; {scaler.skipped} step(s) skipped on "
                f"overflow", flush=True)
    if run.skipped:
        run.say(f"{run.skipped} bad training record(s) skipped (--skip-bad-records)", flush=True)
    say_where(run.say, result)
    return result


def say_where(say, result):
    """The end of a run: where its checkpoint, metrics and timelines are, how to plot
    them, and, when it saved a checkpoint, that the run directory stands for its newest
    one."""
    run_dir = result["run_dir"]
    uses = (f"; eval and predict take --checkpoint {run_dir}, export {run_dir}, for its "
            f"newest checkpoint" if result["checkpoint"] else "")
    older = result.get("older_checkpoint")
    since, last = result.get("set_aside") or (None, None)
    saved = (f"checkpoint {result['checkpoint']}" if result["checkpoint"] else
             f"no checkpoint of the final model: those from step {since} on, whose logits "
             f"were not finite, were set aside as diverged-*; the last good checkpoint is "
             f"{last or 'none'}" if since is not None else
             f"no checkpoint of the final model (--checkpoint-every 0): eval, predict and "
             f"export of {run_dir} take {older}, from before this job's steps" if older else
             "no checkpoint (--checkpoint-every 0: nothing for eval, predict or export)")
    say(f"{saved}; metrics {os.path.join(run_dir, 'metrics.jsonl')}; plots: python -m "
        f"mpitrain plot {run_dir}{uses}", flush=True)
    if result["traces"]:
        first, last = result["traces"]
        which = f"timelines {first} to {last}, one a rank" if last != first else f"timeline {first}"
        say(f"{which}: open in https://ui.perfetto.dev or chrome://tracing", flush=True)
