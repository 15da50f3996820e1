"""The training loop, readable top to bottom (DESIGN.md section 1).

Every rank holds a full replica of the model. One step:

    batch      this rank's shard of the global batch, read, decoded and augmented
               ahead of the step by the loader's workers (mpitrain.datasets.loader)
    forward    model.forward(x, train=True)
    loss       softmax cross-entropy in fp32 (optional label smoothing)
    backward   model.backward(dlogits) writes every gradient into arena.grad
    all-reduce one MPI Allreduce(SUM) over the whole gradient arena, then / ranks
    update     SGD over the arena (mpitrain.optim), refreshing the working weights

Data comes from HDF5 files (mpitrain.datasets; `--data digits` converts the
bundled digits on first use). Every rank takes the same number of steps, so no
rank waits in a collective for one that ran out of data.
Before each evaluation the BatchNorm running statistics are averaged across
ranks; each rank then evaluates a shard of the validation set and the correct
counts are summed. Only rank 0 prints.
"""
import os
import time

import numpy as np

from . import backend
from .optim import SGD, learning_rate

# The default job: resnet_small on the digits with 2 ranks reaches >= 95% validation top-1.
DEFAULTS = dict(model="resnet_small", data="digits", val_data=None, data_dir="data",
                image_size=None, augment=None, workers=2, prefetch=2, skip_bad_records=False,
                epochs=8, batch_size=32, lr=0.1, momentum=0.9, nesterov=False,
                weight_decay=5e-4, label_smoothing=0.0, warmup_epochs=1.0, seed=0,
                device="auto", eval_every=1)

# Data sets known by name: files under data_dir, made by `convert` on first use.
# The digits are centred 32x32 glyphs: random crops and flips would only hurt.
PRESETS = {"digits": dict(train="digits_train.h5", val="digits_val.h5", convert="convert_digits",
                          transform=dict(augment=False, crop_fraction=1.0))}
# Anything else: random-resized-crop and flip for training, centre crop of 87.5% for validation.
TRANSFORM = dict(augment=True, crop_fraction=0.875)

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
def train_step(model, optimizer, comm, x, y, lr, label_smoothing=0.0):
    """Forward, loss, backward, all-reduce of the gradient arena, update.

    x: this rank's images (n, H, W, 3) in the model's working dtype, y: its labels (n,),
    with n = global batch / ranks. Returns this rank's mean loss over its images.
    Averaging the summed gradient over ranks gives the gradient of the loss averaged
    over the global batch, so the update equals a single process's on the whole batch.
    """
    from mpitrain.nets.losses import softmax_cross_entropy
    logits = model.forward(x, train=True)
    loss, dlogits = softmax_cross_entropy(logits, y, label_smoothing=label_smoothing)
    model.backward(dlogits)
    grad = model.arena.grad
    allreduce_sum(comm, grad)
    grad *= 1.0 / comm.size
    optimizer.step(lr)
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


# ----- the whole run -----
def train(comm=None, log=print, **options):
    """Train with `options` (keys of DEFAULTS) on `comm` (MPI.COMM_WORLD by default).

    Returns a dict with the final validation accuracy ("top1", "top5"), the mean
    training loss since the last progress line ("loss"), the number of steps and the
    seconds taken.
    """
    from mpi4py import MPI
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
    model = build_model(cfg["model"], num_classes=num_classes, seed=cfg["seed"])
    data = dict(rank=rank, size=size, image_size=size_px, workers=cfg["workers"],
                prefetch=cfg["prefetch"], dtype=model.dtype, seed=cfg["seed"],
                num_classes=num_classes, skip_bad_records=cfg["skip_bad_records"],
                pinned=backend.xp is not np)
    train_data = Loader(train_file, batch, train=True, **transform, **data)
    val_data = Loader(val_file, batch, train=False, crop_fraction=transform["crop_fraction"], **data)
    limit_threads(local.size)
    local.Free()
    broadcast_model(model, comm)
    optimizer = SGD(model.arena, momentum=cfg["momentum"], weight_decay=cfg["weight_decay"],
                    nesterov=cfg["nesterov"])

    steps = train_data.steps_per_epoch
    report_every = max(1, steps // 4) if steps >= 100 else steps   # a few lines in long epochs
    say(f"mpitrain: {cfg['model']} ({model.num_params():,} parameters) on {train_file} "
        f"({len(train_data.labels)} train / {len(val_data.labels)} val images, {size_px}x{size_px}), "
        f"{size} rank(s) on {backend.device}, global batch {batch} ({batch // size} per rank), "
        f"{steps} steps/epoch, {epochs} epochs", flush=True)

    start = time.perf_counter()
    topk = (1, 5) if num_classes >= 5 else (1,)
    result = {}
    for epoch in range(epochs):
        t0 = time.perf_counter()
        wait0 = train_data.wait_time
        loss_sum = np.zeros(2)                  # summed local losses, steps since last report
        for s, (x, y) in enumerate(train_data):
            lr = learning_rate(epoch + (s + 1) / steps, cfg["lr"], epochs, cfg["warmup_epochs"])
            loss_sum[0] += train_step(model, optimizer, comm, xp.asarray(x), xp.asarray(y), lr,
                                      cfg["label_smoothing"])
            loss_sum[1] += 1
            if (s + 1) % report_every == 0 or s + 1 == steps:
                allreduce_sum(comm, loss_sum)
                result["loss"] = float(loss_sum[0] / loss_sum[1])
                elapsed = time.perf_counter() - t0
                line = (f"epoch {epoch + 1}/{epochs}  step {s + 1}/{steps}  loss {result['loss']:.4f}"
                        f"  lr {lr:.4f}  {(s + 1) * batch / elapsed:,.0f} images/s"
                        f"  data wait {(train_data.wait_time - wait0) / elapsed:.0%}")
                loss_sum[:] = 0
                if s + 1 < steps:
                    say(line, flush=True)
        if (epoch + 1) % cfg["eval_every"] == 0 or epoch + 1 == epochs:
            average_buffers(model, comm)
            accuracy = evaluate(model, comm, val_data, topk)
            result.update(accuracy)
            line += "".join(f"  val {k} {v:.2%}" for k, v in accuracy.items())
        say(f"{line}  ({time.perf_counter() - start:.1f} s)", flush=True)
    train_data.close()
    val_data.close()

    result.update(steps=steps * epochs, seconds=time.perf_counter() - start)
    top5 = f", {result['top5']:.2%} top-5" if "top5" in result else ""
    say(f"final validation accuracy: {result['top1']:.2%} top-1{top5} "
        f"({len(val_data.labels)} images, {epochs} epochs, {result['seconds']:.1f} s)", flush=True)
    return result
