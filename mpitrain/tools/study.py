"""`python -m mpitrain study large-batch`: does top-1 hold as the global batch grows?

The claim of Jia et al. (after Goyal et al. and You et al.) at small scale: train
resnet_small for the same number of epochs at global batches from 32 to the largest
the data allows (powers of two leaving MIN_STEPS steps an epoch, or the batches a
plan names), so a larger batch takes fewer, larger steps, with the seven recipes of
CONFIGS (the digits run the first four; PLANS says what each data set runs):

    sgd        SGD with momentum, the linear scaling rule (lr = 0.1 x batch / 32)
    lars       LARS (trust ratio eta ||w|| / ||g||), lr = 1.0 x sqrt(batch / 32)
    lars-fp16  the same under fp16 mixed precision with dynamic loss scaling
    lamb       LAMB, lr = 0.01 x sqrt(batch / 32)
    nesterov   SGD with Nesterov momentum, the linear scaling rule
    neumann    Neumann, lr = 0.1 x sqrt(batch / 32)
    nlcg       NLCG, lr = 0.01 x sqrt(batch / 32)

all with linear warm-up over the first eighth of the epochs, then polynomial decay
(power 2) to zero, and several seeds per point. Each run is an ordinary
`mpiexec -np K python -m mpitrain train ...` job (K = --ranks-per-run, 1 by default)
started through the venv's recorded mpiexec; --ranks // K of them run at once, each
rank with its share of the cores in threads. One-rank runs side by side are the
fastest way through many small runs: a run has no all-reduce to wait for, and its
whole batch goes through each layer's GEMM at once.

What it writes into --out, once every run is done (each file written whole, under a
temporary name, then renamed):
    results.md     the table (and the recipe), results.csv the same table
    accuracy.png   top-1 against the global batch, one line per recipe
    commands.sh    the exact command of every run
    runs/NAME/     each run's directory (config.json, metrics.jsonl), log.txt, and
                   study-result.json once it has ended (what --resume keeps)
"""
import csv
import io
import json
import math
import os
import shlex
import socket
import shutil
import subprocess
import sys
import time
from importlib.util import find_spec

from mpitrain.files import save_json, save_text

SMALLEST_BATCH = 32
MIN_STEPS = 2           # steps an epoch at the largest batch
MODEL = "resnet_small"

# recipe -> its train options; "lr" is the peak rate at SMALLEST_BATCH and "scaling" how
# it grows with the batch (linear: Goyal et al.; sqrt: the LAMB paper's rule, which
# LARS, whose step is already relative to each layer's weights, follows here too)
CONFIGS = {
    "sgd": dict(optimizer="sgd", precision="fp32", lr=0.1, scaling="linear"),
    "nesterov": dict(optimizer="sgd", nesterov=True, precision="fp32", lr=0.1, scaling="linear"),
    "lars": dict(optimizer="lars", precision="fp32", lr=1.0, scaling="sqrt"),
    "lars-fp16": dict(optimizer="lars", precision="fp16", lr=1.0, scaling="sqrt"),
    "lamb": dict(optimizer="lamb", precision="fp32", lr=0.01, scaling="sqrt"),
    "neumann": dict(optimizer="neumann", precision="fp32", lr=0.1, scaling="sqrt"),
    "nlcg": dict(optimizer="nlcg", precision="fp32", lr=0.01, scaling="sqrt"),
}
# the same for every run (weight decay 5e-4, momentum 0.9, LARS eta 0.001: train's defaults)
COMMON = dict(model=MODEL, schedule="poly", checkpoint_every=0)
WARMUP_FRACTION = 1 / 8
FULL = dict(epochs=16, seeds=3)
QUICK = dict(epochs=4, seeds=1)

# What the study runs on each data set (anything not named: "digits"' plan).
#   recipes     the CONFIGS compared
#   batches     the global batches (None: powers of two from SMALLEST_BATCH up to the
#               largest leaving MIN_STEPS steps an epoch)
#   lr_factors  the sweep: each recipe's rule times these, at every batch, seed 0; the
#               best (top-1 on the validation file) is the point's learning rate
#   widen       while a point's best is the lowest or the highest factor it has tried,
#               one more run at half or twice it, up to `widen` more on each side, so that
#               no rate beside the chosen one is better
#   decide      the batches whose best learning rate is run at `seeds` seeds ("all", or
#               "ends": the smallest and the largest, which decide the conclusion)
# Fashion-MNIST's plan: 63 sweep runs (7 recipes x 3 batches x 3 factors), those past the
# sweep's edges, and 28 seed runs (2 more seeds at the 2 end batches), each 3 epochs of
# 54,000 images.
PLANS = {
    "digits": dict(recipes=("sgd", "lars", "lars-fp16", "lamb"), batches=None,
                   lr_factors=(1.0,), widen=0, decide="all", full=FULL, quick=QUICK),
    "fashion-mnist": dict(recipes=("sgd", "nesterov", "lars", "lars-fp16", "lamb", "neumann",
                                   "nlcg"),
                          batches=(128, 1024, 4096), lr_factors=(0.5, 1.0, 2.0), widen=6,
                          decide="ends", full=dict(epochs=3, seeds=3),
                          quick=dict(epochs=1, seeds=1, batches=(128, 4096),
                                     recipes=("sgd", "lars"), lr_factors=(1.0,),
                                     widen=0)),
}


class StudyError(ValueError):
    """An option or input the study cannot work with, found before any run."""


# ----- the grid -----
def batch_sizes(num_train, quick=False):
    """Powers of two from SMALLEST_BATCH up to the largest leaving MIN_STEPS steps an
    epoch; quick: the smallest, a middle one and the largest."""
    sizes = []
    batch = SMALLEST_BATCH
    while num_train // batch >= MIN_STEPS:
        sizes.append(batch)
        batch *= 2
    if quick and len(sizes) > 3:
        sizes = [sizes[0], sizes[len(sizes) // 2], sizes[-1]]
    return sizes


def plan_for(data, quick=False):
    """The plan (PLANS) of the data set named `data`, its --quick variant with quick."""
    plan = dict(PLANS.get(data, PLANS["digits"]))
    plan.update(plan["quick"] if quick else plan["full"])
    return plan


def plan_batches(plan, num_train, quick=False):
    """The plan's batches that the data allows (MIN_STEPS steps an epoch at least)."""
    if plan["batches"] is None:
        return batch_sizes(num_train, quick)
    return [b for b in plan["batches"] if num_train // b >= MIN_STEPS]


def peak_lr(config, batch, factor=1.0):
    c = CONFIGS[config]
    ratio = batch / SMALLEST_BATCH
    return factor * c["lr"] * (ratio if c["scaling"] == "linear" else math.sqrt(ratio))


def train_options(config, batch, seed, epochs, data, run_dir, factor=1.0):
    """The `train` options of one run, as flag -> value; factor: the sweep's multiple
    of the recipe's rule."""
    c = CONFIGS[config]
    options = dict(COMMON, data=data, batch_size=batch, seed=seed, epochs=epochs,
                   eval_every=epochs, warmup_epochs=epochs * WARMUP_FRACTION,
                   optimizer=c["optimizer"], precision=c["precision"], run_dir=run_dir)
    if c.get("nesterov"):
        options["nesterov"] = True
    if c["scaling"] == "linear":        # the trainer applies the rule itself
        options.update(lr=float(f"{c['lr'] * factor:.6g}"), lr_ref_batch=SMALLEST_BATCH)
    else:
        options["lr"] = float(f"{peak_lr(config, batch, factor):.6g}")  # as the flag writes it
    return options


def best_factor(sweep, results):
    """The factor of the sweep {factor: run name} whose run reached the best top-1 (a
    diverged run never wins; the smaller factor wins a tie); None if every run diverged."""
    done = [(results[name]["top1"], -factor, factor) for factor, name in sweep.items()
            if not results[name].get("diverged")]
    return max(done)[2] if done else None


def past_the_edge(sweep, results, lr_factors, widen):
    """The factor one step past the sweep's edge where its best run is at that edge (half
    the lowest, twice the highest); None where the runs on either side of the best are no
    better, or the sweep has gone `widen` factors of 2 past lr_factors on that side.
    sweep: {factor: run name} of one point; a diverged run counts as the worst, so a point
    where every run diverged goes lower."""
    best = best_factor(sweep, results)
    low, high = min(sweep), max(sweep)
    if best in (None, low) and low > min(lr_factors) / 2 ** widen:
        return low / 2
    if best == high and high < max(lr_factors) * 2 ** widen:
        return high * 2
    return None


def flags(options):
    """train's command line for `options` (True / False: --flag / --no-flag)."""
    line = []
    for key, value in options.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            line.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            line += [f"--{flag}", f"{value:g}" if isinstance(value, float) else str(value)]
    return line


# ----- checks before any run -----
def check_inputs(data, val_data, data_dir, out, resume=False):
    """(training file, number of training images, number of classes, the image size a
    run takes from the file: checks.describe_file); refuses
    (StudyError) a data file that is missing or not mpitrain's format, a validation file
    that is the training file, too few images,
    an --out that cannot be written and, without resume, one that holds an earlier or a
    running study's runs, before anything is written (a named data set converted)."""
    from mpitrain.checks import ConfigError, check_validation_file, describe_file, resolve_data
    from mpitrain.datasets.h5format import FormatError
    from mpitrain.options import Config
    if find_spec("matplotlib") is None:
        raise StudyError("the study plots its results with matplotlib: pip install matplotlib "
                         "(or pip install -e '.[plot]' in the checkout)")
    problem = writable_problem(out) or (None if resume else earlier_study(out))
    if problem:
        raise StudyError(problem)
    try:        # a named data set is converted here, on first use
        train_file, val_file, _ = resolve_data(Config(data=data, data_dir=data_dir,
                                                      val_data=val_data))
        check_validation_file(train_file, val_file)     # each run would refuse it
        num_train, classes, size = describe_file(train_file)
    except (ConfigError, FormatError) as e:
        raise StudyError(str(e)) from None
    if len(batch_sizes(num_train)) < 2:
        raise StudyError(f"{train_file} has {num_train} training images: the study needs at "
                         f"least {MIN_STEPS * SMALLEST_BATCH * 2} to compare two batch sizes")
    return train_file, num_train, len(classes), size


def earlier_study(out, held=False):
    """The refusal of a fresh study into `out` where an earlier study's runs are (it would
    remove them to run its own of the same names), else None; where those are a study's
    running now (it holds --out: config.RunLock), its refusal. held: this study holds
    --out already."""
    from mpitrain.config import RunDirInUse, RunLock
    runs = os.path.join(out, "runs")
    found = [n for n in os.listdir(runs) if os.path.isdir(os.path.join(runs, n))] \
        if os.path.isdir(runs) else []
    if found and not held:
        try:
            RunLock(out, flag="--out").release()
        except RunDirInUse as e:
            return str(e)
    if found:
        return (f"--out {out} holds an earlier study's runs ({len(found)} under {runs}): "
                f"keep the results of those with the same options with --resume (a stopped "
                f"study goes on where it stopped), or give another --out, or remove {out}")
    return None


def study_lock(out):
    """--out made and held by this study (config.RunLock) until it ends: a second study
    into it is refused while this one runs."""
    from mpitrain.config import RunDirInUse, RunLock
    os.makedirs(out, exist_ok=True)
    try:
        return RunLock(out, flag="--out")
    except RunDirInUse as e:
        raise StudyError(str(e)) from None


def writable_problem(out):
    """Why --out cannot hold the results (None: it can), without creating it."""
    target = os.path.abspath(out)
    if os.path.exists(target):
        if not os.path.isdir(target):
            return f"--out {out} is a file, not a directory; choose another name"
        return None if os.access(target, os.W_OK | os.X_OK) else \
            f"--out {out} is not writable; choose another directory"
    parent = os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        return f"--out {out} cannot be created ({parent} is not a writable directory); " \
               f"choose another directory"
    return None


# ----- running -----
class Launcher:
    """Starts `train` runs as MPI jobs of `ranks_per_run` ranks through the venv's
    mpiexec, each rank with `threads` threads."""

    def __init__(self, ranks_per_run, threads):
        from mpitrain.launcher import find_mpiexec, job_environment, launch_options, mpiexec_family
        mpiexec = find_mpiexec()
        if mpiexec is None:
            raise StudyError("no mpiexec found: run ./launch.sh setup")
        family = mpiexec_family(mpiexec)
        self.ranks = ranks_per_run
        self.prefix = [mpiexec, *launch_options(ranks_per_run, family), "-np",
                       str(ranks_per_run), sys.executable, "-m", "mpitrain", "train"]
        self.env = job_environment(family, threads)
        # the runs' ranks end their jobs when the study is gone (control.LauncherWatch): a
        # study killed with SIGKILL cannot end them itself
        self.env.update(MPITRAIN_LAUNCHER_PID=str(os.getpid()),
                        MPITRAIN_LAUNCHER_HOST=socket.gethostname())
        self.threads = {k: self.env[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                 "NUMBA_NUM_THREADS")}

    def command(self, options):
        return self.prefix + flags(options)

    def shell_line(self, options):
        """The command as one shell line, with its thread variables."""
        return " ".join(f"{k}={v}" for k, v in self.threads.items()) + " " + \
            shlex.join(self.command(options))

    def start(self, options, log):
        with open(log, "w") as out:
            return subprocess.Popen(self.command(options), stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env)


def run_name(config, batch, seed, factor=None):
    """A run's name; factor: its place in a learning-rate sweep, where the plan has one."""
    return f"{config}-b{batch}" + (f"-lr{factor:g}x" if factor is not None else "") + f"-s{seed}"


def read_result(run_dir, log, status):
    """{top1, steps, skipped_steps} of a finished run, or {diverged: True} for one that a
    divergence ended (its metrics.jsonl ends in a "diverged" record, MetricsLog's; or in a
    final evaluation whose logits were not finite). Raises RuntimeError for any other
    failure."""
    from mpitrain.metrics import read_metrics
    path = os.path.join(run_dir, "metrics.jsonl")
    records = read_metrics(path) if os.path.exists(path) else []
    evals = [r for r in records if r.get("kind") == "eval"]
    if status == 0 and evals:
        return dict(top1=evals[-1]["top1"], steps=evals[-1]["global_step"],
                    skipped_steps=evals[-1].get("skipped_steps", 0))
    last = records[-1] if records else {}
    if status != 0 and (last.get("kind") == "diverged" or
                        last.get("kind") == "eval" and last.get("nonfinite")):
        return dict(diverged=True)
    with open(log) as f:
        text = f.read()
    raise RuntimeError(f"run {run_dir} failed (exit status {status}); its output, "
                       f"{log}, ends:\n{text[-2000:]}")


def clock(seconds):
    seconds = int(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}"


def time_left(took, pending, running, parallel):
    """Seconds until the last run ends, were each to take as long as the runs of its batch
    size have taken so far (as the runs of any size, before one of its size has ended).
    took: {name: (batch, seconds)}; pending: the options of runs not started; running:
    (options, seconds so far) of those under way."""
    def guess(options):
        same = [t for b, t in took.values() if b == options["batch_size"]]
        return sum(same or [t for _, t in took.values()]) / len(same or took)
    work = sum(map(guess, pending)) + sum(max(0.0, guess(o) - t) for o, t in running)
    return work / parallel


RESULT_FILE = "study-result.json"     # in a run's directory once the study has read it


PATHS = ("data", "data_dir", "val_data", "run_dir")      # a run's options that name files


def files(options):
    """The files and folders a run's data options name now (symbolic links followed;
    a named data set by its name), as a study records them beside the options."""
    from mpitrain.checks import PRESETS
    return {k: v if k == "data" and v in PRESETS else os.path.realpath(v)
            for k, v in options.items() if k in PATHS and k != "run_dir" and isinstance(v, str)}


def kept_result(options, ranks):
    """The result of a run that ended in an earlier study with the same options on as
    many ranks (None: there is none), read from the RESULT_FILE it wrote then: its data
    options compared as the files they named then and name now, however they are spelled
    (a record of an older study, without them, as written), its directory where the
    record lies, its ranks those its environment.json records."""
    try:
        with open(os.path.join(options["run_dir"], RESULT_FILE)) as f:
            record = json.load(f)
        earlier = dict(record["options"], run_dir=options["run_dir"])
        if "files" in record:
            same = ({k: v for k, v in earlier.items() if k not in PATHS} ==
                    {k: v for k, v in options.items() if k not in PATHS}
                    and record["files"] == files(options))
        else:
            same = earlier == options
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    same = same and recorded(options["run_dir"]).get("world_size") == ranks
    return record.get("result") if same else None


def recorded(run_dir):
    """A run's environment.json ({} where there is none): the code that made it, its
    world size, ..."""
    try:
        with open(os.path.join(run_dir, "environment.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def other_code(results):
    """', N of them made by other code than this checkout's (...): ...' for the kept runs
    of `results` whose recorded code is not this checkout's; '' where there is none."""
    from mpitrain.config import source_version
    code = source_version()
    other = [r["source"] for r in results.values() if r.get("kept") and r["source"] != code]
    return (f", {len(other)} of them made by other code than this checkout's ({code}): "
            f"{', '.join(sorted({s or 'not recorded' for s in other}))}" if other else "")


def run_all(runs, launcher, parallel, say=print, resume=False):
    """Run every (name, options) of `runs`, `parallel` at a time; returns {name: result}.
    Prints a line as each run ends: runs and points done, elapsed time, estimated time left.
    resume: a run whose directory holds an earlier study's result for the same options
    is not run again (its result is marked kept)."""
    points = {}
    for name, _ in runs:
        points.setdefault(name.rsplit("-s", 1)[0], []).append(name)
    pending, running, results, took = [], {}, {}, {}
    for name, options in runs:
        kept = kept_result(options, launcher.ranks) if resume else None
        if kept is None:
            pending.append((name, options))
        else:
            results[name] = dict(kept, kept=True,
                                 source=recorded(options["run_dir"]).get("source"))
    if results:
        say(f"study: {len(results)} of {len(runs)} runs ended in an earlier study with the "
            f"same options; their results are kept (--resume){other_code(results)}",
            flush=True)
    redone = [name for name, options in pending
              if os.path.exists(os.path.join(options["run_dir"], RESULT_FILE))]
    if resume and redone:
        say(f"study: {len(redone)} run(s) ended in an earlier study with other options or "
            f"data, or another --ranks-per-run ({', '.join(redone[:3])}"
            f"{', ...' * (len(redone) > 3)}): they run again, in place of those", flush=True)
    start = time.monotonic()
    try:
        while pending or running:
            while pending and len(running) < parallel:
                name, options = pending.pop(0)
                if os.path.isdir(options["run_dir"]):     # a previous study's run of the
                    shutil.rmtree(options["run_dir"])     # same name
                os.makedirs(options["run_dir"])
                log = os.path.join(options["run_dir"], "log.txt")
                running[name] = (launcher.start(options, log), options, log, time.monotonic())
            time.sleep(0.2)
            for name, (proc, options, log, began) in list(running.items()):
                status = proc.poll()
                if status is None:
                    continue
                del running[name]
                results[name] = result = read_result(options["run_dir"], log, status)
                save_json(os.path.join(options["run_dir"], RESULT_FILE),
                          dict(options=options, files=files(options), result=result),
                          sort_keys=False)
                took[name] = (options["batch_size"], time.monotonic() - began)
                done = len(results)
                elapsed = time.monotonic() - start
                eta = time_left(took, [o for _, o in pending],
                                [(o, time.monotonic() - b) for _, o, _, b in running.values()],
                                parallel)
                finished = sum(all(n in results for n in names) for names in points.values())
                outcome = "diverged" if result.get("diverged") else f"top-1 {result['top1']:.1%}"
                say(f"[{done}/{len(runs)} runs, {finished}/{len(points)} points] {name}: "
                    f"{outcome} ({time.monotonic() - began:.0f} s); elapsed {clock(elapsed)}, "
                    f"left about {clock(eta)}", flush=True)
    finally:
        for proc, *_ in running.values():       # interrupted: end the jobs still running
            proc.terminate()
        for proc, *_ in running.values():
            proc.wait()
    return results


# ----- the outputs -----
def summarise(grid, results, factors=None, sweeps=None):
    """One row per (batch, config): mean and spread of top-1 over its seeds. factors:
    {(config, batch): the sweep's best factor} (default 1); sweeps: {(config, batch):
    {factor: run name}}, each factor's seed-0 top-1 (None: diverged) kept in the row."""
    rows = []
    for (config, batch), names in grid.items():
        factor = (factors or {}).get((config, batch), 1.0)     # None: every rate diverged
        sweep = {f: results[n].get("top1") for f, n in (sweeps or {}).get((config, batch),
                                                                          {}).items()}
        done = [results[n] for n in names if not results[n].get("diverged")]
        accs = [r["top1"] for r in done]
        mean = sum(accs) / len(accs) if accs else float("nan")
        sd = math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1)) \
            if len(accs) > 1 else float("nan")
        c = CONFIGS[config]
        rows.append(dict(config=config, batch=batch, optimizer=c["optimizer"],
                         precision=c["precision"],
                         peak_lr=None if factor is None else peak_lr(config, batch, factor),
                         lr_factor=factor, sweep=sweep,
                         steps=done[0]["steps"] if done else None,
                         top1_mean=mean, top1_sd=sd, runs=len(names),
                         diverged=len(names) - len(done), top1_runs=accs,
                         skipped_steps=[r["skipped_steps"] for r in done]))
    rows.sort(key=lambda r: (r["batch"], list(CONFIGS).index(r["config"])))
    return rows


def table_csv(rows):
    out = io.StringIO()
    fields = ["batch", "config", "optimizer", "precision", "peak_lr", "steps", "top1_mean",
              "top1_sd", "runs", "diverged", "top1_runs", "skipped_steps"]
    writer = csv.DictWriter(out, fields, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({**{k: r[k] for k in fields},
                         "peak_lr": "" if r["peak_lr"] is None else f"{r['peak_lr']:.4g}",
                         "top1_mean": f"{r['top1_mean']:.4f}", "top1_sd": f"{r['top1_sd']:.4f}",
                         "top1_runs": " ".join(f"{a:.4f}" for a in r["top1_runs"]),
                         "skipped_steps": " ".join(map(str, r["skipped_steps"]))})
    return out.getvalue()


def table_markdown(rows):
    lines = ["| batch | recipe | optimizer | precision | peak lr | steps | top-1 (mean ± sd) "
             "| runs | skipped fp16 steps |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        top1 = "—" if math.isnan(r["top1_mean"]) else f"{r['top1_mean']:.1%}" + \
            ("" if math.isnan(r["top1_sd"]) else f" ± {r['top1_sd']:.1%}")
        runs = f"{r['runs']}" + (f" ({r['diverged']} diverged)" if r["diverged"] else "")
        skipped = ", ".join(map(str, r["skipped_steps"])) \
            if r["precision"] == "fp16" and r["skipped_steps"] else "—"
        lines.append(f"| {r['batch']} | {r['config']} | {r['optimizer']} | {r['precision']} | "
                     f"{'—' if r['peak_lr'] is None else format(r['peak_lr'], '.4g')} | "
                     f"{r['steps'] if r['steps'] is not None else '—'} | "
                     f"{top1} | {runs} | {skipped} |")
    return "\n".join(lines) + "\n"


def sweep_csv(rows):
    """Every sweep run: batch, recipe, factor of the rule, peak lr, top-1 (seed 0)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["batch", "config", "lr_factor", "peak_lr", "top1", "chosen"])
    for r in rows:
        for factor, top1 in sorted(r["sweep"].items()):
            writer.writerow([r["batch"], r["config"], f"{factor:g}",
                             f"{peak_lr(r['config'], r['batch'], factor):.4g}",
                             "diverged" if top1 is None else f"{top1:.4f}",
                             int(factor == r["lr_factor"])])
    return out.getvalue()


def sweep_markdown(rows):
    """The sweep as a table: each recipe's top-1 at each factor of its rule, by batch."""
    factors = sorted({f for r in rows for f in r["sweep"]})
    lines = ["| batch | recipe | " + " | ".join(f"{f:g}× rule" for f in factors) + " |",
             "|---:|---|" + "---:|" * len(factors)]
    for r in rows:
        cells = []
        for f in factors:
            top1 = r["sweep"].get(f, "")
            cell = "" if top1 == "" else "diverged" if top1 is None else f"{top1:.1%}"
            cells.append(f"**{cell}**" if f == r["lr_factor"] and cell else cell)
        lines.append(f"| {r['batch']} | {r['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def recipe_markdown(epochs, recipes=None):
    lines = [f"Every run: {MODEL}, {epochs} epochs, linear warm-up over the first "
             f"{epochs * WARMUP_FRACTION:g} epochs, then polynomial decay (power 2) to 0; "
             f"momentum 0.9 (SGD, LARS), weight decay 5e-4 (not on biases and BatchNorm), "
             f"LARS eta 0.001, LAMB betas 0.9/0.999; fp16 runs: dynamic loss scaling from 2^16.",
             "", "| recipe | optimizer | precision | peak lr at batch B |", "|---|---|---|---|"]
    for name in recipes or CONFIGS:
        c = CONFIGS[name]
        rule = f"{c['lr']:g} × B / {SMALLEST_BATCH}" if c["scaling"] == "linear" \
            else f"{c['lr']:g} × sqrt(B / {SMALLEST_BATCH})"
        optimizer = c["optimizer"] + (" (Nesterov)" if c.get("nesterov") else "")
        lines.append(f"| {name} | {optimizer} | {c['precision']} | {rule} |")
    return "\n".join(lines) + "\n"


def what_ran(results, seconds):
    """How many runs this study ran and in how long, and how many it kept (--resume)."""
    kept = sum(bool(r.get("kept")) for r in results.values())
    ran = len(results) - kept
    return (f"{ran} run{'s' * (ran != 1)} in {clock(seconds)} (min:s)"
            + (f", {kept} {'more ' * (ran > 0)}kept from an earlier study (--resume)"
               f"{other_code(results)}"
               if kept else ""))


def write_outputs(out, rows, lines, study_command, epochs, num_train, num_classes, data,
                  ran, recipes=None):
    from mpitrain.tools.plot import plot_batch_study
    header = (f"`{study_command}`: {MODEL} on {data} ({num_train} training images), "
              f"{epochs} epochs at every batch; {ran}.\n")
    swept = any(len(r["sweep"]) > 1 for r in rows)
    edges = [f"{r['config']} at {r['batch']}" for r in rows
             if len(r["sweep"]) > 1 and r["lr_factor"] in (min(r["sweep"]), max(r["sweep"]))]
    sweep = (f"\n## The learning-rate sweep\n\nTop-1 of seed 0 at each multiple of the "
             f"recipe's rule; the best (bold) is the point's learning rate above. Where the "
             f"best was the lowest or highest multiple tried, the sweep went on past it.\n\n"
             f"{sweep_markdown(rows)}"
             + (f"\nStill best at the edge of its sweep (its rate may be mistuned): "
                f"{', '.join(edges)}.\n" if edges else "")) if swept else ""
    save_text(os.path.join(out, "results.md"),
              f"# Large-batch study\n\n{header}\n{table_markdown(rows)}{sweep}\n## Recipe\n\n"
              f"{recipe_markdown(epochs, recipes)}")
    save_text(os.path.join(out, "results.csv"), table_csv(rows))
    if swept:
        save_text(os.path.join(out, "sweep.csv"), sweep_csv(rows))
    save_text(os.path.join(out, "commands.sh"),
              f"#!/bin/sh\n# Every run of: {study_command}\n# (in {os.getcwd()}); "
              f"each line is one point's run, ending with its top-1.\n"
              + "".join(f"{line}\n" for line in lines))
    plot_batch_study(rows, os.path.join(out, "accuracy.png"),
                     f"{MODEL}, {num_train} training images, {epochs} epochs", 1 / num_classes)


def large_batch(data="digits", data_dir="data", out="runs/study-large-batch", quick=False,
                epochs=None, seeds=None, ranks=None, ranks_per_run=1, augment=None,
                val_data=None, argv=(), say=print, image_size=None, resume=False):
    """The study (see the module docstring); returns the table's rows."""
    from mpitrain.checks import PRESETS
    from mpitrain.launcher import cores
    plan = plan_for(data, quick)
    epochs, seeds = epochs or plan["epochs"], seeds or plan["seeds"]
    ranks = ranks or cores()
    if SMALLEST_BATCH % ranks_per_run:
        raise StudyError(f"--ranks-per-run {ranks_per_run} does not divide the smallest batch "
                         f"{SMALLEST_BATCH}; use 1, 2, 4, 8, 16 or 32")
    if ranks < ranks_per_run:
        raise StudyError(f"--ranks {ranks} is fewer than --ranks-per-run {ranks_per_run}")
    train_file, num_train, num_classes, data_size = check_inputs(data, val_data, data_dir, out,
                                                                  resume)
    with study_lock(out):
        # again under the lock: another study may have left runs there since
        problem = None if resume else earlier_study(out, held=True)
        if problem:
            raise StudyError(problem)
        size = f"{image_size}x{image_size}" if image_size else \
            f"{data_size}x{data_size} from the data"
        parallel = ranks // ranks_per_run
        launcher = Launcher(ranks_per_run, max(1, cores() // ranks))
        batches = plan_batches(plan, num_train, quick)
        factors = plan["lr_factors"]
        deciding = batches if plan["decide"] == "all" else sorted({batches[0], batches[-1]})

        def make(config, batch, seed, factor):
            name = run_name(config, batch, seed, factor if len(factors) > 1 else None)
            options = train_options(config, batch, seed, epochs, data,
                                    os.path.join(out, "runs", name), factor)
            if data in PRESETS:
                options["data_dir"] = data_dir
            if val_data:
                options["val_data"] = val_data
            if augment is not None:
                options["augment"] = augment
            if image_size:
                options["image_size"] = image_size
            return name, options

        # the sweep at seed 0; with a single factor the seeds need no sweep, and run with it
        sweeps, runs = {}, []
        for batch in batches:
            for config in plan["recipes"]:
                for factor in factors:
                    name, options = make(config, batch, 0, factor)
                    sweeps.setdefault((config, batch), {})[factor] = name
                    runs.append((name, options))
                    if len(factors) == 1 and batch in deciding:
                        runs += [make(config, batch, seed, factor) for seed in range(1, seeds)]
        grid_size = len(batches) * len(plan["recipes"])
        say(f"study: {len(batches)} batch sizes ({', '.join(map(str, batches))}) x "
            f"{len(plan['recipes'])} recipes ({', '.join(plan['recipes'])})"
            + (f" x {len(factors)} learning rates ({', '.join(f'{f:g}' for f in factors)} x each "
               f"rule, and up to {plan['widen']} factors of 2 beyond where the best is at an "
               f"edge), then {seeds} seeds at the best of batches "
               f"{', '.join(map(str, deciding))}" if len(factors) > 1 else
               f" x {seeds} seed(s)") +
            f": {len(runs)} runs of {epochs} epochs on {train_file} ({num_train} images, "
            f"{size}) "
            f"{'first ' if len(factors) > 1 else ''}({grid_size} points); {parallel} run(s) at "
            f"once of {ranks_per_run} rank(s), {launcher.threads['OMP_NUM_THREADS']} thread(s) "
            f"a rank", flush=True)
        start = time.monotonic()
        results = run_all(runs, launcher, parallel, say, resume)
        while True:         # past the sweep's edges, a factor of 2 at a time, every point at once
            more = []
            for (config, batch), sweep in sweeps.items():
                factor = past_the_edge(sweep, results, factors, plan["widen"])
                if factor is not None:
                    name, options = make(config, batch, 0, factor)
                    sweep[factor] = name
                    more.append((name, options))
            if not more:
                break
            say(f"study: {len(more)} more runs: {', '.join(name for name, _ in more)}, where the "
                f"best rate was the lowest or highest of its sweep", flush=True)
            results.update(run_all(more, launcher, parallel, say, resume))
            runs += more
        # each point's learning rate: the sweep's best (the only one without a sweep, where its
        # seeds ran already, diverged or not)
        chosen = {key: best_factor(sweep, results) if len(factors) > 1 else factors[0]
                  for key, sweep in sweeps.items()}
        grid = {key: [sweep[chosen[key] or factors[0]]] for key, sweep in sweeps.items()}
        seeded = []
        for (config, batch), factor in chosen.items():
            if batch in deciding and factor is not None:
                more = [make(config, batch, seed, factor) for seed in range(1, seeds)]
                grid[(config, batch)] += [name for name, _ in more]
                seeded += more if len(factors) > 1 else []
        if seeded:
            say(f"study: {len(seeded)} more runs: seeds 1..{seeds - 1} at each recipe's best "
                f"learning rate at batches {', '.join(map(str, deciding))}", flush=True)
            results.update(run_all(seeded, launcher, parallel, say, resume))
            runs += seeded
        seconds = time.monotonic() - start
        rows = summarise(grid, results, chosen, sweeps)
        study_command = shlex.join(["python", "-m", "mpitrain", "study", "large-batch", *argv])
        lines = []
        for name, options in runs:
            r = results[name]
            lines.append(launcher.shell_line(options) + "  # " +
                         ("diverged" if r.get("diverged") else f"top-1 {r['top1']:.4f}"))
        ran = what_ran({name: results[name] for name, _ in runs}, seconds)
        write_outputs(out, rows, lines, study_command, epochs, num_train, num_classes, data, ran,
                      plan["recipes"])
        say(table_markdown(rows), flush=True)
        say(f"study: {ran}; wrote results.md, results.csv, "
            f"accuracy.png and commands.sh in {out}", flush=True)
        return rows
