"""What a training run checks before any work, so that an option or an input that
cannot work is refused at once (ConfigError: exit status 2, a message that names the
problem and the fix), with nothing written and no rank left waiting.

    options       (each value alone: mpitrain.options.Config) the global batch against
                  the ranks (check_batch), the communication options together
                  (comm_options), what --layers plain and --precision fp64 cannot run
                  (check_layers, check_fp64)
    MPI           the thread level the run's threads need (check_threads), a world the
                  size the launcher started (check_launch)
    data          the named data sets and files (resolve_data), both files readable, of
                  this format, with the same two or more classes, images the run's
                  buffers can hold (describe_data), an image size the network takes
                  (check_image_size)
    run directory writable (prepare_run_dir), with room for a checkpoint
                  (check_free_space); a checkpoint to resume that continues this run
                  (find_resume, check_resume)

Checks that read files are made by every rank alike, or by rank 0 with the verdict
broadcast, so every rank raises the same error.
"""
import os

import numpy as np

from . import backend, checkpoint
from .files import output_problem
from .options import BY_NAME, DEFAULTS
from .precision import make_scaler

# Data sets known by name: files under data_dir, made by `convert` on first use.
# The digits are centred 32x32 glyphs: random crops and flips would only hurt.
# Fashion-MNIST's 28x28 garments likewise, as its benchmarks train them.
PRESETS = {"digits": dict(train="digits_train.h5", val="digits_val.h5", convert="convert_digits",
                          transform=dict(augment=False, crop_fraction=1.0)),
           "fashion-mnist": dict(train="fashion-mnist_train.h5", val="fashion-mnist_val.h5",
                                 convert="convert_fashion_mnist",
                                 transform=dict(augment=False, crop_fraction=1.0))}
# Anything else: random-resized-crop and flip for training, centre crop of 87.5% for validation.
TRANSFORM = dict(augment=True, crop_fraction=0.875)


class ConfigError(ValueError):
    """A training option that cannot work, found before any work is done."""


def check_batch(global_batch, world_size, num_train=None):
    """Refuse a global batch that the ranks cannot share evenly (or that exceeds the data).
    Named by its flag, --batch-size (train's and eval's), so that a refusal of a value
    from --config says so."""
    if global_batch < 1:
        raise ConfigError(f"--batch-size must be positive, got {global_batch}")
    if global_batch % world_size:
        raise ConfigError(f"--batch-size {global_batch}, the global batch, does not divide by "
                          f"the {world_size} MPI ranks; use a multiple of {world_size} "
                          f"(each rank takes batch_size / ranks images per step)")
    if num_train is not None and global_batch > num_train:
        raise ConfigError(f"--batch-size {global_batch}, the global batch, exceeds the "
                          f"{num_train} training images: an epoch would have no step")


def comm_options(cfg, world_size):
    """Refuse communication options that cannot work together (each value alone was
    checked by mpitrain.options.Config)."""
    if cfg.bn_group > world_size:
        raise ConfigError(f"--bn-group {cfg.bn_group} exceeds the {world_size} rank(s): give "
                          f"at most --bn-group {world_size}, or drop it")
    if cfg.bn_group > 1 and not has_batchnorm(cfg.model):
        raise ConfigError(f"--bn-group {cfg.bn_group} takes BatchNorm's statistics over groups "
                          f"of ranks, and {cfg.model} has no BatchNorm layer: drop --bn-group")
    check_topk_wire(cfg.compress, cfg.comm_dtype)
    if cfg.shard_update:
        # the reduce-scatter replaces the bucketed all-reduce: its options cannot apply
        for key, fix in (("comm_dtype", "drop --comm-dtype fp16"),
                         ("allreduce", "drop --allreduce"),
                         ("overlap", "drop --overlap / --no-overlap"),
                         ("fusion_threshold", "drop --fusion-threshold"),
                         ("compress", "drop --compress")):
            if getattr(cfg, key) != DEFAULTS[key]:
                raise ConfigError(f"--shard-update sums fp32 gradients with one reduce-scatter "
                                  f"after backward, so {BY_NAME[key].flag} "
                                  f"{getattr(cfg, key)} does not apply: {fix}")


def has_batchnorm(model_name):
    """Whether the network has a BatchNorm layer (its layers made, no weights)."""
    from mpitrain.nets import MODELS
    from mpitrain.nets.batchnorm import BatchNorm2d
    model = MODELS[model_name](num_classes=2)
    return any(isinstance(m, BatchNorm2d) for _, m in model.named_modules())


# options that only some values of another option use: the others would ignore them without
# a word. option: (the option that chooses, the values that use it)
USED_ONLY_WITH = {"momentum": ("optimizer", ("sgd", "lars", "neumann")),
                  "nesterov": ("optimizer", ("sgd", "lars")),
                  "lars_eta": ("optimizer", ("lars",)),
                  "lars_eps": ("optimizer", ("lars",)),
                  "poly_power": ("schedule", ("poly",)),
                  "milestones": ("schedule", ("step",)),
                  "density": ("compress", ("topk",)),
                  "compress_warmup": ("compress", ("topk",))}


def check_options_used(args):
    """Refuse an option given where the choice it belongs to is another, which would ignore
    it (USED_ONLY_WITH). args: a Config, or a command's namespace (those of its options that
    it has)."""
    given = vars(args)
    for key, (chooser, users) in USED_ONLY_WITH.items():
        if key in given and chooser in given and given[key] != DEFAULTS[key] \
                and given[chooser] not in users:
            flag, by = BY_NAME[key].flag, BY_NAME[chooser].flag
            alone = f" (or add {by} {users[0]})" if len(users) == 1 else ""
            named = ", ".join(users[:-1]) + " and " + users[-1] if len(users) > 1 else users[0]
            raise ConfigError(f"{flag} is an option of {by} {named}; "
                              f"{by} {given[chooser]} would ignore it: drop {flag}{alone}")


def refuse_options(cfg, world_size):
    """The rules between options, and the global batch against the ranks: what `train`'s
    command line checks before the run's imports (its answer in half a second, not two),
    and the run again (train() is called from Python too)."""
    check_layers(cfg)           # first: --layers plain refuses any --bn-group above 1
    check_fp64(cfg)
    comm_options(cfg, world_size)
    check_options_used(cfg)
    check_milestones(cfg)
    check_never_used(cfg)
    check_batch(cfg.batch_size, world_size)
    if cfg.trace:                       # written at the end: found unwritable before the run
        from .metrics import trace_path
        problem = output_problem(trace_path(cfg.trace, 0))
        if problem:
            raise ConfigError(f"--trace {cfg.trace}: {problem}")
    if cfg.resume not in (None, "auto") and not os.path.exists(cfg.resume):
        # before its directory, which a resume without --run-dir goes on in, is made
        raise ConfigError(f"--resume {cfg.resume}: no such checkpoint file or run directory")


def check_milestones(cfg):
    """Refuse a step schedule without milestones, or with one the run never reaches."""
    if cfg.schedule != "step":
        return
    if not cfg.milestones:
        raise ConfigError("--schedule step multiplies the learning rate by 0.1 at each of "
                          "--milestones, and none is given: add --milestones EPOCH "
                          "[EPOCH ...] (for example --milestones 30 60 80)")
    # a milestone applies from the step that reaches it: one at --epochs to the last step only
    late = [m for m in cfg.milestones if m >= cfg.epochs]
    if late:
        said = [f"{' '.join(f'{m:g}' for m in group)} {what}" for group, what in (
            ([m for m in late if m == cfg.epochs], "would apply to the run's last step only"),
            ([m for m in late if m > cfg.epochs], "would never apply")) if group]
        raise ConfigError(f"--milestones {' and '.join(said)}: the run ends after --epochs "
                          f"{cfg.epochs}; drop {'it' if len(late) == 1 else 'them'} or raise "
                          f"--epochs")


def check_never_used(cfg):
    """Refuse values that would do nothing: Nesterov momentum without momentum, dense
    sums for the whole run before top-k compression starts, and Neumann's SGD burn-in (its
    warm-up) for the whole run."""
    if cfg.nesterov and cfg.momentum == 0:
        raise ConfigError("--nesterov looks ahead along the momentum, and --momentum is 0: "
                          "drop --nesterov, or give --momentum above 0")
    if cfg.compress == "topk" and cfg.compress_warmup >= cfg.epochs:
        raise ConfigError(f"--compress-warmup {cfg.compress_warmup} keeps the sums dense for "
                          f"the whole run of --epochs {cfg.epochs}, so top-k never starts: "
                          f"lower --compress-warmup, or drop --compress topk")
    if cfg.optimizer == "neumann" and cfg.warmup_epochs >= cfg.epochs:
        raise ConfigError(f"--optimizer neumann runs plain SGD through its warm-up, and "
                          f"--warmup-epochs {cfg.warmup_epochs:g} covers the whole run of "
                          f"--epochs {cfg.epochs}, so Neumann's update never runs: lower "
                          f"--warmup-epochs, or raise --epochs")


def check_topk_wire(compress, comm_dtype):
    """--compress topk sends fp32 values (train and bench step alike)."""
    if compress == "topk" and comm_dtype != "fp32":
        raise ConfigError("--compress topk sends its values in fp32 and cannot take --comm-dtype "
                          "fp16 (the indices would stay 4 bytes and the values' rounding would "
                          "escape the residual); drop --comm-dtype fp16")


def check_fp64(cfg):
    """Refuse what --precision fp64 cannot run: it computes on the CPU."""
    if cfg.precision != "fp64":
        return
    on_cpu = "fp64 runs on the CPU, as the GPU's kernels and cuDNN plans are fp32 and fp16"
    for refused, option, why in (
            (cfg.device == "gpu", "--device gpu", on_cpu + " (--device auto runs it there)"),
            (cfg.decode != "cpu", f"--decode {cfg.decode}", on_cpu),
            (cfg.ranks_per_gpu is not None, f"--ranks-per-gpu {cfg.ranks_per_gpu}", on_cpu),
            (cfg.compress == "topk", "--compress topk", "top-k's kernels take fp32 gradients")):
        if refused:
            raise ConfigError(f"--precision fp64 cannot run with {option}: {why}; drop "
                              f"{option.split()[0]} or use --precision fp32")


def check_layers(cfg):
    """Refuse what --layers plain cannot run: the plain layers (nets/plain.py) compute in
    NumPy in the master dtype on the CPU, one eager step at a time, and each rank's
    BatchNorm normalises its own batch."""
    if cfg.layers == "fast":
        return
    for refused, option, why in (
            (cfg.precision == "fp16", f"--precision {cfg.precision}",
             "the plain layers compute in the master weights' dtype (fp32, or fp64)"),
            (cfg.device not in ("cpu", "auto"), f"--device {cfg.device}",
             "the plain layers are NumPy, on the CPU (--device auto runs them there)"),
            (cfg.decode != "cpu", f"--decode {cfg.decode}",
             "the plain layers run on the CPU, with no GPU to decode on"),
            (cfg.cuda_graph, "--cuda-graph", "the plain layers run eagerly, on the CPU"),
            (cfg.bn_group > 1, f"--bn-group {cfg.bn_group}",
             "the plain BatchNorm normalises each rank's batch alone")):
        if refused:
            raise ConfigError(f"--layers plain cannot run with {option}: {why}; drop "
                              f"{option.split()[0]} or use --layers fast")


def data_files(data, data_dir, val_data=None):
    """(training file, validation file) that --data, --data-dir and --val-data name: a
    preset's two files under data_dir, else DATA and --val-data or the converter's
    FILE_val.h5 beside it."""
    preset = PRESETS.get(data)
    if preset:
        train, val = (os.path.join(data_dir, preset[k]) for k in ("train", "val"))
        return train, val_data or val
    from mpitrain.datasets import convert
    return data, val_data or convert.val_path(data)


def run_data_files(saved):
    """(training file, validation file) of the run whose checkpoint config is `saved`, as
    found from here: its paths are as the run was given them, relative to the directory it
    started in (`start_dir`), and are taken from there where that copy exists."""
    start = saved.get("start_dir")

    def found(path):
        there = os.path.join(start, path) if start else path     # an absolute path stays
        return there if os.path.exists(there) else path
    return tuple(found(p) for p in data_files(saved["data"], saved.get("data_dir") or "data",
                                              saved.get("val_data")))


def resolve_data(cfg, comm=None, need_val=True):
    """(train file, validation file, loader transform options) for the run's --data
    (need_val=False: a missing validation file is not refused).

    A preset name (digits) means files under data_dir, converted by rank 0 of `comm`
    (None: this process alone) when missing while the other ranks wait; anything else
    is a training file. Validation: --val-data, else the preset's or the converter's
    FILE_val.h5 beside the training file.
    """
    from mpitrain.datasets import convert
    preset = PRESETS.get(cfg.data)
    train_file, val_file = data_files(cfg.data, cfg.data_dir, cfg.val_data)
    if preset:
        problem = None
        if (comm is None or comm.rank == 0) \
                and not all(map(os.path.exists, data_files(cfg.data, cfg.data_dir))):
            problem = output_problem(train_file)
            if problem:
                problem = (f"--data-dir {cfg.data_dir} cannot hold the {cfg.data} files: "
                           f"{problem}")
            else:
                print(f"mpitrain: converting {cfg.data} into {cfg.data_dir}/", flush=True)
                try:
                    getattr(convert, preset["convert"])(cfg.data_dir)
                except convert.ConvertError as e:
                    problem = str(e)
        if comm is not None:
            problem = comm.bcast(problem, root=0)   # every rank raises, none waits alone
        if problem:
            raise ConfigError(problem)
        transform = dict(preset["transform"])
        given = (("validation", val_file),) if cfg.val_data else ()    # beside the preset's
    else:
        transform = dict(TRANSFORM)
        given = (("training", train_file), ("validation", val_file))
    for what, path in given:
        if os.path.isdir(path):
            from mpitrain.datasets.h5format import a_folder
            raise ConfigError(a_folder(path))
        if not os.path.exists(path) and (need_val or what == "training"):
            named = {"training": "--data", "validation": cfg.val_data and "--val-data"}[what]
            fix = (f"check {named}, or make it with `python -m mpitrain convert ...`" if named
                   else "name one with --val-data, or make it with `python -m mpitrain "
                        "convert imagefolder ... --val-fraction F`")
            if named == "--data" and not os.path.splitext(path)[1]:    # a name, not a file
                fix += f" (the named data sets: {', '.join(PRESETS)})"
            raise ConfigError(f"{what} file {path} does not exist; {fix}")
        if what == "training":      # the file named first, before the one beside it is sought
            check_data_file(path)
    if cfg.augment is not None:
        transform["augment"] = cfg.augment
    for key in ("crop_scale", "crop_ratio"):
        if getattr(cfg, key) is not None and not transform["augment"]:
            how = "--no-augment" if cfg.augment is not None else f"the default for {cfg.data}"
            raise ConfigError(f"{BY_NAME[key].flag} shapes augmentation's training crops, and "
                              f"augmentation is off ({how}): drop {BY_NAME[key].flag} or add "
                              f"--augment")
    return train_file, val_file, {**transform, **augment_options(cfg)}


def check_validation_file(train_file, val_file):
    """Refuse a training run whose validation file is its training file: its "validation"
    accuracy would be on the images it trains on."""
    if os.path.exists(val_file) and os.path.samefile(train_file, val_file):
        raise ConfigError(f"validation file {val_file} is the training file {train_file}: "
                          f"accuracy on the images trained on is no validation; give "
                          f"--val-data a file of other images (convert imagefolder "
                          f"--val-fraction F splits one off)")


def check_data_file(path):
    """Refuse (ConfigError, with the reader's words) a file that is not one of mpitrain's
    data files."""
    from mpitrain.datasets.h5format import FormatError, Reader
    try:
        with Reader(path):
            pass
    except FormatError as e:
        raise ConfigError(str(e)) from None


def check_decode(cfg, device, files=()):
    """cfg's --decode ("cpu" or "gpu"), refused where it cannot work on `device` or on
    the data `files`."""
    if cfg.decode == "cpu":
        return "cpu"
    if device == "cpu":
        raise ConfigError("--decode gpu decodes on the GPU, and this run is on the CPU: add "
                          "--device gpu, or drop --decode gpu")
    from mpitrain.datasets.h5format import Reader
    for path in files:
        with Reader(path) as reader:
            if reader.storage != "encoded":
                raise ConfigError(f"--decode gpu decodes JPEG records, and {path} holds "
                                  f"decoded pixels (as the bundled data sets do): drop "
                                  f"--decode gpu")
    from mpitrain.datasets.batch_augment import gpu_decoder_problem
    problem = gpu_decoder_problem()
    if problem:
        raise ConfigError(problem)
    return "gpu"


def crop_fraction(saved):
    """The validation crop of a checkpoint's run (`saved`, the configuration it holds), as
    its loader took it (checks.resolve_data): its --crop-fraction, else its data preset's,
    else the default."""
    if saved.get("crop_fraction") is not None:
        return saved["crop_fraction"]
    preset = PRESETS.get(saved.get("data"))
    return (preset["transform"] if preset else TRANSFORM)["crop_fraction"]


def augment_options(cfg):
    """The loader's scale, ratio (training crops) and crop_fraction (validation) from
    --crop-scale, --crop-ratio and --crop-fraction (None: the data's own), checked."""
    from mpitrain.datasets.augment import RATIO, SCALE
    scale, ratio = cfg.crop_scale or SCALE, cfg.crop_ratio or RATIO
    fraction = cfg.crop_fraction
    if not (len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1):
        raise ConfigError(f"--crop-scale MIN MAX takes the crop's share of the image's area, "
                          f"0 < MIN <= MAX <= 1 (for example 0.08 1), got "
                          f"{' '.join(map(str, scale))}")
    if not (len(ratio) == 2 and 0 < ratio[0] <= ratio[1]):
        raise ConfigError(f"--crop-ratio MIN MAX takes the crop's width / height, 0 < MIN <= MAX "
                          f"(for example 0.75 1.333), got {' '.join(map(str, ratio))}")
    options = dict(scale=tuple(scale), ratio=tuple(ratio))
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ConfigError(f"--crop-fraction takes the centred square's share of the short "
                              f"side, in (0, 1] (for example 0.875), got {fraction}")
        options["crop_fraction"] = fraction
    return options


def describe_file(path):
    """(number of images, class names, the image size a run takes from it without
    --image-size: h5format.default_image_size) of a data file, which must hold an image
    (ConfigError otherwise)."""
    from mpitrain.datasets.h5format import Reader, default_image_size
    with Reader(path) as reader:
        check_not_empty(reader, "data file")
        return len(reader.labels), reader.class_names, default_image_size(reader)


def check_not_empty(reader, what):
    """Refuse a data file (an open h5format.Reader) without a single image."""
    if not len(reader.labels):
        raise ConfigError(f"{what} {reader.path} holds no images: convert a folder that has "
                          f"images in its class folders (or a larger --val-fraction)")


def check_threads():
    """The communication thread and the watchers call MPI while the main thread does; the
    kernels' GEMMs need the BLAS that MPITRAIN_BLAS names."""
    from mpi4py import MPI

    from mpitrain.kernels.blas_choice import blas_choice_problem
    problem = blas_choice_problem()
    if problem:
        raise ConfigError(problem)
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
                 MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise ConfigError(f"the MPI library gives thread level "
                          f"{names.get(MPI.Query_thread(), MPI.Query_thread())}; mpitrain needs "
                          f"MPI_THREAD_MULTIPLE (its communication, signal and watchdog threads "
                          f"call MPI): use an MPI built with thread support (MPICH and Open MPI "
                          f"are by default) and do not lower mpi4py.rc.thread_level")


def check_launch(world_size):
    """Refuse a world that is not what the launcher started: srun without the right --mpi
    starts N separate one-rank jobs, which would train N times into one run directory."""
    from .launcher import launched_size
    launched = launched_size()
    if launched and launched[0] != world_size:
        raise ConfigError(f"the launcher started {launched[0]} process(es) ({launched[1]}) but "
                          f"MPI sees a world of {world_size}: the MPI library does not talk to "
                          f"the launcher. Under Slurm pass srun the --mpi type of your MPI "
                          f"(--mpi=pmi2 for MPICH, --mpi=pmix for Open MPI; launch.sh does), or "
                          f"start the job with that MPI's own mpirun")


def describe_data(train_file, val_file, image_size, batch, workers, prefetch, dtype,
                  ranks_here=1):
    """(number of training images, class names, image size (`image_size`, else the
    training file's: h5format.default_image_size), the training file's
    normalisation {mean, std, pixel_max}, the bytes of a rank's loader buffers) of the
    run's two data files,
    refusing (ConfigError) files that are not this format, a single class, validation
    classes other than the training file's, and images the run's buffers cannot hold."""
    from mpitrain.datasets.h5format import (FormatError, Reader, default_image_size,
                                            white_level)
    try:
        with Reader(train_file) as train, Reader(val_file) as val:
            for what, reader in (("training", train), ("validation", val)):
                check_not_empty(reader, f"{what} file")
            names, val_names = train.class_names, val.class_names
            num_train, stored = len(train.labels), train.image_shape
            # the largest encoded record either file declares, which a worker reads whole
            largest = max((int(np.diff(r.offsets).max()) for r in (train, val)
                           if r.storage == "encoded"), default=0)
            size = image_size or default_image_size(train)
            normalise = dict(mean=train.mean.tolist(), std=train.std.tolist(),
                             pixel_max=white_level(train))
    except FormatError as e:
        raise ConfigError(str(e)) from None
    if len(names) < 2:
        raise ConfigError(f"{train_file} has {len(names)} class ({names}): a classifier needs "
                          f"two or more; convert a folder with a sub-folder per class")
    if val_names != names:
        differ = (f"{len(val_names)} classes against {len(names)}" if len(val_names) != len(names)
                  else "class {} is {!r} against {!r}".format(
                      *next((i, v, t) for i, (v, t) in enumerate(zip(val_names, names)) if v != t)))
        raise ConfigError(f"validation file {val_file} does not have the classes of training "
                          f"file {train_file} ({differ}): convert both from the same folders "
                          f"(convert imagefolder --val-fraction splits one)")
    # the loader's ring of batches, for both loaders, plus one stored record per worker, on
    # each of the `ranks_here` ranks sharing this host's memory
    need = 2 * (prefetch + 1) * batch * size * size * 3 * np.dtype(dtype).itemsize
    need += (workers + 1) * (int(np.prod(stored)) if stored else largest)
    declared = f"images of {stored}" if stored else f"records of up to {largest:,} bytes"
    refuse_beyond_memory(need, ranks_here, f"{train_file}: {size}x{size} images in batches of "
                         f"{batch} need {need / 2**30:.1f} GiB of buffers",
                         f"give a smaller --image-size or --batch-size (or check the file: it "
                         f"declares {declared})")
    return num_train, names, size, normalise, need


def agreed(comm, check, *args, **kwargs):
    """check(*args, **kwargs)'s result on every rank of `comm`; where it refuses on any rank
    (a ConfigError from a rank's own reading, such as its host's free memory), every rank
    raises the first rank's refusal, so that none is left waiting in a collective."""
    try:
        result, problem = check(*args, **kwargs), None
    except ConfigError as e:
        result, problem = None, str(e)
    first = next((p for p in comm.allgather(problem) if p is not None), None)
    if first is not None:
        raise ConfigError(first)
    return result


def refuse_beyond_memory(need, ranks_here, what, fix):
    """ConfigError where `need` bytes on each of the `ranks_here` ranks sharing this host's
    memory exceed what it has available: "`what` [on each of the N ranks of this host],
    more than the G GiB of memory available: `fix`"."""
    from mpitrain.datasets.h5format import available_memory
    have = available_memory()
    if have is not None and need * ranks_here > have:
        each = f" on each of the {ranks_here} ranks of this host" if ranks_here > 1 else ""
        raise ConfigError(f"{what}{each}, more than the {have / 2**30:.1f} GiB of memory "
                          f"available: {fix}")


def check_image_size(model, name, size, data=None):
    """Refuse an image size the network cannot take (its feature maps would vanish): one
    eval forward of a single image, before any work; returns its leaf_shapes. data: the
    file the size came from (None: --image-size gave it), which the refusal names with the
    option that changes it."""
    from mpitrain.kernels.im2col import WindowTooWide
    try:
        return leaf_shapes(model, size)
    except WindowTooWide:       # nothing else: another failure is not the size's
        smallest = next((s for s in range(size + 1, 513) if _takes(model, s)), None)
        what = f"--image-size {size}" if data is None else \
            f"{size}x{size}, the image size of {data},"
        if smallest is None:
            fix = ""
        elif data is None:
            fix = f"; the smallest size it takes is {smallest}"
        else:
            fix = f"; give --image-size {smallest} or more (the images are resized to it)"
        raise ConfigError(f"{what} is too small for {name}: its feature maps shrink to "
                          f"nothing{fix}") from None


def leaf_shapes(model, size):
    """(leaf layer, input shape, output shape) of each layer a network runs, in order, from
    one eval forward of a single size x size image."""
    from mpitrain.nets.module import run_layer
    shapes = []

    def watching(layer, phase, x, *args, **options):
        y = run_layer(layer, phase, x, *args, **options)
        if not layer.children():
            shapes.append((layer, x.shape, y.shape))
        return y
    modules = [m for _, m in model.named_modules() if "run_layer" not in vars(m)]
    for m in modules:
        m.run_layer = watching
    try:
        model.forward(backend.xp.zeros((1, size, size, 3), model.dtype), train=False)
    finally:
        for m in modules:
            del m.run_layer                     # the class's own again
    return shapes


def check_batchnorm_values(shapes, name, size, batch, ranks, group):
    """Refuse a batch and image size that leave a BatchNorm layer one value per channel in
    training, whose variance is then nothing (PyTorch refuses it too): the smallest map a
    BatchNorm normalises (`shapes`: leaf_shapes), times the images its statistics take (a
    rank's share of `batch`, times the ranks of its --bn-group: `group` consecutive ranks,
    the last group the rest)."""
    from mpitrain.nets.batchnorm import BatchNorm2d
    maps = [x[1] * x[2] for layer, x, _ in shapes if isinstance(layer, BatchNorm2d)]
    smallest_group = ranks % group or group
    if maps and batch // ranks * smallest_group * min(maps) < 2:
        share = (", or --bn-group to share the statistics across ranks" if group == 1 else
                 f", or a --bn-group that divides the {ranks} ranks" if ranks % group else "")
        raise ConfigError(
            f"--batch-size {batch} over {ranks} rank(s) gives each {batch // ranks} image(s), "
            f"and at {size}x{size} the smallest map a BatchNorm layer of {name} normalises is "
            f"{min(maps)} pixel(s): one value per channel in training, whose variance is "
            f"nothing; give a --batch-size of two images a rank or more, a larger "
            f"--image-size" + (share if ranks > 1 else ""))


def check_activations_fit(shapes, name, size, per_rank, ranks_here, itemsize, loader_bytes):
    """Refuse a step whose layers' outputs alone, which training keeps for backward, and
    the loaders' buffers (`loader_bytes` a rank) would not fit in the host's memory on its
    `ranks_here` ranks (`shapes`: leaf_shapes; at least this much: the caches, gradients
    and workspace come on top)."""
    outputs = sum(int(np.prod(y)) for _, _, y in shapes) * itemsize * per_rank
    refuse_beyond_memory(outputs + loader_bytes, ranks_here,
                         f"{name} at {size}x{size} keeps at least {outputs / 2**30:.1f} GiB of "
                         f"layer outputs for a step's {per_rank} image(s), and its loaders "
                         f"{loader_bytes / 2**30:.1f} GiB", "give a smaller --image-size or "
                         "--batch-size")


def _takes(model, size):
    from mpitrain.kernels.im2col import WindowTooWide
    try:
        model.forward(backend.xp.zeros((1, size, size, 3), model.dtype), train=False)
        return True
    except WindowTooWide:
        return False


def unlinked(path):
    """`path` with its links resolved where it passes through one (None stays None); a
    relative path stays relative."""
    if path is None or os.path.realpath(path) == os.path.abspath(path):
        return path
    real = os.path.realpath(path)
    return real if os.path.isabs(path) else os.path.relpath(real)


def prepare_run_dir(cfg, comm):
    """Choose the run directory (rank 0 decides, all ranks agree), make sure it can be
    written and take its lock (config.RunLock) before anything is written into it, and
    refuse a directory that another live job holds, or that holds an earlier run when
    this one does not --resume. Returns (run directory, the lock on rank 0, else None)."""
    from .config import RUNS, RunDirInUse, RunLock, default_run_dir
    # through a link (runs/latest): the directory it names now, as rank 0 sees it, which a
    # later run that points the link elsewhere does not move under this one
    cfg.run_dir, cfg.resume = comm.bcast(
        [unlinked(cfg.run_dir), cfg.resume if cfg.resume == "auto" else unlinked(cfg.resume)]
        if comm.rank == 0 else None, root=0)
    resume = cfg.resume
    if cfg.run_dir is None and resume not in (None, "auto"):
        # without --run-dir a resumed run goes on in the directory it continues
        cfg.run_dir = resume if os.path.isdir(resume) else os.path.dirname(os.path.abspath(resume))
    if cfg.run_dir is None and resume == "auto":
        raise ConfigError("--resume auto needs --run-dir: the directory of the run to continue")
    run_dir, problem, lock = cfg.run_dir, None, None
    if comm.rank == 0:
        try:
            if run_dir is None:
                run_dir, made = default_run_dir(), True
            else:
                made = not os.path.isdir(run_dir)
                os.makedirs(run_dir, exist_ok=True)
            if not os.access(run_dir, os.W_OK | os.X_OK):
                problem = f"--run-dir {run_dir} is not writable; choose another directory"
            else:
                lock = RunLock(run_dir, made=made)
                problem = None if resume else earlier_run(run_dir)
        except FileExistsError:
            problem = (f"--run-dir {run_dir} is a file, not a directory; choose another name"
                       if run_dir else f"{RUNS} is a file, not a directory (runs go to "
                       f"{RUNS}/<timestamp>): move it, or give a --run-dir")
        except RunDirInUse as e:
            problem = str(e)
        except OSError as e:
            where = f"--run-dir {run_dir}" if run_dir else f"{RUNS}/<timestamp>"
            problem = f"{where} cannot be created ({e.strerror}); give a --run-dir elsewhere"
    run_dir, problem = comm.bcast((run_dir, problem), root=0)
    cfg.run_dir = run_dir
    if problem:
        if lock:
            lock.release()
        raise ConfigError(problem)
    return run_dir, lock


def earlier_run(run_dir):
    """The refusal of a fresh run into `run_dir` when an earlier run's files are there
    (its metrics and checkpoints would mix with this run's), else None."""
    saved = [os.path.basename(p) for p in checkpoint.checkpoints(run_dir)[-1:]]
    found = [name for name in ("config.json", "metrics.jsonl") if
             os.path.exists(os.path.join(run_dir, name))] + saved
    if not found:
        return None
    elsewhere = "another --run-dir (without --run-dir each run gets a new runs/<timestamp>)"
    if not saved:           # --resume auto would start afresh, over the earlier records
        return (f"--run-dir {run_dir} holds an earlier run ({', '.join(found)}) with no "
                f"checkpoint to continue from: start in {elsewhere}, or with --resume auto "
                f"here, which replaces its records")
    return (f"--run-dir {run_dir} holds an earlier run ({', '.join(found)}): continue it with "
            f"--resume auto, or start afresh in {elsewhere}")


def free_space(directory):
    """Bytes an unprivileged process may still write on the file system of `directory`
    (None where it cannot be asked)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_free_space(run_dir, need, comm):
    """Refuse a run directory whose file system cannot hold one checkpoint of `need`
    bytes (rank 0 looks; every rank raises alike)."""
    problem = None
    if comm.rank == 0:
        have = free_space(run_dir)
        if have is not None and have < need:
            problem = (f"--run-dir {run_dir} has {have / 2**20:.1f} MiB free, but one "
                       f"checkpoint of this run takes about {need / 2**20:.1f} MiB: free space "
                       f"there or choose another --run-dir")
    problem = comm.bcast(problem, root=0)
    if problem:
        raise ConfigError(problem)


def find_resume(cfg, comm, say, data=None):
    """The checkpoint to resume from (rank 0 looks; None: start afresh), after checking
    that its run is this one continued (on `data`'s classes and normalisation, when
    given); refuses, before any work, one that is not."""
    if not cfg.resume:
        return None
    found = None
    if comm.rank == 0:
        skipped = []

        def passed_over(path, error):
            if isinstance(error, checkpoint.CheckpointHeld):
                over = ", and this one written over" if cfg.resume == "auto" else ""
                raise ConfigError(f"{error} (passed over, an older checkpoint would be "
                                  f"resumed{over})")
            say(f"--resume {cfg.resume}: passing over {path}: {error}", flush=True)
            skipped.append(path)
        try:
            if cfg.resume == "auto":
                found = checkpoint.latest(cfg.run_dir, passed_over)
                if found is None and skipped:
                    raise ConfigError(f"--resume auto: no checkpoint in {cfg.run_dir} reads "
                                      f"back (each one is named above), and a run started "
                                      f"afresh would write over them: move them aside to "
                                      f"start afresh, or name one with --resume FILE")
            elif os.path.isdir(cfg.resume):         # another run's directory
                found = checkpoint.latest(cfg.resume, passed_over)
                if found is None:
                    raise ConfigError(f"--resume {cfg.resume}: the run directory holds no "
                                      f"complete checkpoint; name a checkpoint file")
            else:                                   # refuse_options saw it exists
                found = cfg.resume
            if found:
                check_resume(cfg, found, checkpoint.read_config(found), data)
                check_epochs_ahead(cfg, found)
            if found == cfg.resume:                 # a file named: the newest here?
                check_no_newer(found, checkpoint.latest(cfg.run_dir), cfg.run_dir)
        except (ConfigError, checkpoint.CheckpointError) as e:
            found = ConfigError(str(e))
    found = comm.bcast(found, root=0)
    if isinstance(found, ConfigError):
        raise found
    return found


def check_epochs_ahead(cfg, path):
    """Refuse --epochs short of the epochs the checkpoint has trained: the run would
    report the model's accuracy as that of fewer epochs, and rewrite its config so."""
    done, steps = checkpoint.read_position(path)
    if (done, steps) > (cfg.epochs, 0):
        trained = f"{done} epochs" + (f" and {steps} steps" if steps else "")
        least = (f"{done} (nothing more to train)" if not steps else
                 f"{done + 1}, which finishes the epoch it stopped in,")
        raise ConfigError(f"--resume: {path} has trained {trained}, past --epochs "
                          f"{cfg.epochs}: give --epochs {least} or more")


def check_no_newer(path, newest, run_dir):
    """Refuse to resume from checkpoint `path` into a run directory whose newest complete
    checkpoint, `newest`, comes after it: the run would go on beside the later history
    it abandons, whose checkpoints --resume auto and the pruning of old ones would take
    for its own."""
    if newest is None or os.path.samefile(newest, path):
        return
    if checkpoint.read_global_step(newest) > checkpoint.read_global_step(path):
        raise ConfigError(f"--resume {path}: the run directory {run_dir} holds a later checkpoint, "
                          f"{newest}, of a run that went on from there; resume into another "
                          f"--run-dir, or move the later checkpoints out of {run_dir} first")


# what a resumed run must keep: changing them would not continue the same training
RESUME_KEEPS = {"model": "--model", "optimizer": "--optimizer", "precision": "--precision"}
# and its recipe: a resume that left out one of these flags would train on with the
# default in its place (--epochs may change: it lengthens or shortens the run)
RESUME_RECIPE = ("seed", "lr", "lr_ref_batch", "momentum", "nesterov", "weight_decay",
                 "label_smoothing", "warmup_epochs", "schedule", "poly_power", "milestones",
                 "lars_eta", "lars_eps", "loss_scale", "augment", "crop_scale", "crop_ratio",
                 "crop_fraction")


def check_resume(cfg, path, saved, data=None):
    if saved.get("batch_size", cfg.batch_size) != cfg.batch_size:
        raise ConfigError(f"{path} was trained with global batch {saved['batch_size']}, this "
                          f"run has {cfg.batch_size}: a resumed run keeps the global batch "
                          f"(pass --batch-size {saved['batch_size']}; any number of ranks that "
                          f"divides it works)")
    for key, flag in RESUME_KEEPS.items():
        if saved.get(key, getattr(cfg, key)) != getattr(cfg, key):
            raise ConfigError(f"{path} was trained with {flag} {saved[key]}, this run asks for "
                              f"{getattr(cfg, key)}: a resumed run keeps it; pass {flag} "
                              f"{saved[key]}, or start a new run in another --run-dir")
    was = {key: BY_NAME[key].convert(saved[key]) for key in RESUME_RECIPE if key in saved}
    if "loss_scale" in was:             # as given, or what its default meant: the same scaler
        old = {**DEFAULTS, **saved}
        if implied_loss_scale(was["loss_scale"], old["precision"], old["comm_dtype"]) \
                == implied_loss_scale(cfg.loss_scale, cfg.precision, cfg.comm_dtype):
            del was["loss_scale"]
    differ = [key for key, value in was.items() if value != getattr(cfg, key)]
    if differ:
        raise ConfigError(
            f"{path} was trained with {_as_given(differ, was)}, this run has "
            f"{_as_given(differ, {key: getattr(cfg, key) for key in differ})}: a resumed "
            f"run keeps its recipe; give these "
            f"options as the run had them (its config.json holds them all), or start a new "
            f"run in another --run-dir")
    _check_default_loss_scale(cfg, path, saved)
    if data is not None:
        _check_same_data(cfg, path, saved, data)


def _check_same_data(cfg, path, saved, data):
    """A resume on other data (other classes, or images of another mean and std) would
    train the model on what it has not learnt, and fail as a divergence, if at all."""
    was = saved.get("class_names")
    if was is not None and list(was) != list(data.class_names):
        differ = (f"{len(was)} classes against {len(data.class_names)}"
                  if len(was) != len(data.class_names) else
                  next(f"class {i} is {a!r} against {b!r}"
                       for i, (a, b) in enumerate(zip(was, data.class_names)) if a != b))
        problem = f"other classes ({differ})"
    elif all(key in saved for key in ("mean", "std")) and not all(
            np.allclose(saved[key], data.normalise[key]) for key in ("mean", "std")):
        problem = (f"images of another mean and std ({saved['mean']}, {saved['std']} against "
                   f"{list(data.normalise['mean'])}, {list(data.normalise['std'])})")
    else:
        return
    raise ConfigError(f"{path} was trained on --data {saved.get('data')}, and --data "
                      f"{cfg.data} holds {problem}: a resumed run keeps its data; give the "
                      f"run's --data, or start a new run in another --run-dir")


def implied_loss_scale(value, precision, comm_dtype):
    """--loss-scale as given, else the one its default means (precision.make_scaler)."""
    if value is not None:
        return value
    return "dynamic" if make_scaler(None, precision, comm_dtype).dynamic else 1.0


def _check_default_loss_scale(cfg, path, saved):
    """Left at its default, the loss scale follows --precision and --comm-dtype (fp16 on
    the wire makes it dynamic): a resume that changes the wire must not change it."""
    if saved.get("loss_scale", cfg.loss_scale) is not None or cfg.loss_scale is not None:
        return
    old = {**DEFAULTS, **saved}
    was = make_scaler(None, old["precision"], old["comm_dtype"]).dynamic
    now = make_scaler(None, cfg.precision, cfg.comm_dtype).dynamic
    if was != now:
        kind = {True: "dynamic", False: "1"}
        raise ConfigError(
            f"{path} was trained with --comm-dtype {old['comm_dtype']} and its "
            f"default loss scale, {kind[was]}; this run's --comm-dtype {cfg.comm_dtype} would "
            f"make it {kind[now]}: a resumed run keeps its loss scale; pass --comm-dtype "
            f"{old['comm_dtype']}, or start a new run in another --run-dir")


def _as_given(keys, values):
    """The options `keys` with `values` as a command line gives them ("no --flag" for
    one left out)."""
    words = []
    for key in keys:
        option, value = BY_NAME[key], values[key]
        if option.kind == "on-off" and value is not None:
            words.append(option.flag if value else "--no-" + option.flag[2:])
        elif value is None or value is False or value == ():
            words.append(f"no {option.flag}")
        elif value is True:
            words.append(option.flag)
        else:
            words.append(" ".join([option.flag, *map(str, value if isinstance(value, tuple)
                                                     else (value,))]))
    return ", ".join(words)
