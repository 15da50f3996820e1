"""The training loop, readable top to bottom (DESIGN.md section 1).

Every rank holds a full replica of the model. One step:

    batch      this rank's shard of the global batch, read, decoded and augmented
               ahead of the step by the loader's workers (mpitrain.datasets.loader)
    forward    model.forward(x, train=True)
    loss       softmax cross-entropy in fp32 (optional label smoothing)
    backward   model.backward(dlogits) writes every gradient into arena.grad
    all-reduce the gradient arena summed in fusion buckets (slices of it) by a communication
               thread while backward still runs (mpitrain.comm.buckets); 1 / ranks is
               folded into the update's unscale
    overflow   under loss scaling: one flag (inf/NaN anywhere), agreed by all ranks;
               an overflowing step is skipped everywhere (mpitrain.precision)
    update     SGD / LARS / LAMB over the arena (mpitrain.optim), one fused kernel that
               unscales, updates the fp32 master and refreshes the (fp16) working weights

Data comes from HDF5 files (mpitrain.datasets; `--data digits` converts the
bundled digits on first use). Every rank takes the same number of steps, so no
rank waits in a collective for one that ran out of data.
Before each evaluation the BatchNorm running statistics are averaged across
ranks; each rank then evaluates a shard of the validation set and the correct
counts are summed. Only rank 0 prints.
"""
import contextlib
import math
import os
import sys
import time

import numpy as np

from . import backend, checkpoint
from .metrics import MetricsLog, StepProgress, Timeline, Watchdog
from .optim import learning_rate, make_optimizer, scaled_lr
from .precision import LossScaler, found_overflow, make_scaler

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
        comm.Barrier()
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


# ----- collectives over the arenas -----
def allreduce_sum(comm, buf):
    """Sum a flat array over all ranks, in place. Host arrays go to MPI directly; a GPU
    array is staged through host memory (the MPI wheel is not CUDA-aware; the NCCL
    path belongs to mpitrain.comm)."""
    from mpi4py import MPI
    if isinstance(buf, np.ndarray):
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    else:
        host = backend.to_numpy(buf)
        comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        buf[...] = backend.array_module(buf).asarray(host)


def broadcast_from_root(comm, buf):
    """Overwrite a flat array with rank 0's copy, in place."""
    if isinstance(buf, np.ndarray):
        comm.Bcast(buf, root=0)
    else:
        host = backend.to_numpy(buf)
        comm.Bcast(host, root=0)
        buf[...] = backend.array_module(buf).asarray(host)


def broadcast_model(model, comm):
    """Start every replica from rank 0's master weights and buffers."""
    broadcast_from_root(comm, model.arena.master)
    model.arena.sync_working()
    if model.buffer_arena.size:
        broadcast_from_root(comm, model.buffer_arena.data)


def average_buffers(model, comm):
    """Average the BatchNorm running statistics of all replicas (before evaluation)."""
    if model.buffer_arena.size:
        allreduce_sum(comm, model.buffer_arena.data)
        model.buffer_arena.data *= 1.0 / comm.size


# ----- one step -----
def train_step(model, optimizer, comm, x, y, lr, label_smoothing=0.0, scaler=None,
               timeline=NO_TIMELINE, reducer=None):
    """Forward, loss, backward, all-reduce of the gradient arena, overflow check, update.

    x: this rank's images (n, H, W, 3) in the model's working dtype, y: its labels (n,),
    with n = global batch / ranks. Returns this rank's mean loss over its images.
    Averaging the summed gradient over ranks gives the gradient of the loss averaged
    over the global batch, so the update equals a single process's on the whole batch.
    scaler: a precision.LossScaler (None: no scaling, no overflow check). dlogits are
    multiplied by its scale before backward; a step whose gradient overflowed on any
    rank is skipped on every rank (scaler.skipped counts them).
    timeline (mpitrain.metrics.Timeline) times each phase.
    reducer: an mpitrain.comm.buckets.Reducer of this model, which sums the gradient
    buckets while backward runs ("comm" then times only the wait after backward); None:
    one all-reduce of the whole arena after backward.
    """
    from mpitrain.nets.losses import softmax_cross_entropy
    scaler = scaler or LossScaler(1.0)
    with timeline.span("forward", "forward"):
        logits = model.forward(x, train=True)
        loss, dlogits = softmax_cross_entropy(logits, y, label_smoothing=label_smoothing,
                                              scale=scaler.scale)
    if reducer is not None:
        reducer.begin()
    # under loss scaling an overflow is expected now and then: it is found and the step
    # skipped below, so NumPy's warnings about it would only be noise
    quiet = np.errstate(over="ignore", invalid="ignore") if scaler.check else contextlib.nullcontext()
    with timeline.span("backward", "backward"), quiet:
        model.backward(dlogits)
    grad = model.arena.grad
    with timeline.span("all-reduce", "comm"):
        if reducer is not None:
            reducer.finish()
        else:
            allreduce_sum(comm, grad)
    overflow = scaler.check and found_overflow(grad, comm)
    inv_scale = 1.0 / (scaler.scale * comm.size)   # unscale and average over ranks, in the kernel
    if scaler.update(overflow):
        with timeline.span("update", "update"):
            optimizer.step(lr, inv_scale=inv_scale)
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
    allreduce_sum(comm, counts)
    return {f"top{k}": float(counts[i] / counts[-1]) for i, k in enumerate(topk)}


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


# ----- the whole run -----
# ----- the run around the loop (run directory, resume, checkpoints, stopping) -----
class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss in fp32); raised on every rank alike."""


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
    comm.Barrier()
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


def save_checkpoint(run_dir, cfg, model, comm, optimizer, scaler, loader, keep, timeline):
    """Rank 0 writes the state at the loader's position to run_dir (keeping the newest
    `keep`); every rank returns the path once the file is in place."""
    pos = loader.state_dict()
    global_step = pos["epoch"] * loader.steps_per_epoch + pos["step"]
    with timeline.span("checkpoint", "checkpoint"):
        state = checkpoint.collect(model, comm, pos["epoch"], pos["step"], global_step, cfg,
                                   optimizer, scaler)
        path = None
        if comm.rank == 0:
            path = checkpoint.write(
                os.path.join(run_dir, checkpoint.PATTERN.format(global_step=global_step)), state)
            checkpoint.prune(run_dir, keep)
        return comm.bcast(path, root=0)     # no rank leaves before the file is complete


def non_finite_message(comm, loss, epoch, s, run_dir):
    """Collective: which ranks saw a non-finite loss, and what to do."""
    bad = [r for r, b in enumerate(comm.allgather(not math.isfinite(loss))) if b]
    last = checkpoint.latest(run_dir) if comm.rank == 0 else None
    return (f"the training loss is not finite ({loss}) at epoch {epoch + 1}, step {s + 1} on "
            f"rank(s) {bad}: training diverged (try a lower --lr or more --warmup-epochs). "
            f"Nothing was saved after this step; the last checkpoint is "
            f"{last or 'none'}")


def signal_name(signum):
    import signal
    return signal.Signals(int(signum)).name


def train(comm=None, log=print, **options):
    """Train with `options` (keys of DEFAULTS) on `comm` (MPI.COMM_WORLD by default).

    Returns a dict with the final validation accuracy ("top1", "top5"), the mean
    training loss since the last progress line ("loss"), the number of steps and the
    seconds taken.
    """
    from mpi4py import MPI
    from mpitrain.comm import Communicator, syncbn
    from mpitrain.comm.buckets import Reducer
    from mpitrain.comm.replicas import ReplicaMismatch, check_replicas
    from mpitrain.datasets.loader import Loader
    from mpitrain.nets import build_model

    cfg = {**DEFAULTS, **options}
    unknown = set(cfg) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown training options: {sorted(unknown)}")
    comm = comm or MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    check_batch(cfg["batch_size"], size)
    say = log if rank == 0 else (lambda *a, **k: None)

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    backend.use_device(cfg["device"], local.rank, local.size)
    xp = backend.xp

    train_file, val_file, transform = resolve_data(cfg, comm)
    num_train, num_classes, stored_size = describe_file(train_file)
    check_batch(cfg["batch_size"], size, num_train)
    size_px = cfg["image_size"] or stored_size or 224
    batch, epochs = cfg["batch_size"], cfg["epochs"]
    if cfg["precision"] not in ("fp32", "fp16"):
        raise ConfigError(f"unknown precision {cfg['precision']!r}; choose fp32 or fp16")
    model = build_model(cfg["model"], num_classes=num_classes, seed=cfg["seed"],
                        working_dtype=np.float16 if cfg["precision"] == "fp16" else None)
    data = dict(rank=rank, size=size, image_size=size_px, workers=cfg["workers"],
                prefetch=cfg["prefetch"], dtype=model.dtype, seed=cfg["seed"],
                num_classes=num_classes, skip_bad_records=cfg["skip_bad_records"],
                pinned=backend.xp is not np)
    train_data = Loader(train_file, batch, train=True, **transform, **data)
    val_data = Loader(val_file, batch, train=False, crop_fraction=transform["crop_fraction"], **data)
    limit_threads(local.size)
    local.Free()
    broadcast_model(model, comm)
    comm_options(cfg, size)
    communicator = Communicator(comm, cfg["ranks_per_node"])
    say(communicator.describe(), flush=True)
    bn_group = syncbn.attach(model, comm, cfg["bn_group"])
    optimizer = make_optimizer(cfg["optimizer"], model.arena, **optimizer_options(cfg))
    scaler = make_scaler(cfg["loss_scale"], cfg["precision"])
    base_lr = scaled_lr(cfg["lr"], batch, cfg["lr_ref_batch"])

    steps = train_data.steps_per_epoch
    say(f"mpitrain: {cfg['model']} ({model.num_params():,} parameters) on {train_file} "
        f"({len(train_data.labels)} train / {len(val_data.labels)} val images, {size_px}x{size_px}), "
        f"{size} rank(s) on {backend.device}, global batch {batch} ({batch // size} per rank), "
        f"{steps} steps/epoch, {epochs} epochs", flush=True)
    say(f"optimizer {cfg['optimizer']}, peak lr {base_lr:g} ({cfg['schedule']} after "
        f"{cfg['warmup_epochs']:g} warm-up epochs), precision {cfg['precision']}, loss scale "
        f"{'dynamic from ' if scaler.dynamic else ''}{scaler.scale:g}", flush=True)

    # ----- the run around the loop: directory, report, resume, metrics, signals -----
    run_dir = open_run(cfg, comm, say)
    resume_from = find_resume(cfg, comm)
    if resume_from:
        try:
            meta = checkpoint.restore(resume_from, model, comm, optimizer, scaler)
        except checkpoint.CheckpointError as e:
            raise ConfigError(str(e)) from None
        if meta["config"].get("batch_size") != batch:
            raise ConfigError(f"{resume_from} was trained with global batch "
                              f"{meta['config'].get('batch_size')}, this run has {batch}: a resumed "
                              f"run keeps the global batch (pass --batch-size "
                              f"{meta['config'].get('batch_size')}; any number of ranks that "
                              f"divides it works)")
        train_data.load_state_dict({"epoch": meta["epoch"], "step": meta["step"]})
        say(f"resumed from {resume_from}: epoch {meta['epoch'] + 1}, step {meta['step']} "
            f"(written by {meta['world_size']} rank(s))", flush=True)
    elif cfg["resume"]:
        say(f"no checkpoint in {run_dir}: starting from the beginning", flush=True)

    timeline = Timeline(cfg["trace"], rank)
    if cfg["trace"]:
        timeline.trace_layer_groups(model)
    overlap = backend.xp is not np if cfg["overlap"] == "auto" else bool(cfg["overlap"])
    reducer = Reducer(model, communicator, cfg["fusion_threshold"], cfg["allreduce"],
                      np.float16 if cfg["comm_dtype"] == "fp16" else None, overlap, timeline)
    say(f"gradients: {len(reducer.bounds)} bucket(s) of about {cfg['fusion_threshold']:,} bytes, "
        f"all-reduce {cfg['allreduce']}, {cfg['comm_dtype']} on the wire, "
        f"{'overlapped with' if overlap else 'after'} backward"
        + (f"; BatchNorm statistics over groups of {cfg['bn_group']} rank(s)"
           if bn_group else ""), flush=True)
    metrics = MetricsLog(os.path.join(run_dir, "metrics.jsonl")) if rank == 0 else None
    position = train_data.state_dict()
    progress = StepProgress(epochs * steps, position["epoch"] * steps + position["step"],
                            stream=sys.stdout) if rank == 0 else None
    log_every = cfg["log_every"] or (max(1, steps // 4) if steps >= 100 else steps)
    signals = checkpoint.StopSignals()
    watchdog = Watchdog(cfg["collective_timeout"], comm, activity=timeline.activity,
                        board=os.path.join(run_dir, "heartbeat")) \
        if cfg["collective_timeout"] else None
    if watchdog:
        timeline.listener = watchdog.entered
    beat = watchdog.beat if watchdog else (lambda where: None)
    flags = np.zeros(2, np.int64)               # signal received, non-finite loss: agreed by MAX
    stop_on_nan = not scaler.check              # under loss scaling an overflow skips the step
    save = dict(run_dir=run_dir, cfg={**cfg, "num_classes": num_classes, "image_size": size_px},
                model=model, comm=comm, optimizer=optimizer,
                scaler=scaler, loader=train_data, keep=cfg["keep_checkpoints"], timeline=timeline)

    start = time.perf_counter()
    topk = (1, 5) if num_classes >= 5 else (1,)
    result = dict(run_dir=run_dir, stopped=None, checkpoint=resume_from)
    try:
        for epoch in range(position["epoch"], epochs):
            t0 = tlog = time.perf_counter()
            wait0 = train_data.wait_time
            first = train_data.state_dict()["step"]
            loss_sum = np.zeros(2)              # summed local losses, steps since last report
            line = ""
            for s, (x, y) in enumerate(train_data, first):
                now = time.perf_counter()
                timeline.add("data wait", "data", now - train_data.last_wait, now)
                lr = learning_rate(epoch + (s + 1) / steps, base_lr, epochs, cfg["warmup_epochs"],
                                   cfg["schedule"], cfg["milestones"])
                loss = train_step(model, optimizer, comm, xp.asarray(x), xp.asarray(y), lr,
                                  cfg["label_smoothing"], scaler, timeline, reducer)
                global_step = epoch * steps + s + 1
                beat(f"step {global_step}")
                if cfg["check_replicas"] and global_step % cfg["check_replicas"] == 0:
                    try:
                        check_replicas(model.arena, comm, global_step)
                    except ReplicaMismatch as e:
                        raise TrainingError(str(e)) from None
                flags[:] = signals.received, stop_on_nan and not math.isfinite(loss)
                comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
                if flags[1]:
                    raise TrainingError(non_finite_message(comm, loss, epoch, s, run_dir))
                loss_sum += loss, 1
                if (s + 1) % log_every == 0 or s + 1 == steps:
                    allreduce_sum(comm, loss_sum)
                    result["loss"] = float(loss_sum[0] / loss_sum[1])
                    now = time.perf_counter()
                    images_per_s = loss_sum[1] * batch / (now - tlog)
                    phases = {k: v / loss_sum[1] for k, v in timeline.take_totals().items()}
                    line = (f"epoch {epoch + 1}/{epochs}  step {s + 1}/{steps}  loss {result['loss']:.4f}"
                            f"  lr {lr:.4f}  {images_per_s:,.0f} images/s"
                            f"  data wait {(train_data.wait_time - wait0) / (now - t0):.0%}")
                    if metrics:
                        metrics.write(dict(kind="step", epoch=epoch + 1, step=s + 1,
                                           global_step=global_step, loss=result["loss"], lr=lr,
                                           loss_scale=scaler.scale if scaler.check else None,
                                           images_per_s=images_per_s, time=phases))
                    loss_sum[:] = 0
                    tlog = now
                    if progress and progress.tty:
                        progress.update(global_step, line)
                    elif s + 1 < steps:
                        say(line, flush=True)
                if flags[0]:
                    result["stopped"] = signal_name(flags[0])
                    result["checkpoint"] = save_checkpoint(**save)
                    say(f"{result['stopped']}: stopped at epoch {epoch + 1}, step {s + 1}; "
                        f"checkpoint {result['checkpoint']}; continue with "
                        f"--run-dir {run_dir} --resume auto", flush=True)
                    return result
            if (epoch + 1) % cfg["eval_every"] == 0 or epoch + 1 == epochs:
                with timeline.span("evaluate", "evaluate"):
                    average_buffers(model, comm)
                    accuracy = evaluate(model, comm, val_data, topk)
                beat(f"evaluation after epoch {epoch + 1}")
                result.update(accuracy)
                line += "".join(f"  val {k} {v:.2%}" for k, v in accuracy.items())
                if metrics:
                    metrics.write(dict(kind="eval", epoch=epoch + 1,
                                       global_step=(epoch + 1) * steps, **accuracy))
            every = cfg["checkpoint_every"]
            if every and ((epoch + 1) % every == 0 or epoch + 1 == epochs):
                result["checkpoint"] = save_checkpoint(**save)
                beat(f"checkpoint after epoch {epoch + 1}")
            timeline.take_totals()              # evaluation and checkpoint time is not a step's
            if progress and progress.tty:
                progress.line(f"{line}  ({time.perf_counter() - start:.1f} s)")
            else:
                say(f"{line}  ({time.perf_counter() - start:.1f} s)", flush=True)
        if "top1" not in result:               # resumed from the end of the last epoch
            average_buffers(model, comm)
            result.update(evaluate(model, comm, val_data, topk))
    finally:
        reducer.close()
        signals.restore()
        if watchdog:
            watchdog.close()
        train_data.close()
        val_data.close()
        timeline.save()
        if metrics:
            metrics.close()

    result.update(steps=steps * epochs, seconds=time.perf_counter() - start,
                  loss_scale=scaler.scale, skipped_steps=scaler.skipped)
    top5 = f", {result['top5']:.2%} top-5" if "top5" in result else ""
    say(f"final validation accuracy: {result['top1']:.2%} top-1{top5} "
        f"({len(val_data.labels)} images, {epochs} epochs, {result['seconds']:.1f} s)", flush=True)
    if scaler.check:
        say(f"loss scale {scaler.scale:g} at the end; {scaler.skipped} step(s) skipped on "
            f"overflow", flush=True)
    return result
