"""`python -m mpitrain plot RUN_DIR`: PNG curves of a run from its metrics.jsonl.

    loss.png        training loss per logged step (x: epochs), validation loss per evaluation
    accuracy.png    training top-1 per logged step (of the images trained on since the
                    previous record; null in the records of an older run's CUDA graphs),
                    validation top-1 / top-5 per evaluation
    lr.png          learning rate (and the loss scale, when there is one)
    throughput.png  images/s, and the time per step of each phase stacked (the
                    all-reduce's own time drawn beside them: it runs behind backward
                    where it overlaps (on a GPU, or --overlap), else within the "comm"
                    phase, the step's wait for it)

and `plot_batch_study`: the large-batch study's top-1 against the global batch.
"""
import json
import math
import os

from ..files import output_problem, write_atomic


# phases of a step record that overlap the others: drawn as lines, not stacked
BESIDE = {"bucket": "all-reduce (its own time)"}


def stacked_phases(steps):
    """The phases of the step records whose times add up to the step, in order."""
    return sorted({k for r in steps for k in r.get("time", {})} - set(BESIDE))


class PlotError(RuntimeError):
    """No metrics to plot, or no matplotlib."""


def pyplot():
    """matplotlib.pyplot drawing into files (the Agg backend)."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("plot needs matplotlib: pip install matplotlib "
                        "(or pip install -e '.[plot]' in the checkout)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def train_loss_label(run_dir):
    """"train loss", with the run's label smoothing where its config.json has one: the
    training loss is that of the smoothed targets, the validation loss the labels'."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            eps = json.load(f).get("label_smoothing") or 0
    except (OSError, ValueError, AttributeError):
        eps = 0
    return "train loss" + (f" (label smoothing {eps:g})" if eps else "")


def plot_run(run_dir, out=None):
    """Write the PNG files into `out` (default run_dir); returns their paths. run_dir may
    also name the run's metrics.jsonl itself."""
    if os.path.basename(run_dir) == "metrics.jsonl" and os.path.isfile(run_dir):
        run_dir = os.path.dirname(run_dir) or "."
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise PlotError(f"{path} does not exist: RUN_DIR must be a training run's --run-dir")
    records = read_records(path)
    plt = pyplot()
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not steps:
        raise PlotError(f"{path} holds no step records yet")
    out = out or run_dir
    problem = (f"--out {out} is a file; give a directory for the PNG files"
               if os.path.isfile(out) else output_problem(os.path.join(out, "loss.png")))
    if problem:
        raise PlotError(problem)
    per_epoch = steps_per_epoch(steps, evals, run_dir)
    x = [r["global_step"] / per_epoch for r in steps]
    written = []

    def figure(name, title, ylabel, draw):
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        draw(ax)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        target = os.path.join(out, name)
        write_atomic(target, lambda tmp: fig.savefig(tmp, format="png"))
        plt.close(fig)
        written.append(target)

    def loss(ax):
        ax.plot(x, [r["loss"] for r in steps], marker=".", label=train_loss_label(run_dir))
        notes = ["training loss not finite"] if all(r["loss"] is None for r in steps) else []
        scored = [r for r in evals if r.get("loss") is not None]
        if scored:
            ax.plot([r["epoch"] for r in scored], [r["loss"] for r in scored], marker="o",
                    label="val loss")
        elif evals:
            notes.append("validation loss " + ("not finite" if any("loss" in r for r in evals)
                                               else "not in this metrics.jsonl (an older run)"))
        if notes:
            missing(ax, "; ".join(notes))
    figure("loss.png", "training and validation loss", "loss", loss)

    def accuracy(ax):
        counted = [(xi, r["top1"]) for xi, r in zip(x, steps) if r.get("top1") is not None]
        if counted:
            ax.plot(*zip(*[(xi, 100 * a) for xi, a in counted]), marker=".", label="train top1")
        else:
            missing(ax, "training accuracy not recorded: " + (
                "null in these records (an older run with --cuda-graph)"
                if any("top1" in r for r in steps)
                else "not in this metrics.jsonl (an older run)"))
        for key in ("top1", "top5"):
            scored = [(r["epoch"], 100 * r[key]) for r in evals if r.get(key) is not None]
            if scored:
                ax.plot(*zip(*scored), marker="o", label=f"val {key}")
        ax.set_ylim(0, 100)
    figure("accuracy.png", "training and validation accuracy", "accuracy (%)", accuracy)

    def lr(ax):
        ax.plot(x, [r["lr"] for r in steps], label="learning rate")
        scales = [r.get("loss_scale") for r in steps]
        if any(s is not None for s in scales):
            twin = ax.twinx()
            twin.semilogy(x, scales, color="tab:red", label="loss scale")
            twin.set_ylabel("loss scale")
    figure("lr.png", "learning rate", "learning rate", lr)

    def throughput(ax):
        ax.plot(x, [r["images_per_s"] for r in steps], marker=".", label="images/s")
        phases = stacked_phases(steps)
        if phases:
            twin = ax.twinx()
            bottom = [0.0] * len(steps)
            for phase in phases:
                top = [b + 1e3 * r.get("time", {}).get(phase, 0.0) for b, r in zip(bottom, steps)]
                twin.fill_between(x, bottom, top, alpha=0.25, step="mid", label=phase)
                bottom = top
            for phase, label in BESIDE.items():
                if any(phase in r.get("time", {}) for r in steps):
                    twin.plot(x, [1e3 * r.get("time", {}).get(phase, 0.0) for r in steps],
                              linestyle="--", label=label)
            twin.set_ylabel("ms per step (rank 0), by phase")
            twin.legend(loc="lower right", fontsize="small")
    figure("throughput.png", "throughput", "images/s", throughput)
    return written


def missing(ax, text):
    """Say on the axes that a curve is not drawn, and why."""
    ax.text(0.5, 0.04, text, transform=ax.transAxes, ha="center", va="bottom",
            fontsize="small", color="dimgray")


# what plot reads of a record, by its kind: whole numbers for the x axis, numbers (or null:
# not measured, not finite) for the curves; a record lacking one of `REQUIRED` is refused
WHOLE, NUMBER, PHASES = "a whole number", "a number or null", "an object of phase times"
FIELDS = {"step": {"epoch": WHOLE, "step": WHOLE, "global_step": WHOLE, "loss": NUMBER,
                   "lr": NUMBER, "images_per_s": NUMBER, "top1": NUMBER,
                   "loss_scale": NUMBER, "time": PHASES},
          "eval": {"epoch": WHOLE, "global_step": WHOLE, "loss": NUMBER, "top1": NUMBER,
                   "top5": NUMBER}}
REQUIRED = {"step": ("epoch", "step", "global_step", "loss", "lr", "images_per_s"),
            "eval": ("epoch",)}


def read_records(path):
    """The records of metrics.jsonl `path`, each checked for what plot reads of it (a file
    edited or written by something else would end in a traceback): PlotError naming the
    file and line of one that is not a JSON object or has a field of the wrong kind. A
    line that is not JSON is passed over, as metrics.read_metrics does (a torn last line)."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            problem = record_problem(record)
            if problem:
                raise PlotError(f"{path}, line {number}: {problem}; it is not a record a "
                                f"training run writes: remove or mend that line")
            records.append(record)
    return records


def record_problem(record):
    """What is wrong with one metrics record for plot, or None."""
    if not isinstance(record, dict):
        return f"{type(record).__name__} where a JSON object was expected"
    kind = record.get("kind")
    fields = FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:              # another kind (fusion): plot reads nothing of it
        return None
    record_of = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} record"
    for key in REQUIRED[kind]:
        if key not in record:
            return f"{record_of} without {key!r}"
    for key, want in fields.items():
        if key in record and not _is(record[key], want):
            return f"{key!r} of {record_of} is {record[key]!r}, not {want}"
    return None


def _is(value, want):
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if want == WHOLE:
        return isinstance(value, int) and not isinstance(value, bool)
    if want == PHASES:
        return isinstance(value, dict) and all(map(number, value.values()))
    return value is None or number(value)


def steps_per_epoch(steps, evals=(), run_dir=None):
    """The x axis' unit, in steps. From the records where they say it: global_step =
    (epoch - 1) * steps_per_epoch + step of a step record past the first epoch, or
    epoch * steps_per_epoch of an evaluation's. A run stopped in its first epoch has
    neither: then its training images over its global batch (run_dir's config.json names
    the file and the batch, the loader drops a last partial batch), and where that file
    is not found, the last step logged (an epoch as long as the steps seen)."""
    for r in steps:
        if r["epoch"] > 1 and r["global_step"] > r["step"]:
            return (r["global_step"] - r["step"]) / (r["epoch"] - 1)
    for r in evals:
        if r.get("global_step", 0) > 0 and r["epoch"] > 0:
            return r["global_step"] / r["epoch"]
    seen = max(1, max(r["step"] for r in steps))
    whole = run_dir and _steps_of_data(run_dir)
    return whole if whole and whole >= seen else seen


def _steps_of_data(run_dir):
    """Steps per epoch of the run in run_dir from its config.json: its training file's
    images // its global batch; None where that cannot be read. The file's path is as the
    run was given it, found from where the run started (its checkpoints record that)."""
    from ..checkpoint import CheckpointError, checkpoints, read_config
    from ..checks import describe_file, run_data_files
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            saved = json.load(f)
        made = checkpoints(run_dir)
        if made:
            saved.setdefault("start_dir", read_config(made[-1]).get("start_dir"))
        images = describe_file(run_data_files(saved)[0])[0]
        return images // saved["batch_size"] or None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CheckpointError):
        return None


def diverged_notes(rows, config):
    """(batch, top-1 in %, "config: k/n diverged") of each point of `config` with
    diverged runs: its mean is over the others; a point with none left is drawn at 0."""
    return [(r["batch"], 100 * r["top1_mean"] if r["top1_runs"] else 0.0,
             f"{config}: {r['diverged']}/{r['runs']} diverged")
            for r in rows if r["config"] == config and r["diverged"]]


def plot_batch_study(rows, path, title, chance):
    """Top-1 (mean over the seeds that did not diverge, bars: one standard deviation)
    against the global batch, one line per recipe of mpitrain.tools.study, the points with
    diverged runs noted at the foot of their batch; `rows` as study.summarise makes them.
    The PNG is written under a temporary name and renamed."""
    plt = pyplot()
    from matplotlib.ticker import ScalarFormatter
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    notes = {}                      # batch: the divergence notes drawn there so far
    for config in dict.fromkeys(r["config"] for r in rows):
        points = [r for r in rows if r["config"] == config and r["top1_runs"]]
        bars = ax.errorbar([r["batch"] for r in points], [100 * r["top1_mean"] for r in points],
                           yerr=[0 if math.isnan(r["top1_sd"]) else 100 * r["top1_sd"]
                                 for r in points], marker="o", capsize=3, label=config)
        color = bars.lines[0].get_color()
        # each batch's notes at the foot of its column, one above another, in their colours
        for batch, y, text in diverged_notes(rows, config):
            if y == 0:
                ax.plot([batch], [y], marker="x", color=color, clip_on=False)
            above = notes[batch] = notes.get(batch, -1) + 1
            ax.annotate(text, (batch, 0), textcoords="offset points", xytext=(4, 4 + 9 * above),
                        fontsize="x-small", color=color, annotation_clip=False)
    ax.axhline(100 * chance, color="grey", linestyle=":", label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["batch"] for r in rows}))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.set_xlabel("global batch size")
    ax.set_ylabel("validation top-1 (%)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
