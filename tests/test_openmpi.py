"""Launching, whatever the MPI (MPICH's hydra, Open MPI's mpirun, Slurm's srun):
launch.sh's decisions (the venv's MPI is decided once and recorded; a batch job never
installs; srun gets --kill-on-bad-exit=1 and the --mpi type of the recorded MPI, by
`exec`; a spooled copy finds the checkout), Ctrl-C through launch.sh with the venv's
real MPI, and what the program reads from a launcher's environment.

The srun, scontrol, mpicc and mpiexec of the launch.sh checks are stand-ins on PATH that
record how they were called; tests/test_slurm.py runs a real Slurm.
"""
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpitrain.launcher import installed_mpi, outside_environment, output_is_terminal
import launcher
from launcher import BackgroundJob

ROOT = Path(__file__).resolve().parents[1]

STAND_IN = """#!/bin/sh
# records its pid, its arguments and the thread variables it was given
{{ echo "pid=$$"; echo "args=$*"; echo "threads=${{OMP_NUM_THREADS:-unset}}"; }} >> {log}
{extra}
"""


def stand_in(bindir, name, log, extra=""):
    path = bindir / name
    path.write_text(STAND_IN.format(log=log, extra=extra))
    path.chmod(0o755)


def stamp(kind):
    """What launch.sh writes in .mpitrain-installed for a venv of `kind` set up now."""
    version = re.search(r"^__version__ = .*\n", (ROOT / "mpitrain" / "__init__.py").read_text(),
                        re.M).group(0)
    return hashlib.sha256((ROOT / "setup.py").read_bytes() + (ROOT / "pyproject.toml").read_bytes()
                          + version.encode() + f"{kind}\n".encode()).hexdigest()


def fake_venv(tmp_path, impl, stamp_ok=True):
    """A venv as launch.sh leaves it: bin/python (this Python), the MPI record, the stamp."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".mpitrain-mpi").write_text(f"kind=system\nimpl={impl}\nmpiexec=/bin/true\n"
                                        f"library=test\n")
    (venv / ".mpitrain-installed").write_text((stamp("system") if stamp_ok else "stale") + "\n")
    return venv


def in_a_job(tmp_path, venv, mpi_list="pmix\npmi2\nnone", **extra):
    """launch.sh's environment inside a Slurm job: stand-in srun and scontrol, and a system
    mpicc and mpiexec on PATH that must not be used."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    log = tmp_path / "calls"
    list_out = "\n".join(f"\t{t}" for t in mpi_list.split())
    stand_in(bindir, "srun", log / "srun",
             f'[ "$1" = --mpi=list ] && printf "MPI plugin types are...\\n{list_out}\\n"; exit 0')
    for name in ("mpicc", "mpiexec", "mpichversion"):
        stand_in(bindir, name, log / name)
    stand_in(bindir, "scontrol", log / "scontrol",
             f'echo "JobId=1 JobName=x Command={ROOT}/launch.sh train WorkDir=/"')
    log.mkdir(exist_ok=True)
    env = {k: v for k, v in outside_environment().items()
           if not k.startswith(("SLURM_", "MPITRAIN_")) and not k.endswith("_NUM_THREADS")}
    env.update(PATH=f"{bindir}:{env['PATH']}", MPITRAIN_VENV=str(venv), SLURM_JOB_ID="1",
               SLURM_SUBMIT_DIR=str(tmp_path), **extra)
    return env, log


def calls(log, name):
    path = log / name
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("impl, mpi", [("mpich", "pmi2"), ("openmpi", "pmix")])
def test_a_batch_job_runs_exec_srun_with_the_recorded_mpi(tmp_path, impl, mpi):
    venv = fake_venv(tmp_path, impl)
    env, log = in_a_job(tmp_path, venv)
    p = subprocess.Popen([str(ROOT / "launch.sh"), "train", "--epochs", "1"], env=env,
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    srun = calls(log, "srun").split("\n")
    run = [line for line in srun if line.startswith("args=--kill")]
    assert run == [f"args=--kill-on-bad-exit=1 --mpi={mpi} {venv}/bin/python -m mpitrain train "
                   f"--epochs 1"], out + "\n".join(srun)
    assert f"pid={p.pid}" in srun, srun                 # exec: srun is the batch shell
    assert "threads=unset" in srun, srun                # the program shares the cores
    for name in ("mpicc", "mpiexec", "mpichversion"):  # PATH's MPI is not asked
        assert calls(log, name) == "", name
    assert "installing" not in out and "running build_ext" not in out, out


def test_srun_without_the_type_of_the_mpi_falls_back_and_says_so(tmp_path):
    venv = fake_venv(tmp_path, "openmpi")
    env, log = in_a_job(tmp_path, venv, mpi_list="pmi2 none")
    r = subprocess.run([str(ROOT / "launch.sh"), "train"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "srun offers no --mpi=pmix" in r.stderr and "trying --mpi=pmi2" in r.stderr, r.stderr
    assert "--mpi=pmi2" in calls(log, "srun")


def test_srun_flags_choose_the_type(tmp_path):
    venv = fake_venv(tmp_path, "mpich")
    env, log = in_a_job(tmp_path, venv, SRUN_FLAGS="--mpi=pmix --exclusive")
    r = subprocess.run([str(ROOT / "launch.sh"), "train"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "args=--kill-on-bad-exit=1 --mpi=pmix --exclusive " in calls(log, "srun")


def test_inside_an_allocation_a_hostfile_is_refused_and_another_np_said_unused(tmp_path):
    """srun starts the allocation's tasks on its nodes: a HOSTFILE is refused (status 2)
    as HOSTS is, and an NP other than its count of tasks is said to be unused, where both
    were passed over in silence."""
    venv = fake_venv(tmp_path, "mpich")
    env, log = in_a_job(tmp_path, venv, HOSTFILE=str(tmp_path / "hosts"), SLURM_NTASKS="2")
    r = subprocess.run([str(ROOT / "launch.sh"), "train"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr == (
        f"launch.sh: HOSTFILE={tmp_path / 'hosts'} names hosts for mpirun; inside a Slurm "
        f"allocation srun starts the ranks on its nodes: unset HOSTFILE\n"), r.stderr
    assert calls(log, "srun") == ""
    for np_, said in (("3", "launch.sh: NP=3 is not used inside a Slurm allocation: srun "
                            "starts its 2 tasks\n"), ("2", "")):
        (tmp_path / np_).mkdir()
        env, log = in_a_job(tmp_path / np_, venv, NP=np_, SLURM_NTASKS="2")
        r = subprocess.run([str(ROOT / "launch.sh"), "train"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stderr == said, r.stderr
        assert "args=--kill-on-bad-exit=1 " in calls(log, "srun")


def test_a_batch_job_never_installs(tmp_path):
    missing = tmp_path / "nothing"
    env, log = in_a_job(tmp_path, missing)
    r = subprocess.run([str(ROOT / "launch.sh"), "train"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "run ./launch.sh setup first" in r.stderr and "never installs" in r.stderr, r.stderr
    assert not missing.exists()
    assert calls(log, "srun") == ""

    stale = fake_venv(tmp_path, "mpich", stamp_ok=False)
    env, log = in_a_job(tmp_path, stale)
    r = subprocess.run([str(ROOT / "launch.sh"), "train"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is out of date" in r.stderr and "run ./launch.sh setup first" in r.stderr, r.stderr
    assert calls(log, "srun") == ""


def test_another_mpi_asked_of_a_venv_is_refused(tmp_path):
    venv = fake_venv(tmp_path, "mpich")
    env, _ = in_a_job(tmp_path, venv, MPITRAIN_MPI="wheel")
    r = subprocess.run([str(ROOT / "launch.sh"), "setup"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "was set up with MPI 'system'" in r.stderr and "MPITRAIN_MPI=wheel" in r.stderr


def test_a_spooled_copy_finds_the_checkout(tmp_path):
    """sbatch runs a copy of the script from slurmd's spool directory."""
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(ROOT / "launch.sh", spool / "slurm_script")
    venv = fake_venv(tmp_path, "mpich")
    env, log = in_a_job(tmp_path, venv)
    r = subprocess.run(["bash", str(spool / "slurm_script"), "train"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "args=show job 1" in calls(log, "scontrol")
    assert f"{venv}/bin/python -m mpitrain train" in calls(log, "srun")

    (Path(env["PATH"].split(":")[0]) / "scontrol").unlink()    # nothing says where it is
    r = subprocess.run(["bash", str(spool / "slurm_script"), "train"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot find the mpitrain checkout" in r.stderr, r.stderr


def test_the_venv_records_its_mpi():
    record = installed_mpi()
    if record is None:
        pytest.skip(f"{sys.prefix} was not made by launch.sh")
    from mpi4py import MPI
    assert record["kind"] in ("wheel", "system")
    assert record["impl"] == launcher.family()
    assert record["library"] == MPI.Get_library_version().replace("\0", "").strip().splitlines()[0]
    assert os.access(record["mpiexec"], os.X_OK)


# ----- Ctrl-C through launch.sh, with the venv's own MPI -----
class Launched(BackgroundJob):
    """`./launch.sh train ARGS` in the background (SIGINT at its default, as from a shell)."""

    def __init__(self, tmp_path, digits, *args):
        env = {k: v for k, v in launcher.environment().items()    # as a user's shell has it
               if not k.startswith("MPITRAIN_") and not k.endswith("_NUM_THREADS")}
        env.update(MPITRAIN_VENV=sys.prefix, NP="2")
        super().__init__([str(ROOT / "launch.sh"), "train", "--batch-size", "64", "--epochs",
                          "20", "--data-dir", str(digits), "--run-dir", str(tmp_path / "run"),
                          *args], tmp_path / "run", tmp_path / "log", 2, env)


def require_set_up_venv():
    """Skip unless this Python's venv is one launch.sh set up and would use as it is."""
    record = installed_mpi()
    if record is None:
        pytest.skip(f"{sys.prefix} was not made by launch.sh")
    installed = Path(sys.prefix, ".mpitrain-installed").read_text().strip()
    if installed != stamp(record["kind"]):               # launch.sh would install: not here
        pytest.skip(f"{sys.prefix} is older than setup.py or pyproject.toml: ./launch.sh setup")


@pytest.fixture
def launched(tmp_path, digits):
    require_set_up_venv()
    jobs = []

    def start(*args):
        jobs.append(Launched(tmp_path, digits, *args))
        return jobs[-1]
    yield start
    for j in jobs:
        j.cleanup()


@pytest.mark.launches
def test_ctrl_c_to_launch_sh_checkpoints_and_returns_130(launched):
    job = launched()
    job.running()
    job.proc.send_signal(signal.SIGINT)
    status, took, out = job.finish()
    assert status == 130, out
    found = re.findall(r"SIGINT: stopped at epoch \d+, step \d+; checkpoint ([^;\s]+);", out)
    assert len(found) == 1 and os.path.exists(found[0]), out
    assert took < 30, out


@pytest.mark.launches
def test_a_second_ctrl_c_to_launch_sh_ends_the_job_with_130(launched):
    """Rank 0 stopped: the first Ctrl-C cannot be agreed on; the second ends the job now
    (MPICH's mpiexec reports 0 or 255 for it; launch.sh says 130)."""
    job = launched()
    board = job.running()
    os.kill(board[0]["pid"], signal.SIGSTOP)
    job.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    job.proc.send_signal(signal.SIGINT)
    status, took, out = job.finish()
    assert status == 130, out
    assert "final validation accuracy" not in out, out
    assert took < 20, out


def running(pid):
    """Whether process `pid` exists and has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def wait_until_gone(pids, timeout):
    """Seconds until none of `pids` runs any more."""
    start = time.monotonic()
    while any(map(running, pids)):
        assert time.monotonic() - start < timeout, f"ranks {pids} still run after {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.launches
def test_kill_9_of_launch_sh_ends_the_job(launched):
    """SIGKILL reaches launch.sh alone (its launcher has a process group of its own): the
    kernel sends the launcher SIGUSR1, which it passes on, and the ranks watch launch.sh
    too; the job ends within seconds, instead of training on as orphans."""
    job = launched()
    board = job.running()
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait()
    took = wait_until_gone([b["pid"] for b in board.values()], timeout=30)
    out = job.output()
    assert took < 15, out
    assert (re.search(r"SIGUSR1: stopped at epoch \d+, step \d+; checkpoint ", out) or
            f"the launching process (pid {job.proc.pid}, MPITRAIN_LAUNCHER_PID) is gone" in out)
    assert "final validation accuracy" not in out


def test_the_launcher_watch_sees_its_process_end_even_unreaped():
    from mpitrain.control import LauncherWatch
    p = subprocess.Popen(["sleep", "60"])
    watch = LauncherWatch({"MPITRAIN_LAUNCHER_PID": str(p.pid)})
    elsewhere = LauncherWatch({"MPITRAIN_LAUNCHER_PID": str(p.pid),
                               "MPITRAIN_LAUNCHER_HOST": "another-host"})
    assert watch.gone() is None and elsewhere.gone() is None
    p.kill()
    while running(p.pid):                        # a zombie: its parent has not reaped it
        time.sleep(0.01)
    assert watch.gone() == f"the launching process (pid {p.pid}, MPITRAIN_LAUNCHER_PID) is gone"
    p.wait()
    assert watch.gone() and elsewhere.gone() is None


ORPHAN = """
import sys, time
from mpitrain.control import LauncherWatch
watch = LauncherWatch({"PMI_RANK": "0"})            # started by a launcher: its parent
open(sys.argv[1] + ".ready", "w").close()
while not watch.gone():
    time.sleep(0.02)
open(sys.argv[1], "w").write(watch.gone())
"""


def test_the_launcher_watch_sees_its_parent_die(tmp_path):
    """What a rank of Open MPI's mpirun (its parent) sees when mpirun is killed."""
    out = tmp_path / "said"
    parent = subprocess.Popen(["sh", "-c", '"$0" -c "$1" "$2" & wait', sys.executable, ORPHAN,
                               str(out)])
    end = time.monotonic() + 60
    while not (tmp_path / "said.ready").exists():
        assert time.monotonic() < end and parent.poll() is None
        time.sleep(0.02)
    parent.kill()
    parent.wait()
    while not out.exists() or not out.read_text():
        assert time.monotonic() < end, "the child did not see its parent die"
        time.sleep(0.02)
    assert out.read_text() == (f"this rank's parent process (pid {parent.pid}: the MPI "
                               f"launcher or its proxy) is gone")


@pytest.mark.launches
def test_kill_9_of_the_launcher_ends_the_ranks(tmp_path, digits):
    """mpiexec (or mpirun) killed: its ranks, whose parent it or its proxy was, end."""
    from test_checkpoint import command
    job = BackgroundJob(command(2, "train", "--batch-size", "64", "--epochs", "20",
                                "--data-dir", str(digits), "--run-dir", str(tmp_path / "run")),
                        tmp_path / "run", tmp_path / "log", 2)
    try:
        board = job.running()
        job.proc.send_signal(signal.SIGKILL)
        job.proc.wait()
        assert wait_until_gone([b["pid"] for b in board.values()], timeout=30) < 15
    finally:
        job.cleanup()


# ----- what the program reads from the launcher -----
def test_no_progress_bar_on_open_mpis_pseudo_terminal(monkeypatch):
    class Terminal:
        def isatty(self):
            return True
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    assert output_is_terminal(Terminal())
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")      # mpirun's ranks: a pty, not a person
    assert not output_is_terminal(Terminal())


def test_a_job_started_from_a_rank_does_not_inherit_its_launch():
    env = {"PATH": "/bin", "PMI_RANK": "1", "PMI_SIZE": "2", "HYDI_CONTROL_FD": "5",
           "OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_orte_hnp_uri": "x", "PMIX_RANK": "0",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_MCA_btl": "self,vader", "OMP_NUM_THREADS": "2"}
    assert outside_environment(env) == {"PATH": "/bin", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                                        "OMPI_MCA_btl": "self,vader", "OMP_NUM_THREADS": "2"}
