"""`./launch.sh gpu-check` and `python -m mpitrain check-gpu`: prove the GPU path on a GPU machine.

For a machine with an NVIDIA GPU and no network. The steps, each recorded in
the JSON report (`--out`), and each run in a fresh interpreter, so that what
the install step put in place is what the later steps import:

    preflight    an NVIDIA driver and GPU are present, else exit 2 at once,
                 naming what is missing
    install      with --wheels DIR (or WHEELS=DIR): the packages of DIR's
                 wheels that are not installed yet, and pyproject.toml's build
                 requirements at their versions, then mpitrain itself
                 (editable), all with `pip install --no-index --find-links DIR`;
                 without it, mpitrain is installed offline only if it does not
                 import yet
    build        the Cython kernels (setup.py build_ext --inplace)
    environment  CuPy sees the GPU and mpi4py loads an MPI library (else exit
                 2, naming what is missing); the run's environment report
                 (mpitrain.config.gpu_environment)
    tests        `pytest -m gpu` over tests/, every test's outcome
    compare      one training step on the GPU against the same step on the
                 CPU, fp32 and fp16 (compare_step): logits, loss, every
                 gradient, the update and the updated master weights
    nccl         a one-rank Communicator's all-reduce and broadcast of CuPy
                 arrays through NCCL, and the Reducer's stream path (nccl_check)
    bench        `bench step --device gpu` at 224x224 on ResNet-50 fp16 batch 256
                 with CUDA graphs and eagerly, fp32 batch 128 (eager: its fully
                 connected layer is cuBLAS's, which CuPy does not capture), and
                 AlexNet fp16 batch 512 with CUDA graphs and eagerly, and ResNet-50
                 fp16 with graphs and cuDNN's non-deterministic plans allowed
                 (BENCH), against PyTorch where it sees the GPU
    profile      `bench step --device gpu --profile N` of ResNet-50 and AlexNet in
                 fp16: device time per layer type and phase, kernels per step
    shared       a `train` MPI job of two ranks sharing the GPU (--ranks-per-gpu 2:
                 their sums go through MPI, staged in host memory) per entry of
                 SHARED: every all-reduce algorithm, one also after backward, fp16
                 on the wire, the sharded update, top-k; digits, 2 epochs, the
                 replicas compared after every step (a difference stops the job);
                 the last epoch's images/s and the share of the all-reduce that
                 backward hid
    data         `convert synthetic` of --jpegs 500x375 JPEGs (and VAL_JPEGS others,
                 train's validation file), then `bench data
                 --device gpu` (GPU decoding against the CPU loader, a worker on
                 every core each), `bench step --data --cuda-graph` of ResNet-50
                 fp16 batch 256, the loader decoding on the GPU, then on the CPU,
                 each against a random batch, and `train` of the same on the file
                 for 2 epochs, decoding on the GPU, then on the CPU (train_data):
                 its last images/s against bench step's on the random batch

The order puts the measurements first: install, build, environment, bench,
profile, shared, data, then tests, compare and nccl. `--budget SECONDS` bounds
the whole check: a step starts only while time is left, and its commands may
run only as long as what is left; the steps that did not fit are reported as
skipped for time (where every step was skipped, the last line says that nothing
ran, not that all passed). `--out-dir DIR` keeps the report (DIR/report.json) and
each step's whole output (DIR/STEP.log) there, each written as its step ends; it and
`--out` are checked before the first step.
`--dry-run` goes through the same steps without a GPU and without running their
commands, recording each command line: the control flow, checked where there is
no GPU.

Exit status: 0 every step passed, 1 a step failed, 2 no GPU (or CuPy does not
see it, or no MPI library) or bad arguments. This module imports only the
standard library (and mpitrain.files, which imports no more) at its top, so `python -m
mpitrain.tools.check_gpu` runs from a checkout before mpitrain is installed (launch.sh
gpu-check does that).
"""
import argparse
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from mpitrain.files import output_problem, save_json, save_text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = ("install", "build", "bench", "profile", "shared", "data", "tests", "compare",
         "nccl")

# fp32: the largest |gpu - cpu| / max |cpu| each quantity may show. The fp32 step runs
# cuDNN without TF32 (kernels/cudnn.py TF32), so both sides compute in fp32 and differ in
# the order of their sums; a weight gradient ahead of BatchNorm is a sum that cancels to
# about a hundredth of its terms, which magnifies that. "update" is the change of the
# master weights, relative to its own largest value; "master" the updated weights.
TOLERANCE = {"logits": 1e-4, "loss": 1e-5, "grad": 2e-3, "update": 2e-3, "master": 1e-5}
# fp16: both devices round every activation to 11 bits, at the same places but from sums
# taken in different orders, so one rounding may differ by an ulp and cancellation
# magnifies it; no fixed bound tells a bug from that. Both fp16 steps are measured
# against the fp32 step on the CPU instead: the GPU's may be off by FP16_MARGIN times
# the CPU's own distance, or by one fp16 rounding (FP16_FLOOR), whichever is larger.
FP16_MARGIN, FP16_FLOOR = 2.0, 2.0 ** -11

# (model, precision, batch, bench step options) of the throughput runs at 224x224; each
# option names its run as in BENCH_NAMES
GRAPH, NONDETERMINISTIC = ("--cuda-graph",), ("--cuda-graph", "--nondeterministic-plans")
BENCH = (("resnet50", "fp16", 256, GRAPH), ("resnet50", "fp16", 256, ()),
         ("resnet50", "fp32", 128, ()), ("alexnet", "fp16", 512, GRAPH),
         ("alexnet", "fp16", 512, ()), ("resnet50", "fp16", 256, NONDETERMINISTIC))
BENCH_NAMES = {"--cuda-graph": "graph", "--nondeterministic-plans": "nondeterministic"}
# (model, batch) of the profiles, in fp16
PROFILE = (("resnet50", 256), ("alexnet", 512))
# (name, train options) of the shared step's jobs: every all-reduce algorithm (those of
# comm.ALGORITHMS, not imported here: it would start MPI; a test holds them equal) with
# the GPU's default overlap, 2d also after backward, flat with fp16 on the wire, the
# sharded update and top-k; each on SHARED_TRAIN, for at most SHARED_TIMEOUT seconds.
# hybrid and shm come last: on device buffers they run flat and 2d
# (comm.algorithms.choose, comm.topology), so a short budget leaves out repeats only
SHARED = (("2d", ("--allreduce", "2d")),
          ("hierarchical", ("--allreduce", "hierarchical")),
          ("flat fp16", ("--allreduce", "flat", "--precision", "fp16", "--comm-dtype", "fp16")),
          ("shard-update", ("--shard-update",)),
          ("topk", ("--compress", "topk", "--density", "0.1")),
          ("2d no-overlap", ("--allreduce", "2d", "--no-overlap")),
          ("hybrid", ("--allreduce", "hybrid")),
          ("shm", ("--allreduce", "shm")))
# a job that hangs ends after 120 s without a step (its watchdog names where it stopped),
# not at SHARED_TIMEOUT
SHARED_TRAIN = ("--device", "gpu", "--ranks-per-gpu", "2", "--data", "digits", "--epochs", "2",
                "--check-replicas", "1", "--collective-timeout", "120")
SHARED_RANKS, SHARED_TIMEOUT = 2, 300


class CheckError(Exception):
    """Cannot go on: the message names what is missing (exit status 2)."""


def add_arguments(parser):
    """The options of check-gpu (shared by the CLI and `python -m mpitrain.tools.check_gpu`)."""
    from mpitrain.argtypes import nonnegative_int, path, positive_int
    parser.add_argument("--wheels", type=path, metavar="DIR",
                        default=os.environ.get("WHEELS") or None,
                        help="install from this folder of wheels first, without network "
                             "(default: $WHEELS)")
    parser.add_argument("--out", type=path, metavar="FILE",
                        help="the JSON report (default: gpu-check-<time>.json here)")
    parser.add_argument("--skip", nargs="+", choices=STEPS, default=[], metavar="STEP",
                        help=f"steps to leave out: {', '.join(STEPS)}")
    parser.add_argument("--steps", type=positive_int, default=20,
                        help="timed steps per throughput run (default: 20)")
    parser.add_argument("--warmup", type=nonnegative_int, default=5,
                        help="untimed steps before them (default: 5)")
    parser.add_argument("--rounds", type=positive_int, default=2, metavar="N",
                        help="rounds per throughput run, taking turns with PyTorch at "
                             "going first; the ratio is their median (bench step --rounds; "
                             "default: 2)")
    parser.add_argument("--profile-steps", type=positive_int, default=5, metavar="N",
                        help="steps per profile (default: 5)")
    # 20,000: the training runs' file; `convert synthetic` makes them with a thread per
    # core (about 16 ms a JPEG on one core: 40 s on 8)
    parser.add_argument("--jpegs", type=positive_int, default=20000, metavar="N",
                        help="JPEGs of the data steps' synthetic file (at least a batch of "
                             "256; default: 20000)")
    parser.add_argument("--budget", type=nonnegative_int, metavar="SECONDS",
                        help="stop starting steps once this many seconds have passed, and "
                             "stop a step's commands there (default: no limit)")
    parser.add_argument("--out-dir", type=path, metavar="DIR",
                        help="write the report (DIR/report.json) and each step's output "
                             "(DIR/STEP.log) there as each step ends")
    parser.add_argument("--dry-run", action="store_true",
                        help="go through the steps without a GPU, recording each command "
                             "instead of running it")


def run(args):
    """The whole check; returns the exit status."""
    try:
        check_outputs(args)
        wheels = _wheel_files(args.wheels) if args.wheels else None
        problem = None if args.dry_run else preflight()
        if problem:
            raise CheckError(problem)
        CLOCK.start(args.budget, args.dry_run)
        report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0],
                  "root": ROOT, "budget": args.budget, "dry_run": args.dry_run, "steps": {}}
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
        out = args.out or (os.path.join(args.out_dir, "report.json") if args.out_dir else
                           f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}.json")
        try:
            _all_steps(args, wheels, report, lambda: _save(report, out))
        finally:
            _save(report, out)
    except CheckError as e:
        sys.stderr.write(f"gpu-check: {e}\n")
        return 2
    print(summary(report))
    print(f"gpu-check: report written to {out}")
    return 0 if report["passed"] and ran(report) else 1


def check_outputs(args):
    """Refuse, before any step, a --out or --out-dir the report cannot be written to: the
    check would run its steps and then fail to save what they measured."""
    problem = None
    if args.out_dir:
        problem = (f"--out-dir {args.out_dir} is a file; give a directory for the report and "
                   f"the steps' logs" if os.path.isfile(args.out_dir) else
                   output_problem(os.path.join(args.out_dir, "report.json")))
    if args.out and not problem:
        problem = output_problem(args.out)
        problem = problem and f"--out {problem}"
    if problem:
        raise CheckError(problem)


def _save(report, out):
    """Write the report as it stands (after every step: a check stopped midway keeps what
    it measured), replacing the file whole."""
    report["passed"] = all(s.get("passed", True) for s in report["steps"].values())
    save_json(out, report, sort_keys=False)     # the steps in the order they ran


def _all_steps(args, wheels, report, save):
    steps = report["steps"]
    skip = set(args.skip)

    def step(name, function, *a, group=None):
        if (group or name) in skip:
            steps[name] = {"skipped": True}
            return
        if CLOCK.left() <= 0:
            steps[name] = {"skipped": True, "reason": f"out of time (--budget {args.budget})"}
            print(f"gpu-check: {name} skipped: out of time", flush=True)
            save()
            return
        print(f"gpu-check: {name} ...", flush=True)
        t0 = time.perf_counter()
        steps[name] = function(*a)
        output = steps[name].pop("output", None)
        steps[name].pop("stdout", None)     # its tail is kept; what it meant is parsed
        steps[name]["seconds"] = round(time.perf_counter() - t0, 1)
        if args.out_dir:
            save_text(os.path.join(args.out_dir, f"{name.replace(' ', '-')}.log"),
                      output or steps[name].get("output_tail", ""))
        if not steps[name].get("passed", True):
            print(f"gpu-check: {name} FAILED: {'; '.join(steps[name].get('failures', []))}",
                  flush=True)
        save()

    step("install", install, wheels)
    if not steps["install"].get("passed", True):
        return                              # nothing below can import what it needs
    step("build", _command_step, [sys.executable, "setup.py", "build_ext", "--inplace", "-q"], 600)
    env = steps["environment"] = {"passed": True, "torch_cuda": True, "dry_run": True} \
        if CLOCK.dry_run else _call("environment", timeout=300)
    if not env.get("passed"):               # no GPU for CuPy, no MPI, or mpitrain broken
        raise CheckError(env.get("missing") or "; ".join(env.get("failures", [])))
    save()
    for model, precision, batch, options in BENCH:
        step(" ".join(["bench", model, precision, *(BENCH_NAMES[o] for o in options)]), bench,
             model, precision, batch, env["torch_cuda"], args.steps, args.warmup, args.rounds,
             options,
             group="bench")
    for model, batch in PROFILE:
        step(f"profile {model}", profile, model, batch, args.profile_steps, group="profile")
    for name, options in SHARED:
        step(f"shared {name}", shared, options, group="shared")
    with tempfile.TemporaryDirectory() as tmp:
        jpegs = os.path.join(tmp, "synthetic.h5")
        step("data convert", convert_jpegs, jpegs, args.jpegs, group="data")
        step("data loader", bench_data, jpegs, group="data")
        for decode in ("gpu", "cpu"):
            step(f"data step {decode}", bench_step_data, jpegs, decode, group="data")
        for decode in ("gpu", "cpu"):
            step(f"data train {decode}", train_data, jpegs, decode, group="data")
            random = steps.get(f"data step {decode}", {}).get("random", {}).get("images_per_s")
            trained = steps[f"data train {decode}"].get("images_per_s")
            if random and trained:
                steps[f"data train {decode}"]["over_random"] = trained / random
    step("tests", run_tests)
    for precision in ("fp32", "fp16"):
        step(f"compare {precision}", _call, "compare_step", precision, group="compare")
    step("nccl", _call, "nccl_check")


# ----- the steps -----
def preflight():
    """None when this machine shows an NVIDIA driver and GPU, else what is missing
    (standard library only: it runs before anything is installed)."""
    if os.path.exists("/proc/driver/nvidia/version") or glob.glob("/dev/nvidia[0-9]*"):
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ("no NVIDIA GPU here: no NVIDIA driver (/proc/driver/nvidia/version is "
                "missing), no /dev/nvidia* device and no nvidia-smi; gpu-check needs a "
                "machine with an NVIDIA GPU and its driver")
    r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    if r.returncode or "GPU" not in r.stdout:
        return f"nvidia-smi -L lists no GPU: {(r.stderr or r.stdout).strip()[:300]}"
    return None


def _wheel_files(folder):
    if not os.path.isdir(folder):
        raise CheckError(f"--wheels / WHEELS={folder}: no such folder")
    files = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not files:
        raise CheckError(f"--wheels / WHEELS={folder}: no .whl file in it (docs/gpu.md "
                         f"says how to fetch them)")
    return folder, files


def build_requirements():
    """pyproject.toml's build requirements, as launch.sh reads them: its one line
    `requires = [...]`."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        line = re.search(r"^requires = \[(.*)\]$", f.read(), re.M).group(1)
    return re.findall(r'"([^"]+)"', line)


def install(wheels):
    """The folder's packages, then mpitrain (editable), without network."""
    if wheels is None:
        if _command_step([sys.executable, "-c", "import mpitrain.kernels, mpitrain.nets"],
                         120)["passed"]:
            return {"passed": True, "note": "mpitrain imports; nothing installed"}
        pip = [sys.executable, "-m", "pip", "install", "--no-index"]
        return _command_step(pip + ["--no-build-isolation", "-e", ROOT], 1200)
    folder, files = wheels
    # By name, not by file: what is installed already (the machine's CuPy, NumPy) stays.
    # Without their dependencies: the folder is the set to install (nvidia-cudnn-frontend
    # names the CUTLASS DSL, a large package that its graph API does not load); mpitrain's
    # own install below then says which of its dependencies are still missing.
    # The build's requirements go by their versions (cython>=3.1): by name alone, an older
    # Cython that the machine has would stay, and the kernels' build would fail on it.
    names = sorted({os.path.basename(f).split("-")[0] for f in files})
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", folder]
    packages = pip + ["--no-deps"] + names + build_requirements()
    first = _command_step(packages, 1800)
    if not first["passed"]:
        return {**first, "packages": packages}
    done = _command_step(pip + ["--no-build-isolation", "-e", ROOT], 1200)
    return {**done, "wheels": [os.path.basename(f) for f in files], "packages": packages,
            "output_tail": first["output_tail"] + done["output_tail"]}


def run_tests():
    """pytest -m gpu over tests/, then tests/mpi (one rank), as launch.sh test runs them;
    each test's outcome from the JUnit XML reports."""
    import tempfile
    import xml.etree.ElementTree as ET
    if not os.path.isdir(os.path.join(ROOT, "tests")):
        return {"passed": False, "failures": [f"no tests/ folder in {ROOT}: run from a checkout"]}
    tests, failures, tails, ran, commands = {}, [], [], True, []
    with tempfile.TemporaryDirectory() as tmp:
        for i, where in enumerate((["tests", "--ignore=tests/mpi"], ["tests/mpi"])):
            xml = os.path.join(tmp, f"phase{i}.xml")
            commands.append([sys.executable, "-m", "pytest", "-m", "gpu", *where, "-q",
                             "-p", "no:cacheprovider", f"--junitxml={xml}"])
            r = _command_step(commands[-1], 1800)
            ran = ran and r["passed"]
            failures += r.get("failures", [])
            tails.append(r.get("output_tail", ""))
            if os.path.exists(xml):
                for case in ET.parse(xml).getroot().iter("testcase"):
                    tags = {child.tag for child in case}
                    tests[f"{case.get('classname')}::{case.get('name')}"] = (
                        "failed" if tags & {"failure", "error"} else
                        "skipped" if "skipped" in tags else "passed")
    if CLOCK.dry_run:
        return {"passed": True, "commands": commands, "output_tail": "".join(tails)}
    counts = {k: sum(v == k for v in tests.values()) for k in ("passed", "failed", "skipped")}
    failures = [name for name, v in tests.items() if v == "failed"] or failures or \
        ([] if counts["passed"] else [f"no gpu test ran ({counts['skipped']} skipped)"])
    return {"passed": ran and counts["passed"] > 0, "counts": counts, "tests": tests,
            "failures": failures, "output_tail": "\n".join(tails)[-4000:]}


def _bench_argv(model, precision, batch, *options):
    return [sys.executable, "-m", "mpitrain", "bench", "step", "--device", "gpu", "--model",
            model, "--image-size", "224", "--batch", str(batch), "--precision", precision,
            *options]


def bench(model, precision, batch, torch, steps, warmup, rounds=1, options=()):
    """bench step --device gpu on `model` at 224x224 (with --reference torch when PyTorch
    sees the GPU), `rounds` rounds, with the further `options`; its JSON result."""
    argv = _bench_argv(model, precision, batch, "--steps", str(steps), "--warmup", str(warmup),
                       "--rounds", str(rounds), "--json", *options)
    if torch:
        argv += ["--reference", "torch"]
    return _json_command(argv, 1800)


def profile(model, batch, steps):
    """bench step --device gpu --profile on `model` in fp16 at 224x224: its text."""
    r = _command_step(_bench_argv(model, "fp16", batch, "--steps", "3", "--warmup", "2",
                                  "--profile", str(steps)), 1800)
    return {**r, "output": r.get("stdout", "")}


def shared(options, train=SHARED_TRAIN):
    """`python -m mpitrain train` with the options `train` and `options`, as an MPI job of
    SHARED_RANKS ranks on one GPU, started as launch.sh starts one (the venv's mpiexec, each
    rank its share of the cores); passed when it exits 0: --check-replicas stops a job whose
    replicas differ. Its last epoch's images/s and final accuracy, and from rank 0's
    metrics.jsonl the last log's all-reduce time per step, the part of it the step waited
    for, and the share hidden."""
    from mpitrain.launcher import (cores, find_mpiexec, job_environment, launch_options,
                                   mpiexec_family)
    mpiexec = find_mpiexec()
    if mpiexec is None:
        return {"passed": False, "failures": ["no mpiexec beside this Python or on PATH: put "
                                              "the mpich wheel in the wheels folder"]}
    family = mpiexec_family(mpiexec)
    with tempfile.TemporaryDirectory() as run_dir:
        argv = [mpiexec, *launch_options(SHARED_RANKS, family), "-np", str(SHARED_RANKS),
                sys.executable, "-m", "mpitrain", "train", *train, *options,
                "--run-dir", run_dir]
        r = _command_step(argv, SHARED_TIMEOUT,
                          job_environment(family, max(1, cores() // SHARED_RANKS)))
        if CLOCK.dry_run or not r["passed"]:
            return r
        out = {**r, "replicas": "equal after every step"}
        rates = re.findall(r"([\d,]+) images/s", r["stdout"])
        accuracy = re.search(r"final validation accuracy: ([\d.]+)% top-1", r["stdout"])
        if rates:
            out["images_per_s"] = float(rates[-1].replace(",", ""))
        if accuracy:
            out["val_top1"] = float(accuracy.group(1)) / 100
        metrics, logs = os.path.join(run_dir, "metrics.jsonl"), []
        if os.path.exists(metrics):
            with open(metrics) as f:
                logs = [json.loads(line) for line in f if line.strip()]
    times = [log["time"] for log in logs if log.get("kind") == "step"][-1:]
    # "bucket": the all-reduce's own time; "comm": the step's wait for it (comm/buckets.py;
    # the sharded update's reduce-scatter has no buckets)
    if times and "bucket" in times[0]:
        from mpitrain.tools.bench.step import hidden_fraction
        wait, total = 1e3 * times[0]["comm"], 1e3 * times[0]["bucket"]
        out.update(comm_wait_ms=wait, comm_total_ms=total,
                   hidden_fraction=hidden_fraction(wait, total))
    return out


VAL_JPEGS = 512         # the data steps' validation file: two of train's batches


def convert_jpegs(path, count):
    """convert synthetic: `count` JPEGs of 500x375 into `path`, the data steps' file (a
    thread per core), then VAL_JPEGS other ones (another seed) into validation_file(path),
    train's validation file."""
    from mpitrain.launcher import cores
    argv = [sys.executable, "-m", "mpitrain", "convert", "synthetic", path, "--count", str(count)]
    t0 = time.perf_counter()
    r = {**_command_step(argv, 900), "jpegs": count, "threads": cores()}
    if r["passed"] and not CLOCK.dry_run:
        r["jpegs_per_s"] = count / (time.perf_counter() - t0)
    if r["passed"]:
        val = _command_step([sys.executable, "-m", "mpitrain", "convert", "synthetic",
                             validation_file(path), "--count", str(VAL_JPEGS), "--seed", "1"],
                            300)
        r.update(passed=val["passed"], val_command=val.get("command"),
                 failures=r.get("failures", []) + val.get("failures", []))
    return r


def validation_file(path):
    """The validation file beside the data steps' file (convert's FILE_val.h5)."""
    return path[:-len(".h5")] + "_val.h5"


def bench_data(path):
    """bench data --device gpu on `path`: the loader decoding on the GPU with a worker per
    core against the CPU loader with as many; its JSON result."""
    from mpitrain.launcher import cores
    return _json_command([sys.executable, "-m", "mpitrain", "bench", "data", "--device", "gpu",
                          "--data", path, "--workers", str(cores()), "--batch", "256",
                          "--batches", "5", "--json"], 600)


def bench_step_data(path, decode):
    """bench step --data on `path`: ResNet-50 fp16 batch 256 with CUDA graphs fed by the
    loader decoding on the GPU or on the CPU (`decode`; a worker per core), against a random
    batch; its JSON result."""
    from mpitrain.launcher import cores
    return _json_command(_bench_argv("resnet50", "fp16", 256, "--data", path, "--decode", decode,
                                     "--workers", str(cores()), "--cuda-graph", "--steps", "6",
                                     "--warmup", "3", "--json"), 900)


# train_data's run: bench_step_data's step, as a user trains on JPEG records
TRAIN_DATA = ("--device", "gpu", "--model", "resnet50", "--precision", "fp16", "--batch-size",
              "256", "--image-size", "224", "--cuda-graph", "--epochs", "2")


def train_data(path, decode):
    """`python -m mpitrain train` (TRAIN_DATA) on `path`, with validation_file(path), the
    loader decoding on `decode` with a worker per core: the last progress line's
    images/s (the second epoch's last quarter) and the share of that time the step waited
    for data, from metrics.jsonl."""
    from mpitrain.launcher import cores
    with tempfile.TemporaryDirectory() as run_dir:
        argv = [sys.executable, "-m", "mpitrain", "train", *TRAIN_DATA, "--data", path,
                "--val-data", validation_file(path), "--decode", decode, "--workers", str(cores()),
                "--run-dir", run_dir]
        r = {**_command_step(argv, 900), "decode": decode, "jpegs_file": path}
        metrics = os.path.join(run_dir, "metrics.jsonl")
        if CLOCK.dry_run or not r["passed"] or not os.path.exists(metrics):
            return r
        with open(metrics) as f:
            logs = [json.loads(line) for line in f if line.strip()]
    last = [log for log in logs if log.get("kind") == "step"][-1:]
    if last:
        r["images_per_s"] = last[0]["images_per_s"]
        r["wait_share"] = last[0]["time"]["data"] / sum(last[0]["time"].values())
    return r


class Clock:
    """The check's budget: seconds left (inf without one), and whether commands run."""

    def start(self, budget, dry_run=False):
        self.end = None if budget is None else time.monotonic() + budget
        self.dry_run = dry_run

    def left(self):
        return float("inf") if self.end is None else self.end - time.monotonic()


CLOCK = Clock()
CLOCK.start(None)


def _command_step(argv, timeout, env=None):
    """Run argv in the checkout (in `env`, default this environment), for at most `timeout`
    seconds and what is left of the budget; {"passed", "stdout", "output_tail", "failures"}.
    A dry run records argv."""
    if CLOCK.dry_run:
        return {"passed": True, "command": argv, "stdout": "",
                "output_tail": f"dry run: {shlex.join(argv)}\n"}
    timeout = max(1, min(timeout, CLOCK.left()))
    try:
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env=env)
    except subprocess.TimeoutExpired as e:
        out = ((e.stdout or b"").decode(errors="replace")
               + (e.stderr or b"").decode(errors="replace"))
        return {"passed": False, "output_tail": out[-4000:], "output": out,
                "failures": [f"{' '.join(argv[:6])} ... ran past {timeout:.0f} s"]}
    out = {"passed": not r.returncode, "stdout": r.stdout,
           "output_tail": (r.stdout + r.stderr)[-4000:]}
    if r.returncode:
        out["failures"] = [f"{' '.join(argv[:6])} ... exited {r.returncode}: "
                           f"{r.stderr.strip()[-600:]}"]
    return out


def _json_command(argv, timeout):
    """_command_step of a command that prints one JSON object last (--json): that object,
    with the command's pass and failures (its figures even when part of it failed)."""
    r = _command_step(argv, timeout)
    if CLOCK.dry_run:
        return r
    try:
        figures = json.loads(r["stdout"].strip().splitlines()[-1])
    except (KeyError, IndexError, ValueError):
        return r
    return {**figures, "passed": r["passed"], "failures": r.get("failures", []),
            "output": r["output_tail"]}


def _call(function, *args, timeout=1200):
    """This module's `function(*args)` in a fresh interpreter; its JSON result."""
    code = ("import json, sys; from mpitrain.tools import check_gpu; "
            "print(json.dumps(getattr(check_gpu, sys.argv[1])(*json.loads(sys.argv[2]))))")
    r = _command_step([sys.executable, "-c", code, function, json.dumps(args)], timeout)
    if not r["passed"] or CLOCK.dry_run:
        return r
    return json.loads(r["stdout"].strip().splitlines()[-1])


# ----- what runs in the children (after the install) -----
def environment():
    """What is missing for the other steps (None when nothing), and the environment report."""
    out = {"missing": None, "passed": False, "torch_cuda": False}
    try:
        from mpitrain.config import mpi_library
        out["mpi"] = mpi_library()
    except Exception as e:      # mpi4py without a library to load: no MPI on this machine
        out["missing"] = (f"no MPI library for mpi4py ({type(e).__name__}: {e}); add the "
                          f"`mpich` wheel to the wheels folder")
    from mpitrain import backend
    out["missing"] = backend.gpu_problem() or out["missing"]
    if out["missing"]:
        return out
    from mpitrain.config import gpu_environment
    backend.use_device("gpu")
    out["report"] = gpu_environment()
    from mpitrain.datasets.batch_augment import gpu_decoder_problem
    out["gpu_decode"] = gpu_decoder_problem() or "works"     # what the data steps need
    out["passed"] = True
    try:
        import torch
        out["torch"] = torch.__version__
        out["torch_cuda"] = bool(torch.cuda.is_available())
    except ImportError:
        out["torch"] = None
    return out


def compare_step(precision, model_name="resnet_small", image_size=32, batch=32, num_classes=10,
                 seed=0, lr=0.1, devices=("cpu", "gpu")):
    """One training step (mpitrain.tools.bench.step.OneStep: forward and loss, backward,
    overflow check, SGD update) of the same model, seed and batch on the two `devices` (the
    reference first); the largest relative differences, against TOLERANCE in fp32 and
    against FP16_MARGIN times the reference device's own in fp16 (both measured from
    the reference device's fp32 step)."""
    import numpy as np

    from mpitrain import backend
    from mpitrain.tools.bench.step import OneStep, build_on_device
    host = backend.to_numpy

    def one_step(device, precision):
        backend.use_device(device)
        model, x, y = build_on_device(model_name, image_size, batch, num_classes, seed, precision)
        step = OneStep(model, precision, lr=lr)
        before = host(model.arena.master).astype(np.float64)
        for attempt in range(1, 25):        # as training: halve the loss scale until no overflow
            with np.errstate(over="ignore", invalid="ignore"):
                logits, loss = step.forward(x, y)
                step.backward()
            scale = step.scaler.scale       # the gradients are the loss's, times this
            grads = {name: host(p.grad).astype(np.float64) / scale
                     for name, p in model.named_params()}
            if step.update():
                break
        master = host(model.arena.master).astype(np.float64)
        return dict(logits=host(logits).astype(np.float64), loss=np.float64(float(loss)),
                    grads=grads, attempts=attempt, scale=scale, master=master,
                    update=master - before)

    def differences(a, b):
        """max relative difference of each quantity (of the worst gradient), and per gradient"""
        per_param = {name: _relative(a["grads"][name], g) for name, g in b["grads"].items()}
        worst = max(per_param, key=per_param.get)
        return {"logits": _relative(a["logits"], b["logits"]),
                "loss": _relative(a["loss"], b["loss"]),
                "grad": per_param[worst], "update": _relative(a["update"], b["update"]),
                "master": _relative(a["master"], b["master"])}, per_param, worst

    from mpitrain.kernels import cudnn
    previous, tf32 = backend.device, cudnn.TF32
    cudnn.TF32 = False
    try:
        cpu, gpu = (one_step(device, precision) for device in devices)
        reference = one_step(devices[0], "fp32") if precision == "fp16" else cpu
    finally:
        cudnn.TF32 = tf32
        backend.use_device("cpu" if previous == "cpu" else "gpu")
    diffs, per_param, worst = differences(gpu, reference)
    out = {}
    if precision == "fp16":
        out["cpu_from_fp32"] = differences(cpu, reference)[0]
        limits = {k: max(FP16_MARGIN * v, FP16_FLOOR) for k, v in out["cpu_from_fp32"].items()}
    else:
        limits = TOLERANCE
    failures = [f"{k}: {v:.2e} > {limits[k]:.1e}" for k, v in diffs.items() if not v <= limits[k]]
    if cpu["attempts"] != gpu["attempts"]:
        failures.append(f"the step overflowed {cpu['attempts'] - 1} time(s) on {devices[0]}, "
                        f"{gpu['attempts'] - 1} on {devices[1]} before one was applied")
    return {"passed": not failures, "failures": failures, "precision": precision,
            "model": model_name, "image_size": image_size, "batch": batch, "seed": seed,
            "devices": list(devices), "reference": f"{devices[0]} fp32" if precision == "fp16"
            else devices[0], "attempts": cpu["attempts"], "loss_scale": cpu["scale"],
            "loss": {"cpu": float(cpu["loss"]), "gpu": float(gpu["loss"])},
            "max_relative": diffs, "worst_gradient": worst, "tolerance": limits,
            "gradients": per_param, **out}


def _relative(a, b):
    """max |a - b| / max |b| (inf when a differs where b is all zeros, or is not finite)."""
    import numpy as np
    diff = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    scale = float(np.max(np.abs(b)))
    if not np.isfinite(diff):
        return float("inf")
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))


def nccl_check():
    """A one-rank Communicator on the GPU: all-reduce (fp32, fp16) and broadcast of CuPy
    arrays through NCCL, and a Reducer summing a model's gradient buckets on the
    communication stream (no thread: NCCL only queues)."""
    import cupy
    import numpy as np
    from mpi4py import MPI

    from mpitrain import backend
    from mpitrain.comm import Communicator, nccl
    from mpitrain.comm.buckets import Reducer
    from mpitrain.nets import build_model
    previous = backend.device
    backend.use_device("gpu")
    comm = Communicator(MPI.COMM_WORLD)
    failures, out = [], {"ranks": comm.size, "nccl": nccl.version()}
    try:
        if comm.nccl() is None:
            return {**out, "passed": False,
                    "failures": ["cupy.cuda.nccl is unavailable: install nvidia-nccl-cu12/-cu13"]}
        for dtype in (np.float32, np.float16):
            a = (cupy.arange(1 << 16) % 7).astype(dtype)     # small integers: exact sums
            expected = a.get() * comm.size
            comm.allreduce(a, "flat")
            backend.synchronize()
            if not np.array_equal(a.get(), expected):
                failures.append(f"all-reduce of {np.dtype(dtype).name} differs")
        b = cupy.arange(1000, dtype=cupy.float32) * (comm.rank + 1)
        comm.broadcast(b, root=0)
        backend.synchronize()
        if not np.array_equal(b.get(), np.arange(1000, dtype=np.float32)):
            failures.append("broadcast differs from rank 0's array")
        model = build_model("resnet_small", num_classes=10)
        reducer = Reducer(model.arena, comm, threshold=64 << 10, overlap=True)
        out["reducer_threaded"] = reducer.threaded
        if reducer.threaded:
            failures.append("the Reducer runs a thread although NCCL is there")
        reducer.begin()
        for p in model.arena.params:        # as backward writes them, on the compute stream
            p.grad[...] = cupy.arange(p.size, dtype=p.grad.dtype).reshape(p.shape) % 5
            p.grad_ready()
        reducer.finish()
        got = model.arena.grad.get()        # queued after the event finish() waits on
        reducer.close()
        expected = np.zeros_like(got)
        for p in model.arena.params:
            expected[p.offset:p.offset + p.size] = np.arange(p.size) % 5 * comm.size
        if not np.array_equal(got, expected):
            failures.append("the Reducer's bucket sums differ")
        out["buckets"] = len(reducer.bounds)
    finally:
        comm.free()
        backend.use_device("cpu" if previous == "cpu" else "gpu")
    return {**out, "passed": not failures, "failures": failures}


# ----- the report -----
def summary(report):
    """A line per step, then the throughput table."""
    lines = []
    for name, s in report["steps"].items():
        if s.get("skipped"):
            lines.append(f"SKIP  {name}" + (f": {s['reason']}" if "reason" in s else ""))
            continue
        state = "PASS" if s.get("passed", True) else "FAIL"
        lines.append(f"{state}  {name}{_detail(name, s)}")
    if not ran(report):
        lines.append("gpu-check: nothing ran: every step was skipped (--skip, or out of "
                     "time under --budget)")
    else:
        lines.append(f"gpu-check: {'all passed' if report['passed'] else 'FAILED'}")
    return "\n".join(lines)


def ran(report):
    """Whether any step ran (a dry run's environment is recorded, not run): a check that
    checked nothing has not passed."""
    return any(not s.get("skipped") and not s.get("dry_run") for s in report["steps"].values())


def _detail(name, s):
    if name == "environment" and "report" in s:
        r = s["report"]
        fp16 = "" if r.get("cudnn_fp16_reason") is None else f"; fp16: {r['cudnn_fp16_reason']}"
        return (f": {r.get('gpu')}, CuPy {r.get('cupy')}, CUDA {r.get('cuda_runtime')} "
                f"(driver {r.get('cuda_driver')}), NCCL {r.get('nccl')}, cuDNN {r.get('cudnn')} "
                f"(frontend {r.get('cudnn_frontend')}"
                f"{'' if r.get('cudnn_reason') is None else '; not used: ' + r['cudnn_reason']}"
                f"{fp16}), "
                f"MPI {s.get('mpi')}, torch {s.get('torch')}, --decode gpu: {s.get('gpu_decode')}")
    if name == "tests" and "counts" in s:
        c = s["counts"]
        return f": {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
    if name.startswith("compare") and "max_relative" in s:
        return ": " + ", ".join(f"{k} {v:.1e} (<= {s['tolerance'][k]:.0e})"
                                for k, v in s["max_relative"].items())
    if name.startswith("bench") and "mpitrain" in s:
        text = (f": {s['model']} 224x224 {s['precision']} batch {s['batch']}: mpitrain "
                f"{s['mpitrain']['images_per_s']:.0f} images/s")
        if "torch" in s:
            text += (f", PyTorch {s['torch']['images_per_s']:.0f} images/s, "
                     f"ratio {s['ratio']:.2f}x")
        return text
    if name.startswith("shared") and "images_per_s" in s:
        return (f": {s['images_per_s']:,.0f} images/s"
                + (f", {s['hidden_fraction']:.0%} of {s['comm_total_ms']:.1f} ms all-reduce "
                   f"hidden" if "hidden_fraction" in s else "")
                + (f", val top-1 {s['val_top1']:.1%}" if "val_top1" in s else "")
                + f", replicas {s['replicas']}")
    if name == "data convert" and "jpegs_per_s" in s:
        return (f": {s['jpegs']} JPEGs of 500x375, {s['jpegs_per_s']:.0f} a second "
                f"({s['threads']} threads)")
    if name == "data loader" and "cpu_every_core" in s:
        return (f": decoding on the GPU {s['mpitrain']['images_per_s']:.0f} images/s, the CPU "
                f"loader {s['cpu_every_core']['images_per_s']:.0f} ({s['workers']} workers "
                f"each; {s['gpu_over_cpu']:.2f}x)")
    if name.startswith("data step") and "fed" in s:
        return (f": {s['model']} {s['precision']} batch {s['batch']}, decoding on the "
                f"{s['decode'].upper()}: random batch "
                f"{s['random']['images_per_s']:.0f} images/s, loader-fed "
                f"{s['fed']['images_per_s']:.0f} ({s['ratio']:.2f}x; waiting "
                f"{s['fed']['wait_share']:.0%} of the time)")
    if name.startswith("data train") and "images_per_s" in s:
        return (f": ResNet-50 fp16 batch 256 trained on the JPEGs, decoding on the "
                f"{s['decode'].upper()}: {s['images_per_s']:.0f} images/s"
                + (f" ({s['over_random']:.2f}x bench step's random batch)"
                   if "over_random" in s else "")
                + f", waiting for data {s['wait_share']:.0%} of the time")
    if name == "nccl" and "nccl" in s:
        return f": NCCL {s['nccl']}, {s.get('buckets')} buckets through the Reducer"
    return ""


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mpitrain.tools.check_gpu",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
