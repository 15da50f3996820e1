"""The train options, declared once.

Each `Option` says an option's name, default, type (`parse`: the text of a
command-line value to the value), allowed values, help and group. From this one
table come:

    the command line      add_arguments(parser): `train`'s flags, and the flags that
                          `preview` and `study` share with it
    a value from YAML     Option.convert: the same parse and choices as the flag
    or Python             (Config(**values) checks every value it is given)
    the defaults          DEFAULTS
    the docs' table       markdown(): docs/train-options.md (`python -m mpitrain.options`)

The run reads the values as attributes of a `Config` (cfg.batch_size). Rules
between two options (--compress topk against --comm-dtype fp16, ...) are written
once, in mpitrain/checks.py. Adding an option is one `Option(...)` line here; the
code that uses it reads cfg.<name>.
"""
import argparse
from types import SimpleNamespace
from typing import Callable, NamedTuple

from .argtypes import (OnOff, density, finite_float, fraction, fusion_threshold, loss_scale,
                       metavar, nonnegative_float, nonnegative_int, path, positive_float,
                       positive_int, trace_file, workers)
from .precision import DTYPES
# nets.MODELS, optim.OPTIMIZERS and comm.ALGORITHMS, which are not imported here (the first
# two bring Numba, so a refused option would wait a second for its answer; the third would
# start MPI); a test holds them equal
MODELS = ("alexnet", "alexnet_bn", "resnet101", "resnet152", "resnet18", "resnet34", "resnet50",
          "resnet_small")
OPTIMIZERS = ("sgd", "lars", "lamb", "neumann", "nlcg")
ALLREDUCE = ("flat", "hierarchical", "2d", "shm", "hybrid")
DEVICES = ("cpu", "gpu", "auto")

# the crops of datasets/augment.py (SCALE, RATIO), for the help; a test holds them equal
CROP_SCALE, CROP_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)

IMAGE_SIZE = ("square side of the images the network takes (default: the data's, the "
              "short side of its median image as `convert` recorded it, at most 224; "
              "224 for a file that does not record it)")


class Option(NamedTuple):
    """One train option. kind: "value" (--name VALUE), "switch" (--name sets True) or
    "on-off" (--name / --no-name). nargs: how many values a "value" takes (None: one).
    A default of None means "not given" and is always allowed."""
    name: str
    default: object
    help: str
    group: str
    parse: Callable | None = None
    choices: tuple | None = None
    kind: str = "value"
    nargs: int | str | None = None
    metavar: str | tuple | None = None

    @property
    def flag(self):
        return "--" + self.name.replace("_", "-")

    def convert(self, value):
        """A value from YAML or Python, checked by the flag's own type and choices;
        ValueError names what is wrong."""
        if value is None and self.default is None:
            return None
        if self.kind != "value":
            if not isinstance(value, bool) and value != self.default:    # --overlap's auto
                raise ValueError(f"{value!r} is not true or false")
            return value
        if self.nargs is None:
            return self._one(value)
        if not isinstance(value, (list, tuple)) or (
                isinstance(self.nargs, int) and len(value) != self.nargs):
            raise ValueError(f"{value!r}: {self.nargs if self.nargs != '+' else 'a list of'} "
                             f"values expected")
        return tuple(self._one(v) for v in value)

    def _one(self, value):
        if isinstance(value, (list, tuple, dict)) or isinstance(value, bool):
            raise ValueError(f"{value!r}: one value expected")
        if self.parse and not getattr(self.parse, "as_typed", False):
            value = str(value)      # as a flag's text: epochs 2.5 is refused, not cut to 2
        try:
            value = self.parse(value) if self.parse else value
        except argparse.ArgumentTypeError as e:
            raise ValueError(str(e)) from None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{value!r}: choose from {', '.join(map(str, self.choices))}")
        return value

    def add_to(self, parser, **overrides):
        """This option as a flag of `parser` (argparse); `overrides` replace keyword
        arguments of add_argument (a command's own default, say)."""
        kwargs = dict(default=self.default, help=self.help)
        if self.kind == "switch":
            kwargs["action"] = "store_true"
        elif self.kind == "on-off":
            kwargs["action"] = OnOff
        else:
            kwargs.update(type=self.parse, choices=self.choices, nargs=self.nargs,
                          metavar=self.metavar)
        kwargs.update(overrides)
        parser.add_argument(self.flag, **{k: v for k, v in kwargs.items() if v is not None})


MODEL, OPTIM = "model and data", "optimizer, schedule and precision"
RUN, COMM = "the run around the loop", "communication"

OPTIONS = (
    # ----- model and data -----
    Option("model", "resnet_small", "the network (`python -m mpitrain inspect` lists its "
           "layers)", MODEL, choices=MODELS),
    Option("data", "digits", "a training file made by `convert` (with its FILE_val.h5), or "
           "'digits': scikit-learn's bundled handwritten digits at 32x32, or 'fashion-mnist' "
           "(28x28), converted into --data-dir on first use", MODEL, path,
           metavar="FILE|digits|fashion-mnist"),
    Option("val_data", None, "validation file (default: DATA's FILE_val.h5, or a named "
           "data set's own)", MODEL, path, metavar="FILE"),
    Option("data_dir", "data", "where named data sets (digits, fashion-mnist) are converted "
           "to", MODEL, path, metavar="DIR"),
    Option("image_size", None, IMAGE_SIZE, MODEL, positive_int, metavar="PX"),
    Option("augment", None, "random-resized-crop and flip for training (default: on, off for "
           "digits and fashion-mnist)", MODEL, kind="on-off"),
    Option("crop_scale", None, f"a training crop's share of the image's area, drawn "
           f"uniformly from [MIN, MAX] (default: {CROP_SCALE[0]:g} {CROP_SCALE[1]:g}); raise "
           f"MIN where small crops cut the object out of small images", MODEL, finite_float,
           nargs=2, metavar=("MIN", "MAX")),
    Option("crop_ratio", None, f"a training crop's width / height, drawn log-uniformly from "
           f"[MIN, MAX] (default: {CROP_RATIO[0]:g} {CROP_RATIO[1]:.4g})", MODEL,
           finite_float, nargs=2, metavar=("MIN", "MAX")),
    Option("crop_fraction", None, "validation: the centred square of F times the short side, "
           "resized to the image size (default: 0.875, 1 for digits and fashion-mnist)", MODEL,
           float, metavar="F"),
    Option("decode", "cpu", "where JPEGs are decoded and augmented: by the --workers threads "
           "on the host, or on the GPU (nvImageCodec, then one kernel per chunk of a batch, "
           "on the workers' own CUDA streams)", MODEL, choices=("cpu", "gpu")),
    Option("workers", 2, "loader threads reading, decoding and augmenting ahead of the step "
           "(at most the cores this process may run on)", MODEL, workers, metavar="N"),
    Option("prefetch", 2, "batches prepared ahead of the step", MODEL, positive_int,
           metavar="N"),
    Option("skip_bad_records", False, "skip and count records that fail to decode instead of "
           "stopping", MODEL, kind="switch"),
    Option("epochs", 8, "passes over the training data", MODEL, positive_int, metavar="N"),
    Option("batch_size", 32, "GLOBAL batch size, split evenly over the ranks (it must divide "
           "by their number)", MODEL, positive_int, metavar="N"),
    Option("seed", 0, "seeds the weights and the data order (a named data set's validation "
           "split is drawn once, with seed 0, when it is converted)", MODEL,
           nonnegative_int, metavar="N"),
    Option("device", "auto", "where the steps run (auto: a GPU when CuPy sees one)", MODEL,
           choices=DEVICES),
    Option("eval_every", 1, "evaluate every N epochs (and after the last)", MODEL,
           positive_int, metavar="N"),
    Option("layers", "fast", "the layers forward and backward run on: fast (nets/: Numba and "
           "GEMM kernels, cuDNN on a GPU) or plain (their NumPy twins in nets/plain.py, the "
           "formulas written out: slower, on the CPU in fp32, without --cuda-graph or "
           "--bn-group); either way the same arena, optimizer, all-reduce and checkpoints",
           MODEL, choices=("fast", "plain")),

    # ----- optimizer, schedule and precision -----
    Option("optimizer", "sgd", "SGD with momentum; LARS (per-layer trust ratio on SGD); LAMB; "
           "neumann (Krishnan et al.: --momentum caps mu, the warm-up epochs are its SGD "
           "burn-in); nlcg (preconditioned nonlinear conjugate gradients, Adya et al.); each "
           "one fused kernel over the parameter arena", OPTIM, choices=OPTIMIZERS),
    Option("lr", 0.1, "peak learning rate (after warm-up), for the batch --lr-ref-batch when "
           "that is given", OPTIM, positive_float),
    Option("lr_ref_batch", None, "linear scaling rule: peak lr = LR * batch-size / N "
           "(default: no scaling)", OPTIM, positive_int, metavar="N"),
    Option("momentum", 0.9, "momentum coefficient (SGD, LARS; Neumann: the cap of mu)", OPTIM,
           fraction),
    Option("nesterov", False, "Nesterov momentum (SGD and LARS)", OPTIM, kind="switch"),
    Option("weight_decay", 5e-4, "L2 penalty, not applied to biases and BatchNorm gamma/beta",
           OPTIM, nonnegative_float),
    Option("label_smoothing", 0.0, "the target's share spread evenly over the classes",
           OPTIM, fraction),
    Option("warmup_epochs", 1.0, "linear learning-rate warm-up, in epochs", OPTIM,
           nonnegative_float),
    Option("lars_eta", 0.001, "LARS trust coefficient: local lr = eta |w| / (|g| + wd |w| + "
           "eps); biases and BatchNorm gamma/beta take neither LARS nor weight decay", OPTIM,
           positive_float),
    Option("lars_eps", 1e-9, "LARS: the eps of the trust ratio", OPTIM, nonnegative_float),
    Option("schedule", "cosine", "decay after warm-up: cosine to 0, poly (power --poly-power) "
           "to 0, step (x0.1 at each of --milestones), constant; each step takes the rate at "
           "the epoch position it ends at (a cosine or poly run's last step at 0, a milestone "
           "from the step that reaches it)", OPTIM,
           choices=("cosine", "poly", "step", "constant")),
    Option("poly_power", 2.0, "--schedule poly: lr = peak * (1 - t) ** P", OPTIM,
           positive_float, metavar="P"),
    Option("milestones", (), "epochs at which --schedule step multiplies lr by 0.1", OPTIM,
           positive_float, nargs="+", metavar="EPOCH"),
    Option("precision", "fp32", "fp16: fp16 activations and working weights, fp32 master "
           "weights, BatchNorm statistics and loss (mixed precision); fp64: everything in "
           "float64, on the CPU, to check a run against a float64 reference", OPTIM,
           choices=tuple(DTYPES)),
    Option("loss_scale", None, "multiply the loss gradient by S (unscaled in the update), or "
           "'dynamic' (from 2^16, halved and the step skipped on an inf or NaN in the summed "
           "gradient, doubled after 2000 clean steps); default: dynamic where fp16 carries "
           "gradients (--precision fp16, or --comm-dtype fp16: each rank's share would fall "
           "into fp16's subnormals), else 1", OPTIM, loss_scale, metavar="S|dynamic"),
    Option("cuda_graph", False, "on a GPU with one rank: replay forward, loss and backward "
           "from CUDA graphs captured after 2 eager steps (mpitrain/graph.py); the run says "
           "when a model cannot be captured (fp32 fully connected layers) and runs it "
           "eagerly", OPTIM, kind="on-off"),

    # ----- the run around the loop -----
    Option("run_dir", None, "where config.json, environment.json, metrics.jsonl and the "
           "checkpoints go; not given: runs/<timestamp>, or with --resume PATH the run directory "
           "PATH is or lies in", RUN, path, metavar="DIR"),
    Option("checkpoint_every", 1, "write a checkpoint every N epochs and after the last (0: "
           "only on a stop signal: SIGTERM, SIGINT, SIGUSR1)", RUN, nonnegative_int,
           metavar="N"),
    Option("keep_checkpoints", 3, "keep the newest K checkpoints", RUN, positive_int, metavar="K"),
    Option("resume", None, "continue from the newest complete checkpoint in --run-dir (auto) "
           "or from PATH (a checkpoint file, or a run directory: its newest complete "
           "checkpoint); the global batch must be the same, the number of ranks may differ",
           RUN, path, metavar="auto|PATH"),
    Option("trace", None, "write a Chrome-trace timeline per rank: FILE.rankN.json for "
           "FILE.json (or FILE without an extension; another one is refused), or "
           "DIR/trace.rankN.json for a directory or a name ending in /", RUN, trace_file,
           metavar="FILE"),
    Option("collective_timeout", None, "end the job (MPI Abort) when no step, evaluation or "
           "checkpoint completes for S seconds", RUN, positive_float, metavar="S"),
    Option("stop_grace", None, "after a stop signal (SIGTERM, SIGINT, SIGUSR1), end the job "
           "at once if this rank has not reached the next step within S seconds (it is "
           "blocked, waiting for a rank that is gone); default: 4 x the longest step or epoch "
           "end seen, at least 30 s", RUN, positive_float, metavar="S"),
    Option("log_every", None, "a progress line and a metrics.jsonl record every N steps "
           "(default: 4 per epoch of 100 steps or more, else 1 per epoch)", RUN, positive_int,
           metavar="N"),

    # ----- communication -----
    Option("ranks_per_node", None, "treat ranks r with equal r // K as one node (exercises "
           "the multi-node algorithms on one host); default: the ranks sharing memory form a "
           "node", COMM, positive_int, metavar="K"),
    Option("ranks_per_gpu", None, "let K consecutive ranks of a node share each GPU, their "
           "collectives through MPI (staged through host memory) instead of NCCL, which "
           "refuses two ranks on one GPU; K must divide the node's ranks (default: a GPU per "
           "rank)", COMM, positive_int, metavar="K"),
    Option("allreduce", "hybrid", "gradient all-reduce algorithm (hybrid: chosen per bucket "
           "from size and topology, see mpitrain/comm/algorithms.py)", COMM, choices=ALLREDUCE),
    Option("fusion_threshold", 4 << 20, "gradients are summed in buckets of about this many "
           "bytes of the gradient arena (slices of it, no packing); auto: the first steps try "
           "sizes from 16 KiB to 64 MiB and the fastest is kept (printed, and saved in "
           "metrics.jsonl and checkpoints)", COMM, fusion_threshold, metavar="BYTES"),
    Option("overlap", "auto", "sum the gradient buckets during backward (--overlap) or after "
           "it (--no-overlap); auto: during on a GPU, after on a CPU, where the ranks' cores "
           "have no idle time to hide the sum in", COMM, kind="on-off"),
    Option("comm_dtype", "fp32", "dtype of the gradients on the wire (fp16 halves the bytes; "
           "each rank's gradient is divided by the ranks before the sum; fp32 sends fp64 "
           "under --precision fp64)", COMM,
           choices=("fp32", "fp16")),
    Option("compress", "none", "topk: each rank sends only the --density largest fraction of "
           "each gradient bucket (indices and values, all-gathered) and keeps the rest as a "
           "residual added to its next gradient", COMM, choices=("none", "topk")),
    Option("density", 0.01, "with --compress topk: the fraction of each bucket sent, in "
           "(0, 1]", COMM, density, metavar="D"),
    Option("compress_warmup", 0, "with --compress topk: dense sums for the first EPOCHS "
           "epochs", COMM, nonnegative_int, metavar="EPOCHS"),
    Option("check_replicas", 0, "every N steps compare a checksum of the master weights "
           "across ranks and stop if they differ (0: never)", COMM, nonnegative_int,
           metavar="N"),
    Option("bn_group", 1, "BatchNorm batch statistics over groups of G consecutive ranks (1: "
           "per rank)", COMM, positive_int, metavar="G"),
    Option("shard_update", False, "weight-update sharding: the gradients are reduce-scattered, "
           "each rank updates 1/N of the weights and holds only that part's optimizer state, "
           "then the weights are all-gathered (mpitrain/shard.py); fp32 on the wire, after "
           "backward", COMM, kind="switch"),
)

BY_NAME = {o.name: o for o in OPTIONS}
DEFAULTS = {o.name: o.default for o in OPTIONS}
GROUPS = tuple(dict.fromkeys(o.group for o in OPTIONS))


class Config(SimpleNamespace):
    """The values of a run's train options, read as attributes (cfg.batch_size).
    Config(**values) takes the defaults for what is not given and checks every value
    given (Option.convert); an unknown name or a bad value raises ValueError naming the
    flag."""

    def __init__(self, **values):
        unknown = sorted(set(values) - set(BY_NAME))
        if unknown:
            raise ValueError(f"unknown training options: {', '.join(unknown)}")
        checked = dict(DEFAULTS)
        for name, value in values.items():
            try:
                checked[name] = BY_NAME[name].convert(value)
            except ValueError as e:
                raise ValueError(f"{BY_NAME[name].flag}: {e}") from None
        super().__init__(**checked)

    def as_dict(self):
        return dict(vars(self))

    def changed(self):
        """{name: value} of the options not at their defaults."""
        return {k: v for k, v in vars(self).items() if v != DEFAULTS[k]}


def add_arguments(parser, names=None):
    """The options `names` (all of them by default) as flags of `parser`; all of them
    in their groups, as train's --help shows them."""
    chosen = [o for o in OPTIONS if names is None or o.name in names]
    for group in GROUPS:
        members = [o for o in chosen if o.group == group]
        if members:
            target = parser.add_argument_group(group) if names is None else parser
            for o in members:
                o.add_to(target)


def markdown():
    """The docs' table of every train option, a section per group."""
    lines = ["# train options", "",
             "Made from mpitrain/options.py by `python -m mpitrain.options > "
             "docs/train-options.md`; `python -m mpitrain train --help` says the same.", ""]
    for group in GROUPS:
        lines += [f"## {group[0].upper()}{group[1:]}", "", "| flag | default | meaning |",
                  "|---|---|---|"]
        for o in OPTIONS:
            if o.group == group:
                cells = (f"`{usage(o)}`", describe_default(o), o.help)
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def usage(option):
    """How the flag is written: `--crop-scale MIN MAX`, `--[no-]augment`, ..."""
    if option.kind == "switch":
        return option.flag
    if option.kind == "on-off":
        return f"--[no-]{option.flag[2:]}"
    if option.choices:
        value = "|".join(option.choices)
    elif isinstance(option.metavar, tuple):
        value = " ".join(option.metavar)
    else:
        value = option.metavar or metavar(option.parse, option.name)
    return f"{option.flag} {value}" + (" ..." if option.nargs == "+" else "")


def describe_default(option):
    if option.default is None or option.default == ():
        return "–"
    if option.kind != "value":
        return "on" if option.default is True else "off" if option.default is False \
            else str(option.default)
    return f"`{option.default}`"


if __name__ == "__main__":
    print(markdown(), end="")
