"""The training loop, readable top to bottom (DESIGN.md section 1).

Every rank holds a full replica of the model. One step, `train_step`:

    batch      this rank's shard of the global batch, read, decoded and augmented
               ahead of the step by the loader's workers (mpitrain.datasets.loader)
    forward    model.forward(x, train=True)
    loss       softmax cross-entropy in fp32 (optional label smoothing), its gradient
               multiplied by the loss scale
    backward   model.backward(dlogits) writes every gradient into arena.grad; each
               layer says when a gradient is final (param.grad_ready())
    all-reduce the Reducer sums the gradient arena over the ranks in fusion buckets,
               slices of it (mpitrain.comm.buckets), during backward on a GPU
    overflow   under loss scaling: an inf or NaN anywhere in the summed gradient, which
               holds the same bits on every rank, so every rank reaches the same
               verdict without a vote; such a step is skipped everywhere and its
               BatchNorm statistics are put back (mpitrain.precision)
    update     SGD / LARS / LAMB over the arena (mpitrain.optim), one fused kernel that
               unscales and averages over the ranks, updates the fp32 master and
               refreshes the (fp16) working weights

After the step the ranks agree on two flags in one all-reduce (MAX): a stop
signal received, a non-finite loss.

The run around the steps (`Run`): set-up (options, Communicator, device, data,
model, optimizer, run directory, resume), the epochs, and the end of each
epoch: BatchNorm statistics averaged over the ranks, each rank evaluating a
shard of the validation set with the correct counts summed, a checkpoint.
Every collective goes through the run's one Communicator (mpitrain.comm).
Every rank takes the same number of steps, so no rank waits in a collective
for one that ran out of data. Only rank 0 prints. Stopping on signals and the
stall watchdog live in mpitrain.control.
"""
import contextlib
import math
import os
import sys
import time

import numpy as np

from . import backend, checkpoint
from .control import StopSignals, Watchdog
from mpitrain.kernels.update import has_overflow
from .metrics import MetricsLog, StepProgress, Timeline
from .optim import learning_rate, make_optimizer, scaled_lr
from .precision import LossScaler, make_scaler

# The default job: resnet_small on the digits with 2 ranks reaches >= 95% validation top-1.
DEFAULTS = dict(model="resnet_small", data="digits", val_data=None, data_dir="data",
                image_size=None, augment=None, workers=2, prefetch=2, skip_bad_records=False,
                epochs=8, batch_size=32, lr=0.1, momentum=0.9, nesterov=False,
                weight_decay=5e-4, label_smoothing=0.0, warmup_epochs=1.0, seed=0,
                device="auto", eval_every=1,
                # optimizer and precision; loss_scale None: dynamic under fp16, 1 under fp32
                optimizer="sgd", lr_ref_batch=None, lars_eta=0.001, lars_eps=1e-9,
                schedule="cosine", milestones=(), precision="fp32", loss_scale=None)

# The run around the loop: run directory, checkpoints, logging, failure handling.
DEFAULTS.update(run_dir=None, checkpoint_every=1, keep_checkpoints=3, resume=None, trace=None,
                collective_timeout=None, log_every=None)

# Communication: topology, all-reduce algorithm, fusion buckets and their overlap
# with backward ("auto": on for a GPU arena, off for a host one, see comm/buckets.py), the
# gradient dtype on the wire, replica checks, distributed BatchNorm.
DEFAULTS.update(ranks_per_node=None, allreduce="hybrid", fusion_threshold=4 << 20, overlap="auto",
                comm_dtype="fp32", check_replicas=0, bn_group=1)

# Data sets known by name: files under data_dir, made by `convert` on first use.
# The digits are centred 32x32 glyphs: random crops and flips would only hurt.
PRESETS = {"digits": dict(train="digits_train.h5", val="digits_val.h5", convert="convert_digits",
                          transform=dict(augment=False, crop_fraction=1.0))}
# Anything else: random-resized-crop and flip for training, centre crop of 87.5% for validation.
TRANSFORM = dict(augment=True, crop_fraction=0.875)

NO_TIMELINE = Timeline.off()      # train_step's default: no timing

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "NUMBA_NUM_THREADS")


class ConfigError(ValueError):
    """A training option that cannot work, found before any work is done."""


def check_batch(global_batch, world_size, num_train=None):
    """Refuse a global batch that the ranks cannot share evenly (or that exceeds the data)."""
    if global_batch < 1:
        raise ConfigError(f"the global batch size must be positive, got {global_batch}")
    if global_batch % world_size:
        raise ConfigError(f"global batch size {global_batch} does not divide by the {world_size} "
                         f"MPI ranks; use a multiple of {world_size} "
                         f"(each rank takes batch_size / ranks images per step)")
    if num_train is not None and global_batch > num_train:
        raise ConfigError(f"global batch size {global_batch} exceeds the {num_train} training "
                         f"images: an epoch would have no step")


def comm_options(cfg, world_size):
    """Refuse communication options that cannot work."""
    from .comm import ALGORITHMS
    if cfg["allreduce"] not in ALGORITHMS:
        raise ConfigError(f"unknown all-reduce {cfg['allreduce']!r}; choose one of "
                          f"{', '.join(ALGORITHMS)}")
    if cfg["comm_dtype"] not in ("fp32", "fp16"):
        raise ConfigError(f"unknown --comm-dtype {cfg['comm_dtype']!r}; choose fp32 or fp16")
    for key in ("fusion_threshold", "bn_group", "ranks_per_node"):
        if cfg[key] is not None and cfg[key] < 1:
            raise ConfigError(f"--{key.replace('_', '-')} must be positive, got {cfg[key]}")
    if cfg["bn_group"] > world_size:
        raise ConfigError(f"--bn-group {cfg['bn_group']} exceeds the {world_size} rank(s)")


def resolve_data(cfg, comm):
    """(train file, validation file, loader transform options) for the run's --data.

    A preset name (digits) means files under data_dir, converted by rank 0 when
    missing while the other ranks wait; anything else is a training file, with
    --val-data or else the converter's FILE_val.h5 beside it as validation.
    """
    from mpitrain.datasets import convert
    preset = PRESETS.get(cfg["data"])
    if preset:
        train_file, val_file = (os.path.join(cfg["data_dir"], preset[k]) for k in ("train", "val"))
        if comm.rank == 0 and not (os.path.exists(train_file) and os.path.exists(val_file)):
            print(f"mpitrain: converting {cfg['data']} into {cfg['data_dir']}/", flush=True)
            getattr(convert, preset["convert"])(cfg["data_dir"])
        comm.barrier()
        transform = dict(preset["transform"])
    else:
        train_file, transform = cfg["data"], dict(TRANSFORM)
        val_file = cfg["val_data"] or convert.val_path(train_file)
        for what, path in (("training", train_file), ("validation", val_file)):
            if not os.path.exists(path):
                raise ConfigError(f"{what} file {path} does not exist; make it with "
                                  f"`python -m mpitrain convert ...`"
                                  + (" or name it with --val-data" if what == "validation" else ""))
    if cfg["augment"] is not None:
        transform["augment"] = cfg["augment"]
    return train_file, val_file, transform


def describe_file(path):
    """(number of images, number of classes, stored image size or None) of a data file."""
    from mpitrain.datasets.h5format import Reader
    with Reader(path) as reader:
        return len(reader.labels), len(reader.class_names), \
            reader.image_shape[0] if reader.image_shape else None


def limit_threads(local_size):
    """Share the cores of a node among its ranks (nproc / local ranks threads each),
    unless the user chose a thread count through the environment."""
    if any(v in os.environ for v in THREAD_VARIABLES):
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threadpool_limits(max(1, cores // local_size))


def optimizer_options(cfg):
    """The keyword arguments of mpitrain.optim.make_optimizer for the run's --optimizer."""
    name = cfg["optimizer"]
    if name == "lamb":
        return dict(weight_decay=cfg["weight_decay"])
    hyper = dict(momentum=cfg["momentum"], weight_decay=cfg["weight_decay"],
                 nesterov=cfg["nesterov"])
    if name == "lars":
        hyper.update(eta=cfg["lars_eta"], eps=cfg["lars_eps"])
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
               timeline=NO_TIMELINE):
    """Forward, loss, backward, gradient sum, overflow check, update.

    x: this rank's images (n, H, W, 3) in the model's working dtype, y: its labels (n,),
    with n = global batch / ranks. Returns this rank's mean loss over its images.
    reducer: the mpitrain.comm.buckets.Reducer of model.arena; averaging its sum over the
    ranks gives the gradient of the loss averaged over the global batch, so the update
    equals a single process's on the whole batch.
    scaler: a precision.LossScaler (None: no scaling, no overflow check). dlogits are
    multiplied by its scale before backward; a step whose summed gradient overflowed is
    skipped on every rank (scaler.skipped counts them), BatchNorm statistics included.
    timeline (mpitrain.metrics.Timeline) times each phase.
    """
    from mpitrain.nets.losses import softmax_cross_entropy
    scaler = scaler or LossScaler(1.0)
    # running statistics may move only on a step that is applied: keep them to put back
    saved_stats = model.buffer_arena.data.copy() if scaler.check else None
    # under loss scaling an overflow is expected now and then: it is found and the step
    # skipped below, so NumPy's warnings about it would only be noise
    quiet = np.errstate(over="ignore", invalid="ignore") if scaler.check else contextlib.nullcontext()
    with quiet:
        with timeline.span("forward", "forward"):
            logits = model.forward(x, train=True)
            loss, dlogits = softmax_cross_entropy(logits, y, label_smoothing=label_smoothing,
                                                  scale=scaler.scale)
        reducer.begin()
        with timeline.span("backward", "backward"):
            model.backward(dlogits)
    with timeline.span("all-reduce", "comm"):
        reducer.finish()
    # the summed gradient holds the same bits on every rank, and so does this flag
    overflow = scaler.check and has_overflow(model.arena.grad)
    if scaler.update(overflow):
        with timeline.span("update", "update"):
            optimizer.step(lr, inv_scale=reducer.postscale / scaler.scale)
    else:
        model.buffer_arena.data[...] = saved_stats
    return float(loss)


def evaluate(model, comm, loader, topk=(1, 5)):
    """Top-k accuracy of the whole validation set: each rank scores its shard of every
    (padded) step and the correct counts are summed. Returns {"top1": fraction, ...}."""
    from mpitrain.nets.losses import accuracy_counts
    xp = backend.xp
    counts = np.zeros(len(topk) + 1)            # correct at each k, then the number scored
    for x, y in loader:
        n = loader.last_valid                   # the rest of the batch pads the last step
        if n:
            logits = model.forward(xp.asarray(x[:n]), train=False)
            counts[:-1] += accuracy_counts(logits, xp.asarray(y[:n]), topk=topk)
            counts[-1] += n
    comm.allreduce(counts, "flat")
    return {f"top{k}": float(counts[i] / counts[-1]) for i, k in enumerate(topk)}


# ----- the run around the steps -----
def open_run(cfg, comm, say):
    """Choose the run directory (rank 0 decides, all ranks agree), save and print the
    resolved configuration and the environment there. Returns the directory."""
    from .config import default_run_dir, describe, environment, save_json
    resume = cfg["resume"]
    if cfg["run_dir"] is None and resume not in (None, "auto"):
        cfg["run_dir"] = os.path.dirname(os.path.abspath(resume))
    if cfg["run_dir"] is None and resume == "auto":
        raise ConfigError("--resume auto needs --run-dir: the directory of the run to continue")
    run_dir = cfg["run_dir"] = cfg["run_dir"] or default_run_dir(comm)
    env = environment(comm, backend.device)
    if comm.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        save_json(os.path.join(run_dir, "config.json"), cfg)
        save_json(os.path.join(run_dir, "environment.json"), env)
        say(describe(f"configuration (saved in {run_dir}/config.json)", cfg), flush=True)
        say(describe("environment", env), flush=True)
    comm.barrier()
    return run_dir


def find_resume(cfg, comm):
    """The checkpoint to resume from (rank 0 looks; None: start afresh)."""
    if not cfg["resume"]:
        return None
    path = None
    if comm.rank == 0:
        if cfg["resume"] == "auto":
            path = checkpoint.latest(cfg["run_dir"])
        elif os.path.exists(cfg["resume"]):
            path = cfg["resume"]
        else:
            path = ConfigError(f"--resume {cfg['resume']}: no such checkpoint file")
    path = comm.bcast(path, root=0)
    if isinstance(path, ConfigError):
        raise path
    return path


def signal_name(signum):
    import signal
    return signal.Signals(int(signum)).name


class Run:
    """One training run: `__init__` sets it up, `epoch()` runs the steps of an epoch,
    `end_of_epoch()` evaluates and checkpoints, `stop()` ends on a signal, `close()`
    releases everything. `result` collects what train() returns."""

    def __init__(self, cfg, mpi_comm, log):
        from mpitrain.comm import Communicator, syncbn
        from mpitrain.comm.buckets import Reducer, share_gradients
        from mpitrain.datasets.loader import Loader
        from mpitrain.nets import build_model
        self.cfg = cfg
        self.reducer = self.signals = self.watchdog = self.metrics = self.progress = None
        self.train_data = self.val_data = self.comm = None
        self.timeline = NO_TIMELINE

        # ----- options that cannot work are refused before any work -----
        comm_options(cfg, mpi_comm.size)
        check_batch(cfg["batch_size"], mpi_comm.size)
        if cfg["precision"] not in ("fp32", "fp16"):
            raise ConfigError(f"unknown precision {cfg['precision']!r}; choose fp32 or fp16")

        # ----- ranks, device, data, model -----
        self.comm = comm = Communicator(mpi_comm, cfg["ranks_per_node"])
        rank, size = comm.rank, comm.size
        self.say = say = log if rank == 0 else (lambda *a, **k: None)
        backend.use_device(cfg["device"], comm.host_rank, comm.host_size)
        limit_threads(comm.host_size)
        train_file, val_file, transform = resolve_data(cfg, comm)
        num_train, num_classes, stored_size = describe_file(train_file)
        self.batch, self.epochs = batch, epochs = cfg["batch_size"], cfg["epochs"]
        check_batch(batch, size, num_train)
        size_px = cfg["image_size"] or stored_size or 224
        self.model = model = build_model(
            cfg["model"], num_classes=num_classes, seed=cfg["seed"], rank=rank,
            working_dtype=np.float16 if cfg["precision"] == "fp16" else None)
        data = dict(rank=rank, size=size, image_size=size_px, workers=cfg["workers"],
                    prefetch=cfg["prefetch"], dtype=model.dtype, seed=cfg["seed"],
                    num_classes=num_classes, skip_bad_records=cfg["skip_bad_records"],
                    pinned=backend.xp is not np)
        self.train_data = Loader(train_file, batch, train=True, **transform, **data)
        self.val_data = Loader(val_file, batch, train=False,
                               crop_fraction=transform["crop_fraction"], **data)
        broadcast_model(model, comm)
        say(comm.describe(), flush=True)
        bn_group = syncbn.attach(model, comm, cfg["bn_group"])
        self.optimizer = make_optimizer(cfg["optimizer"], model.arena, **optimizer_options(cfg))
        self.scaler = scaler = make_scaler(cfg["loss_scale"], cfg["precision"])
        self.base_lr = scaled_lr(cfg["lr"], batch, cfg["lr_ref_batch"])
        self.steps = steps = self.train_data.steps_per_epoch
        say(f"mpitrain: {cfg['model']} ({model.num_params():,} parameters) on {train_file} "
            f"({len(self.train_data.labels)} train / {len(self.val_data.labels)} val images, "
            f"{size_px}x{size_px}), {size} rank(s) on {backend.device}, global batch {batch} "
            f"({batch // size} per rank), {steps} steps/epoch, {epochs} epochs", flush=True)
        say(f"optimizer {cfg['optimizer']}, peak lr {self.base_lr:g} ({cfg['schedule']} after "
            f"{cfg['warmup_epochs']:g} warm-up epochs), precision {cfg['precision']}, loss scale "
            f"{'dynamic from ' if scaler.dynamic else ''}{scaler.scale:g}", flush=True)

        # ----- run directory, resume -----
        self.run_dir = run_dir = open_run(cfg, comm, say)
        self.result = dict(run_dir=run_dir, stopped=None, checkpoint=None)
        self.resume(find_resume(cfg, comm))

        # ----- gradients, timing, metrics, progress, signals, watchdog -----
        self.timeline = timeline = Timeline(cfg["trace"], rank)
        if cfg["trace"]:
            timeline.trace_layer_groups(model)
        overlap = backend.xp is not np if cfg["overlap"] == "auto" else bool(cfg["overlap"])
        share_gradients(model.arena, comm, cfg["allreduce"])
        self.reducer = Reducer(model.arena, comm, cfg["fusion_threshold"], cfg["allreduce"],
                               np.float16 if cfg["comm_dtype"] == "fp16" else None, overlap,
                               timeline)
        say(f"gradients: {len(self.reducer.bounds)} bucket(s) of about "
            f"{cfg['fusion_threshold']:,} bytes, all-reduce {cfg['allreduce']}, "
            f"{cfg['comm_dtype']} on the wire, {'overlapped with' if overlap else 'after'} backward"
            + (f"; BatchNorm statistics over groups of {cfg['bn_group']} rank(s)"
               if bn_group else ""), flush=True)
        self.metrics = MetricsLog(os.path.join(run_dir, "metrics.jsonl")) if rank == 0 else None
        position = self.train_data.state_dict()
        self.first_epoch = position["epoch"]
        self.progress = StepProgress(epochs * steps, position["epoch"] * steps + position["step"],
                                     stream=sys.stdout) if rank == 0 else None
        self.log_every = cfg["log_every"] or (max(1, steps // 4) if steps >= 100 else steps)
        self.signals = StopSignals()
        if cfg["collective_timeout"]:
            self.watchdog = Watchdog(cfg["collective_timeout"], comm, activity=timeline.activity,
                                     board=os.path.join(run_dir, "heartbeat"))
            timeline.listener = self.watchdog.entered
        self.stop_on_nan = not scaler.check     # under loss scaling an overflow skips the step
        self.topk = (1, 5) if num_classes >= 5 else (1,)
        self.saved_cfg = {**cfg, "num_classes": num_classes, "image_size": size_px}
        self.saved_step = None                  # global step of the newest checkpoint written
        self.start = time.perf_counter()

    def resume(self, path):
        """Restore the run from checkpoint `path` (None: start afresh)."""
        if path is None:
            if self.cfg["resume"]:
                self.say(f"no checkpoint in {self.run_dir}: starting from the beginning", flush=True)
            return
        try:
            meta = checkpoint.restore(path, self.model, self.comm, self.optimizer, self.scaler)
        except checkpoint.CheckpointError as e:
            raise ConfigError(str(e)) from None
        saved = meta["config"].get("batch_size")
        if saved != self.batch:
            raise ConfigError(f"{path} was trained with global batch {saved}, this run has "
                              f"{self.batch}: a resumed run keeps the global batch (pass "
                              f"--batch-size {saved}; any number of ranks that divides it works)")
        self.train_data.load_state_dict({"epoch": meta["epoch"], "step": meta["step"]})
        self.result["checkpoint"] = path
        self.say(f"resumed from {path}: epoch {meta['epoch'] + 1}, step {meta['step']} "
                 f"(written by {meta['world_size']} rank(s))", flush=True)

    def beat(self, where):
        if self.watchdog:
            self.watchdog.beat(where)

    # ----- the epochs -----
    def epoch(self, epoch):
        """The steps of `epoch` from the loader's position. Returns the name of the stop
        signal when the ranks agreed to stop after a step, else None."""
        cfg, comm, data, steps = self.cfg, self.comm, self.train_data, self.steps
        self.epoch_start = self.last_log = time.perf_counter()
        self.wait_start = data.wait_time
        self.loss_sum = np.zeros(2)             # summed local losses, steps since the last log
        self.line = ""
        for s, (x, y) in enumerate(data, data.state_dict()["step"]):
            now = time.perf_counter()
            self.timeline.add("data wait", "data", now - data.last_wait, now)
            lr = learning_rate(epoch + (s + 1) / steps, self.base_lr, self.epochs,
                               cfg["warmup_epochs"], cfg["schedule"], cfg["milestones"])
            loss = train_step(self.model, self.optimizer, self.reducer, backend.xp.asarray(x),
                              backend.xp.asarray(y), lr, cfg["label_smoothing"], self.scaler,
                              self.timeline)
            global_step = epoch * steps + s + 1
            self.beat(f"step {global_step}")
            if cfg["check_replicas"] and global_step % cfg["check_replicas"] == 0:
                self.check_replicas(global_step)
            stop, diverged = comm.allmax([self.signals.received,
                                          self.stop_on_nan and not math.isfinite(loss)])
            if diverged:
                raise TrainingError(self.non_finite_message(loss, epoch, s))
            self.loss_sum += loss, 1
            if (s + 1) % self.log_every == 0 or s + 1 == steps:
                self.log_step(epoch, s, lr, global_step)
            if self.progress:
                self.progress.update(global_step, self.line if (s + 1) % self.log_every == 0
                                     and s + 1 < steps else None)
            if stop:
                return signal_name(stop)
        return None

    def log_step(self, epoch, s, lr, global_step):
        """The mean loss over the ranks and the steps since the last log: the progress text
        and a metrics.jsonl record."""
        self.comm.allreduce(self.loss_sum, "flat")
        self.result["loss"] = loss = float(self.loss_sum[0] / self.loss_sum[1])
        now = time.perf_counter()
        images_per_s = self.loss_sum[1] * self.batch / (now - self.last_log)
        phases = {k: v / self.loss_sum[1] for k, v in self.timeline.take_totals().items()}
        wait = (self.train_data.wait_time - self.wait_start) / (now - self.epoch_start)
        self.line = (f"epoch {epoch + 1}/{self.epochs}  step {s + 1}/{self.steps}  loss {loss:.4f}"
                     f"  lr {lr:.4f}  {images_per_s:,.0f} images/s  data wait {wait:.0%}")
        if self.metrics:
            self.metrics.write(dict(kind="step", epoch=epoch + 1, step=s + 1,
                                    global_step=global_step, loss=loss, lr=lr,
                                    loss_scale=self.scaler.scale if self.scaler.check else None,
                                    images_per_s=images_per_s, time=phases))
        self.loss_sum[:] = 0
        self.last_log = now

    def end_of_epoch(self, epoch):
        """BatchNorm statistics averaged and the validation set scored (every --eval-every
        epochs and after the last), a checkpoint (every --checkpoint-every epochs and after
        the last), the epoch's summary line."""
        cfg, line = self.cfg, self.line
        if (epoch + 1) % cfg["eval_every"] == 0 or epoch + 1 == self.epochs:
            with self.timeline.span("evaluate", "evaluate"):
                accuracy = self.evaluate()
            self.beat(f"evaluation after epoch {epoch + 1}")
            line += "".join(f"  val {k} {v:.2%}" for k, v in accuracy.items())
            if self.metrics:
                self.metrics.write(dict(kind="eval", epoch=epoch + 1,
                                        global_step=(epoch + 1) * self.steps, **accuracy))
        every = cfg["checkpoint_every"]
        if every and ((epoch + 1) % every == 0 or epoch + 1 == self.epochs):
            self.save_checkpoint()
            self.beat(f"checkpoint after epoch {epoch + 1}")
        self.timeline.take_totals()             # evaluation and checkpoint time is not a step's
        if self.progress:
            self.progress.line(f"{line}  ({time.perf_counter() - self.start:.1f} s)")

    def evaluate(self):
        average_buffers(self.model, self.comm)
        accuracy = evaluate(self.model, self.comm, self.val_data, self.topk)
        self.result.update(accuracy)
        return accuracy

    def save_checkpoint(self):
        """Rank 0 writes the state at the loader's position (keeping the newest
        --keep-checkpoints); every rank returns once the file is in place. Nothing is
        written twice for one position."""
        pos = self.train_data.state_dict()
        global_step = pos["epoch"] * self.steps + pos["step"]
        if global_step == self.saved_step:
            return
        with self.timeline.span("checkpoint", "checkpoint"):
            state = checkpoint.collect(self.model, self.comm, pos["epoch"], pos["step"],
                                       global_step, self.saved_cfg, self.optimizer, self.scaler)
            path = None
            if self.comm.rank == 0:
                path = checkpoint.write(os.path.join(
                    self.run_dir, checkpoint.PATTERN.format(global_step=global_step)), state)
                checkpoint.prune(self.run_dir, self.cfg["keep_checkpoints"])
            # no rank leaves before the file is complete
            self.result["checkpoint"] = self.comm.bcast(path, root=0)
        self.saved_step = global_step

    def stop(self, signal_name):
        """The ranks agreed to stop on `signal_name`: checkpoint, say how to continue."""
        self.result["stopped"] = signal_name
        self.save_checkpoint()
        pos = self.train_data.state_dict()
        self.say(f"{signal_name}: stopped at epoch {pos['epoch'] + 1}, step {pos['step']}; "
                 f"checkpoint {self.result['checkpoint']}; continue with "
                 f"--run-dir {self.run_dir} --resume auto", flush=True)

    def check_replicas(self, global_step):
        from mpitrain.comm.replicas import ReplicaMismatch, check_replicas
        try:
            check_replicas(self.model.arena, self.comm, global_step)
        except ReplicaMismatch as e:
            raise TrainingError(str(e)) from None

    def non_finite_message(self, loss, epoch, s):
        """Collective: which ranks saw a non-finite loss, and what to do."""
        bad = [r for r, b in enumerate(self.comm.allgather(not math.isfinite(loss))) if b]
        last = checkpoint.latest(self.run_dir) if self.comm.rank == 0 else None
        return (f"the training loss is not finite ({loss}) at epoch {epoch + 1}, step {s + 1} "
                f"on rank(s) {bad}: training diverged (try a lower --lr or more "
                f"--warmup-epochs). Nothing was saved after this step; the last checkpoint "
                f"is {last or 'none'}")

    def close(self, collective=True):
        """Release the run. After an error on this rank alone (collective=False) nothing
        may wait for the other ranks: the job is being aborted."""
        if self.reducer:
            if collective:
                self.reducer.close()
        if self.signals:
            self.signals.restore()
        if self.watchdog:
            self.watchdog.close()
        for loader in (self.train_data, self.val_data):
            if loader:
                loader.close()
        self.timeline.save()
        if self.metrics:
            self.metrics.close()
        if self.progress:
            self.progress.close()
        if self.comm and collective:
            self.comm.free()


def train(comm=None, log=print, **options):
    """Train with `options` (keys of DEFAULTS) on `comm` (an mpi4py communicator,
    MPI.COMM_WORLD by default).

    Returns a dict with the final validation accuracy ("top1", "top5"), the mean
    training loss since the last progress line ("loss"), the number of steps and the
    seconds taken, the run directory, the last checkpoint, and the stop signal's name
    ("stopped") when a signal ended the run early.
    """
    from mpi4py import MPI
    cfg = {**DEFAULTS, **options}
    unknown = set(cfg) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown training options: {sorted(unknown)}")
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
    result.update(steps=run.steps * run.epochs, seconds=time.perf_counter() - run.start,
                  loss_scale=scaler.scale, skipped_steps=scaler.skipped)
    top5 = f", {result['top5']:.2%} top-5" if "top5" in result else ""
    run.say(f"final validation accuracy: {result['top1']:.2%} top-1{top5} "
            f"({len(run.val_data.labels)} images, {run.epochs} epochs, "
            f"{result['seconds']:.1f} s)", flush=True)
    if scaler.check:
        run.say(f"loss scale {scaler.scale:g} at the end; {scaler.skipped} step(s) skipped on "
                f"overflow", flush=True)
    return result
