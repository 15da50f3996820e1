"""`python -m mpitrain <command>`: train, convert, inspect, bench.

Bad values are refused by argparse (exit status 2, with its usage message)
before any work starts. NumPy and MPI are imported only by the command that
needs them, so `--help` is quick and `bench step --native-openblas` can re-run
itself with a changed environment.
"""
import argparse
import sys


# ----- argument types: each returns the value or raises ArgumentTypeError -----
def _number(kind, low=None, high=None, low_open=False, high_open=False):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if low is not None and (value < low or (low_open and value == low)):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if low_open else '>='} {low}")
        if high is not None and (value > high or (high_open and value == high)):
            raise argparse.ArgumentTypeError(f"{text} must be {'<' if high_open else '<='} {high}")
        return value
    parse.__name__ = kind.__name__          # argparse names the type in its messages
    return parse


positive_int = _number(int, 1)
nonnegative_int = _number(int, 0)
positive_float = _number(float, 0.0, low_open=True)
nonnegative_float = _number(float, 0.0)
fraction = _number(float, 0.0, 1.0, high_open=True)     # [0, 1)


def build_parser():
    from mpitrain.nets import MODELS
    from mpitrain.train import DEFAULTS as D
    models = sorted(MODELS)

    parser = argparse.ArgumentParser(
        prog="python -m mpitrain",
        description="Parameter-server-free MPI data-parallel training of convolutional networks.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    train = commands.add_parser(
        "train", help="train a network (launch under mpirun/srun for several ranks)",
        description="Train a network data-parallel: every MPI rank holds a replica, gradients "
                    "are summed with one all-reduce per step. Run under mpirun -np N or srun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    train.add_argument("--model", choices=models, default=D["model"])
    train.add_argument("--data", default=D["data"],
                       help="a training file made by `convert`, or 'digits': scikit-learn's "
                            "bundled handwritten digits at 32x32, converted into --data-dir "
                            "on first use")
    train.add_argument("--val-data", help="validation file (default: DATA's FILE_val.h5)")
    train.add_argument("--data-dir", default=D["data_dir"],
                       help="where named data sets (digits) are converted to")
    train.add_argument("--image-size", type=positive_int,
                       help="training crop size (default: a pixel file's own size, else 224)")
    train.add_argument("--augment", action=argparse.BooleanOptionalAction,
                       help="random-resized-crop and flip for training (default: on, off for digits)")
    train.add_argument("--workers", type=nonnegative_int, default=D["workers"],
                       help="loader threads reading, decoding and augmenting ahead of the step")
    train.add_argument("--prefetch", type=positive_int, default=D["prefetch"],
                       help="batches prepared ahead of the step")
    train.add_argument("--skip-bad-records", action="store_true",
                       help="skip and count records that fail to decode instead of stopping")
    train.add_argument("--epochs", type=positive_int, default=D["epochs"])
    train.add_argument("--batch-size", type=positive_int, default=D["batch_size"],
                       help="GLOBAL batch size, split evenly over the ranks")
    train.add_argument("--lr", type=positive_float, default=D["lr"],
                       help="peak learning rate (after warm-up; cosine decay to 0)")
    train.add_argument("--momentum", type=fraction, default=D["momentum"])
    train.add_argument("--nesterov", action="store_true", help="Nesterov momentum")
    train.add_argument("--weight-decay", type=nonnegative_float, default=D["weight_decay"],
                       help="L2 penalty, not applied to biases and BatchNorm gamma/beta")
    train.add_argument("--label-smoothing", type=fraction, default=D["label_smoothing"])
    train.add_argument("--warmup-epochs", type=nonnegative_float, default=D["warmup_epochs"],
                       help="linear learning-rate warm-up, in epochs")
    train.add_argument("--seed", type=nonnegative_int, default=D["seed"],
                       help="seeds the weights, the validation split and the data order")
    train.add_argument("--device", choices=["cpu", "gpu", "auto"], default=D["device"])
    train.add_argument("--eval-every", type=positive_int, default=D["eval_every"],
                       help="evaluate every N epochs (and after the last)")
    train.set_defaults(command_parser=train)     # for errors found after parsing

    inspect = commands.add_parser(
        "inspect", help="table of layers: output shape, parameters, multiply-adds",
        description="Print every layer of a network with its output shape, parameters and "
                    "forward multiply-adds, and the totals.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    inspect.add_argument("--model", choices=models, default="resnet50")
    inspect.add_argument("--image-size", type=positive_int, default=224)
    inspect.add_argument("--num-classes", type=positive_int, default=1000)

    convert = commands.add_parser(
        "convert", help="make HDF5 data files (image folders, the digits, synthetic images)",
        description="Convert images into mpitrain's HDF5 format (docs/data-format.md). "
                    "Files are written to a temporary name and renamed when complete.")
    sources = convert.add_subparsers(dest="source", required=True, metavar="source")
    folder = sources.add_parser(
        "imagefolder", help="SRC/<class>/<image> (the ImageNet layout) -> DST.h5",
        description="Convert a folder with one sub-folder per class. Every image is decoded "
                    "once to validate it; unreadable files are skipped and listed in "
                    "DST.skipped.txt. Under mpirun each rank converts a share "
                    "(mpirun -np N python -m mpitrain convert imagefolder ...).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    folder.add_argument("src")
    folder.add_argument("dst")
    folder.add_argument("--val-fraction", type=fraction, default=0.0,
                        help="stratified share written to DST_val.h5")
    folder.add_argument("--resize-short", type=positive_int,
                        help="store JPEGs downscaled so that the short side is N pixels")
    folder.add_argument("--seed", type=nonnegative_int, default=0, help="order on disk, split")
    digits = sources.add_parser("digits", help="the bundled digits -> DST_DIR/digits_{train,val}.h5",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    digits.add_argument("dst_dir", nargs="?", default=D["data_dir"])
    synthetic = sources.add_parser(
        "synthetic", help="generated JPEGs at ImageNet sizes, for benchmarks",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    synthetic.add_argument("dst")
    synthetic.add_argument("--count", type=positive_int, default=1000)
    synthetic.add_argument("--size", type=image_size, default=(500, 375), help="WIDTHxHEIGHT")
    synthetic.add_argument("--classes", type=positive_int, default=10)
    synthetic.add_argument("--seed", type=nonnegative_int, default=0)

    bench = commands.add_parser("bench", help="benchmarks (step, data)",
                                description="Benchmarks; each reports against a reference "
                                            "measured in the same run.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="benchmark")
    step = benches.add_parser(
        "step", help="training-step throughput on random data, one process",
        description="Throughput (images/s) of full training steps (forward + loss, backward, "
                    "SGD update) on random data in one process (no all-reduce), with the "
                    "median time of each phase; optionally the same in PyTorch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    step.add_argument("--model", choices=models, default="resnet50")
    step.add_argument("--image-size", type=positive_int, default=64)
    step.add_argument("--batch", type=positive_int, default=32)
    step.add_argument("--num-classes", type=positive_int, default=1000)
    step.add_argument("--steps", type=positive_int, default=10, help="timed steps")
    step.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed steps first")
    step.add_argument("--seed", type=nonnegative_int, default=0)
    step.add_argument("--reference", choices=["torch"],
                      help="also time the same network and batch in PyTorch, and the ratio")
    step.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    step.add_argument("--native-openblas", action="store_true",
                      help="re-run this command with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE "
                           "removed from the environment (OpenBLAS picks its own core type)")
    data = benches.add_parser(
        "data", help="loader throughput: read + decode + augment, images/s",
        description="Images/s of the loader (read, decode, augment into batches) per worker "
                    "and in total; optionally a PyTorch DataLoader with PIL transforms on the "
                    "same file, same workers, in the same run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    data.add_argument("--data", required=True, help="an HDF5 file made by `convert`")
    data.add_argument("--workers", type=nonnegative_int, default=2)
    data.add_argument("--batch", type=positive_int, default=32)
    data.add_argument("--image-size", type=positive_int, default=224)
    data.add_argument("--batches", type=positive_int, help="batches timed (default: two epochs)")
    data.add_argument("--reference", choices=["torch"])
    data.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    return parser


def image_size(text):
    """'500x375' -> (500, 375)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT, e.g. 500x375") from None
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"{text}: width and height must be positive")
    return width, height


def run_convert(args):
    from mpitrain.datasets import convert
    from mpitrain.metrics import Progress
    if args.source == "digits":
        result = convert.convert_digits(args.dst_dir)
    elif args.source == "synthetic":
        progress = Progress(f"synthetic {args.dst}")
        result = convert.convert_synthetic(args.dst, args.count, args.size, args.classes,
                                           args.seed, progress=progress)
        progress.close()
    else:
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        progress = Progress(f"imagefolder {args.src}") if world.rank == 0 else None
        result = convert.convert_imagefolder(args.src, args.dst, args.val_fraction,
                                             args.resize_short, args.seed, progress,
                                             world if world.size > 1 else None)
        if world.rank != 0:
            return
        progress.close()
    for split, path in result.files.items():
        print(f"{split}: {result.counts[split]} images -> {path}")
    if result.skipped:
        print(f"{len(result.skipped)} files skipped, listed in {result.report_path}")


def run_train(args):
    from mpi4py import MPI
    from mpitrain.train import ConfigError, train
    options = {k: v for k, v in vars(args).items() if k not in ("command", "command_parser")}
    try:
        train(**options)
    except ConfigError as e:
        if MPI.COMM_WORLD.rank == 0:
            args.command_parser.error(str(e))    # usage and message on stderr, exit status 2
        sys.exit(2)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        run_train(args)
    elif args.command == "inspect":
        from mpitrain.inspect import report
        print(report(args.model, image_size=args.image_size, num_classes=args.num_classes))
    elif args.command == "convert":
        run_convert(args)
    elif args.bench == "step":
        from mpitrain.bench import main_step
        main_step(args, argv)
    elif args.bench == "data":
        from mpitrain.bench_data import run
        run(args.data, args.workers, args.batch, args.image_size, args.reference, args.json,
            args.batches)
