"""`python -m mpitrain eval`: top-1/top-5 of a checkpoint on a data file (by default its
run's validation file), distributed.

The model, its number of classes, the image size and the crop come from the
checkpoint's saved configuration. Rank 0 reads the checkpoint and broadcasts it;
the BatchNorm statistics are the mean of the saved ranks' (as in training before
an evaluation); every rank scores a shard of the file (mpitrain.train.evaluate).
The model runs in fp32 from the master weights, whatever the training precision.
"""
import os

import numpy as np

from .. import backend


class EvalError(ValueError):
    """A checkpoint and a data file that cannot be evaluated together."""


def evaluate_checkpoint(path, data=None, batch_size=None, workers=2, device="auto", comm=None,
                        image_size=None, data_dir=None, skip_bad_records=None):
    """{"top1", "top5" (5 classes or more), "loss" (mean cross-entropy), "images",
    "image_size", "data", ...} of checkpoint `path` on file `data` (a named data set: its
    validation file under `data_dir`, None: the run's; data None: its run's validation
    file), at `image_size` (None: the checkpoint's), leaving out records that fail to
    decode where `skip_bad_records` (None: as the checkpoint's run did);
    mpitrain.train.evaluate says the rest."""
    from mpi4py import MPI
    from mpitrain.comm import Communicator
    comm = Communicator(comm or MPI.COMM_WORLD)
    result = _evaluate(comm, path, data, batch_size, workers, device, image_size, data_dir,
                       skip_bad_records)
    comm.free()         # collective: not after an error, which may be one rank's alone
    return result


def _evaluate(comm, path, data, batch_size, workers, device, image_size, data_dir,
              skip_bad_records):
    from mpitrain.datasets.h5format import FormatError
    from mpitrain.datasets.loader import Loader
    from mpitrain.nets import build_model

    from .. import checkpoint
    from ..checks import (ConfigError, check_batch, check_image_size, crop_fraction,
                          describe_file)
    from ..train import average_buffers, evaluate, limit_threads
    limit_threads(comm)                 # the host's cores shared among its ranks, as train's
    info = None
    if comm.rank == 0:
        try:
            cfg = checkpoint.read_config(path)
            data = scored_file(cfg, data, data_dir)
            info = (cfg, data, describe_file(data))
        except (checkpoint.CheckpointError, FormatError, ConfigError, EvalError) as e:
            info = str(e)
        except OSError as e:
            info = f"cannot read data file {data}: {e}"
    info = comm.bcast(info, root=0)
    if isinstance(info, str):
        raise EvalError(info)
    cfg, data, (num_images, names, stored_size) = info
    classes = cfg.get("num_classes")
    if classes != len(names):
        raise EvalError(f"{data} has {len(names)} classes, but the checkpoint's model "
                        f"{cfg['model']} was trained on {classes}: not the same label set")
    trained = cfg.get("class_names")        # None: a checkpoint without names, not compared
    if trained is not None and trained != names:
        i = next(i for i, (a, b) in enumerate(zip(trained, names)) if a != b)
        raise EvalError(f"{data}'s class {i} is {names[i]!r}, the checkpoint's model learnt "
                        f"{trained[i]!r} there: not the same label set")
    # the training batch by default, rounded up to divide by this job's ranks (the scores
    # do not depend on the batch)
    batch = batch_size or -(-cfg["batch_size"] // comm.size) * comm.size
    try:
        check_batch(batch, comm.size)
    except ConfigError as e:
        raise EvalError(str(e)) from None

    try:
        backend.use_device(device, comm.host_rank, comm.host_size)
    except backend.DeviceError as e:
        raise EvalError(str(e)) from None
    model = build_model(cfg["model"], num_classes=classes, seed=0)
    size_px = image_size or cfg.get("image_size") or stored_size
    try:                # as train refuses it: the feature maps would vanish in a layer
        check_image_size(model, cfg["model"], size_px, data=None if image_size else
                         path if cfg.get("image_size") else data)
    except ConfigError as e:
        raise EvalError(str(e)) from None
    try:
        checkpoint.restore(path, model, comm)
    except checkpoint.CheckpointError as e:
        raise EvalError(str(e)) from None
    average_buffers(model, comm)
    crop = crop_fraction(cfg)
    # the normalisation the model was trained with (a checkpoint without it: the file's)
    normalise = {key: cfg[key] for key in ("mean", "std", "pixel_max") if key in cfg} \
        if "mean" in cfg and "std" in cfg else None
    with Loader(data, batch, rank=comm.rank, size=comm.size, train=False, image_size=size_px,
                workers=workers, dtype=np.float32, num_classes=classes, crop_fraction=crop,
                pinned=backend.xp is not np, normalise=normalise,
                skip_bad_records=cfg.get("skip_bad_records", False) if skip_bad_records is None
                else skip_bad_records) as loader:
        result = evaluate(model, comm, loader, (1, 5) if classes >= 5 else (1,))
    result.update(images=num_images, image_size=size_px, data=data)
    return result


def scored_file(cfg, data, data_dir):
    """The file eval scores: --data FILE as given; a named data set's validation file
    (--data NAME, or no --data after a run on NAME with --data-dir), under --data-dir or
    else the run's --data-dir as found from here; without either option, the run's
    validation file. A named set's missing file is refused with the command that makes
    it, and --data-dir where no named set is scored."""
    from ..checks import PRESETS, data_files, run_data_files
    if data is None and data_dir is None:
        return run_validation_file(cfg)
    name = cfg["data"] if data is None else data
    if name not in PRESETS:
        if data_dir is not None:
            raise EvalError(f"--data-dir is where a named data set's files are "
                            f"({', '.join(PRESETS)}); {name} is a file"
                            f"{' (the run trained on it)' if data is None else ''}: drop "
                            f"--data-dir")
        return data
    val = (data_files(name, data_dir)[1] if data_dir is not None
           else run_data_files(dict(cfg, data=name, val_data=None))[1])
    if not os.path.exists(val):
        folder = os.path.dirname(val)
        raise EvalError(f"the validation file of {name}, {val}, does not exist: make it with "
                        f"`python -m mpitrain convert {name} {folder}`, or give --data-dir "
                        f"where it is")
    return val


def run_validation_file(cfg):
    """The validation file of the run that saved config `cfg` (checks.run_data_files),
    refused where it is found neither where the run started nor here."""
    from ..checks import run_data_files
    val = run_data_files(cfg)[1]
    if not os.path.exists(val):
        where = (f"neither in {cfg['start_dir']}, where the run started, nor here"
                 if cfg.get("start_dir") else "not here (its paths are relative to where it ran)")
        raise EvalError(f"the checkpoint's run validated on {val}, which is {where}: name a "
                        f"data file with --data FILE")
    return val
