"""`python -m mpitrain <command>`: train, inspect, bench step.

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
    train.add_argument("--data", choices=["digits"], default=D["data"],
                       help="digits: scikit-learn's bundled handwritten digits at 32x32")
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

    bench = commands.add_parser("bench", help="benchmarks (bench step)",
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
    return parser


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
    elif args.command == "bench":
        from mpitrain.bench import main_step
        main_step(args, argv)
