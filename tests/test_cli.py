"""`python -m mpitrain`: argparse refuses bad values with exit status 2; inspect and
the benchmarks produce what they promise; a rank ending the job
first lets the launcher read its last words."""
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from mpitrain.cli import main


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mpitrain", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv,message", [
    (["train", "--epochs", "-1"], "argument --epochs: -1 must be >= 1"),
    (["train", "--epochs", "two"], "argument --epochs: 'two' is not a valid int"),
    (["train", "--batch-size", "0"], "argument --batch-size: 0 must be >= 1"),
    (["train", "--lr", "0"], "argument --lr: 0 must be > 0.0"),
    (["train", "--momentum", "1.5"], "argument --momentum: 1.5 must be < 1.0"),
    (["train", "--label-smoothing", "-0.1"], "argument --label-smoothing: -0.1 must be >= 0.0"),
    (["train", "--weight-decay=-1e-4"], "argument --weight-decay: -1e-4 must be >= 0.0"),
    (["train", "--data", "no/such/file.h5"], "training file no/such/file.h5 does not exist"),
    (["convert", "synthetic", "x.h5", "--size", "500"],
     "argument --size: '500' is not WIDTHxHEIGHT"),
    (["convert", "imagefolder", "src"], "the following arguments are required: DST"),
    (["train", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["train", "--fusion-threshold", "0"], "argument --fusion-threshold: 0 must be >= 1"),
    (["train", "--fusion-threshold", "fast"],
     "argument --fusion-threshold: 'fast' is neither a number of bytes nor auto"),
    (["train", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["inspect", "--image-size", "0"], "argument --image-size: 0 must be >= 1"),
    (["bench", "step", "--steps", "0"], "argument --steps: 0 must be >= 1"),
    (["bench", "step", "--reference", "jax"], "argument --reference: invalid choice: 'jax'"),
    (["bench", "step", "--compress", "topk", "--comm-dtype", "fp16"],
     "--compress topk sends its values in fp32 and cannot take --comm-dtype fp16"),
    (["bench", "step", "--density", "0"], "argument --density: 0 must be > 0.0"),
    (["train", "--precision", "fp64", "--device", "gpu"],
     "--precision fp64 cannot run with --device gpu: fp64 runs on the CPU, as the GPU's "
     "kernels and cuDNN plans are fp32 and fp16 (--device auto runs it there); drop --device"),
    (["train", "--precision", "fp64", "--decode", "gpu"],
     "--precision fp64 cannot run with --decode gpu: fp64 runs on the CPU"),
    (["train", "--precision", "fp64", "--ranks-per-gpu", "2"],
     "--precision fp64 cannot run with --ranks-per-gpu 2: fp64 runs on the CPU"),
    (["train", "--precision", "fp64", "--compress", "topk"],
     "--precision fp64 cannot run with --compress topk: top-k's kernels take fp32 gradients"),
    (["train", "--layers", "plain", "--precision", "fp16"],
     "--layers plain cannot run with --precision fp16"),
    (["bench", "comm", "--algorithms", "flat,ring"],
     "argument --algorithms: 'ring' is not one of flat, hierarchical, 2d, shm, hybrid"),
    (["bench", "comm", "--fusion-mib", "4,0"], "argument --fusion-mib: 0 must be >= 1"),
    (["bench", "comm", "--densities", "0.1,2"], "argument --densities: 2 must be <= 1.0"),
    (["bench", "comm", "--wires", "fp8"], "argument --wires: 'fp8' is not one of fp32, fp16"),
    (["bench", "comm", "--algorithms", ""], "argument --algorithms: '' names none: give one or "
                                           "more of flat, hierarchical, 2d, shm, hybrid, "
                                           "separated by commas"),
    (["bench"], "the following arguments are required: benchmark"),
    ([], "the following arguments are required: command"),
])
def test_bad_values_exit_2_with_the_reason_alone(argv, message, capsys):
    """One line, the reason, last; the usage is --help's."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err, err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("argv,message", [
    (["train", "--bach-size", "64"], "python -m mpitrain train: error: unrecognized option "
                                     "--bach-size: did you mean --batch-size"),
    (["bench", "step", "--warmpu=3"], "python -m mpitrain bench step: error: unrecognized "
                                      "option --warmpu: did you mean --warmup?"),
    (["train", "--epoch", "3"], "unrecognized option --epoch: did you mean --epochs"),
    (["eval", "--checkpoint", "x.h5", "--data", "y.h5", "--batch", "4"],
     "unrecognized option --batch: did you mean --batch-size"),
    (["inspect", "resnet50"], "unrecognized argument resnet50: did you mean --model resnet50?"),
    (["train", "--epochs", "1", "lars"],
     "unrecognized argument lars: did you mean --optimizer lars?"),
    (["train", "later"], "unrecognized arguments: later (--help lists the options)"),
])
def test_unknown_options_get_the_nearest_names_and_no_abbreviation_is_taken(argv, message,
                                                                           capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_path_given_without_its_option_is_answered_with_the_option(tmp_path, capsys,
                                                                    monkeypatch):
    """`eval runs/X` for `eval --checkpoint runs/X`, a data file for --data, and predict's
    first image that is a run directory."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("runs/x")
    open("val.h5", "w").close()
    for argv, message in [
            (["eval", "runs/x"], "the following arguments are required: --checkpoint; runs/x "
                                 "was given without its option: did you mean --checkpoint "
                                 "runs/x?"),
            (["eval", "--checkpoint", "runs/x", "val.h5"],
             "unrecognized argument val.h5: did you mean --data val.h5?"),
            (["predict", "runs/x", "a.jpg"], "give --checkpoint (a checkpoint or run "
                                             "directory), --onnx FILE (an exported model), or "
                                             "both; runs/x: did you mean --checkpoint runs/x?"),
            (["eval", "--data", "val.h5"], "the following arguments are required: "
                                           "--checkpoint\n")]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err


def test_unknown_model_lists_the_choices():
    r = run("train", "--model", "resnet51")
    assert r.returncode == 2
    assert "argument --model: invalid choice: 'resnet51' (choose from" in r.stderr
    for name in ("alexnet", "alexnet_bn", "resnet18", "resnet50", "resnet152", "resnet_small"):
        assert f"'{name}'" in r.stderr or f" {name}" in r.stderr


def loaded_after(argv, modules):
    """(exit status, those of `modules` imported) after `main(argv)` in a fresh process (its
    stderr's end in place of the list where it printed none)."""
    code = ("import atexit, sys\n"
            f"atexit.register(lambda: print(sorted({set(modules)!r} & set(sys.modules))))\n"
            f"from mpitrain.cli import main\nmain({argv!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    return r.returncode, (r.stdout.splitlines() or [r.stderr[-2000:]])[-1]


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["train", "--epochs", "-1"],
                                  ["train", "--model", "resnet51"], ["eval", "--data", "v.h5"],
                                  ["--version"]])
def test_help_and_a_refused_option_answer_without_loading_numba_or_mpi(argv):
    """The command line, its help, --version and the refusals of one value are plain
    Python: their answer does not wait for Numba's and MPI's second of imports."""
    status, loaded = loaded_after(argv, ("numba", "mpi4py.MPI", "h5py"))
    assert (status, loaded) == (0 if argv[-1] in ("--help", "--version") else 2, "[]")


def test_version_names_mpitrain_its_commit_python_and_the_libraries():
    """--version: mpitrain's version with `git describe` of its checkout, then Python's and
    the installed libraries' versions, as their own modules give them."""
    import importlib.metadata
    import platform

    import h5py
    import mpi4py
    import numba
    import numpy

    import mpitrain
    r = subprocess.run([sys.executable, "-m", "mpitrain", "--version"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    root = os.path.dirname(os.path.dirname(mpitrain.__file__))
    if os.path.exists(os.path.join(root, ".git")):
        commit = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty",
                                 "--abbrev=12"], capture_output=True, text=True).stdout.strip()
        assert first == f"mpitrain {mpitrain.__version__} (checkout {commit})"
    else:
        assert first == f"mpitrain {mpitrain.__version__}"
    assert second.startswith(f"Python {platform.python_version()} on "), second
    assert importlib.metadata.version("mpitrain") == mpitrain.__version__   # setup.py reads it
    for module in (numpy, numba, h5py, mpi4py):
        assert f"{module.__name__} {module.__version__}" in second, second


def venv_python(path, site=None):
    """A new venv's Python, without mpitrain or its dependencies; with `site`, that folder
    on its path (its packages importable, but its .pth files not run: mpitrain's editable
    install, which maps kernels/ to mpitrain.kernels, stays out)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120)
    python = str(path / "bin" / "python")
    if site:
        purelib = subprocess.run([python, "-c", "import sysconfig; "
                                  "print(sysconfig.get_path('purelib'))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(purelib, "site.pth"), "w") as f:
            f.write(site + "\n")
    return python


@pytest.mark.parametrize("with_dependencies", [False, True])
def test_a_python_without_mpitrain_installed_is_told_how_to_run_it(tmp_path, with_dependencies):
    """`python -m mpitrain` in the checkout from a Python without the dependencies, or
    without mpitrain installed: one line naming the missing module and the fix, status 2."""
    import sysconfig

    from mpitrain.cli import DEPENDENCIES
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python = venv_python(tmp_path / "venv",
                         sysconfig.get_path("purelib") if with_dependencies else None)
    r = subprocess.run([python, "-m", "mpitrain", "train"], cwd=root, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    missing = re.fullmatch(rf"(?:mpitrain|rank 0 of 1): error: this Python \({re.escape(python)}"
                           rf"\) has no module '([\w.]+)': mpitrain runs where it is installed "
                           rf"with its dependencies: `./launch.sh COMMAND ...` \(or "
                           rf"`.venv/bin/python -m mpitrain ...`\) after `./launch.sh setup`, "
                           rf"or a Python in which `pip install -e .` ran in the checkout\n",
                           r.stderr)
    assert missing, r.stderr
    name = missing.group(1)
    assert name.startswith("mpitrain.") if with_dependencies else name in DEPENDENCIES, name


def test_the_dependencies_named_are_setup_pys():
    from mpitrain.cli import DEPENDENCIES
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "setup.py")) as f:
        required = re.search(r"install_requires=\[(.*?)\]", f.read(), re.S).group(1)
    imported_as = {"pillow": "PIL", "scikit-learn": "sklearn", "pyyaml": "yaml"}
    names = [re.match(r"[\w-]+", d).group(0) for d in re.findall(r'"([^"]+)"', required)]
    assert sorted(imported_as.get(n, n) for n in names) == sorted(DEPENDENCIES)


@pytest.mark.parametrize("argv", [["train", "--compress", "topk", "--comm-dtype", "fp16"],
                                  ["train", "--optimizer", "sgd", "--lars-eta", "0.01"],
                                  ["train", "--schedule", "step"]])
def test_train_refuses_options_that_cannot_work_together_before_the_runs_imports(argv):
    """checks.refuse_options, before the run's imports (Numba, the layers, the loader)."""
    assert loaded_after(argv, ("numba", "mpitrain.train", "h5py")) == (2, "[]")


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["inspect", "--help"],
                                  ["bench", "--help"], ["bench", "step", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "usage: python -m mpitrain" in out
    # a default is said where it says something, once: not for a flag, an empty list or
    # none, nor again after a help that words its own (--val-data: DATA's FILE_val.h5)
    assert not re.search(r"\(default: (None|False|True|\(\))\)", out), out
    assert not re.search(r"default[^()]*\) \(default: ", out), out
    if argv[0] == "train":
        assert "--epochs N passes over the training data (default: 8)" in out, out


def parsers(parser, path=()):
    """(command words, parser) of every command and subcommand below `parser`."""
    import argparse
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def test_every_option_names_its_value_by_its_kind():
    """In every command's --help, a number's value is N (a count) or X (a real number), a
    path's FILE, DIR or FILE|RUN_DIR: never the option's own name again (`--lr LR`,
    `--checkpoint CHECKPOINT`)."""
    from mpitrain.cli import build_parser
    commands = dict(parsers(build_parser()))
    assert ("bench", "step") in commands and ("convert", "synthetic") in commands
    for words, parser in commands.items():
        text = parser.format_help()
        repeated = [m.group(0) for m in re.finditer(r"--([a-z-]+) ([A-Z_]+)\b", text)
                    if m.group(1).replace("-", "_").upper() == m.group(2)]
        assert not repeated, (words, repeated)
    train = commands[("train",)].format_help()
    assert "--lr X" in train and "--epochs N" in train
    assert "--checkpoint FILE|RUN_DIR" in commands[("eval",)].format_help()


def test_every_option_with_a_default_says_its_default():
    """An option that takes a value, or an --X/--no-X one, and has a default says it in its
    help, in cli.Help's words or its own; a help that says "default" of something else
    would hide it, and so would no help at all."""
    import argparse
    from mpitrain.argtypes import OnOff
    from mpitrain.cli import build_parser
    hidden = []
    for words, parser in parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            takes = action.nargs != 0 or isinstance(action, OnOff)
            if takes and action.default not in (None, (), argparse.SUPPRESS):
                said = (formatter._get_help_string(action) or "") % dict(default=action.default)
                if not re.search(r"default[^)]*:", said):
                    hidden.append((words, action.option_strings, said))
    assert not hidden, hidden


def test_every_on_off_option_is_onoff():
    """--X/--no-X options are argtypes.OnOff, whose help reads the same on every Python
    (3.10's BooleanOptionalAction writes a default of its own into the help)."""
    import argparse
    from mpitrain.argtypes import OnOff
    from mpitrain.cli import build_parser
    on_off = [(words, action) for words, parser in parsers(build_parser())
              for action in parser._actions
              if isinstance(action, argparse.BooleanOptionalAction)]
    raw = [(words, a.option_strings) for words, a in on_off if not isinstance(a, OnOff)]
    assert on_off and not raw, raw


@pytest.mark.parametrize("argv", [["inspect", "--num-classes", "1"],
                                  ["bench", "step", "--num-classes", "1"],
                                  ["convert", "synthetic", "x.h5", "--classes", "1"]])
def test_a_network_of_one_class_is_refused_by_name(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {argv[-2]}: 1 must be >= 2" in err, err
    assert not os.listdir(tmp_path)


def test_inspect_resnet50(capsys):
    main(["inspect", "--model", "resnet50", "--image-size", "224"])
    assert "25,557,032" in capsys.readouterr().out


# ----- the benchmarks: one cheap run each, checking what the benchmark could get wrong -----
@pytest.mark.torch
def test_bench_step_times_the_same_network_in_torch():
    """The PyTorch side runs in a child process that rebuilds the network and the batch
    from the seed: the ratio means something only if both frameworks then run the same
    network with the same weights on the same batch, so their first losses (before any
    update) agree, and only with torch on the step's thread count."""
    r = run("bench", "step", "--model", "resnet_small", "--image-size", "32", "--batch", "8",
            "--steps", "1", "--warmup", "1", "--num-classes", "10", "--seed", "3",
            "--reference", "torch", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)                      # one JSON object and nothing else
    ours, theirs = result["mpitrain"]["first_loss"], result["torch"]["first_loss"]
    assert theirs == pytest.approx(ours, rel=1e-5)
    assert result["torch"]["threads"] == result["blas"]["threads"]


@pytest.mark.torch
def test_bench_step_rounds_take_turns_and_quote_the_median_ratio():
    """--rounds 3: three rounds, PyTorch going first in the second; each round's ratio is
    its own two figures', the quoted ratio their median, each side's figures those of
    its median round with the largest peak memory, and both still run one network."""
    r = run("bench", "step", "--model", "resnet_small", "--image-size", "16", "--batch", "4",
            "--steps", "1", "--warmup", "1", "--num-classes", "10", "--reference", "torch",
            "--rounds", "3", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    rounds = result["rounds"]
    assert [o["first"] for o in rounds] == ["mpitrain", "torch", "mpitrain"]
    for o in rounds:
        assert o["ratio"] == pytest.approx(o["mpitrain"] / o["torch"], rel=1e-12)
    assert result["ratio"] == sorted(o["ratio"] for o in rounds)[1]
    for side in ("mpitrain", "torch"):
        assert result[side]["images_per_s"] == sorted(o[side] for o in rounds)[1]
        assert result[side]["peak_memory"] > 0
    assert result["torch"]["first_loss"] == pytest.approx(result["mpitrain"]["first_loss"],
                                                          rel=1e-5)


def test_bench_step_rounds_without_a_reference_and_their_text():
    """Without a reference the rounds time mpitrain alone; the text lists every round."""
    r = run("bench", "step", "--model", "resnet_small", "--image-size", "16", "--batch", "4",
            "--steps", "1", "--warmup", "0", "--num-classes", "10", "--rounds", "2")
    assert r.returncode == 0, r.stderr
    assert "each side's median round of 2, taking turns at going first" in r.stdout
    listed = [line for line in r.stdout.splitlines() if line.startswith("rounds, images/s: ")]
    assert len(listed) == 1 and "1: " in listed[0] and "; 2: " in listed[0]
    assert "torch" not in listed[0] and "ratio" not in r.stdout


@pytest.mark.launches
@pytest.mark.one_mpi
def test_bench_step_refuses_one_process_options_under_mpirun():
    """The data-parallel benchmark has no reference, profile or rounds: given under
    mpirun they are an error naming each (exit 2 on every rank, said once), not options
    silently ignored."""
    import launcher
    r = subprocess.run(launcher.mpitrain_command(
        2, "bench", "step", "--model", "resnet_small", "--image-size", "16", "--batch", "4",
        "--steps", "1", "--warmup", "0", "--reference", "torch", "--profile", "1",
        "--rounds", "2"),
        capture_output=True, text=True, timeout=120, env=launcher.environment(2))
    assert r.returncode == 2, (r.stdout, r.stderr)
    message = "--reference, --profile, --rounds apply to the one-process benchmark"
    assert r.stderr.count(message) == 1, r.stderr


@pytest.mark.launches
@pytest.mark.one_mpi
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: the baseline wants one thread")
def test_bench_step_ranks_run_their_share_and_the_baseline_every_core():
    """Under mpirun each rank's pools are its share of the cores, and the one-rank baseline
    runs in a process of its own on the threads of the node's ranks together, however the
    job was started: launch.sh's NUMBA_NUM_THREADS=1 capped the baseline at one thread
    (the scaling efficiency overstated), and under a plain mpiexec the ranks kept pools of
    all the host's cores (their steps several times slower)."""
    import launcher

    from mpitrain.launcher import affinity
    from mpitrain.tools.bench.step import format_parallel
    args = ["bench", "step", "--model", "resnet_small", "--image-size", "16", "--batch", "4",
            "--steps", "1", "--warmup", "0", "--json"]
    capped = launcher.environment(2)                   # NUMBA_NUM_THREADS=1 for each rank
    free = {k: v for k, v in capped.items() if k not in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS",
                                                         "OPENBLAS_NUM_THREADS")}
    share = max(1, launcher.cores() // 2)
    every = min(2 * share, os.cpu_count())
    for env in (capped, free):
        r = subprocess.run(launcher.mpitrain_command(2, *args), capture_output=True, text=True,
                           timeout=180, env=env)
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout)
        assert result["blas"]["numba_pool"] == share, result["blas"]
        assert result["one_rank"]["threads"] == every, result["one_rank"]
        assert f"1 rank x {every} threads, batch 4" in format_parallel(result)
    # each rank pinned to a core of its own (as Open MPI's mpirun and Slurm bind them): the
    # baseline ran on rank 0's core alone, which it inherited
    pinned = ("import os, sys\nfrom mpitrain.launcher import affinity, launched_rank\n"
              "os.sched_setaffinity(0, {affinity()[launched_rank()]})\n"
              "os.execv(sys.executable, [sys.executable, '-m', 'mpitrain', *sys.argv[1:]])\n")
    r = subprocess.run(launcher.command(2, sys.executable, "-c", pinned, *args),
                       capture_output=True, text=True, timeout=180, env=free)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["blas"]["numba_pool"] == 1 and result["one_rank"]["threads"] == 2 \
        and result["one_rank"]["cores"] == affinity()[:2], \
        (result["blas"], result["one_rank"])


@pytest.mark.launches
def test_native_openblas_reruns_each_rank_before_mpi_starts():
    """Under mpirun each rank re-runs itself without the forcing variables before MPI
    starts (a rank that started MPI first failed in the second MPI_Init)."""
    import launcher
    env = {**launcher.environment(2), "OPENBLAS_L2_SIZE": "262144"}
    r = subprocess.run(launcher.mpitrain_command(
        2, "bench", "step", "--model", "resnet_small", "--image-size", "16", "--batch", "4",
        "--steps", "1", "--warmup", "0", "--native-openblas", "--json"),
        capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["ranks"] == 2 and "--native-openblas: re-running without" \
        in r.stderr, r.stdout + r.stderr


def test_bench_step_profile_counts_every_gemm_of_a_training_step():
    """--profile records each GEMM: per step one per convolution and linear layer in
    forward and two in backward (dW and dx), but for the first convolution's dx, which
    the images do not need; and their operations, 2 m n k each, are those of three
    times the forward pass's multiply-adds (inspect's count) less that dx."""
    from mpitrain.tools.inspect import layer_table
    r = run("bench", "step", "--model", "resnet_small", "--image-size", "32", "--batch", "8",
            "--steps", "1", "--warmup", "1", "--num-classes", "10", "--profile", "2", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    profile = result["mpitrain"]["profile"]
    rows, _ = layer_table("resnet_small", image_size=32, num_classes=10)
    gemm_layers = [row for row in rows if row[1] in ("Conv2d", "Linear")]
    assert sum(g["calls"] for g in profile["gemms"]) == 3 * len(gemm_layers) - 1
    macs = 8 * sum(row[4] for row in gemm_layers)
    first = 8 * gemm_layers[0][4]
    assert profile["flops_per_step"] == pytest.approx(2 * (3 * macs - first), rel=1e-9)
    assert set(profile["ms"]) >= {"GEMM", "BatchNorm", "im2col", "col2im", "update"}
    assert 0 < profile["outside_gemm"] < 1 and result["mpitrain"]["peak_memory"] > 0


def test_native_openblas_reruns_without_the_forcing_variables():
    """--native-openblas re-runs the command without OPENBLAS_CORETYPE/_L2_SIZE (which
    OpenBLAS reads when it loads) and says so; the benchmark then sees neither."""
    env = {**os.environ, "OPENBLAS_L2_SIZE": "262144"}
    r = subprocess.run([sys.executable, "-m", "mpitrain", "bench", "step", "--model",
                        "resnet_small", "--image-size", "32", "--batch", "4", "--steps", "1",
                        "--warmup", "0", "--num-classes", "10", "--native-openblas", "--json"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "--native-openblas: re-running without" in r.stderr
    result = json.loads(r.stdout)
    assert result["blas"]["forced"] == {}
    removed = result["native_openblas"]["removed"]
    assert "OPENBLAS_L2_SIZE=262144" in removed
    if "OPENBLAS_CORETYPE" in os.environ:
        assert f"OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']}" in removed


@pytest.mark.parametrize("choice", [None, "mkl", "openblas"])
def test_bench_step_names_the_teams_blas_and_how_to_take_mkl_where_passed_over(choice):
    """The team's GEMMs line: the BLAS MPITRAIN_BLAS names, else MKL on an Intel CPU where
    installed, else OpenBLAS; where MKL is installed and passed over for the CPU's maker,
    it says so and how to take it."""
    from test_gemm_kernels import cpu_maker, mkl_installed, needs_mkl
    if choice == "mkl":
        needs_mkl()
    env = {k: v for k, v in os.environ.items() if k != "MPITRAIN_BLAS"}
    r = subprocess.run([sys.executable, "-m", "mpitrain", "bench", "step", "--model",
                        "resnet_small", "--image-size", "16", "--batch", "4", "--steps", "1",
                        "--warmup", "0", "--num-classes", "10"], capture_output=True, text=True,
                       timeout=120, env={**env, **({"MPITRAIN_BLAS": choice} if choice else {})})
    assert r.returncode == 0, r.stderr
    vendor = cpu_maker()
    want = choice or ("mkl" if vendor == "GenuineIntel" and mkl_installed() else "openblas")
    line = next(x for x in r.stdout.splitlines() if x.startswith("the team's GEMMs: "))
    assert line.startswith(f"the team's GEMMs: {want} "), line
    passed_over = choice is None and want == "openblas" and mkl_installed()
    assert line.endswith(f"; MKL is installed, but taken only on GenuineIntel CPUs, and this "
                         f"one is {vendor}: MPITRAIN_BLAS=mkl takes it") == passed_over, line


def test_bench_update_times_kernels_that_compute_the_numpy_step():
    """Every implementation it times first takes one step from the same state; a kernel
    that computes another step would make its time meaningless."""
    r = run("bench", "update", "--model", "resnet_small", "--repeats", "1", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert set(result["results"]) >= {"numpy", "numba"}
    for impl, figures in result["results"].items():
        assert figures["max_diff_vs_numpy"] < 1e-5, impl


@pytest.mark.launches
@pytest.mark.one_mpi
def test_bench_step_sets_topk_sharding_and_autotune_against_the_dense_step():
    """Under mpirun, bench step reports top-k's bytes (8 per pick, ceil(D n) picks per
    bucket), the sharded update's optimizer state (its shard's velocity), and the fusion
    tuner's choice, each beside the dense, unsharded, fixed-bucket step."""
    import math

    import launcher

    from mpitrain.comm.buckets import bucket_bounds
    from mpitrain.nets import build_model
    arena = build_model("resnet_small").arena
    r = subprocess.run(launcher.mpitrain_command(
        2, "bench", "step", "--model", "resnet_small", "--image-size", "16", "--batch", "4",
        "--steps", "2", "--warmup", "1", "--compress", "topk", "--density", "0.05",
        "--shard-update", "--fusion-threshold", "auto", "--json"),
        capture_output=True, text=True, timeout=300, env=launcher.environment(2))
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    chosen = result["autotune"]["chosen"]
    assert chosen in result["autotune"]["candidates"] and result["fusion_threshold"] == chosen
    picks = sum(math.ceil(0.05 * (b - a)) for a, b in bucket_bounds(arena, chosen))
    assert result["topk"]["bytes"] == 8 * picks
    assert result["dense_bytes"] == 4 * arena.size
    shards = result["sharded"]["state_bytes"] / result["state_bytes"]
    assert abs(shards - 0.5) <= 128 / arena.size        # half the arena, to an ALIGN unit
    for run in ("overlap", "no_overlap", "topk", "sharded"):
        assert result[run]["step_ms"] > 0, run
    # the last rank to reach the sums waits for no one: no longer than rank 0 spent there
    dense = result["no_overlap"]
    assert 0 < dense["allreduce_ms"] <= dense["comm_total_ms"] + 1e-6
    assert 0 <= result["hidden_fraction"] <= 1


def test_bench_step_hidden_share_is_never_negative():
    """The main thread's wait includes the hand-off to the communication thread, so on a
    tiny model it can outlast the all-reduce itself: nothing was hidden then, not less."""
    from mpitrain.tools.bench.step import hidden_fraction
    assert hidden_fraction(2.0, 8.0) == 0.75
    assert hidden_fraction(0.0, 8.0) == 1.0
    assert hidden_fraction(0.13, 0.1) == 0.0


@pytest.mark.launches
def test_bench_comm_sums_the_model_arena_as_training_does():
    """bench comm must time the model's own gradient arena (its tensors, in arena order)
    allocated as training allocates it, in the node's shared memory: only then does
    `hybrid` take the path training takes (shm for the arena and its buckets)."""
    import launcher

    from mpitrain.nets import build_model
    sizes = build_model("resnet_small").arena.segments["size"]
    r = subprocess.run(launcher.mpitrain_command(2, "bench", "comm",
                                                 "--model", "resnet_small", "--algorithms",
                                                 "flat,hybrid", "--fusion-mib", "4", "--repeats",
                                                 "1", "--no-sweep", "--json"),
                       capture_output=True, text=True, timeout=180, env=launcher.environment(2))
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["values"] == int(sizes.sum())
    rows = {(row["algorithm"], row["mode"], row["wire"]): row for row in result["rows"]}
    assert rows["flat", "per-tensor", "fp32"]["calls"] == len(sizes)
    for mode in ("whole", "fused 4 MiB"):
        assert rows["hybrid", mode, "fp32"]["ran"] == ["shm"], mode


def test_bench_comm_on_one_rank_says_that_nothing_is_sent():
    r = run("bench", "comm", "--model", "resnet_small", "--algorithms", "flat",
            "--fusion-mib", "4", "--repeats", "1", "--no-sweep", "--densities", "0.1",
            "--wires", "fp32")
    assert r.returncode == 0, r.stderr
    assert "\none rank: nothing is sent, so these times are each algorithm's local work; time " \
           "the all-reduce under mpirun (./launch.sh bench comm: NP ranks)\n" in r.stdout, r.stdout


def test_bench_data_times_full_batches(tmp_path):
    """convert synthetic JPEGs through the CLI, then time the loader on them: the images
    counted as they come out of the loader are the batches asked for, all of them full
    (the file's 8 records make two batches an epoch; three are timed after the first)."""
    jpegs = tmp_path / "synthetic.h5"
    r = run("convert", "synthetic", str(jpegs), "--count", "8", "--size", "96x64", "--classes", "2")
    assert r.returncode == 0, r.stderr
    assert "train: 8 images" in r.stdout
    r = run("bench", "data", "--data", str(jpegs), "--image-size", "48", "--batch", "4",
            "--workers", "1", "--batches", "3", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["records"] == 8
    assert result["mpitrain"]["images"] == 3 * 4
    from mpitrain.launcher import cores
    assert result["cores"] == cores()
    for workers in (1, cores() + 1):        # more workers than cores: said beside the figures
        r = run("bench", "data", "--data", str(jpegs), "--image-size", "48", "--batch", "4",
                "--workers", str(workers), "--batches", "3")
        assert r.returncode == 0, r.stderr
        said = f"({workers} workers on {cores()} cores: they take turns" in r.stdout
        assert said == (workers > cores()), r.stdout
    r = run("bench", "data", "--data", str(jpegs), "--batch", "9")      # no full batch
    assert r.returncode == 2 and r.stderr.endswith(
        f"error: {jpegs} holds 8 images, fewer than one batch of 9: lower --batch\n"), r.stderr


@pytest.mark.torch
def test_bench_data_rounds_take_turns_and_quote_the_median(tmp_path):
    """--rounds 3 --reference torch: the loader and the DataLoader take turns at going first;
    each ratio is the median of the rounds' ratios, each side's figures its median round's
    by images per CPU-second."""
    pytest.importorskip("torch")
    jpegs = tmp_path / "synthetic.h5"
    synthetic_jpegs(jpegs, count=16)
    r = run("bench", "data", "--data", str(jpegs), "--image-size", "48", "--batch", "4",
            "--workers", "1", "--batches", "3", "--rounds", "3", "--reference", "torch", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    rounds = result["rounds"]
    assert [k["first"] for k in rounds] == ["mpitrain", "torch", "mpitrain"]
    for key in ("ratio", "ratio_cpu"):
        assert result[key] == sorted(k[key] for k in rounds)[1]
    for side in ("mpitrain", "torch"):
        middle = sorted(k[side]["images_per_cpu_s"] for k in rounds)[1]
        assert result[side]["images_per_cpu_s"] == middle
        assert result[side]["images"] == 3 * 4
    for k in rounds:
        assert k["ratio_cpu"] == pytest.approx(k["mpitrain"]["images_per_cpu_s"]
                                               / k["torch"]["images_per_cpu_s"])


def test_bench_step_nondeterministic_plans_need_a_gpu():
    r = run("bench", "step", "--nondeterministic-plans", "--model", "resnet_small",
            "--image-size", "32", "--steps", "1", "--warmup", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--nondeterministic-plans chooses among cuDNN's plans, on a GPU: add --device gpu" \
        in r.stderr and "images/s" not in r.stdout


def synthetic_jpegs(path, count=8):
    r = run("convert", "synthetic", str(path), "--count", str(count), "--size", "96x64",
            "--classes", "2")
    assert r.returncode == 0, r.stderr


def test_bench_data_on_a_gpu_is_refused_where_there_is_none(tmp_path):
    """--device gpu without a GPU (or without nvImageCodec): exit 2, naming what is
    missing, before any loader starts."""
    from mpitrain.backend import gpu_available
    if gpu_available():
        pytest.skip("a GPU is visible: test_bench_data_on_the_gpu runs instead")
    synthetic_jpegs(tmp_path / "s.h5")
    r = run("bench", "data", "--data", str(tmp_path / "s.h5"), "--device", "gpu",
            "--image-size", "48", "--batch", "4")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no GPU can be used" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "images/s" not in r.stdout


@pytest.mark.gpu
def test_bench_data_on_the_gpu(tmp_path):
    """--device gpu: the GPU loader's full batches timed, and the CPU loader on every core
    beside it, with their ratio."""
    synthetic_jpegs(tmp_path / "s.h5", count=32)
    r = run("bench", "data", "--data", str(tmp_path / "s.h5"), "--device", "gpu",
            "--image-size", "48", "--batch", "8", "--workers", "1", "--batches", "6", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["device"] == "gpu" and result["mpitrain"]["images"] == 6 * 8
    assert result["mpitrain"]["host_decoded"] == 0      # every JPEG decoded on the GPU
    assert result["cpu_every_core"]["images"] == 6 * 8
    assert result["gpu_over_cpu"] == pytest.approx(
        result["mpitrain"]["images_per_s"] / result["cpu_every_core"]["images_per_s"])


def test_the_idle_team_sleeps_after_a_moment():
    """Once mpitrain is imported, the OpenMP team that runs the kernels and the GEMMs spins
    for under a millisecond between kernels (GOMP_SPINCOUNT, mpitrain/__init__.py), then
    sleeps: the process takes next to no CPU time while its main thread sleeps after a
    step's worth of GEMMs on the team. (With OMP_WAIT_POLICY=ACTIVE the team's thread
    burns the whole sleep.)"""
    code = ("import mpitrain, time, numba, numpy as np; from mpitrain.kernels import gemm; "
            "numba.set_num_threads(2); a = np.ones((512, 512), np.float32); "
            "assert gemm.team_gemms(2); [gemm.matmul(a, a) for _ in range(3)]; "
            "c = time.process_time(); time.sleep(0.3); print(time.process_time() - c)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS")}
    env["NUMBA_NUM_THREADS"] = "2"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) < 0.03, f"{float(run.stdout):.3f} s of CPU while asleep"


def test_idle_openblas_threads_sleep_between_gemms():
    """Once mpitrain is imported, OpenBLAS's GEMM threads sleep when a GEMM is done instead
    of spinning for about 0.1 s (OPENBLAS_THREAD_TIMEOUT, mpitrain/__init__.py): the process
    takes next to no CPU time while its main thread sleeps after a GEMM. (Without the
    setting, 2 OpenBLAS threads burn about 0.1 s here.)"""
    code = ("import mpitrain, time, numpy as np; a = np.ones((512, 512), np.float32); "
            "[a @ a for _ in range(3)]; c = time.process_time(); time.sleep(0.3); "
            "print(time.process_time() - c)")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT",
                                                              "OMP_WAIT_POLICY")}
    env["OPENBLAS_NUM_THREADS"] = "2"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) < 0.03, f"{float(run.stdout):.3f} s of CPU while asleep"


# ----- ending the job -----
def test_a_rank_ending_the_job_waits_until_the_launcher_has_read_its_output(tmp_path):
    """Before its MPI Abort, a rank waits until what it wrote to its stdout and stderr
    pipes has been read (control.end_job), so the message saying why the job ends
    reaches the user. The wait returns only once a reader that comes late has read
    every byte; a reader that never comes costs the timeout; a file is never waited for."""
    from mpitrain.control import unread, wait_until_read
    message = b"rank 1 of 2: uncaught exception, ending the job\n" * 100
    r, w = os.pipe()
    try:
        os.write(w, message)
        assert unread(w) == len(message)
        reader = threading.Timer(0.2, os.read, (r, 2 * len(message)))
        reader.start()
        wait_until_read((w,), timeout=60)
        assert unread(w) == 0                     # returned after the reader, not before
        reader.join()
        os.write(w, b"x")
        start = time.monotonic()
        wait_until_read((w,), timeout=0.1)
        assert unread(w) == 1 and time.monotonic() - start >= 0.1
    finally:
        os.close(r)
        os.close(w)
    with open(tmp_path / "log", "w") as f:
        f.write("unread until closed")
        f.flush()
        assert unread(f.fileno()) == 0


def test_bench_step_data_times_steps_fed_by_the_loader(tmp_path):
    """bench step --data: the same network's steps on a random batch, then on the loader's
    batches from a converted file (its classes), every timed step a full batch."""
    jpegs = tmp_path / "synthetic.h5"
    assert run("convert", "synthetic", str(jpegs), "--count", "8", "--size", "96x64",
               "--classes", "3").returncode == 0
    r = run("bench", "step", "--data", str(jpegs), "--model", "resnet_small", "--image-size",
            "32", "--batch", "4", "--steps", "3", "--warmup", "1", "--workers", "1", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["records"] == 8 and result["classes"] == 3
    fed, random = result["fed"], result["random"]
    assert fed["images"] == 3 * 4
    assert fed["step_ms"] > 0 and random["step_ms"] > 0 and 0 <= fed["wait_share"] < 1
    assert result["ratio"] == pytest.approx(fed["images_per_s"] / random["images_per_s"])
    assert result["decode"] == "cpu" and "cuda_graph" not in fed
    # --cuda-graph: both kinds of step say why they ran eagerly (here: on the CPU)
    r = run("bench", "step", "--data", str(jpegs), "--model", "resnet_small", "--image-size",
            "32", "--batch", "4", "--steps", "1", "--warmup", "1", "--workers", "1",
            "--cuda-graph")
    assert r.returncode == 0, r.stderr
    assert "(CUDA graphs: the step runs on the CPU" in r.stdout, r.stdout
    assert "decoded by 1 loader worker(s)" in r.stdout, r.stdout


def test_bench_step_data_refuses_what_it_cannot_time(tmp_path):
    jpegs = tmp_path / "synthetic.h5"
    assert run("convert", "synthetic", str(jpegs), "--count", "4", "--size", "96x64",
               "--classes", "2").returncode == 0
    for argv, message in (
            (["--data", str(tmp_path / "none.h5")], "none.h5 does not exist; make it with"),
            (["--data", str(tmp_path / "none.h5"), "--reference", "torch"],
             "--reference cannot be used with --data"),
            (["--decode", "gpu"], "--decode gpu times the loader's decoding: give it a file"),
            (["--data", str(jpegs), "--decode", "gpu"],
             "--decode gpu decodes on the GPU the steps run on: add --device gpu"),
            (["--data", str(jpegs), "--decode", "gpu", "--device", "gpu"], "GPU"),):
        r = run("bench", "step", *argv)
        assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.parametrize("argv,option", [
    (["eval", "--checkpoint", ""], "--checkpoint"),
    (["eval", "--checkpoint", "runs/x", "--data-dir", ""], "--data-dir"),
    (["export", "", "m.onnx"], "CHECKPOINT"),
    (["export", "runs/x", ""], "OUT"),
    (["predict", "--checkpoint", "runs/x", ""], "IMAGE"),
    (["plot", ""], "RUN_DIR"),
    (["plot", "runs/x", "--out", ""], "--out"),
    (["inspect", "--data", ""], "--data"),
    (["preview", "--out", ""], "--out"),
    (["bench", "data", "--data", ""], "--data"),
    (["simulate", "--device", "cpu", "--calibration", ""], "--calibration"),
    (["study", "large-batch", "--out", ""], "--out"),
    (["check-gpu", "--dry-run", "--out-dir", ""], "--out-dir"),
    (["convert", "digits", ""], "DST_DIR"),
])
def test_an_empty_path_is_refused_by_every_command(argv, option, capsys):
    """'' names no file: the commands took it for the current directory or its parent,
    or for their default."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert f"error: argument {option}: '' is an empty path" in err, err


def test_convert_to_an_empty_path_writes_nothing_in_the_parent_directory(tmp_path):
    here = tmp_path / "here"
    here.mkdir()
    r = subprocess.run([sys.executable, "-m", "mpitrain", "convert", "synthetic", "",
                        "--count", "2"], capture_output=True, text=True, timeout=120, cwd=here)
    assert r.returncode == 2 and "argument DST: '' is an empty path" in r.stderr, r.stderr
    assert os.listdir(tmp_path) == ["here"] and os.listdir(here) == []


def test_a_synthetic_size_beyond_a_jpegs_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["convert", "synthetic", str(tmp_path / "s.h5"), "--size", "70000x8",
              "--count", "1"])
    assert exit_.value.code == 2
    assert "argument --size: 70000x8: a JPEG holds at most 65535 pixels a side; give a " \
           "smaller size" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv,lower", [
    (["inspect", "--image-size", "100000"], "--image-size"),
    (["bench", "data", "--data", "{digits}/digits_train.h5", "--image-size", "100000"],
     "--image-size"),
    (["bench", "step", "--batch", "100000", "--image-size", "100000"], "--image-size or --batch"),
])
def test_an_array_beyond_memory_is_one_line_naming_the_sizes_to_lower(argv, lower, digits):
    """NumPy's MemoryError said as what to change, with status 2, not as a traceback."""
    r = run(*[a.format(digits=digits) for a in argv])
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(rf"error: out of memory: Unable to allocate .*; lower {lower} \(the images "
                     rf"and activations of a batch must fit in this machine's memory\)\n$",
                     r.stderr), r.stderr
    assert "Traceback" not in r.stderr


def test_plot_takes_an_epochs_steps_from_the_runs_data_when_its_records_do_not_say(digits,
                                                                                   tmp_path):
    """A run stopped in its first epoch has no record past it: its x axis is the run's
    training images over its batch (1437 digits // 64 = 22 steps an epoch), not the last
    step logged (which drew 10 steps as a whole epoch)."""
    from mpitrain.tools.plot import read_records, steps_per_epoch
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "mpitrain", "train", "--data-dir", str(digits),
                        "--run-dir", str(run_dir), "--epochs", "1", "--batch-size", "64",
                        "--log-every", "5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    metrics = run_dir / "metrics.jsonl"
    records = read_records(str(metrics))
    steps = [x for x in records if x["kind"] == "step"]
    evals = [x for x in records if x["kind"] == "eval"]
    assert steps_per_epoch(steps, evals) == 22                  # the evaluation's record
    # as the run's metrics.jsonl stands when it is stopped at step 12
    lines = [line for line in metrics.read_text().splitlines(keepends=True)
             if json.loads(line)["kind"] != "step" or json.loads(line)["step"] <= 12]
    metrics.write_text("".join(line for line in lines if json.loads(line)["kind"] == "step"))
    stopped = read_records(str(metrics))
    assert max(x["step"] for x in stopped) == 10
    assert steps_per_epoch(stopped, (), str(run_dir)) == 22
    assert steps_per_epoch(stopped, (), str(tmp_path / "gone")) == 10    # no config.json
    r = run("plot", str(run_dir))
    assert r.returncode == 0 and (run_dir / "loss.png").exists(), r.stderr
