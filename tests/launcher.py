"""The MPI launcher for tests that start their own jobs, whatever the MPI: the venv's
mpiexec as launch.sh recorded it (MPICH's hydra or Open MPI's mpirun), with the options
it needs, in an environment without the launch variables of any job around the test.

    command(ranks, *argv)        [mpiexec, options, -np, ranks, *argv]
    mpitrain_command(ranks, ...) command(ranks, python, -m, mpitrain, ...)
    environment(ranks)           the environment for it (pass it: env=environment(n))
    family()                     "mpich" or "openmpi"
    hosts_command(layout, *argv) the same job on emulated hosts: layout (2, 2) is host
                                 nodeA with ranks 0-1 and nodeB with ranks 2-3
    hosts_environment(layout)    the environment for it, naming each rank's host
    require_emulated_hosts()     skip (saying why) where hosts cannot be emulated
    BackgroundJob                a training job running in the background, its ranks
                                 found through their heartbeat files

Tests that start MPI jobs are marked `launches` (CI runs them again under a second MPI).
Find a rank's pid in its run directory's heartbeat files
(mpitrain.control.read_heartbeats), never in a launcher's process tree; assert the
statuses mpitrain promises, and what the launchers report for them only as docs/cluster.md
documents it.
"""
import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpitrain.launcher import (HEAVY_YIELD, cores, find_mpiexec, installed_mpi,
                               job_environment, launch_options, mpi_family, mpiexec_family)


@functools.lru_cache(maxsize=None)
def mpiexec():
    """The mpiexec launch.sh recorded for this venv, else the one beside this Python (the
    mpich wheel), else the one on PATH."""
    found = find_mpiexec()
    if found is None:
        pytest.fail("no mpiexec: run ./launch.sh setup")
    return found


@functools.lru_cache(maxsize=None)
def family():
    """"mpich" or "openmpi": the library this Python's mpi4py is built against."""
    record = installed_mpi()
    if record and record.get("impl") in ("mpich", "openmpi"):
        return record["impl"]
    found = None
    if "mpi4py.MPI" in sys.modules:              # never import it here: that starts MPI
        found = mpi_family(sys.modules["mpi4py.MPI"].Get_library_version())
    return found or mpiexec_family(mpiexec())


def options(ranks):
    """The launcher's options for `ranks` ranks on this host (mpitrain.launcher)."""
    return launch_options(ranks, family())


def command(ranks, *argv):
    return [mpiexec(), *options(ranks), "-np", str(ranks), *argv]


def mpitrain_command(ranks, *args):
    """`mpiexec -np ranks python -m mpitrain args`."""
    return command(ranks, sys.executable, "-m", "mpitrain", *args)


def environment(ranks=None):
    """The environment for a job: this one without launch variables (a job started from
    inside another would join it, or be refused), Open MPI's consent to run as root, and,
    for `ranks` ranks, each rank's share of the cores in threads (as launch.sh gives).
    MPICH's ranks sleep while they wait, as those of a job with more ranks than cores do
    (launch_options): a test's job shares the cores with the other test processes'. (Open
    MPI 4's ranks would only call sched_yield, which gained nothing here.)"""
    env = job_environment(family(), max(1, cores() // ranks) if ranks else None)
    if family() == "mpich":
        env[HEAVY_YIELD] = "1"
    return env


# Emulated hosts: tests/emulated_host.sh stands in for ssh and starts each "host"'s
# processes in a UTS namespace of that name, so MPI sees several hosts on this machine
EMULATED_HOST = Path(__file__).resolve().with_name("emulated_host.sh")
# the host of every rank, comma-separated, as the job was launched (tests/mpi checks it)
HOSTS_VARIABLE = "MPITRAIN_TEST_HOSTS"


def host_names(count):
    """nodeA, nodeB, ...: the names of `count` emulated hosts."""
    if not 1 <= count <= 26:
        raise ValueError(f"1 to 26 emulated hosts, not {count}")
    return [f"node{chr(ord('A') + i)}" for i in range(count)]


def placement(layout, interleave=False):
    """The host of every rank, in rank order, of a launch of `layout` (ranks per host):
    in blocks (nodeA's ranks first), or, with `interleave`, one rank per host in turn."""
    names = host_names(len(layout))
    if not interleave:
        return [name for name, ranks in zip(names, layout) for _ in range(ranks)]
    if len(set(layout)) != 1:
        raise ValueError(f"interleaving needs as many ranks on every host, not {layout}")
    return names * layout[0]


@functools.lru_cache(maxsize=None)
def emulated_hosts_unavailable():
    """Why hosts cannot be emulated here (a new UTS namespace needs root), or None."""
    try:
        probe = subprocess.run([str(EMULATED_HOST), "probe-host", "hostname"],
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{EMULATED_HOST.name} did not run: {e}"
    if probe.returncode or probe.stdout.strip() != "probe-host":
        return (f"{EMULATED_HOST.name} could not give a process a host name of its own "
                f"(status {probe.returncode}): {probe.stderr.strip() or probe.stdout.strip()}")
    return None


def require_emulated_hosts():
    why = emulated_hosts_unavailable()
    if why:
        pytest.skip(f"NO EMULATED HOSTS, the tests across node boundaries did not run: {why} "
                    f"(unshare --uts needs root, as CI runs)")


def hosts_command(layout, *argv, interleave=False):
    """`mpiexec` starting argv on emulated hosts: layout[i] ranks on host i (placement())."""
    names = host_names(len(layout))

    def hosts(slots):
        return ",".join(f"{name}:{n}" for name, n in zip(names, slots))
    if family() == "openmpi":
        # routed direct: every daemon reports to mpirun itself, not through the tree of
        # daemons an rsh launch builds. Each host's slots hold its ranks, so Open MPI sees
        # no oversubscription: ranks that outnumber this machine's cores are told to yield
        # the core while they wait (else they spin, and the job crawls)
        opts = ["--host", hosts(layout), "--mca", "plm_rsh_agent", str(EMULATED_HOST),
                "--mca", "routed", "direct", "--bind-to", "none",
                *(["--map-by", "node"] if interleave else []),
                *(["--mca", "mpi_yield_when_idle", "1"] if sum(layout) > cores() else [])]
    else:       # hydra fills each host's slots in turn: one slot each deals the ranks out
        opts = ["-hosts", hosts([1] * len(layout) if interleave else layout),
                "-bootstrap", "ssh", "-bootstrap-exec", str(EMULATED_HOST)]
    return [mpiexec(), *opts, "-np", str(sum(layout)), *argv]


def hosts_environment(layout, interleave=False):
    """environment() for the ranks of hosts_command(layout), which share this machine's
    cores, with each rank's host in HOSTS_VARIABLE."""
    env = environment(sum(layout))
    env[HOSTS_VARIABLE] = ",".join(placement(layout, interleave))
    return env


class BackgroundJob:
    """`cmd` (a training job writing to `run_dir`) started in the background, its output
    in `log`; its ranks are found through their heartbeat files."""

    def __init__(self, cmd, run_dir, log, ranks=2, env=None):
        self.run_dir, self.log, self.ranks = Path(run_dir), Path(log), ranks
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env=env or environment(ranks))

    def board(self):
        from mpitrain.control import read_heartbeats
        return read_heartbeats(self.run_dir / "heartbeat", self.ranks)

    def wait_for(self, test, what, timeout=120):
        """Poll the heartbeat files until test(board) holds; returns the board. JobEnded
        where the job ends first."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise JobEnded(f"the job ended before {what}:\n{self.output()}")
            board = self.board()
            if all(board.values()) and test(board):
                return board
            time.sleep(0.002)
        raise AssertionError(f"no {what} within {timeout} s:\n{self.output()}")

    def running(self):
        """The board once every rank is past its first steps."""
        return self.wait_for(lambda b: all(r["count"] > 8 for r in b.values()), "steps")

    def pid(self, rank):
        return self.board()[rank]["pid"]

    def finish(self, timeout=120):
        """(status, seconds it took, output)."""
        start = time.monotonic()
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end within {timeout} s; heartbeats "
                                 f"{self.board()}; its output:\n{self.output()}") from None
        return status, time.monotonic() - start, self.output()

    def output(self):
        return self.log.read_text()

    def cleanup(self):
        """Leave no process behind (SIGSTOPped ranks included)."""
        for b in self.board().values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    if b:
                        os.kill(b["pid"], sig)
                except ProcessLookupError:
                    pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def under_cuda_simulator(module, check, timeout=600):
    """Run `module.check()` (a test module in tests/) in a child under the numba-cuda
    simulator, which numba chooses when it is imported; the child's assertions fail the
    calling test, with its output."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import {module} as t; t.{check}()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"), timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr


class JobEnded(AssertionError):
    """A BackgroundJob ended before what wait_for waited for."""


def signal_as_step_starts(job, step, sig=signal.SIGUSR1, timeout=60):
    """Send rank 0 of a BackgroundJob `sig` as it starts `step` (stopped meanwhile, so the
    step cannot slip past before the signal is in), and let the job end: its finish().
    JobEnded where the job runs to its end before the polls see that step start (a fast
    job's step lasts milliseconds: the caller tries again)."""
    job.wait_for(lambda b: b[0]["where"] == f"in 'forward' after step {step - 1}", f"step {step}")
    os.kill(job.pid(0), signal.SIGSTOP)
    os.kill(job.pid(0), sig)
    os.kill(job.pid(0), signal.SIGCONT)
    return job.finish(timeout=timeout)
