"""`launch.sh train` under a real Slurm, as a cluster runs it: a single-node Slurm (Debian's
slurm-wlm and munge, ProctrackType=proctrack/linuxproc, TaskPlugin=task/none,
MpiDefault=none, one node of 2 CPUs) is started here, in a temporary directory, with its
own munge socket and ports; jobs are submitted with sbatch from another directory than
the checkout.

Checked: the job is ONE world of 2 ranks (launch.sh picks srun's --mpi for the venv's
MPI; without it each task would be a 1-rank job, which mpitrain refuses); `scancel
--signal=USR1` stops it with a checkpoint and status 0, `--resume auto` continues it to
the end; a signal to the batch shell (sbatch --signal=B:USR1@N) reaches the ranks
through `exec srun`; a rank killed with SIGKILL ends the job (--kill-on-bad-exit=1).

Skipped, with the reason, where Slurm is not installed (.ci/run installs it) or cannot
be started (not root, no munged).
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpitrain import checkpoint
from mpitrain.control import read_heartbeats
import launcher

pytestmark = pytest.mark.launches

ROOT = Path(__file__).resolve().parents[1]
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")
# 22 steps per epoch of the digits at a global batch of 64, about a second each here
JOB = ("--batch-size", "64", "--seed", "7")


def tool(name):
    found = shutil.which(name)
    for d in SBIN:
        if found is None and os.access(os.path.join(d, name), os.X_OK):
            found = os.path.join(d, name)
    return found


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=mpitraintest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
CredType=cred/munge
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=5
MinJobAge=600
FirstJobId={first_job}
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """munged, slurmctld and slurmd of a one-node cluster, in the foreground, as children."""

    def __init__(self, d):
        self.d, self.host = d, socket.gethostname().split(".")[0]
        self.daemons = []
        for sub in ("ctld", "spool"):
            (d / sub).mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        conf = d / "slurm.conf"
        # job ids not seen before on this host: MPICH names its shared memory after them
        conf.write_text(SLURM_CONF.format(host=self.host, d=d, ctld_port=free_port(),
                                          slurmd_port=free_port(),
                                          first_job=int(time.time()) % 10_000_000 * 10 + 1000))
        # clients and jobs: this cluster only, nothing of a Slurm job this test may run in
        self.env = {k: v for k, v in launcher.environment().items()
                    if not k.startswith(("SLURM_", "MPITRAIN_")) and not k.endswith("_NUM_THREADS")}
        self.env.update(SLURM_CONF=str(conf), MPITRAIN_VENV=sys.prefix)
        self.start([tool("munged"), "--foreground", "--force", f"--socket={d}/munge.socket",
                    f"--key-file={key}", f"--pid-file={d}/munged.pid",
                    f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"], "munged")
        self.wait(lambda: (d / "munge.socket").exists(), "munged's socket", 10)
        self.start([tool("slurmctld"), "-D", "-c", "-f", str(conf)], "slurmctld")
        self.start([tool("slurmd"), "-D", "-f", str(conf), "-N", self.host], "slurmd")
        self.wait(lambda: "State=IDLE" in self.scontrol("show", "node", self.host), "an idle node",
                  30)

    def start(self, cmd, name):
        log = open(self.d / f"{name}.out", "w")
        self.daemons.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             env=self.env, start_new_session=True))

    def wait(self, test, what, timeout):
        end = time.monotonic() + timeout
        while not test():
            for p in self.daemons:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited ({p.returncode}) before {what}: "
                                       + self.logs())
            if time.monotonic() > end:
                raise RuntimeError(f"no {what} after {timeout} s: " + self.logs())
            time.sleep(0.2)

    def logs(self):
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.d.iterdir())
                         if p.suffix in (".log", ".out"))

    def run(self, *cmd, check=True):
        r = subprocess.run([tool(cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=60,
                           env=self.env)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: {r.returncode}\n{r.stdout}{r.stderr}")
        return r.stdout

    def scontrol(self, *args):
        return self.run("scontrol", "-o", *args, check=False)

    def cancel_all(self, timeout=60):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).split()
            if not jobs:
                return
            self.run("scancel", *jobs, check=False)
            time.sleep(0.5)

    def stop(self):
        self.cancel_all()
        for p in reversed(self.daemons):
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [t for t in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol",
                           "scancel") if tool(t) is None]
    if missing:
        pytest.skip(f"Slurm is not installed (no {', '.join(missing)}: apt-get install "
                    f"slurm-wlm munge; .ci/run does)")
    if os.geteuid() != 0:
        pytest.skip("starting slurmd needs root")
    d = tmp_path_factory.mktemp("slurm")
    try:
        cluster = Slurm(d)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"Slurm could not be started here: {e}")
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def no_job_left(request):
    """After each test its jobs are gone: none runs on into the next test's."""
    yield
    if "slurm" in request.fixturenames:
        request.getfixturevalue("slurm").cancel_all()


# the states of a job that has ended; the others (PENDING, RUNNING, and transient ones
# such as CONFIGURING, SIGNALING while --signal is delivered, COMPLETING) have not
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY")


class Job:
    """`sbatch [options] /path/to/launch.sh train ARGS` from `where` (not the checkout)."""

    def __init__(self, slurm, where, run_dir, *args, sbatch=(), env=None):
        self.slurm, self.run_dir = slurm, run_dir
        self.log = where / f"job-{run_dir.name}.out"
        out = subprocess.run([tool("sbatch"), "--parsable", "--ntasks=2", "--nodes=1",
                              f"--output={self.log}", *sbatch, str(ROOT / "launch.sh"), "train",
                              *JOB, "--run-dir", str(run_dir), *args],
                             cwd=where, capture_output=True, text=True, timeout=60,
                             env={**slurm.env, **(env or {})})
        assert out.returncode == 0, out.stdout + out.stderr
        self.id = out.stdout.strip().split(";")[0]

    def info(self):
        return self.slurm.scontrol("show", "job", self.id)

    def state(self):
        """The job's state, None while scontrol cannot say (slurmctld busy)."""
        found = re.search(r"JobState=(\S+)", self.info())
        return found.group(1) if found else None

    def output(self):
        return self.log.read_text() if self.log.exists() else ""

    def ranks(self, min_count=10, timeout=120):
        """{rank: heartbeat} once both ranks are past their first steps."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            board = read_heartbeats(self.run_dir / "heartbeat", 2)
            if all(board.values()) and all(b["count"] > min_count for b in board.values()):
                return board
            assert self.state() not in ENDED, \
                f"job {self.id} {self.state()} before its ranks ran:\n{self.output()}"
            time.sleep(0.1)
        raise AssertionError(f"job {self.id}: no progress in {timeout} s:\n{self.output()}\n"
                             + self.info())

    def finish(self, timeout=180):
        """(state, exit code as Slurm reports it "status:signal", output)."""
        end = time.monotonic() + timeout
        while True:
            info = self.info()
            state = re.search(r"JobState=(\S+)", info)
            if state and state.group(1) in ENDED:
                break
            assert time.monotonic() < end, f"job {self.id} still running:\n{self.output()}"
            time.sleep(0.2)
        return state.group(1), re.search(r"\bExitCode=(\S+)", info).group(1), self.output()


def one_world_of_two(out):
    assert out.count("2 rank(s) on 1 node(s)") == 1, out       # one job, rank 0 reports
    assert "1 rank(s) on 1 node(s)" not in out, out


def stopped_at(out, name):
    found = re.findall(rf"{name}: stopped at epoch (\d+), step (\d+); checkpoint ([^;\s]+);", out)
    assert len(found) == 1, out
    return found[0]


def test_sbatch_runs_one_job_of_two_ranks_stops_on_usr1_and_resumes(slurm, digits, tmp_path):
    run_dir = tmp_path / "run"
    # long enough that the signal lands mid-run (the digits run 6 epochs in 2 s on an idle
    # host, and the signal, sent after 10 steps, came after the run's end)
    args = ("--data-dir", str(digits), "--epochs", "30")
    job = Job(slurm, tmp_path, run_dir, *args)
    job.ranks()
    slurm.run("scancel", "--signal=USR1", job.id)        # to the job's tasks, as Slurm does
    state, code, out = job.finish()
    assert (state, code) == ("COMPLETED", "0:0"), out     # SIGUSR1: stopped on request, 0
    one_world_of_two(out)
    epoch, step, path = stopped_at(out, "SIGUSR1")
    assert os.path.exists(path) and checkpoint.read(path)["world_size"] == 2, out
    assert "final validation accuracy" not in out, out
    assert "running build_ext" not in out and "installing" not in out, out

    again = Job(slurm, tmp_path, run_dir, *args, "--resume", "auto")
    state, code, out = again.finish()
    assert (state, code) == ("COMPLETED", "0:0"), out
    one_world_of_two(out)
    assert f"resumed from {path}" in out, out
    assert len(re.findall(r"final validation accuracy: [\d.]+% top-1", out)) == 1, out
    assert os.path.exists(run_dir / "checkpoint-000000660.h5"), out     # 30 epochs of 22


def test_a_signal_to_the_batch_shell_reaches_the_ranks(slurm, digits, tmp_path):
    """sbatch --signal=B:USR1@50 with a 1-minute limit: Slurm signals the batch shell
    (launch.sh, which exec'ed srun: srun forwards it to every task) within the first
    half-minute; the ranks checkpoint and the job ends with 0."""
    run_dir = tmp_path / "run"
    job = Job(slurm, tmp_path, run_dir, "--data-dir", str(digits), "--epochs", "200",
              sbatch=("--time=1", "--signal=B:USR1@50"))
    state, code, out = job.finish(timeout=120)
    assert (state, code) == ("COMPLETED", "0:0"), out + job.info()
    one_world_of_two(out)
    _, _, path = stopped_at(out, "SIGUSR1")
    assert os.path.exists(path), out


def test_a_rank_killed_with_sigkill_ends_the_job(slurm, digits, tmp_path):
    """srun --kill-on-bad-exit=1 (launch.sh passes it): the other rank does not wait in
    its all-reduce until the time limit."""
    run_dir = tmp_path / "run"
    job = Job(slurm, tmp_path, run_dir, "--data-dir", str(digits), "--epochs", "200")
    pid = job.ranks()[1]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    state, code, out = job.finish(timeout=60)
    assert state != "COMPLETED" or code != "0:0", out
    assert time.monotonic() - killed < 30, out


def test_without_pmi_the_tasks_are_refused_not_trained_twice(slurm, digits, tmp_path):
    """SRUN_FLAGS=--mpi=none (what Slurm's default MpiDefault=none gives): each task is a
    1-rank MPI world; mpitrain refuses to start (status 2) instead of training twice, and
    the launcher's rank 0 says why. --kill-on-bad-exit=0 after it lets every task refuse
    by itself, so the status is 2 whichever task refuses first."""
    run_dir = tmp_path / "run"
    job = Job(slurm, tmp_path, run_dir, "--data-dir", str(digits), "--epochs", "1",
              env={"SRUN_FLAGS": "--mpi=none --kill-on-bad-exit=0"})
    state, code, out = job.finish(timeout=120)
    assert "epoch 1/1" not in out, out
    if launcher.family() == "openmpi":       # Open MPI's MPI_Init refuses first (status 1)
        assert state == "FAILED" and "direct launched using \"srun\"" in out, out
    else:
        assert (state, code) == ("FAILED", "2:0"), out
        assert out.count("the launcher started 2 process(es)") == 1, out
