"""launch.sh for every command: `./launch.sh COMMAND ARGS...` starts mpitrain's MPI jobs
under the venv's recorded MPI with its options and the others in one process, and a
set-up that names each step with how long it usually takes (and the mpich wheel as the
way around compiling mpi4py). The venv here is a stand-in (tests/test_openmpi.py's):
its MPI launcher and, for the set-up, its Python record how they were called."""
import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpitrain.cli import build_parser
from mpitrain.launcher import cores, launch_options, outside_environment
from test_gemm_kernels import cpu_maker
from test_openmpi import ROOT, calls, fake_venv, stand_in


def launch(tmp_path, impl, *args, then="", **extra):
    """`launch.sh ARGS` with a venv whose recorded mpiexec is a stand-in (running the shell
    code `then` after it records its call); (result, log)."""
    venv = fake_venv(tmp_path, impl)
    python = venv / "bin" / "python"               # this Python with its site-packages
    python.unlink()
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    log = tmp_path / "calls"
    log.mkdir(exist_ok=True)
    stand_in(venv / "bin", "mpiexec", log / "mpiexec", then)
    (venv / ".mpitrain-mpi").write_text(f"kind=system\nimpl={impl}\n"
                                        f"mpiexec={venv}/bin/mpiexec\nlibrary=test\n")
    env = {k: v for k, v in outside_environment().items()
           if not k.startswith(("SLURM_", "MPITRAIN_", "OMPI_")) and not k.endswith("_NUM_THREADS")}
    env.update({"MPITRAIN_VENV": str(venv), "NP": "2", **extra})
    r = subprocess.run([str(ROOT / "launch.sh"), *args], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    return r, log, venv


@pytest.mark.parametrize("impl, options", [("mpich", ""), ("openmpi", "--quiet --bind-to none ")])
@pytest.mark.parametrize("args", [("eval", "--checkpoint", "runs/latest", "--data", "v.h5"),
                                  ("bench", "comm", "--model", "resnet_small"),
                                  ("convert", "imagefolder", "src", "dst.h5")])
def test_mpi_commands_run_under_the_recorded_mpi(tmp_path, impl, options, args):
    r, log, venv = launch(tmp_path, impl, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"args={options}-np 2 {venv}/bin/python -m mpitrain {' '.join(args)}\n" in \
        calls(log, "mpiexec"), calls(log, "mpiexec")


@pytest.mark.parametrize("impl, options, slots", [("mpich", "", "host:N"),
                                                   ("openmpi", "--quiet --bind-to none ",
                                                    "host slots=N")])
def test_a_hostfile_is_passed_to_mpirun_and_a_missing_one_refused(tmp_path, impl, options,
                                                                  slots):
    """The ranks on the file's hosts get no thread counts of this host's cores: they share
    their own host's (the program counts them), where this host's share was given to
    all; a missing file's refusal shows the venv's MPI's format of a line with slots."""
    hosts = tmp_path / "hosts"
    hosts.write_text("nodeA:2\n")
    r, log, venv = launch(tmp_path, impl, "train", HOSTFILE=str(hosts))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"args={options}--hostfile {hosts} -np 2 {venv}/bin/python -m mpitrain train\n" \
        "threads=unset\n" in calls(log, "mpiexec"), calls(log, "mpiexec")
    r, log, venv = launch(tmp_path / "here", impl, "train")
    assert "threads=unset" not in calls(log, "mpiexec"), calls(log, "mpiexec")
    missing = tmp_path / "nothere"
    r, log, _ = launch(tmp_path / "again", impl, "train", HOSTFILE=str(missing))
    assert r.returncode == 2 and r.stderr == (
        f"launch.sh: HOSTFILE={missing}: no such file (mpirun --hostfile reads one host a "
        f"line, \"host\" or \"{slots}\"); unset HOSTFILE to run on this machine\n"), r.stderr
    assert calls(log, "mpiexec") == ""


@pytest.mark.parametrize("impl", ["mpich", "openmpi"])
def test_a_rank_killed_by_a_signal_is_named_under_open_mpis_quiet_mpirun(tmp_path, impl):
    """mpirun --quiet said nothing of a rank that a signal killed (MPICH's mpiexec says
    it itself); mpitrain's own ends after a stop signal sent to a rank (143, 130) or when
    its launcher is gone (129) are no such death."""
    r, _, _ = launch(tmp_path, impl, "train", then="exit 137")
    assert r.returncode == 137, r.stdout + r.stderr
    notice = ("launch.sh: a rank was killed by SIGKILL (mpirun's status 137): the job ended "
              "there; with SIGKILL, look for the out-of-memory killer in the system's log "
              "(dmesg)\n")
    assert r.stderr == (notice if impl == "openmpi" else ""), r.stderr
    for own in (143, 130, 129):
        r, _, _ = launch(tmp_path / str(own), impl, "train", then=f"exit {own}")
        assert r.returncode == own and r.stderr == "", r.stderr


@pytest.mark.parametrize("impl, crowded", [("mpich", "-genv MPIR_CVAR_ENABLE_HEAVY_YIELD 1 "),
                                           ("openmpi", "--quiet --bind-to none --oversubscribe ")])
def test_ranks_that_outnumber_the_cores_yield_them_while_they_wait(tmp_path, impl, crowded):
    """NP above the cores: MPICH's ranks sleep in their wait loop, Open MPI is told it
    oversubscribes (its ranks yield then); mpitrain's own launches (a study's runs) alike,
    and neither at NP up to the cores."""
    ranks = cores() + 1
    r, log, venv = launch(tmp_path, impl, "train", NP=str(ranks))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"args={crowded}-np {ranks} {venv}/bin/python -m mpitrain train\n" in \
        calls(log, "mpiexec"), calls(log, "mpiexec")
    assert launch_options(ranks, impl) == crowded.split()
    assert launch_options(cores(), impl) == \
        ([] if impl == "mpich" else ["--quiet", "--bind-to", "none"])


@pytest.mark.parametrize("np_", ["0", "abc", "1.5", "-1", ""])
def test_np_must_be_a_count_of_ranks(tmp_path, np_):
    """NP=0, abc, 1.5 or -1 printed bash's errors, or nothing, and trained on 1 rank; an
    empty NP is the default, 2."""
    r, log, venv = launch(tmp_path, "mpich", "train", NP=np_)
    if not np_:
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"args=-np 2 {venv}/bin/python -m mpitrain train\n" in calls(log, "mpiexec")
        return
    assert r.returncode == 2 and r.stderr == (
        f"launch.sh: NP={np_}: the number of MPI ranks must be a whole number of 1 or more "
        f"(for example NP=4); unset it for 2\n"), r.stderr
    assert calls(log, "mpiexec") == ""


def test_the_main_job_runs_in_the_checkout_and_says_so_to_a_caller_elsewhere(tmp_path):
    r, log, venv = launch(tmp_path, "mpich")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"args=-np 2 {venv}/bin/python -m mpitrain train\n" in calls(log, "mpiexec")
    assert f"launch.sh: the main job runs in the checkout, {ROOT}: the paths it prints " \
        "(data/, runs/) are there" in r.stdout, r.stdout


def test_test_with_arguments_runs_that_selection_of_pytest(tmp_path):
    r, log, _ = launch(tmp_path, "mpich", "test", "tests/test_options.py", "--collect-only",
                       "-q", "-p", "no:cacheprovider")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tests/test_options.py::" in r.stdout and "test_cli.py" not in r.stdout, r.stdout
    assert calls(log, "mpiexec") == ""


def test_other_commands_run_in_one_process(tmp_path):
    r, log, _ = launch(tmp_path, "mpich", "inspect", "--model", "resnet_small",
                       "--image-size", "32", "--num-classes", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resnet_small" in r.stdout and "total" in r.stdout.lower(), r.stdout
    assert calls(log, "mpiexec") == ""


def test_version_names_mpitrain_its_checkout_and_the_venvs_mpi(tmp_path):
    r, log, venv = launch(tmp_path, "mpich", "--version")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"launch.sh: venv {venv}, MPI system (mpich: test), {venv}/bin/mpiexec"
    assert lines[1].startswith("mpitrain ") and lines[2].startswith("Python "), r.stdout
    assert calls(log, "mpiexec") == ""


def test_commands_take_paths_relative_to_where_launch_sh_was_started(tmp_path):
    """launch.sh sets itself up in the checkout, then runs the command in the caller's
    directory: a relative output path lands there."""
    r, _, _ = launch(tmp_path, "mpich", "convert", "synthetic", "mine.h5", "--count", "2",
                     "--size", "40x30", "--classes", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "mine.h5").exists() and not (ROOT / "mine.h5").exists()


def test_every_command_of_mpitrain_is_one_of_launch_sh(tmp_path):
    commands = build_parser()._subparsers._group_actions[0].choices
    for command in [*commands, "trian"]:
        (tmp_path / command).mkdir()
        r, _, _ = launch(tmp_path / command, "mpich", command, "--help")
        if command != "trian":
            assert r.returncode == 0, (command, r.stdout + r.stderr)
    assert r.returncode == 2 and "launch.sh: unknown command 'trian'" in r.stderr, r.stderr


PIP = """#!/bin/sh
# a venv's python for launch.sh's set-up: records pip's arguments, succeeds at once
echo "args=$*" >> {log}
case "$*" in *sysconfig*) exec {python} "$@" ;; esac
"""


@pytest.mark.parametrize("blas", ["", "mkl", "MKL", "openblas"])
def test_setup_names_each_step_and_the_wheel_that_skips_the_compile(tmp_path, blas):
    """... and installs MKL only where it will be the team's BLAS: MPITRAIN_BLAS=mkl, or
    MPITRAIN_BLAS unset on an Intel CPU; elsewhere it says MKL is left out and how to add
    it."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "python-calls"
    python = venv / "bin" / "python"
    python.write_text(PIP.format(log=log, python=sys.executable))
    python.chmod(0o755)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("mpicc", "mpiexec"):              # an MPI on PATH: mpi4py is compiled
        stand_in(bindir, name, tmp_path / name)
    env = {k: v for k, v in outside_environment().items()
           if not k.startswith(("SLURM_", "MPITRAIN_"))}
    env.update(MPITRAIN_VENV=str(venv), PATH=f"{bindir}:{env['PATH']}",
               **({"MPITRAIN_BLAS": blas} if blas else {}))
    r = subprocess.run([str(ROOT / "launch.sh"), "setup"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    mkl = blas.lower() == "mkl" or (not blas and cpu_maker() == "GenuineIntel")   # any case,
    # as kernels.gemm reads it
    install = "args=-m pip install --no-build-isolation -e .[test,mkl]" if mkl else \
        "args=-m pip install --no-build-isolation -e .[test]"
    assert install in log.read_text().splitlines(), log.read_text()
    # the kernels build without isolation, with the build requirements pyproject.toml names
    requires = re.search(r"^requires = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.M)
    build = "args=-m pip install " + " ".join(ast.literal_eval(requires.group(1)))
    assert build in log.read_text().splitlines(), log.read_text()
    left_out = f"`{venv}/bin/pip install mkl` adds it, MPITRAIN_BLAS=mkl takes it"
    assert (left_out in r.stdout) == (not mkl), r.stdout
    steps = [line for line in r.stdout.splitlines() if "(usually " in line]
    assert steps == [
        "launch.sh: installing Cython, NumPy, setuptools, wheel (usually under a minute)",
        f"launch.sh: compiling mpi4py against {bindir}/mpicc (usually 5 to 10 minutes on 2 cores)",
        "launch.sh: installing mpitrain and its dependencies (h5py, Numba, SciPy, "
        "scikit-learn, ...) (usually 1 to 3 minutes)",
        "launch.sh: compiling the CPU kernels (an epoch of the digits in fp32 and in fp16) "
        "(usually under a minute)"], r.stdout
    assert "run again with MPITRAIN_MPI=wheel (MPICH from the mpich wheel, no compile)" \
        in r.stdout, r.stdout
    assert r.stdout.count("launch.sh:   done in ") == 4, r.stdout
    calls_made = log.read_text()
    # into the venv even where another mpi4py is importable (a venv that sees more packages)
    assert "--no-binary=mpi4py --no-cache-dir --ignore-installed mpi4py" in calls_made
    assert calls_made.splitlines()[-1] == "args=-m mpitrain.tools.warm", calls_made


def test_every_command_leaves_the_checkouts_byte_code_up_to_date(tmp_path):
    """launch.sh byte-compiles the checkout's modules, as pip does those of the packages
    it installs (an editable install has none): with PYTHONDONTWRITEBYTECODE set, no
    process that imports them writes any."""
    removed = ROOT / "mpitrain" / "argtypes.py"
    Path(importlib.util.cache_from_source(str(removed))).unlink(missing_ok=True)
    r, _, _ = launch(tmp_path, "mpich", "plot", "--help", PYTHONDONTWRITEBYTECODE="1")
    assert r.returncode == 0, r.stdout + r.stderr
    for folder in ("mpitrain", "nets", "kernels", "datasets"):
        for source in (ROOT / folder).rglob("*.py"):
            pyc = Path(importlib.util.cache_from_source(str(source)))
            assert pyc.exists(), source
            header = pyc.read_bytes()[:16]          # magic, flags, the source's mtime and
            assert header[:4] == importlib.util.MAGIC_NUMBER, pyc      # size, or its hash
            if int.from_bytes(header[4:8], "little") & 1:    # hashed (SOURCE_DATE_EPOCH set)
                assert header[8:16] == importlib.util.source_hash(source.read_bytes()), pyc
            else:
                assert int.from_bytes(header[8:12], "little") == int(source.stat().st_mtime), pyc


def test_a_second_venv_copies_the_kernels_built_in_place_and_compiles_a_stale_one(tmp_path):
    """setup.py's build_ext, which pip's editable install runs into a new build folder,
    copies a kernels/*.so that is newer than the sources and NumPy's headers, compiling
    nothing; one older than its sources it compiles (here with a C compiler that fails)."""
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels",              # mtimes kept
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "setup.py", tmp_path)
    (tmp_path / "mpitrain").mkdir()
    shutil.copy2(ROOT / "mpitrain" / "__init__.py", tmp_path / "mpitrain")   # the version
    built = sorted((tmp_path / "kernels").glob("_*.so"))
    assert [so.name.split(".")[0] for so in built] == ["_im2col", "_pool"]

    def build_ext(out, **env):
        return subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", out,
                               "--build-temp", "tmp"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, **env))

    r = build_ext("out")
    assert r.returncode == 0 and "building '" not in r.stdout + r.stderr, r.stdout + r.stderr
    for so in built:
        assert (tmp_path / "out/mpitrain/kernels" / so.name).read_bytes() == so.read_bytes()
    os.utime(built[1], (0, 0))                          # _pool.so older than its sources
    r = build_ext("out2", CC="false")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "building 'mpitrain.kernels._pool' extension" in r.stdout, r.stdout + r.stderr
    assert "building 'mpitrain.kernels._im2col'" not in r.stdout, r.stdout


def test_help_lists_every_command_of_launch_sh():
    r = subprocess.run([str(ROOT / "launch.sh"), "--help"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    for command in ("./launch.sh ", "test ", "test-mpi", "train ARGS", "COMMAND ARGS", "setup ",
                    "gpu-check", "--version"):
        assert command in r.stdout, (command, r.stdout)
    assert "#SBATCH --" not in r.stdout and "set -euo" not in r.stdout, r.stdout
