"""The GPU path as far as a CPU can check it: which device a process takes, the stream
interface on the host, the environment report, and the refusals of check-gpu and
`bench step --device gpu` where there is no GPU. Tests marked `gpu` run the same
code on a GPU (skipped elsewhere); the ordering of the Reducer's stream calls is
tested in tests/mpi/test_buckets.py."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.backend import DeviceError, pick_device

ROOT = Path(__file__).resolve().parents[1]
HAS_GPU = backend.gpu_available()
cpu_only = pytest.mark.skipif(HAS_GPU, reason="checks what happens where there is no GPU")


def mpitrain(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], capture_output=True,
                          text=True, timeout=timeout)


# ----- device selection -----
@pytest.mark.parametrize("kind,env,gpus,local_rank,local_size,expected", [
    ("cpu", {}, 4, 0, 1, None),
    ("auto", {}, 0, 0, 1, None),                          # no GPU: the CPU
    ("auto", {}, 2, 1, 2, 1),                             # a GPU per node-local rank
    ("auto", {"MPITRAIN_DEVICE": "cpu"}, 2, 0, 1, None),  # the environment overrides auto
    ("cpu", {"MPITRAIN_DEVICE": "gpu"}, 0, 0, 1, None),   # ... but not an explicit choice
    ("gpu", {}, 8, 5, 8, 5),
    ("gpu", {}, 2, 3, 2, 1),                              # local rank modulo the GPUs
])
def test_pick_device(kind, env, gpus, local_rank, local_size, expected):
    assert pick_device(kind, gpus, local_rank, local_size, env) == expected


@pytest.mark.parametrize("kind,env,gpus,local_size,message", [
    ("gpu", {}, 0, 1, "--device gpu was asked for, but no GPU can be used"),
    ("auto", {"MPITRAIN_DEVICE": "gpu"}, 0, 1, "--device gpu was asked for"),
    ("gpu", {}, 2, 3, "3 ranks on this node but only 2 visible GPU(s)"),
    ("tpu", {}, 1, 1, "unknown device 'tpu'"),
])
def test_pick_device_refuses_what_cannot_work(kind, env, gpus, local_size, message):
    with pytest.raises(DeviceError) as e:
        pick_device(kind, gpus, 0, local_size, env)
    assert message in str(e.value)


@pytest.mark.parametrize("gpus,local_rank,local_size,k,expected", [
    (1, 0, 2, 2, 0), (1, 1, 2, 2, 0),                     # two ranks on one GPU
    (2, 1, 4, 2, 0), (2, 2, 4, 2, 1), (2, 3, 4, 2, 1),    # consecutive ranks share a GPU
    (4, 3, 4, 1, 3),                                      # K = 1: a GPU per rank
    (8, 5, 6, 3, 1),                                      # fewer GPUs taken than visible
])
def test_ranks_per_gpu_shares_each_gpu_among_consecutive_ranks(gpus, local_rank, local_size, k,
                                                               expected):
    assert pick_device("gpu", gpus, local_rank, local_size, {}, ranks_per_gpu=k) == expected
    assert backend.collectives_for(k) == ("nccl" if k == 1 else "mpi")
    assert backend.collectives_for(None) == "nccl"


@pytest.mark.parametrize("kind,gpus,local_size,k,message", [
    ("gpu", 1, 3, 2, "--ranks-per-gpu 2 does not divide the 3 ranks on this node"),
    ("gpu", 2, 6, 2, "6 ranks on this node at --ranks-per-gpu 2 need 3 GPUs, but only 2"),
    ("gpu", 1, 2, 0, "--ranks-per-gpu must be a positive integer, got 0"),
    ("cpu", 1, 2, 2, "--ranks-per-gpu 2 shares GPUs among ranks, but this run is on the CPU"),
    ("auto", 0, 2, 2, "on the CPU (no GPU can be used); drop --ranks-per-gpu"),
    ("gpu", 1, 2, None, "or let K ranks share each GPU with --ranks-per-gpu K"),
])
def test_ranks_per_gpu_refuses_what_cannot_work(kind, gpus, local_size, k, message):
    with pytest.raises(DeviceError) as e:
        pick_device(kind, gpus, 0, local_size, {}, ranks_per_gpu=k)
    assert message in str(e.value)


@cpu_only
def test_use_device_gpu_names_what_is_missing():
    with pytest.raises(DeviceError, match="CuPy") as e:
        backend.use_device("gpu")
    assert "or use --device cpu" in str(e.value)
    assert backend.use_device("auto") is np and backend.device == "cpu"


# ----- streams on the host -----
def test_host_streams_do_nothing_and_run_in_program_order():
    s = backend.streams(np.zeros(3))
    assert type(s) is backend.HostStreams
    assert s.current() is None and s.comm() is None
    event = s.record(s.current())
    s.wait(s.comm(), event)
    with s.using(s.comm()):
        pass


# ----- the environment report -----
def test_environment_on_a_cpu_records_no_gpu_and_imports_nothing_of_it():
    import numba
    from mpi4py import MPI

    from mpitrain.comm import Communicator
    from mpitrain.config import environment
    comm = Communicator(MPI.COMM_SELF)
    try:
        before = set(sys.modules)
        env = environment(comm, "cpu")
    finally:
        comm.free()
    assert env["device"] == "cpu"
    from mpitrain.kernels import gemm           # who runs the products, as the run prints it
    assert env["gemm"] == gemm.describe(numba.get_num_threads())
    assert env["gemm"].startswith(f"{gemm.team_blas().name} {gemm.team_blas().version}, ")
    assert not {"cupy", "cuda_runtime", "nccl", "cudnn", "gpu"} & set(env)
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("cupy", "cudnn")}


@cpu_only
def test_gpu_environment_says_what_is_missing():
    from mpitrain.config import gpu_environment
    env = gpu_environment()
    for key in ("cupy", "cuda_runtime", "cuda_driver", "gpu", "nccl"):
        assert env[key] is None, key
    assert "CuPy" in env["cupy_error"] or "cupy" in env["cupy_error"]
    assert env["cudnn_reason"] and env["cudnn_reason"] != "available"


# ----- the command line where there is no GPU -----
@cpu_only
@pytest.mark.parametrize("command", [["-m", "mpitrain", "check-gpu"],
                                     ["-m", "mpitrain.tools.check_gpu"]])
def test_check_gpu_fails_fast_without_a_gpu(command, tmp_path):
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, *command, "--out", str(out)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "no NVIDIA GPU here" in r.stderr and "nvidia-smi" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()                 # nothing was measured


def test_check_gpu_refuses_a_missing_wheels_folder(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mpitrain.tools.check_gpu", "--wheels",
                        str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "no such folder" in r.stderr
    (tmp_path / "empty").mkdir()
    r = subprocess.run([sys.executable, "-m", "mpitrain.tools.check_gpu", "--wheels",
                        str(tmp_path / "empty")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "no .whl file" in r.stderr


@cpu_only
def test_bench_step_on_a_missing_gpu_says_so():
    r = mpitrain("bench", "step", "--model", "resnet_small", "--device", "gpu")
    assert r.returncode == 2
    assert "bench step: error: --device gpu was asked for, but no GPU can be used" in r.stderr
    assert "Traceback" not in r.stderr


def test_bench_step_refuses_unknown_device_and_precision():
    for option, value in (("--device", "tpu"), ("--precision", "fp8")):
        r = mpitrain("bench", "step", option, value)
        assert r.returncode == 2
        assert f"argument {option}: invalid choice: '{value}'" in r.stderr


def test_bench_step_fp16_takes_the_mixed_precision_training_step():
    """--precision fp16: fp16 working weights and a dynamic loss scale; the first loss is
    that of the fp32 network on the same batch (to fp16 rounding)."""
    common = ["bench", "step", "--model", "resnet_small", "--image-size", "16", "--batch", "4",
              "--steps", "1", "--warmup", "0", "--num-classes", "10", "--json"]
    results = {}
    for precision in ("fp32", "fp16"):
        r = mpitrain(*common, "--precision", precision, timeout=300)
        assert r.returncode == 0, r.stderr
        results[precision] = json.loads(r.stdout)
        assert results[precision]["precision"] == precision
        assert results[precision]["device"] == "cpu"
    fp32, fp16 = (results[p]["mpitrain"]["first_loss"] for p in ("fp32", "fp16"))
    assert fp16 == pytest.approx(fp32, rel=1e-2)


def test_one_step_skips_the_update_of_an_overflowed_gradient():
    """OneStep (bench step, check-gpu's comparison) takes train_step's path: under fp16 a
    non-finite gradient skips the update and halves the loss scale."""
    from mpitrain.tools.bench.step import OneStep, build_on_device
    model, x, y = build_on_device("resnet_small", 8, 2, 10, 0, "fp16")
    step = OneStep(model, "fp16")
    scale = step.scaler.scale
    before = model.arena.master.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        step.forward(x, y)
        step.backward()
        model.arena.grad[model.arena.params[0].offset] = np.inf
        assert step.update() is False
    assert np.array_equal(model.arena.master, before)
    assert step.scaler.scale == scale / 2
    step.forward(x, y)
    step.backward()
    assert step.update() is True
    assert not np.array_equal(model.arena.master, before)


# ----- on a GPU -----
@pytest.mark.gpu
def test_use_device_takes_a_gpu_and_its_streams():
    import cupy
    try:
        assert backend.use_device("gpu") is cupy
        assert backend.device.startswith("cuda:")
        s = backend.streams(cupy.zeros(3))
        assert type(s) is backend.CudaStreams
        comm = s.comm()
        assert comm is backend.comm_stream()            # made once per device
        assert comm.ptr not in (0, s.current().ptr)     # not the compute stream
        event = s.record(s.current())
        s.wait(comm, event)
        with s.using(comm):
            assert cupy.cuda.get_current_stream() == comm
        assert cupy.cuda.get_current_stream() != comm
    finally:
        backend.use_device("cpu")


@pytest.mark.gpu
def test_gpu_environment_records_the_versions():
    from mpitrain.config import gpu_environment
    from mpitrain.kernels import cudnn
    try:
        backend.use_device("gpu")
        env = gpu_environment()
    finally:
        backend.use_device("cpu")
    for key in ("cupy", "cuda_runtime", "cuda_driver", "gpu"):
        assert env[key], key
    # cuDNN is used, with its versions recorded, or the record says why not
    if cudnn.available():
        assert env["cudnn_reason"] is None and env["cudnn"] >= 8000 and env["cudnn_frontend"]
    else:
        assert env["cudnn_reason"].startswith(("not installed:", "no GPU:", "graph build failed:",
                                               "failed to run:", "wrong result:"))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_one_step_on_the_gpu_matches_the_cpu(precision):
    from mpitrain.tools.check_gpu import compare_step
    result = compare_step(precision)
    assert result["passed"], (result["failures"], result["max_relative"])


@pytest.mark.gpu
def test_nccl_on_one_rank():
    from mpitrain.tools.check_gpu import nccl_check
    result = nccl_check()
    assert result["passed"], result["failures"]
    assert result["reducer_threaded"] is False


@pytest.mark.gpu
@pytest.mark.torch
def test_bench_step_on_the_gpu_against_torch_amp():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch sees no GPU (a CPU-only build)")
    r = mpitrain("bench", "step", "--device", "gpu", "--precision", "fp16", "--model",
                 "resnet_small", "--image-size", "32", "--batch", "16", "--num-classes", "10",
                 "--steps", "2", "--warmup", "1", "--reference", "torch", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["device"].startswith("cuda:")
    assert result["torch"]["memory_format"] == "channels_last"
    assert result["torch"]["first_loss"] == pytest.approx(result["mpitrain"]["first_loss"],
                                                          rel=2e-2)
    padded, = result["padded_inputs"]                   # the stem's images, 3 channels
    assert padded["x"] == [16, 32, 32, 3] and padded["channels"] in (3, 4), padded
    assert padded["ms"] is None or set(padded["ms"]) == {"3", "4"}, padded


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_step_comparison_finds_no_difference_between_two_cpu_runs(precision):
    """check-gpu's comparison machinery, with the CPU on both sides: the same step twice
    gives the same bits (in fp16 both are equally far from the fp32 step, and not at
    zero), every quantity is compared, and the step was applied."""
    from mpitrain.tools.check_gpu import TOLERANCE, compare_step
    result = compare_step(precision, image_size=8, batch=4, devices=("cpu", "cpu"))
    assert result["passed"], result["failures"]
    assert set(result["max_relative"]) == set(TOLERANCE)
    if precision == "fp32":
        assert all(v == 0 for v in result["max_relative"].values()), result["max_relative"]
    else:
        assert result["max_relative"] == result["cpu_from_fp32"]
        assert result["max_relative"]["grad"] > 0 and result["max_relative"]["logits"] > 0
    from mpitrain.nets import build_model
    names = [name for name, _ in build_model("resnet_small", num_classes=10).named_params()]
    assert sorted(result["gradients"]) == sorted(names)
    assert result["loss"]["cpu"] == result["loss"]["gpu"]


def dry_run(out, *options, status=0):
    """check-gpu --dry-run writing into `out`, with `options`: its finished process (exit
    status `status`) and its report's steps."""
    r = subprocess.run([sys.executable, "-m", "mpitrain.tools.check_gpu", "--dry-run",
                        "--out-dir", str(out), *options], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == status, r.stderr
    return r, json.loads((out / "report.json").read_text())["steps"]


def test_check_gpu_dry_run_goes_through_every_step_measurements_first(tmp_path):
    """Without a GPU, --dry-run takes the check's whole control flow: every step in order,
    the bench rows and profiles before the tests, each command recorded and its log
    written to --out-dir as the step ends, the report beside them."""
    out = tmp_path / "check"
    r, steps = dry_run(out, "--steps", "7", "--rounds", "2", "--profile-steps", "4")
    names = list(steps)
    from mpitrain.tools.check_gpu import SHARED
    assert names == ["install", "build", "environment", "bench resnet50 fp16 graph",
                     "bench resnet50 fp16", "bench resnet50 fp32", "bench alexnet fp16 graph",
                     "bench alexnet fp16", "bench resnet50 fp16 graph nondeterministic",
                     "profile resnet50", "profile alexnet",
                     *(f"shared {name}" for name, _ in SHARED), "data convert",
                     "data loader", "data step gpu", "data step cpu", "data train gpu",
                     "data train cpu", "tests", "compare fp32",
                     "compare fp16", "nccl"]
    bench = steps["bench alexnet fp16"]["command"]
    assert bench[bench.index("--model") + 1] == "alexnet" and "--reference" in bench
    assert "--cuda-graph" not in bench
    for graph in ("bench resnet50 fp16 graph", "bench alexnet fp16 graph",
                  "bench resnet50 fp16 graph nondeterministic"):
        assert "--cuda-graph" in steps[graph]["command"]
    assert [name for name, s in steps.items()
            if "--nondeterministic-plans" in s.get("command", [])] == \
        ["bench resnet50 fp16 graph nondeterministic"]
    assert bench[bench.index("--steps") + 1] == "7" and bench[bench.index("--rounds") + 1] == "2"
    profile = steps["profile resnet50"]["command"]
    assert profile[profile.index("--profile") + 1] == "4"
    assert "dry run: " in (out / "bench-resnet50-fp32.log").read_text()
    assert "pytest" in (out / "tests.log").read_text()
    assert "gpu-check: all passed" in r.stdout


def value(argv, option):
    return argv[argv.index(option) + 1]


# Runs mpitrain commands (argv lists, JSON in argv[1]) in one process; writes to argv[2]
# each one's [exit status, standard error].
RUN_COMMANDS = """
import contextlib, io, json, sys
from mpitrain.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
            status = 0
        except SystemExit as e:
            status = e.code
    results.append([status, err.getvalue()])
json.dump(results, open(sys.argv[2], "w"))
"""


@cpu_only
def test_check_gpu_commands_pass_every_check_ahead_of_the_device(tmp_path):
    """Each mpitrain command that the check runs on a GPU (as `launch.sh gpu-check` is run
    with --rounds 2) gets past the parser and the option checks, which come before the
    device's: here it is refused for want of a GPU and for nothing else. (An option refusal
    found first on a lent GPU would cost its minutes.)"""
    _, steps = dry_run(tmp_path / "check", "--rounds", "2", "--steps", "10", "--warmup", "3")
    commands = {name: s["command"][s["command"].index("mpitrain") + 1:]
                for name, s in steps.items()
                if "mpitrain" in s.get("command", []) and "convert" not in s["command"]}
    assert len(commands) >= 20 and {argv[0] for argv in commands.values()} == \
        {"bench", "train"}
    results = tmp_path / "results.json"
    subprocess.run([sys.executable, "-c", RUN_COMMANDS, json.dumps(list(commands.values())),
                    str(results)], check=True, timeout=300, cwd=tmp_path)
    for name, (status, err) in zip(commands, json.loads(results.read_text())):
        assert status == 2 and "--device gpu was asked for, but no GPU can be used" in err, \
            (name, status, err)


def test_check_gpu_dry_run_shares_the_gpu_with_every_algorithm_then_times_the_data(tmp_path):
    """The shared steps: a train job of 2 ranks on one GPU per configuration, every
    all-reduce algorithm among them, overlap off for one, the sharded update and top-k,
    each checking its replicas after every step; the data steps: --jpegs synthetic JPEGs,
    then bench data, bench step --data and train on that file, a worker per core."""
    from mpitrain.comm import ALGORITHMS
    from mpitrain.launcher import cores
    out = tmp_path / "check"
    _, steps = dry_run(out, "--jpegs", "300", "--skip", "install", "build", "bench", "profile",
                       "tests", "compare", "nccl")
    jobs = {name: s["command"] for name, s in steps.items() if name.startswith("shared ")}
    assert len(jobs) >= len(ALGORITHMS) + 3
    for argv in jobs.values():
        n = argv.index("-np")
        assert argv[n + 1:n + 6] == ["2", sys.executable, "-m", "mpitrain", "train"]
        assert value(argv, "--device") == "gpu" and value(argv, "--ranks-per-gpu") == "2"
        assert value(argv, "--data") == "digits" and value(argv, "--epochs") == "2"
        assert value(argv, "--check-replicas") == "1" and "--run-dir" in argv
    algorithms = {value(argv, "--allreduce") for argv in jobs.values() if "--allreduce" in argv}
    assert algorithms == set(ALGORITHMS)
    assert "--no-overlap" in jobs["shared 2d no-overlap"]
    assert "--shard-update" in jobs["shared shard-update"]
    assert value(jobs["shared topk"], "--compress") == "topk"
    assert value(jobs["shared flat fp16"], "--comm-dtype") == "fp16"
    assert "dry run: " in (out / "shared-2d-no-overlap.log").read_text()

    convert, loader, step, step_cpu = (steps[f"data {name}"]["command"]
                                       for name in ("convert", "loader", "step gpu", "step cpu"))
    assert convert[convert.index("convert"):][:2] == ["convert", "synthetic"]
    assert value(convert, "--count") == "300" and steps["data convert"]["jpegs"] == 300
    jpegs = convert[convert.index("synthetic") + 1]
    assert loader[loader.index("bench"):][:2] == ["bench", "data"]
    assert value(loader, "--device") == "gpu" and value(loader, "--data") == jpegs
    assert value(loader, "--workers") == str(cores()) and value(loader, "--batch") == "256"
    assert step[step.index("bench"):][:2] == ["bench", "step"] and value(step, "--data") == jpegs
    assert (value(step, "--model"), value(step, "--precision"), value(step, "--batch")) == \
        ("resnet50", "fp16", "256")
    assert value(step, "--decode") == "gpu" and "--cuda-graph" in step
    at = step.index("--decode") + 1
    assert step_cpu == step[:at] + ["cpu"] + step[at + 1:]
    assert "--json" in loader and "--json" in step
    train, train_cpu = (steps[f"data train {decode}"]["command"] for decode in ("gpu", "cpu"))
    assert train[train.index("mpitrain"):][:2] == ["mpitrain", "train"]
    assert value(train, "--data") == jpegs
    val = steps["data convert"]["val_command"]
    assert value(val, "--seed") == "1" and value(train, "--val-data") == \
        val[val.index("synthetic") + 1] == jpegs.replace(".h5", "_val.h5")
    assert (value(train, "--model"), value(train, "--precision"), value(train, "--batch-size"),
            value(train, "--image-size"), value(train, "--device")) == \
        ("resnet50", "fp16", "256", "224", "gpu")
    assert value(train, "--decode") == "gpu" and value(train_cpu, "--decode") == "cpu"
    assert value(train, "--workers") == str(cores()) and "--cuda-graph" in train
    assert value(train, "--run-dir") != value(train_cpu, "--run-dir")
    for name in ("tests", "nccl", "bench resnet50 fp16 graph", "profile alexnet"):
        assert steps[name] == {"skipped": True}


def test_check_gpu_installs_the_wheels_and_the_build_requirements_at_their_versions(tmp_path):
    """--wheels DIR: its packages by name (what the machine has stays), pyproject.toml's
    build requirements by version (an older Cython is replaced), both from DIR alone, then
    mpitrain itself."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("cython-3.3.1-cp312-cp312-manylinux_2_28_x86_64.whl",
                 "mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl"):
        (wheels / name).write_bytes(b"")
    _, steps = dry_run(tmp_path / "check", "--wheels", str(wheels), "--skip", "shared", "data",
                       "bench", "profile", "tests", "compare", "nccl")
    install = steps["install"]
    requires = re.search(r"^requires = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert "cython>=3.1" in ast.literal_eval(requires.group(1))
    assert install["packages"] == [sys.executable, "-m", "pip", "install", "--no-index",
                                   "--find-links", str(wheels), "--no-deps", "cython", "mpich",
                                   *ast.literal_eval(requires.group(1))]
    assert install["command"][-3:] == ["--no-build-isolation", "-e", str(ROOT)]
    assert install["wheels"] == sorted(os.listdir(wheels))


def test_check_gpu_skips_the_shared_and_data_steps_when_asked(tmp_path):
    _, steps = dry_run(tmp_path / "check", "--skip", "shared", "data", "bench", "profile",
                       "tests")
    skipped = [name for name in steps if name.startswith(("shared ", "data "))]
    assert len(skipped) > 3 and all(steps[name] == {"skipped": True} for name in skipped)
    assert "command" in steps["compare fp32"]


def test_check_gpu_starts_no_step_past_its_budget(tmp_path):
    r, steps = dry_run(tmp_path / "check", "--budget", "0", "--skip", "tests",
                       status=1)               # nothing ran: not a pass
    assert steps["tests"] == {"skipped": True}
    for name in ("bench resnet50 fp16 graph", "shared hybrid", "shared topk", "data convert",
                 "data step gpu"):
        assert steps[name]["reason"] == "out of time (--budget 0)"
    assert all(s.get("skipped") for name, s in steps.items() if name != "environment")
    assert "SKIP  nccl: out of time (--budget 0)" in r.stdout


@pytest.mark.launches
@pytest.mark.one_mpi
@pytest.mark.parametrize("options,hidden", [(("--allreduce", "2d"), True),
                                            (("--shard-update",), False)])
def test_a_shared_step_reports_its_job(options, hidden):
    """What a shared step makes of its job's output and metrics, from the same job on
    the CPU: the last epoch's images/s and accuracy, the replicas equal, and the share of
    the all-reduce hidden (none to report for the sharded update's reduce-scatter)."""
    from mpitrain.tools import check_gpu
    result = check_gpu.shared(options, train=("--device", "cpu", "--data", "digits",
                                              "--epochs", "1", "--check-replicas", "1"))
    assert result["passed"], result
    assert result["images_per_s"] > 0 and 0 < result["val_top1"] <= 1
    assert result["replicas"] == "equal after every step"
    assert ("hidden_fraction" in result) == hidden
    if hidden:
        assert 0 <= result["hidden_fraction"] <= 1 and result["comm_total_ms"] > 0
    assert "images/s" in check_gpu._detail("shared 2d", result)
