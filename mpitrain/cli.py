"""`python -m mpitrain <command>`: convert, preview, train, plot, eval, predict, export,
inspect, simulate, study, bench, check-gpu (listed by --help in this order: a first hour's).

Bad values are refused by argparse before any work starts: exit status 2 and one
line, the reason, last (the usage is --help's; an unknown option gets the nearest
known names, and no option is taken from an abbreviation). MPI is started only by
the command that needs it, so `--help` needs no launcher and `bench step
--native-openblas` can replace itself (execve) with a changed environment.
"""
import argparse
import errno
import json
import os
import re
import signal
import sys
import time
import traceback

from .argtypes import (OnOff, class_count, comma_list, density, fraction, metavar,
                       nonnegative_float, nonnegative_int, number, path, positive_float,
                       positive_int, workers)
from .options import BY_NAME, DEFAULTS, IMAGE_SIZE, add_arguments

REFUSAL_GRACE = 1.0     # seconds the other ranks wait before exiting on a refusal


ON_OFF = {True: "on", False: "off"}     # the default of an --X/--no-X option, in its help


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help where the default says something: not for a
    flag (except on or off for --X/--no-X), an option without one (None, or an empty list),
    or a help that words its own; a number's value named N (a count) or X (a real number)
    where the option names none."""

    def _get_default_metavar_for_optional(self, action):
        return metavar(action.type, action.dest)

    def _get_help_string(self, action):
        if isinstance(action, OnOff) and action.help and action.default is not None \
                and "default" not in action.help:
            return f"{action.help} (default: {ON_OFF.get(action.default, action.default)})"
        if not action.help or action.nargs == 0 or action.default in (None, ()) \
                or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, saying a bad command line once and last: under mpirun every rank parses
    it, and only the launcher's rank 0 prints the message (all exit with status 2, the
    others a REFUSAL_GRACE later, so that no launcher ends rank 0 before it has said why). The
    message is one line, `PROG: error: REASON`, the last thing printed, without the usage
    (that is --help's); an option is never taken from an abbreviation of its name, and an
    unknown one is answered with the nearest known names."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)    # --epoch is not --epochs
        kwargs.setdefault("formatter_class", Help)
        super().__init__(*args, **kwargs)

    def print_help(self, file=None):
        """--help, said once: by rank 0 alone under mpirun, as an error is."""
        from mpitrain.launcher import launched_rank
        if launched_rank() == 0:
            super().print_help(file)

    def error(self, message):
        from mpitrain.launcher import launched_rank
        if message.startswith("the following arguments are required"):
            message += "".join(f"; {arg} was given without its option: {hint}"
                               for arg, hint in self.hints(self.loose()))
        if launched_rank() == 0:
            self.exit(2, f"{self.prog}: error: {message}\n")
        # a launcher that ends the job at its first bad exit (srun --kill-on-bad-exit,
        # Open MPI) would otherwise end rank 0 before its message is out
        time.sleep(REFUSAL_GRACE)
        self.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        """Unknown options are refused by the command that was given them, which knows
        the names to suggest."""
        self.given = sys.argv[1:] if args is None else list(args)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:
            self.error(self.unrecognized(extras))
        return namespace, extras

    def unrecognized(self, extras):
        for arg, hint in self.hints(extras):
            what = "option" if arg.startswith("-") else "argument"
            return f"unrecognized {what} {arg.split('=', 1)[0]}: {hint} (--help lists the options)"
        return f"unrecognized arguments: {' '.join(extras)} (--help lists the options)"

    def loose(self):
        """The words given to this parser that are neither an option nor an option's value."""
        takes_value = {s for s, a in self._option_string_actions.items() if a.nargs != 0}
        given = getattr(self, "given", [])
        return [w for i, w in enumerate(given) if not w.startswith("-")
                and (i == 0 or given[i - 1] not in takes_value)]

    def hints(self, words):
        """(word, "did you mean ...?") for each of `words` that is near an option's name, a
        choice of an option (`inspect resnet50` for `inspect --model resnet50`), or a path
        of the kind an option takes (`eval runs/X` for `eval --checkpoint runs/X`)."""
        import difflib
        known = [s for s in self._option_string_actions if s.startswith("--")]
        for word in words:
            name = word.split("=", 1)[0]
            if name.startswith("-"):
                near = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
            else:
                near = [a.option_strings[-1] + " " + word for a in self._actions
                        if a.option_strings and a.choices and word in a.choices]
                near += [option + " " + word for option, kind in PATH_OPTIONS
                         if option in known and kind(word)]
            if near:
                yield word, f"did you mean {' or '.join(near[:2])}?"


def is_checkpoint(path):
    """A run directory or a checkpoint file, by its name."""
    return os.path.isdir(path) or (os.path.isfile(path)
                                   and os.path.basename(path).startswith("checkpoint-"))


# options whose value is a path, and the paths each takes: what a path given without its
# option was meant for
PATH_OPTIONS = (("--checkpoint", is_checkpoint),
                ("--data", lambda path: os.path.isfile(path) and not is_checkpoint(path)))


# ----- the commands and their options: one add_* function a command -----

# the checkpoint of eval, predict and export
CHECKPOINT = "a checkpoint-*.h5 file, or a run directory (its newest complete checkpoint)"

# export and predict --data
STAND_IN = ("the training data file (or its validation file) for mean, std and class "
            "names, when it is not where the checkpoint's config says")

# the names --model takes
MODELS = BY_NAME["model"].choices

# predict --tolerance: mpitrain.tools.onnx_predict.TOLERANCE, which is not imported (NumPy would be)
ONNX_TOLERANCE = 1e-3


class Version(argparse.Action):
    """--version: mpitrain's, its checkout's and its libraries' (config.versions), said once
    under mpirun, as --help is."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from mpitrain.config import versions
        from mpitrain.launcher import launched_rank
        if launched_rank() == 0:
            print(versions())
        parser.exit()


def build_parser():
    parser = Parser(
        prog="python -m mpitrain",
        description="Parameter-server-free MPI data-parallel training of convolutional networks.")
    parser.add_argument("--version", action=Version,
                        help="print mpitrain's version (and its checkout's commit), Python's "
                             "and its libraries', and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for add in (add_convert, add_preview, add_train, add_plot, add_eval, add_predict,
                add_export, add_inspect, add_simulate, add_study, add_bench, add_check_gpu):
        add(commands)
    return parser


def add_train(commands):
    """`train`: every option of mpitrain/options.py, and --config."""
    train = commands.add_parser(
        "train", help="train a network (launch under mpirun/srun for several ranks)",
        description="Train a network data-parallel: every MPI rank holds a replica, gradients "
                    "are summed with one all-reduce per step. Run under mpirun -np N or srun.")
    add_arguments(train)                        # every option of mpitrain/options.py
    train.add_argument("--config", type=path, metavar="YAML",
                       help="a YAML file of train options (keys as the flags, dashes or "
                            "underscores); flags given on the command line override it")
    train.set_defaults(command_parser=train)     # for errors found after parsing


def add_inspect(commands):
    """`inspect`: the table of a network's layers (mpitrain/tools/inspect.py)."""
    inspect = commands.add_parser(
        "inspect", help="table of layers: output shape, parameters, multiply-adds",
        description="Print every layer of a network with its output shape, parameters and "
                    "forward multiply-adds, and the totals. The number of classes (and so "
                    "of parameters) is the data's with --data, as train builds the model.")
    inspect.add_argument("--model", choices=MODELS,
                         help=f"default: with --data, train's ({DEFAULTS['model']}: the network "
                              f"`train --data` builds), else resnet50")
    inspect.add_argument("--data", type=path, metavar="FILE|digits|fashion-mnist",
                         help="take the classes and the image size from this training file, "
                              "or 'digits' or 'fashion-mnist'")
    inspect.add_argument("--data-dir", type=path, default=DEFAULTS["data_dir"], metavar="DIR",
                         help="where named data sets are converted to")
    inspect.add_argument("--image-size", type=positive_int, metavar="PX",
                         help="default: the data's with --data, else 224")
    inspect.add_argument("--num-classes", type=class_count,
                         help="default: the data's with --data, else 1000")
    inspect.set_defaults(command_parser=inspect)


def add_convert(commands):
    """`convert SOURCE`: HDF5 data files from image folders, the digits, Fashion-MNIST or
    synthetic JPEGs (mpitrain/datasets/convert.py)."""
    convert = commands.add_parser(
        "convert", help="make HDF5 data files (image folders, the digits, Fashion-MNIST, "
                        "synthetic images)",
        description="Convert images into mpitrain's HDF5 format (docs/data-format.md). "
                    "Files are written to a temporary name and renamed when complete; "
                    "their directory is made where missing.")
    sources = convert.add_subparsers(dest="source", required=True, metavar="source")
    folder = sources.add_parser(
        "imagefolder", help="SRC/<class>/<image> (the ImageNet layout) -> DST.h5",
        description="Convert a folder with one sub-folder per class. Every image is decoded "
                    "once to validate it; unreadable files are skipped and listed in "
                    "DST.skipped.txt. Under mpirun each rank converts a share "
                    "(mpirun -np N python -m mpi4py -m mpitrain convert imagefolder ...: "
                    "mpi4py's runner ends the job when one rank fails).")
    folder.add_argument("src", type=path, metavar="SRC")
    folder.add_argument("dst", type=path, metavar="DST")
    folder.add_argument("--val-fraction", type=fraction, default=0.0,
                        help="stratified share written to DST_val.h5")
    folder.add_argument("--resize-short", type=positive_int,
                        help="store JPEGs downscaled so that the short side is N pixels")
    folder.add_argument("--seed", type=nonnegative_int, default=0, help="order on disk, split")
    folder.set_defaults(command_parser=folder)
    digits = sources.add_parser(
        "digits", help="the bundled digits -> DST_DIR/digits_{train,val}.h5")
    add_dst_dir(digits)
    digits.set_defaults(command_parser=digits)
    fashion = sources.add_parser(
        "fashion-mnist", help="Fashion-MNIST (Debian's dataset-fashion-mnist, fetched with "
                              "apt-get download where not installed) -> "
                              "DST_DIR/fashion-mnist_{train,val,test}.h5",
        description="60,000 training images split into training (54,000) and a stratified "
                    "validation file (6,000); the 10,000 test images into a test file.")
    add_dst_dir(fashion)
    fashion.add_argument("--seed", type=nonnegative_int, default=0, help="the validation draw")
    fashion.set_defaults(command_parser=fashion)
    synthetic = sources.add_parser(
        "synthetic", help="generated JPEGs at ImageNet sizes, for benchmarks")
    synthetic.add_argument("dst", type=path, metavar="DST")
    synthetic.add_argument("--count", type=positive_int, default=1000, help="images")
    synthetic.add_argument("--size", type=image_size, default=(500, 375), metavar="WxH",
                           help="the images' width and height in pixels (default: 500x375)")
    synthetic.add_argument("--classes", type=class_count, default=10,
                           help="classes (image i is of class i mod CLASSES)")
    synthetic.add_argument("--seed", type=nonnegative_int, default=0, help="seeds the pictures")
    synthetic.set_defaults(command_parser=synthetic)


def add_dst_dir(source):
    """A named data set's DST_DIR: the folder its files are written to."""
    source.add_argument("dst_dir", type=path, nargs="?", default=DEFAULTS["data_dir"],
                        metavar="DST_DIR",
                        help=f"the folder the files are written to (default: "
                             f"{DEFAULTS['data_dir']})")


def add_bench(commands):
    """`bench BENCHMARK`: step, data, update and comm (mpitrain/tools/bench/)."""
    bench = commands.add_parser("bench", help="benchmarks (step, update, comm, data)",
                                description="Benchmarks; each reports against a reference "
                                            "measured in the same run.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="benchmark")
    for add in (add_bench_step, add_bench_data, add_bench_update, add_bench_comm):
        add(benches)


def add_bench_step(benches):
    """`bench step`: full training steps (mpitrain/tools/bench/step.py)."""
    step = benches.add_parser(
        "step", help="training-step throughput on random data (under mpirun: scaling)",
        description="Throughput (images/s) of full training steps (forward + loss, backward, "
                    "SGD update) on random data in one process (no all-reduce), with the "
                    "median time of each phase; optionally the same in PyTorch. Under "
                    "mpirun -np N: N ranks with --batch images each, with the gradient "
                    "all-reduce overlapped and not, against one rank with N times the "
                    "threads (scaling efficiency) and the share of communication hidden.")
    step.add_argument("--model", choices=MODELS, default="resnet50", help="the network")
    step.add_argument("--image-size", type=positive_int, metavar="PX", default=64,
                      help="square side of the random images")
    step.add_argument("--batch", type=positive_int, default=32, help="images per step (per rank)")
    step.add_argument("--num-classes", type=class_count, default=1000,
                      help="the network's outputs")
    step.add_argument("--steps", type=positive_int, default=10, help="timed steps")
    step.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed steps first")
    step.add_argument("--seed", type=nonnegative_int, default=0,
                      help="seeds the weights and the random batch")
    step.add_argument("--reference", choices=["torch"],
                      help="one process: also time the same network and batch in PyTorch, "
                           "and the ratio")
    step.add_argument("--device", choices=["cpu", "gpu", "auto"], default="cpu",
                      help="where the steps run (gpu: CuPy and cuDNN, one GPU per rank under "
                           "mpirun); PyTorch runs there too, in channels_last on a GPU")
    step.add_argument("--precision", choices=["fp32", "fp16"], default="fp32",
                      help="fp16: training's mixed precision (fp16 compute, fp32 master weights, "
                           "dynamic loss scale); PyTorch on a GPU: autocast + GradScaler")
    step.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    for name, text in (("fusion_threshold", "under mpirun: gradient bucket size; auto: tune "
                                             "it as training does, then time the choice "
                                             "against train's fixed size"),
                       ("allreduce", "under mpirun: all-reduce algorithm"),
                       ("comm_dtype", "under mpirun: gradient dtype on the wire"),
                       ("compress", "under mpirun: also time top-k sparsified gradients "
                                    "(train --compress topk) against the dense sum"),
                       ("density", "with --compress topk: the fraction of each bucket sent")):
        BY_NAME[name].add_to(step, help=text)
    step.add_argument("--shard-update", action="store_true",
                      help="under mpirun: also time the sharded update (train --shard-update) "
                           "against the unsharded one, with the optimizer state per rank")
    step.add_argument("--profile", type=nonnegative_int, default=0, metavar="N",
                      help="one process: on the CPU, 2N more steps: N under cProfile for the "
                           "time per kind of work (GEMM, im2col, col2im, BatchNorm, ReLU, "
                           "pooling, loss, copies, update), N without it for each GEMM shape "
                           "with its GFLOP/s and the share outside GEMMs; on a GPU, N more "
                           "steps timed by CUDA events per layer type and phase, with GB/s "
                           "and TFLOP/s against the card's measured peaks, the host's time to "
                           "queue a step, and the kernels one step launches")
    step.add_argument("--cuda-graph", action="store_true",
                      help="one process on a GPU: replay forward and backward from CUDA "
                           "graphs captured after 2 eager steps (mpitrain/graph.py; the "
                           "warm-up steps include the capture); an fp32 model with fully "
                           "connected layers runs eagerly, and the output says so")
    step.add_argument("--nondeterministic-plans", action="store_true",
                      help="on a GPU: let cuDNN's heuristics offer convolution plans whose "
                           "bits may differ from run to run, which train leaves out "
                           "(kernels/cudnn.py DETERMINISTIC): what leaving them out costs")
    step.add_argument("--rounds", type=positive_int, default=1, metavar="N",
                      help="one process: time mpitrain (and --reference) N times, taking turns "
                           "at going first, and report each round and the median ratio (a "
                           "host's speed drifts between runs a minute apart)")
    step.add_argument("--data", type=path, metavar="FILE",
                      help="one process: also time the steps fed by the loader from FILE (a "
                           "file made by `convert`, training crops at --image-size), against "
                           "the steps on a random batch (mpitrain/tools/bench/step_data.py)")
    step.add_argument("--workers", type=workers, default=DEFAULTS["workers"],
                      help="with --data: loader threads")
    BY_NAME["decode"].add_to(step, help="with --data: where the loader decodes and augments "
                                        "(gpu: as train --decode gpu, with --device gpu)")
    step.add_argument("--native-openblas", action="store_true",
                      help="re-run this command with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE "
                           "removed from the environment (OpenBLAS picks its own core type)")
    step.set_defaults(command_parser=step)


def add_bench_data(benches):
    """`bench data`: the loader (mpitrain/tools/bench/data.py)."""
    data = benches.add_parser(
        "data", help="loader throughput: read + decode + augment, images/s",
        description="Images/s of the loader (read, decode, augment into batches) per worker "
                    "and in total; optionally a PyTorch DataLoader with PIL transforms on the "
                    "same file, same workers, in the same run.")
    data.add_argument("--data", type=path, required=True, metavar="FILE",
                      help="an HDF5 file made by `convert`")
    data.add_argument("--workers", type=nonnegative_int, default=2,
                      help="loader threads, and PyTorch DataLoader processes with --reference "
                           "(0: none, the work done in the timing loop)")
    data.add_argument("--batch", type=positive_int, default=32, help="images per batch")
    data.add_argument("--image-size", type=positive_int, metavar="PX", help=IMAGE_SIZE)
    data.add_argument("--batches", type=positive_int,
                      help="batches timed (default: two epochs, at least 96, so that the "
                           "batches prefetched when the clock starts and stops weigh little)")
    data.add_argument("--reference", choices=["torch"])
    data.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                      help="gpu: decode and augment on the GPU (train --decode gpu) with "
                           "--workers threads, against the CPU loader with a worker on every "
                           "core")
    data.add_argument("--rounds", type=positive_int, default=1, metavar="N",
                      help="time the loader (and --reference) N times, taking turns at going "
                           "first, and report each round and the median ratio (a host's speed "
                           "drifts between runs a minute apart)")
    data.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    data.set_defaults(command_parser=data)


def add_bench_update(benches):
    """`bench update`: one optimizer step (mpitrain/tools/bench/update.py)."""
    update = benches.add_parser(
        "update", help="one optimizer step over a model's arena, per kernel implementation",
        description="Time one LARS step (norms + fused update, fp32 master, fp16 working "
                    "copy) over a model's parameter arena for each kernel implementation "
                    "available here, against the NumPy reference and against this machine's "
                    "memory bandwidth measured in the same run.")
    update.add_argument("--model", choices=MODELS, default="resnet50",
                        help="the network whose arena is updated")
    update.add_argument("--repeats", type=positive_int, default=7, help="timed runs (median)")
    update.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    update.add_argument("--shard-update", action="store_true",
                        help="under mpirun: optimizer time and optimizer-state memory per rank "
                             "with weight-update sharding (train --shard-update) and without")
    update.add_argument("--optimizer", choices=BY_NAME["optimizer"].choices, default="lars",
                        help="the optimizer of --shard-update")


def add_bench_comm(benches):
    """`bench comm`: the gradient all-reduce (mpitrain/tools/bench/comm.py)."""
    comm = benches.add_parser(
        "comm", help="gradient all-reduce: algorithms, fused vs per-tensor, fp16 vs fp32",
        description="Under mpirun: time one step's gradient sum of a model's arena for each "
                    "all-reduce algorithm, as one buffer, as fusion buckets and per tensor, "
                    "with fp32 and fp16 on the wire, and a sweep of buffer sizes; reports "
                    "milliseconds and bus bandwidth (NCCL's busbw).")
    comm.add_argument("--model", choices=MODELS, default="resnet50",
                      help="the network whose gradients are summed")
    algorithms = BY_NAME["allreduce"].choices
    comm.add_argument("--algorithms", type=comma_list(str, algorithms),
                      default=",".join(algorithms), metavar="A,A",
                      help=f"comma-separated algorithms, of {', '.join(algorithms)}")
    comm.add_argument("--fusion-mib", type=comma_list(positive_int), default="1,4,16",
                      metavar="MIB,MIB", help="fusion bucket sizes in MiB")
    comm.add_argument("--repeats", type=positive_int, default=5, help="timed runs (median)")
    comm.add_argument("--ranks-per-node", type=positive_int, metavar="K")
    comm.add_argument("--no-sweep", action="store_true", help="skip the buffer-size sweep")
    comm.add_argument("--wires", type=comma_list(str, ("fp32", "fp16")), default="fp32,fp16",
                      metavar="W,W", help="dtypes of the values on the wire: fp32, fp16 or both")
    comm.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    comm.add_argument("--densities", type=comma_list(density, empty=True), default="0.1,0.01",
                      metavar="D,D",
                      help="top-k densities timed against dense sums over the model's "
                           "buckets ('' for none)")


def add_check_gpu(commands):
    """`check-gpu`: the GPU check (its options: mpitrain/tools/check_gpu.py)."""
    check = commands.add_parser(
        "check-gpu", help="prove the GPU path on this machine (tests, CPU-vs-GPU step, NCCL, "
                          "throughput) and write a JSON report",
        description="On a machine with an NVIDIA GPU (no network needed): install from a "
                    "folder of wheels if given, build the kernels, time bench step on "
                    "ResNet-50 and AlexNet against PyTorch and profile it, train two ranks "
                    "sharing the GPU with every all-reduce algorithm, time the loader "
                    "decoding on the GPU and the steps it feeds, run the gpu-marked tests, "
                    "compare one training step on the GPU with the CPU (fp32 and fp16), and "
                    "run NCCL on one rank (mpitrain/tools/check_gpu.py lists the steps). "
                    "Exit status 0: all passed; 1: something failed; 2: no GPU or bad input.")
    from mpitrain.tools import check_gpu
    check_gpu.add_arguments(check)


def add_eval(commands):
    """`eval`: a checkpoint's accuracy on a data file (mpitrain/tools/evaluate.py)."""
    evaluate = commands.add_parser(
        "eval", help="top-1/top-5 accuracy of a checkpoint on a data file (distributed)",
        description="Score a checkpoint's model on an HDF5 file made by `convert` (by "
                    "default the validation file its run trained with); under "
                    "mpirun the ranks share the file. The model and its number of classes "
                    "come from the checkpoint.")
    evaluate.add_argument("--checkpoint", type=path, required=True, metavar="FILE|RUN_DIR",
                          help=CHECKPOINT)
    evaluate.add_argument("--data", type=path, metavar="FILE|digits|fashion-mnist",
                          help="an HDF5 file made by `convert`, or a named data set (its "
                               "validation file) (default: the validation file of the "
                               "checkpoint's run)")
    evaluate.add_argument("--data-dir", type=path, metavar="DIR",
                          help="where a named data set's files are (default: the checkpoint's "
                               "run's --data-dir)")
    evaluate.add_argument("--batch-size", type=positive_int,
                          help="GLOBAL batch (default: the checkpoint's training batch, "
                               "rounded up to a multiple of the ranks)")
    evaluate.add_argument("--workers", type=workers, default=DEFAULTS["workers"],
                          help="loader threads (at most the cores this process may run on)")
    evaluate.add_argument("--image-size", type=positive_int, metavar="PX",
                          help="square side of the images (default: the checkpoint's, which "
                               "its run took from its data or its --image-size)")
    evaluate.add_argument("--skip-bad-records", action=OnOff, default=None,
                          help="leave out and count records that fail to decode instead of "
                               "stopping (default: as the checkpoint's run, train's "
                               "--skip-bad-records)")
    evaluate.add_argument("--device", choices=["cpu", "gpu", "auto"], default=DEFAULTS["device"],
                          help="where the forward passes run (auto: a GPU when CuPy sees one)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate.set_defaults(command_parser=evaluate)


def add_plot(commands):
    """`plot`: a run's curves as PNG files (mpitrain/tools/plot.py)."""
    plot = commands.add_parser(
        "plot", help="PNG curves (loss, accuracy, learning rate, throughput) of a run",
        description="Draw RUN_DIR/metrics.jsonl as PNG files in RUN_DIR (or --out): "
                    "loss.png (training and validation), accuracy.png (training top-1, "
                    "validation top-1 and top-5), lr.png, throughput.png. Needs matplotlib "
                    "(pip install 'mpitrain[plot]').")
    plot.add_argument("run_dir", type=path, metavar="RUN_DIR",
                      help="a training run's --run-dir (or its metrics.jsonl)")
    plot.add_argument("--out", type=path, metavar="DIR",
                      help="directory for the PNG files (default: RUN_DIR)")
    plot.set_defaults(command_parser=plot)


def add_export(commands):
    """`export`: a checkpoint as safetensors or ONNX (mpitrain/tools/export.py)."""
    export = commands.add_parser(
        "export", help="write a checkpoint's model as safetensors (PyTorch) or ONNX",
        description="Write the eval-mode model of a checkpoint for other frameworks, with "
                    "its preprocessing (image size, crop, mean/std, class names) as metadata. "
                    "safetensors: torchvision's state_dict names and layouts (OIHW, flatten "
                    "order), for load_state_dict(strict=True) of the torchvision-shaped "
                    "model. onnx: input 'images' (batch, 3, H, W) float32 NCHW, output "
                    "'logits', opset 17, dynamic batch. OUT is written to a temporary file "
                    "and renamed when complete. Needs the package of the format "
                    "(pip install 'mpitrain[export]').")
    export.add_argument("checkpoint", type=path, metavar="CHECKPOINT", help=CHECKPOINT)
    export.add_argument("--format", choices=["safetensors", "onnx"],
                        help="the file format to write (default: OUT's extension, "
                             ".safetensors or .onnx)")
    export.add_argument("out", type=path, metavar="OUT",
                        help="the file to write (its directory is made where missing)")
    export.add_argument("--data", type=path, metavar="FILE", help=STAND_IN)
    export.set_defaults(command_parser=export)


def add_predict(commands):
    """`predict`: the top classes of image files (mpitrain/tools/predict.py)."""
    predict = commands.add_parser(
        "predict", help="top-5 classes of image files under a checkpoint's model (one process)",
        description="Classify image files with a checkpoint's model, prepared as its run "
                    "prepared validation images (resize, centre crop at its image size and "
                    "crop fraction, the training file's mean/std). Prints the most probable "
                    "classes with their names and probabilities. One process: no mpirun. "
                    "With --onnx FILE: the exported ONNX file run by onnxruntime on the "
                    "images prepared as its metadata says (the same code); with "
                    "--checkpoint too, its probabilities compared with the checkpoint's "
                    "(exit 1 above --tolerance).")
    predict.add_argument("--checkpoint", type=path, metavar="FILE|RUN_DIR",
                         help=CHECKPOINT + " (required without --onnx)")
    predict.add_argument("--onnx", type=path, metavar="FILE",
                         help="a file of `export --format onnx`, run by onnxruntime "
                              "(pip install onnxruntime)")
    predict.add_argument("--tolerance", type=positive_float, metavar="P",
                         default=ONNX_TOLERANCE,
                         help="with --onnx and --checkpoint: the largest difference of "
                              "probabilities that agrees")
    predict.add_argument("images", type=path, nargs="+", metavar="IMAGE",
                         help="image files (JPEG, PNG, anything Pillow reads; 16-bit "
                              "greyscale PNGs are taken in a 16-bit data file's units)")
    predict.add_argument("--top", type=positive_int, default=5,
                         help="classes shown per image (at most the model's classes)")
    predict.add_argument("--batch-size", type=positive_int, default=32,
                         help="images per forward pass")
    predict.add_argument("--data", type=path, metavar="FILE", help=STAND_IN)
    predict.add_argument("--json", action="store_true", help="print one JSON object")
    predict.set_defaults(command_parser=predict)


# the train options that preview and study share with train
DATA_OPTIONS = ("data", "val_data", "data_dir", "image_size")
AUGMENT_OPTIONS = ("augment", "crop_scale", "crop_ratio", "crop_fraction")


def run_preview(args):
    from mpitrain.checks import ConfigError
    from mpitrain.datasets.h5format import FormatError
    from mpitrain.tools.preview import preview
    from mpitrain.options import DEFAULTS, Config
    cfg = Config(**{k: v for k, v in vars(args).items() if k in DEFAULTS})
    try:
        preview(cfg, args.split, args.batch, args.out)
    except (ConfigError, FormatError) as e:
        args.command_parser.error(str(e))


def add_preview(commands):
    """`preview`: one batch as the loader gives it, as a PNG grid (mpitrain/tools/preview.py)."""
    preview = commands.add_parser(
        "preview", help="write one batch as the loader gives it to the network, as a PNG grid",
        description="Read one batch of --data as `train` would (the same image size, "
                    "augmentation and crop options, the same seed), undo the normalisation "
                    "and write the images in a grid with their labels, so that what the "
                    "network sees can be looked at. One process.")
    add_arguments(preview, DATA_OPTIONS + AUGMENT_OPTIONS)
    preview.add_argument("--split", choices=["train", "val"], default="train",
                         help="the training batches (augmented) or the validation ones")
    preview.add_argument("--batch", type=positive_int, default=16, help="images in the grid")
    BY_NAME["seed"].add_to(preview, help="the run's seed (the shuffle and the crops follow it)")
    preview.add_argument("--out", type=path, default="batch.png", metavar="FILE",
                         help="the PNG file to write (its name ends in .png)")
    preview.set_defaults(command_parser=preview)


def add_study(commands):
    """`study large-batch`: accuracy against the global batch (mpitrain/tools/study.py)."""
    from mpitrain.tools.study import PLANS
    fashion = PLANS["fashion-mnist"]
    study = commands.add_parser("study", help="experiments made of many training runs "
                                              "(large-batch)")
    studies = study.add_subparsers(dest="study", required=True, metavar="study")
    large = studies.add_parser(
        "large-batch", help="top-1 against the global batch for SGD, LARS, LARS fp16, LAMB",
        description="Train resnet_small for the same epochs at global batches from 32 to the "
                    "largest the data allows (powers of two, 2 or more steps an epoch) with "
                    "SGD (linear scaling rule), LARS, LARS under fp16 and LAMB, all with "
                    "warm-up and polynomial decay, several seeds each. Each run is a "
                    "`train` job of --ranks-per-run ranks started with the venv's mpiexec; "
                    "--ranks / --ranks-per-run run at once. Writes results.md, results.csv, "
                    "accuracy.png and commands.sh (every run's command) into --out, once "
                    "every run is done. Needs matplotlib. With --data fashion-mnist: "
                    "batches 128, 1024 and 4096 (7.6% of its 54,000 training images), "
                    "Nesterov momentum, Neumann and NLCG too, each recipe's peak learning "
                    "rate chosen by a sweep of "
                    f"{', '.join(f'{f:g}' for f in fashion['lr_factors'])} times its rule at "
                    "every batch (sweep.csv), carried on by factors of 2 past an edge where "
                    f"the best is there (up to {fashion['widen']} more on each side), then 3 "
                    "seeds at the best of the smallest and largest batch, 3 epochs.")
    add_arguments(large, DATA_OPTIONS)
    large.add_argument("--augment", action=OnOff,
                       help="random-resized-crop and flip (default: the data's own: off for "
                            "digits, on for a file)")
    large.add_argument("--out", type=path, default="runs/study-large-batch", metavar="DIR",
                       help="directory for the results and the runs; one that holds an "
                            "earlier study's runs takes --resume")
    large.add_argument("--quick", action="store_true",
                       help="digits: 3 batch sizes, 1 seed, 4 epochs (about a minute on 2 "
                            "cores); fashion-mnist: batches 128 and 4096, SGD and LARS, 1 "
                            "epoch, no sweep")
    large.add_argument("--epochs", type=positive_int,
                       help="epochs of every run (default: the data's plan: digits 16, "
                            "--quick 4; fashion-mnist 3, --quick 1)")
    large.add_argument("--seeds", type=positive_int,
                       help="runs per point, seeds 0..N-1 (default: 3, --quick 1; with a "
                            "learning-rate sweep, at the deciding batches)")
    large.add_argument("--ranks", type=positive_int,
                       help="ranks (cores) to spread the runs over (default: this machine's "
                            "cores)")
    large.add_argument("--ranks-per-run", type=positive_int, default=1,
                       help="MPI ranks of each run (a divisor of 32)")
    large.add_argument("--resume", action="store_true",
                       help="keep the results of runs that ended in an earlier study into the "
                            "same --out with the same options and --ranks-per-run, and run only "
                            "the others (a study stopped halfway goes on where it stopped)")
    large.set_defaults(command_parser=large)


def run_study(args, argv):
    from mpitrain.tools.study import StudyError, large_batch
    try:
        large_batch(args.data, args.data_dir, args.out, args.quick, args.epochs, args.seeds,
                    args.ranks, args.ranks_per_run, args.augment, args.val_data, argv[2:],
                    image_size=args.image_size, resume=args.resume)
    except StudyError as e:
        args.command_parser.error(str(e))


def add_simulate(commands):
    """The `simulate` command: the α-β cost model of mpitrain/tools/simulate.py, and its
    calibration against this host."""
    from mpitrain.tools.simulate import DEVICES
    sim = commands.add_parser(
        "simulate", help="predict step time and scaling of N ranks (alpha-beta cost model)",
        description="Predict the step time, the communication time of each all-reduce "
                    "algorithm and the scaling efficiency of data-parallel training on N "
                    "ranks, from a latency-bandwidth model of each collective, the model's "
                    "real gradient buckets and the device's published training throughput "
                    "(formulas: mpitrain/tools/simulate.py; results: docs/scaling.md). "
                    "--calibrate measures this host instead (bench comm and bench step on "
                    "1 to --max-ranks ranks) and prints predicted against measured.")
    sim.add_argument("--model", choices=MODELS, default="resnet50", help="the network")
    sim.add_argument("--ranks", type=positive_int, metavar="N",
                     help="ranks (devices) in the job (default: 1024; --sweep runs 1 to 4,096)")
    sim.add_argument("--ranks-per-node", type=positive_int, metavar="K",
                     help="ranks sharing a node's link; not given: the device's usual node, "
                          "8 GPUs or this host's 2 cores")
    sim.add_argument("--device", choices=sorted(DEVICES), default="p40",
                     help="each rank's device (throughputs and links: docs/scaling.md)")
    sim.add_argument("--network", type=positive_float, default=100.0, metavar="GBPS",
                     help="network bandwidth per node, Gbit/s")
    sim.add_argument("--network-latency", type=nonnegative_float, default=5.0, metavar="US",
                     help="network latency per message step, microseconds")
    sim.add_argument("--across", choices=["ring", "tree"], default="ring",
                     help="the all-reduce spanning nodes: a ring (2(m-1) latency steps, the "
                          "2018 NCCL) or recursive halving-doubling / NCCL's trees (2 log2 m)")
    sim.add_argument("--allreduce", choices=["flat", "hierarchical", "2d", "shm", "hybrid", "all"],
                     default="all", help="algorithm (shm: CPU hosts only; hybrid: the fastest "
                                         "per bucket)")
    sim.add_argument("--fusion-threshold", type=positive_int, default=DEFAULTS["fusion_threshold"],
                     metavar="BYTES", help="gradient bucket size, as train's")
    sim.add_argument("--comm-dtype", choices=["fp32", "fp16"], default="fp32",
                     help="gradient dtype on the wire")
    sim.add_argument("--overlap", action=OnOff, default=True,
                     help="sum the buckets during backward (--overlap) or after it")
    sim.add_argument("--batch-per-rank", type=positive_int, metavar="B",
                     help="images per rank per step; not given: 32, or 8 with --calibrate")
    sim.add_argument("--image-size", type=positive_int, metavar="PX",
                     help="input size; not given: 224, or 64 with --calibrate")
    sim.add_argument("--epochs", type=positive_float, default=90.0,
                     help="epochs of ImageNet-1k for the time-to-train column")
    sim.add_argument("--sweep", action="store_true",
                     help="scaling efficiency against rank count, 1 to 4,096")
    sim.add_argument("--calibration", type=path, metavar="FILE",
                     help="with --device cpu: the fit `--calibrate` saved (calibration.json)")
    sim.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    cal = sim.add_argument_group("--calibrate (runs MPI jobs on this host, a few minutes)")
    cal.add_argument("--calibrate", action="store_true",
                     help="measure this host with bench comm and bench step on 1 to --max-ranks "
                          "ranks, fit alpha and beta per algorithm, print predicted against "
                          "measured and save the fit in --out")
    cal.add_argument("--out", type=path, default="runs/calibration", metavar="DIR",
                     help="where --calibrate writes calibration.json and the benchmarks' output")
    cal.add_argument("--max-ranks", type=number(int, 2, 16), default=4,
                     help="largest rank count measured")
    cal.add_argument("--steps", type=positive_int, default=5, help="timed bench steps per run")
    cal.add_argument("--warmup", type=positive_int, default=2,
                     help="untimed bench steps first (the first compiles and allocates)")
    cal.add_argument("--repeats", type=positive_int, default=3, help="bench comm repeats")
    sim.set_defaults(command_parser=sim)


def run_simulate(args):
    from mpitrain.tools import simulate
    if args.calibration and args.device != "cpu":
        args.command_parser.error("--calibration describes this CPU host: use it with --device cpu")
    if args.calibrate and (args.sweep or args.calibration):
        args.command_parser.error("--calibrate measures this host; run --sweep or "
                                  "--calibration FILE in a separate command")
    if args.sweep and args.ranks:
        args.command_parser.error(f"--sweep predicts every rank count from 1 to 4,096; drop "
                                  f"--ranks {args.ranks}, or drop --sweep for {args.ranks} alone")
    args.ranks = args.ranks or 1024
    try:
        if args.calibrate:
            simulate.calibrate(args)
        else:
            simulate.run(args)
    except ValueError as e:
        args.command_parser.error(str(e))


JPEG_SIDE = 65535       # the largest width or height a JPEG's header can give


def image_size(text):
    """'500x375' -> (500, 375)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT, e.g. 500x375") from None
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"{text}: width and height must be positive")
    if max(width, height) > JPEG_SIDE:
        raise argparse.ArgumentTypeError(f"{text}: a JPEG holds at most {JPEG_SIDE} pixels a "
                                         f"side; give a smaller size")
    return width, height


def run_convert(args):
    from mpitrain.datasets import convert
    from mpitrain.files import output_problem
    from mpitrain.metrics import Progress
    if args.source in ("synthetic", "imagefolder"):
        problem = output_problem(args.dst)
    else:                                       # the named data sets' files, in a folder
        problem = output_problem(os.path.join(args.dst_dir, f"{args.source}_train.h5"))
        if not os.path.isdir(args.dst_dir) and \
                os.path.splitext(args.dst_dir)[1].lower() in (".h5", ".hdf5"):
            problem = (f"DST_DIR {args.dst_dir} names an HDF5 file, and `convert "
                       f"{args.source}` writes {args.source}_train.h5 and its other files into "
                       f"a folder: give the folder (for example "
                       f"{os.path.dirname(args.dst_dir) or DEFAULTS['data_dir']})")
    src = os.path.abspath(args.src) if args.source == "imagefolder" else None
    if src and os.path.commonpath([src, os.path.abspath(args.dst)]) == src:
        problem = (f"{args.dst} lies inside SRC {args.src}, among the images it converts "
                   f"(a class folder's next conversion would take it for one); write it "
                   f"outside SRC")
    if problem:
        args.command_parser.error(problem)
    if args.source == "digits":
        result = convert.convert_digits(args.dst_dir)
    elif args.source == "fashion-mnist":
        try:
            result = convert.convert_fashion_mnist(args.dst_dir, args.seed)
        except convert.ConvertError as e:
            args.command_parser.error(str(e))
    elif args.source == "synthetic":
        progress = Progress(f"synthetic {args.dst}")
        result = convert.convert_synthetic(args.dst, args.count, args.size, args.classes,
                                           args.seed, progress=progress)
        progress.close()
    else:
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        progress = Progress(f"imagefolder {args.src}") if world.rank == 0 else None
        try:
            result = convert.convert_imagefolder(args.src, args.dst, args.val_fraction,
                                                 args.resize_short, args.seed, progress,
                                                 world if world.size > 1 else None)
        except convert.ConvertError as e:       # raised on every rank alike
            args.command_parser.error(str(e))
        if world.rank != 0:
            return
        progress.close()
    for split, path in result.files.items():
        print(f"{split}: {result.counts[split]} images -> {path}")
    if result.skipped:
        print(f"{len(result.skipped)} file(s) skipped, listed in {result.report_path}")


def explicit_options(parser, argv):
    """The train options given on the command line (not left at their defaults): parse
    again with every default suppressed."""
    sub = parser._subparsers._group_actions[0].choices["train"]
    saved = [(a, a.default) for a in sub._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        given = vars(parser.parse_args(argv))
    finally:
        for action, default in saved:
            action.default = default
    return set(given) - {"command", "command_parser"}


def apply_config_file(args, parser, argv):
    """Fill in args from --config YAML where the command line did not give the option;
    each YAML value goes through the flag's own type and choices (Option.convert).
    Returns the names of the options it set."""
    from mpitrain.config import ConfigFileError, load_yaml
    sub = args.command_parser
    try:
        values = load_yaml(args.config, set(BY_NAME))
    except ConfigFileError as e:
        sub.error(str(e))
    explicit = explicit_options(parser, argv)
    for key, value in values.items():
        if key in explicit:
            continue
        try:
            value = BY_NAME[key].convert(value)
        except ValueError as e:
            sub.error(f"config file {args.config}: {key}: {e}")
        setattr(args, key, value)
    return [key for key in values if key not in explicit]


def from_config_file(message, keys, path):
    """For a refusal that names options by their flags: ' (set by --config PATH: KEY, ...)'
    for those of `keys` (the options that file set) that it names, else ''."""
    named = [key for key in keys
             if re.search(re.escape(BY_NAME[key].flag) + r"(?![\w-])", message)]
    return f" (set by --config {path}: {', '.join(named)})" if named else ""


def run_train(args, parser=None, argv=()):
    from mpitrain.control import EXIT_STATUS, record_early
    record_early()                               # before the imports and set-up: seconds
    from mpi4py import MPI
    from mpitrain.checks import ConfigError, refuse_options
    from mpitrain.launcher import size_thread_pools
    from mpitrain.options import Config
    from_file = apply_config_file(args, parser, argv) if getattr(args, "config", None) else []
    options = {k: v for k, v in vars(args).items()
               if k not in ("command", "command_parser", "config")}

    def refuse(e):                               # exit status 2, said once
        args.command_parser.error(f"{e}{from_config_file(str(e), from_file, args.config)}")
    try:                                         # before the run's imports: a second or two
        refuse_options(Config(**options), MPI.COMM_WORLD.size)
    except ValueError as e:                      # a ConfigError, or Config's own refusal
        refuse(e)
    size_thread_pools(MPI.COMM_WORLD)            # before Numba loads
    from mpitrain.precision import LossScaleError
    from mpitrain.train import TrainingError, describe_nonfinite, train
    try:
        result = train(**options)
    except ConfigError as e:                     # raised on every rank alike
        refuse(e)
    except (TrainingError, LossScaleError) as e:   # raised on every rank alike
        if MPI.COMM_WORLD.rank == 0:
            sys.stderr.write(f"mpitrain train: error: {e}\n")
        sys.exit(1)
    if result["stopped"]:                        # a checkpoint was written
        sys.exit(EXIT_STATUS[result["stopped"]])
    if result["nonfinite"]:                      # the same sums on every rank
        if MPI.COMM_WORLD.rank == 0:
            sys.stderr.write(f"mpitrain train: error: the final evaluation: "
                             f"{describe_nonfinite(result)}\n")
        sys.exit(1)


def checkpoint_in(args, comm=None):
    """args.checkpoint, or where it names a run directory, that directory's newest complete
    checkpoint (chosen by rank 0 of `comm` when given, so that every rank takes the same),
    saying on stderr which newer ones it passes over and why; a directory without one is
    refused."""
    from mpitrain import checkpoint
    if not os.path.isdir(args.checkpoint):
        return args.checkpoint

    def passed_over(path, error):
        sys.stderr.write(f"{args.command_parser.prog}: passing over {path}: {error}\n")
    found = checkpoint.latest(args.checkpoint, passed_over) \
        if comm is None or comm.rank == 0 else None
    if comm is not None:
        found = comm.bcast(found, root=0)
    if found is None:
        fix = ("its run had --checkpoint-every 0, which saves one only on a stop signal: "
               "train it again without that option" if saved_none(args.checkpoint) else
               "give a checkpoint file, or train (or --resume) the run to its first checkpoint")
        args.command_parser.error(f"run directory {args.checkpoint} holds no complete "
                                  f"checkpoint: {fix}")
    return found


def refuse_image_size(args):
    """After a ValueError of bench step: when its --image-size is the cause (the network's
    feature maps vanish in a layer), raise train's refusal of it (checks.check_image_size,
    a ConfigError), which `run` says in one line before it ends the job: under mpirun it
    may be one rank's. Checked only then, so that no benchmark pays for an extra model
    and forward pass."""
    from mpitrain.checks import check_image_size
    from mpitrain.nets import build_model
    check_image_size(build_model(args.model, num_classes=2), args.model, args.image_size)


def saved_none(run_dir):
    """Whether the run in run_dir was trained with --checkpoint-every 0 (its config.json)."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            return json.load(f).get("checkpoint_every") == 0
    except (OSError, ValueError, AttributeError):
        return False


def run_eval(args):
    from mpi4py import MPI
    from mpitrain.launcher import size_thread_pools
    size_thread_pools(MPI.COMM_WORLD)            # before Numba loads
    from mpitrain.tools.evaluate import EvalError, evaluate_checkpoint
    from mpitrain.train import describe_images, describe_nonfinite
    args.checkpoint = checkpoint_in(args, MPI.COMM_WORLD)
    try:
        result = evaluate_checkpoint(args.checkpoint, args.data, args.batch_size, args.workers,
                                     args.device, image_size=args.image_size,
                                     data_dir=args.data_dir,
                                     skip_bad_records=args.skip_bad_records)
    except EvalError as e:
        args.command_parser.error(str(e))
    if MPI.COMM_WORLD.rank == 0:
        if args.json:
            import json
            print(json.dumps(result))
        else:
            top5 = f", top-5 {result['top5']:.2%}" if "top5" in result else ""
            print(f"{args.checkpoint} on {result['data']} ({describe_images(result)}, "
                  f"{result['image_size']}x{result['image_size']}): "
                  f"top-1 {result['top1']:.2%}{top5}")
        if result["nonfinite"]:
            sys.stderr.write(f"mpitrain eval: error: "
                             f"{describe_nonfinite(result)}\n")
    if result["nonfinite"]:                      # the same sums on every rank
        sys.exit(1)


def run_predict(args):
    """`predict` of a checkpoint (mpitrain/tools/predict.py), or of an exported ONNX file,
    compared with the checkpoint when both are given (mpitrain/tools/onnx_predict.py)."""
    if args.checkpoint is None and args.onnx is None:
        meant = "".join(f"; {word}: {hint}" for word, hint in
                        args.command_parser.hints(args.images[:1]) if "--checkpoint" in hint)
        args.command_parser.error("give --checkpoint (a checkpoint or run directory), "
                                  "--onnx FILE (an exported model), or both" + meant)
    # a tolerance set, where nothing is compared (the default's value is taken as unset)
    if args.tolerance != ONNX_TOLERANCE and None in (args.onnx, args.checkpoint):
        args.command_parser.error("--tolerance is for the comparison of --onnx FILE with "
                                  "--checkpoint: give both, or drop it")
    if args.data is not None and args.checkpoint is None:
        args.command_parser.error("--data stands in for the checkpoint's training file, and "
                                  "the ONNX file carries its own preprocessing: add "
                                  "--checkpoint, or drop --data")
    if args.checkpoint is not None:
        given, args.checkpoint = args.checkpoint, checkpoint_in(args)
        if args.checkpoint != given:    # its text names no checkpoint, as eval's and export's do
            sys.stderr.write(f"{args.command_parser.prog}: {given}: its newest complete "
                             f"checkpoint, {os.path.basename(args.checkpoint)}\n")
    if args.onnx is not None:
        from mpitrain.tools.onnx_predict import run
    else:
        from mpitrain.tools.predict import run
    run(args)


def gpu_decode_or_refuse(args):
    """bench data --device gpu, bench step --data --decode gpu: this process on a GPU,
    with nvImageCodec, and --data of JPEG records, as train --decode gpu checks them (the
    refusal names what is missing)."""
    from mpitrain import backend
    from mpitrain.checks import ConfigError, check_decode
    from mpitrain.datasets.h5format import FormatError
    from mpitrain.options import Config
    try:
        backend.use_device("gpu")
        check_decode(Config(decode="gpu"), backend.device,     # a missing file: said later
                     [args.data] if os.path.exists(args.data) else [])
    except (backend.DeviceError, ConfigError, FormatError) as e:
        args.command_parser.error(str(e))


def data_image_size(args):
    """--image-size, else the size of args.data (checks.describe_file), said unless --json;
    a file of fewer images than --batch is refused."""
    from mpitrain.checks import ConfigError, describe_file
    from mpitrain.datasets.h5format import FormatError
    try:
        images, _, size = describe_file(args.data)
    except (ConfigError, FormatError) as e:
        args.command_parser.error(str(e))
    if images < args.batch:
        args.command_parser.error(f"{args.data} holds {images} images, fewer than one batch "
                                  f"of {args.batch}: lower --batch")
    if args.image_size:
        return args.image_size
    if not args.json:
        print(f"images {size}x{size} from the data (--image-size to change)", flush=True)
    return size


def run_plot(args):
    from mpitrain.tools.plot import PlotError, plot_run
    try:
        paths = plot_run(args.run_dir, args.out)
    except PlotError as e:
        args.command_parser.error(str(e))
    for path in paths:
        print(path)


FULL = (errno.ENOSPC, errno.EDQUOT)


def os_error(e):
    """An OSError of a named file, or of a full disk, as one line with the fix."""
    if e.errno in FULL:
        return (f"{e.strerror}{f' ({e.filename})' if e.filename else ''}: free space on "
                f"the file system being written, or write elsewhere")
    return f"{e.filename}: {e.strerror}"


# setup.py's install_requires, by the names they are imported as
DEPENDENCIES = ("numpy", "numba", "h5py", "PIL", "simplejpeg", "mpi4py", "sklearn", "yaml",
                "threadpoolctl", "tqdm")
# the checkout's folders that become mpitrain's packages only when it is installed
INSTALLED_AS = ("mpitrain.kernels", "mpitrain.nets", "mpitrain.datasets")


def not_installed(e):
    """A ModuleNotFoundError of a Python that lacks mpitrain's dependencies, or in which
    mpitrain is not installed (setup.py's package_dir makes kernels/ mpitrain.kernels, and
    builds its compiled kernels), as one line with the fix; None for any other missing
    module."""
    name = e.name or ""
    if not (name.split(".")[0] in DEPENDENCIES
            or any(name == p or name.startswith(p + ".") for p in INSTALLED_AS)):
        return None
    return (f"this Python ({sys.executable}) has no module {name!r}: mpitrain runs where "
            f"it is installed with its dependencies: `./launch.sh COMMAND ...` (or "
            f"`.venv/bin/python -m mpitrain ...`) after `./launch.sh setup`, or a Python in "
            f"which `pip install -e .` ran in the checkout")


# the options that size a command's arrays: what an answer to running out of memory names
SIZE_OPTIONS = ("--image-size", "--batch-size", "--batch", "--batch-per-rank", "--size")


def out_of_memory(e, argv):
    """A MemoryError (NumPy's names the array it could not allocate) as one line naming
    the size options given, the ones to lower."""
    given = [o for o in SIZE_OPTIONS if any(a == o or a.startswith(o + "=") for a in argv)]
    lower = " or ".join(given) or "the image size or the batch"
    return (f"out of memory: {str(e) or 'an allocation failed'}; lower {lower} (the images "
            f"and activations of a batch must fit in this machine's memory)")


# one-process commands that write files: SIGTERM unwinds them as Ctrl-C does, so that
# files.write_atomic removes its temporary file (the signal's default action leaves it),
# and the study ends its runs, each with a checkpoint, and says so
UNWOUND_BY_SIGTERM = {"export", "plot", "preview", "study"}


class Terminated(BaseException):
    """SIGTERM, raised in the main thread of a command of UNWOUND_BY_SIGTERM."""


def terminate(signum, frame):
    raise Terminated


def run(argv=None):
    """What `python -m mpitrain` and the installed `mpitrain` script run (mpitrain/__main__.py):
    main(), and when it fails on any rank, the end of the whole job.

    An error of the operating system on a named file (a path that cannot be made), or a
    full disk, is said in one line, without the traceback (exit status 1); so are a Python
    without mpitrain's dependencies and an array too large for memory (an --image-size
    of 100000: the size options given, to lower), with exit status 2.

    Without the Abort, one rank dying inside a training step (or stopped by Ctrl-C
    before the run handles signals) leaves the others waiting forever in their next
    collective, and MPI_Finalize at exit waits for them too."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in UNWOUND_BY_SIGTERM:
        signal.signal(signal.SIGTERM, terminate)
    try:
        main(argv)
    except SystemExit:
        raise
    except BaseException as e:
        MPI = getattr(sys.modules.get("mpi4py"), "MPI", None)
        world = MPI.COMM_WORLD if MPI is not None and MPI.Is_initialized() \
            and not MPI.Is_finalized() else None
        where = f"rank {world.rank} of {world.size}" if world is not None else "mpitrain"
        # Ctrl-C, or SIGTERM where it unwinds the command: what to say, and the signal
        stopped = (("terminated", signal.SIGTERM) if isinstance(e, Terminated) else
                   ("interrupted", signal.SIGINT) if isinstance(e, KeyboardInterrupt) else None)
        missing = not_installed(e) if isinstance(e, ModuleNotFoundError) else None
        # a record that cannot be read, or a refusal that only some ranks reach: bad input,
        # its message says it all
        data_error = tuple(getattr(sys.modules.get(module), name, ())
                           for module, name in (("mpitrain.datasets.loader", "DataError"),
                                                ("mpitrain.checks", "ConfigError")))
        if stopped:
            sys.stderr.write(f"{where}: {stopped[0]}, ending the job\n")
        elif isinstance(e, data_error):
            sys.stderr.write(f"{where}: error: {e}\n")
        elif missing:
            sys.stderr.write(f"{where}: error: {missing}\n")
        elif isinstance(e, MemoryError):
            sys.stderr.write(f"{where}: error: {out_of_memory(e, argv)}\n")
        elif isinstance(e, OSError) and (e.filename is not None or e.errno in FULL):
            sys.stderr.write(f"{where}: error: {os_error(e)}\n")
        else:
            sys.stderr.write(f"{where}: uncaught exception, ending the job\n"
                             f"{traceback.format_exc()}")
        sys.stderr.flush()
        status = 128 + stopped[1] if stopped else 2 if isinstance(
            e, (MemoryError, *data_error)) or missing else 1
        if world is not None and world.size > 1:
            from mpitrain.control import end_job
            end_job(world, status)
        sys.exit(status)


# the commands that run the layers, through the kernels' BLAS (MPITRAIN_BLAS chooses it)
COMPUTING = {"train", "eval", "inspect", "export", "predict", "preview", "study", "bench"}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in COMPUTING:
        # before any model is built: a product would fail in the middle of the command's
        # own checks, which could then blame another option (and without loading Numba,
        # whose pools a rank sizes later: launcher.size_thread_pools)
        from mpitrain.kernels.blas_choice import blas_choice_problem
        problem = blas_choice_problem()
        if problem:
            getattr(args, "command_parser", parser).error(problem)
    if args.command == "train":
        run_train(args, parser, argv)
    elif args.command == "eval":
        run_eval(args)
    elif args.command == "plot":
        run_plot(args)
    elif args.command == "inspect":
        from mpitrain.tools.inspect import run
        run(args)
    elif args.command == "convert":
        run_convert(args)
    elif args.command == "export":
        from mpitrain.tools.export import run
        args.checkpoint = checkpoint_in(args)
        run(args)
    elif args.command == "predict":
        run_predict(args)
    elif args.command == "preview":
        run_preview(args)
    elif args.command == "study":
        run_study(args, argv)
    elif args.command == "simulate":
        run_simulate(args)
    elif args.command == "check-gpu":
        from mpitrain.tools.check_gpu import run
        sys.exit(run(args))
    elif args.bench == "step":
        from mpitrain.tools.bench.step import main_step
        from mpitrain.checks import ConfigError, check_options_used, check_topk_wire
        try:
            check_options_used(args)
            check_topk_wire(args.compress, args.comm_dtype)
        except ConfigError as e:
            args.command_parser.error(str(e))
        if args.decode == "gpu" and not args.data:
            args.command_parser.error("--decode gpu times the loader's decoding: give it a "
                                      "file with --data FILE, or drop --decode")
        try:
            if args.data:
                from mpitrain.tools.bench.step_data import main
                if args.decode == "gpu" and args.device == "gpu":
                    gpu_decode_or_refuse(args)
                main(args)
            else:
                main_step(args, argv)
        except ValueError:
            refuse_image_size(args)
            raise
    elif args.bench == "data":
        from mpitrain.tools.bench.data import run
        if args.device == "gpu":
            gpu_decode_or_refuse(args)
        run(args.data, args.workers, args.batch, data_image_size(args), args.reference,
            args.json, args.batches, args.device, args.rounds)
    elif args.bench == "update":
        from mpitrain.tools.bench.update import run, run_sharded
        if args.shard_update:
            run_sharded(args.model, args.optimizer, args.repeats, args.json)
        else:
            run(args.model, args.repeats, args.json)
    elif args.bench == "comm":
        from mpitrain.tools.bench.comm import MiB, run
        run(args.model, args.algorithms, tuple(f * MiB for f in args.fusion_mib), args.repeats,
            args.ranks_per_node, not args.no_sweep, args.json, densities=args.densities,
            wires=args.wires)
