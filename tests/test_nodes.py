"""Across real node boundaries, on one machine: every "host" of these jobs is a UTS
namespace with a host name of its own (tests/emulated_host.sh, started as ssh would be
by MPICH's hydra and Open MPI's mpirun: launcher.hosts_command), so MPI finds one node
per name (COMM_TYPE_SHARED, shared memory inside it, its network transport between
them) while the ranks share this machine's cores, memory and files.

The MPI tests run there in one job per layout, checking the topology against the
launch (MPITRAIN_TEST_HOSTS), then training jobs: the default job on 2 hosts of 2 ranks
against 1 host of 4, a rank on the second host killed or stopped, and a checkpoint of a
2-host job resumed on 4 hosts. Skipped, saying so, where namespaces cannot be made.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mpitrain import checkpoint
import launcher
from launcher import BackgroundJob
from test_checkpoint import wait_for
from test_openmpi import require_set_up_venv

pytestmark = pytest.mark.launches

ROOT = Path(__file__).resolve().parents[1]

# The MPI tests at 2x2: all of them, with the --ranks-per-node grouping that spans the
# hosts (3: ranks 0-2, on nodeA and nodeB, share no memory) and not those of 1 and 2
# (nodes of one host, as on one machine)
ALL = ("tests/mpi", "-k", "not rpn1 and not rpn2")
# on the other layouts, what the node boundary can change: the topology, the shared
# windows, every algorithm's sums (fp16 on the wire too) alone and through the Reducer,
# the replicas through the training path, the BatchNorm groups
ACROSS = ("tests/mpi/test_comm.py", "tests/mpi/test_buckets.py", "tests/mpi/test_syncbn.py",
          "tests/mpi/test_data_parallel.py", "-k",
          "not rpn1 and not rpn2 and not rpn3 and (topology or windows or small_sums or "
          "medium_sums or fp16_on_the_wire or hybrid_rule or reducer_sums_every_ranks or "
          "groups_equal or replicas_stay)")


def run_on_hosts(layout, *argv, interleave=False, timeout=600):
    launcher.require_emulated_hosts()
    return subprocess.run(launcher.hosts_command(layout, *argv, interleave=interleave),
                          cwd=ROOT, env=launcher.hosts_environment(layout, interleave),
                          capture_output=True, text=True, timeout=timeout)


def mpitrain_on_hosts(layout, *args):
    return launcher.hosts_command(layout, sys.executable, "-m", "mpitrain", *args)


@pytest.mark.parametrize("layout, interleave, tests", [
    ((2, 2), False, ALL),
    ((3, 3), False, ACROSS),
    ((2, 2, 2), False, ACROSS),
    ((3, 2), False, ACROSS),                         # nodes of unequal size
    ((2, 2), True, ACROSS),                          # nodeA, nodeB, nodeA, nodeB
], ids=["2x2", "2x3", "3x2", "3+2", "2x2-interleaved"])
def test_the_mpi_tests_across_hosts(layout, interleave, tests):
    r = run_on_hosts(layout, sys.executable, "-m", "mpi4py", "-m", "pytest", *tests, "-q",
                     "-p", "no:cacheprovider", "--color=no", interleave=interleave)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-30000:]
    summary = r.stdout.strip().splitlines()[-1]           # rank 0's
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, out[-30000:]


# ----- training jobs -----
def final_top1(out):
    found = re.findall(r"final validation accuracy: ([\d.]+)% top-1", out)
    assert len(found) == 1, out                         # rank 0 alone reports
    return float(found[0])


@pytest.mark.one_mpi
def test_default_job_on_2_hosts_of_2_trains_as_on_1_host_of_4(digits, tmp_path):
    """The default job with its replicas compared every 10 steps: 4 ranks on 2 nodes reach
    the accuracy of 4 ranks on 1 (their sums add in another order: not the same bits)."""
    args = ("train", "--data-dir", str(digits), "--check-replicas", "10")
    one = subprocess.run(launcher.mpitrain_command(4, *args, "--run-dir", str(tmp_path / "one")),
                         env=launcher.environment(4), capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "4 rank(s) on 1 node(s)" in one.stdout, one.stdout
    two = run_on_hosts((2, 2), sys.executable, "-m", "mpitrain", *args,
                       "--run-dir", str(tmp_path / "two"))
    assert two.returncode == 0, two.stdout + two.stderr
    assert ("4 rank(s) on 2 node(s)" in two.stdout and "node 0: 2 rank(s): 0-1" in two.stdout
            and "node 1: 2 rank(s): 2-3" in two.stdout), two.stdout
    env = json.loads((tmp_path / "two" / "environment.json").read_text())
    assert (env["nodes"], env["hosts"], env["ranks_per_host"]) == (2, ["nodeA", "nodeB"],
                                                                    [2, 2]), env
    a, b = final_top1(one.stdout), final_top1(two.stdout)
    assert min(a, b) >= 95.0 and abs(a - b) <= 1.5, (a, b)


# 22 steps an epoch: the jobs are interrupted in epoch 2, and 30 epochs keep them running
JOB = ("train", "--epochs", "30", "--batch-size", "64")


def start_on_2_hosts(digits, run_dir, log, *extra):
    """The job on nodeA (ranks 0, 1) and nodeB (ranks 2, 3), once its first checkpoint
    is written; its ranks' heartbeats name their hosts."""
    launcher.require_emulated_hosts()
    job = BackgroundJob(mpitrain_on_hosts((2, 2), *JOB, "--data-dir", str(digits),
                                          "--run-dir", str(run_dir), *extra),
                        run_dir, log, ranks=4, env=launcher.hosts_environment((2, 2)))
    try:
        wait_for(run_dir / "checkpoint-000000022.h5", job.proc)
        hosts = [b["host"] for b in job.wait_for(lambda b: True, "heartbeats").values()]
        assert hosts == launcher.placement((2, 2)), (hosts, job.output())
    except BaseException:
        job.cleanup()
        raise
    return job


def test_kill_9_on_the_second_host_ends_the_job_and_it_resumes_on_4_hosts(digits, tmp_path):
    """A rank of nodeB killed ends every rank on both hosts; the checkpoints, written once
    (by rank 0), hold the 4 ranks' run and resume on 4 nodes of one rank each."""
    run_dir = tmp_path / "run"
    job = start_on_2_hosts(digits, run_dir, tmp_path / "log")
    try:
        os.kill(job.pid(3), signal.SIGKILL)
        status, took, out = job.finish(timeout=30)
    finally:
        job.cleanup()
    assert status != 0 and took < 30, out
    saved = sorted(p.name for p in run_dir.glob("checkpoint-*.h5"))
    assert saved and all(int(re.findall(r"\d+", n)[0]) % 22 == 0 for n in saved), saved
    last = checkpoint.latest(str(run_dir))
    state = checkpoint.read(last)
    assert state["world_size"] == 4 and state["step"] == 0, (last, state["step"])

    epochs = state["epoch"] + 1
    r = run_on_hosts((1, 1, 1, 1), sys.executable, "-m", "mpitrain", "train", "--epochs",
                     str(epochs), "--batch-size", "64", "--data-dir", str(digits),
                     "--run-dir", str(run_dir), "--resume", "auto")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 rank(s) on 4 node(s)" in r.stdout, r.stdout
    assert f"resumed from {last}: epoch {epochs}, step 0 (written by 4 rank(s))" in r.stdout, \
        r.stdout
    end = checkpoint.read(str(run_dir / f"checkpoint-{22 * epochs:09d}.h5"))
    assert (end["epoch"], end["world_size"]) == (epochs, 4)
    assert not list(run_dir.glob(".checkpoint-*.tmp")), sorted(os.listdir(run_dir))


def test_a_stopped_rank_on_the_second_host_is_named_with_its_host(digits, tmp_path):
    run_dir = tmp_path / "run"
    job = start_on_2_hosts(digits, run_dir, tmp_path / "log", "--collective-timeout", "6")
    try:
        stopped = job.pid(3)
        os.kill(stopped, signal.SIGSTOP)                # rank 3 stops arriving
        status, _, out = job.finish(timeout=60)
    finally:
        job.cleanup()
    assert status != 0, out
    assert "no progress for" in out and "(--collective-timeout 6)" in out, out
    assert f"rank 3: no sign of life for" in out and f"(pid {stopped} on nodeB)" in out, out


def test_launch_sh_trains_on_emulated_hosts(digits, tmp_path):
    """HOSTS=2 NP=4 ./launch.sh train: 2 nodes of 2 ranks; a HOSTS that does not divide
    NP, or beside a HOSTFILE, is refused (status 2) before any launch."""
    require_set_up_venv()
    launcher.require_emulated_hosts()
    env = {k: v for k, v in launcher.environment().items()    # as a user's shell has it
           if not k.startswith("MPITRAIN_") and not k.endswith("_NUM_THREADS")}
    env.update(MPITRAIN_VENV=sys.prefix, HOSTS="2", NP="4")
    args = [str(ROOT / "launch.sh"), "train", "--epochs", "1", "--batch-size", "64",
            "--data-dir", str(digits), "--run-dir", str(tmp_path / "run")]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("4 rank(s) on 2 node(s)" in r.stdout and "node 1: 2 rank(s): 2-3" in r.stdout
            and "final validation accuracy" in r.stdout), r.stdout
    for extra, error in (({"NP": "3"}, "HOSTS=2 does not divide NP=3: every emulated host "
                                       "runs NP / HOSTS ranks; choose NP as a multiple of 2"),
                         ({"HOSTFILE": str(tmp_path / "hosts")}, "HOSTS and HOSTFILE exclude "
                                                                 "each other")):
        r = subprocess.run(args, env={**env, **extra}, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and error in r.stderr and not r.stdout, r.stdout + r.stderr


def launched_on_2_hosts(digits, tmp_path, name):
    """HOSTS=2 NP=2 ./launch.sh train in the background (a rank on nodeA and on nodeB,
    SIGINT at its default, as from a shell), once its ranks are past their first steps."""
    require_set_up_venv()
    launcher.require_emulated_hosts()
    env = {k: v for k, v in launcher.environment().items()    # as a user's shell has it
           if not k.startswith("MPITRAIN_") and not k.endswith("_NUM_THREADS")}
    env.update(MPITRAIN_VENV=sys.prefix, HOSTS="2", NP="2")
    run_dir = tmp_path / name
    job = BackgroundJob([str(ROOT / "launch.sh"), *JOB, "--data-dir", str(digits),
                         "--run-dir", str(run_dir)], run_dir, tmp_path / f"{name}.log", 2, env)
    try:
        board = job.running()
    except BaseException:
        job.cleanup()
        raise
    return job, [b["pid"] for b in board.values()]


def test_ctrl_c_to_launch_sh_checkpoints_a_job_on_emulated_hosts(digits, tmp_path):
    """Open MPI's ranks on emulated hosts are its daemon's children, not mpirun's: Ctrl-C
    still checkpoints and returns 130, where Open MPI trained on to the end."""
    job, _ = launched_on_2_hosts(digits, tmp_path, "int")
    try:
        job.proc.send_signal(signal.SIGINT)
        status, took, out = job.finish(timeout=60)
    finally:
        job.cleanup()
    assert status == 130 and took < 30, out
    found = re.findall(r"SIGINT: stopped at epoch \d+, step \d+; checkpoint ([^;\s]+);", out)
    assert len(found) == 1 and os.path.exists(found[0]), out


def test_kill_9_of_launch_sh_ends_a_job_on_emulated_hosts(digits, tmp_path):
    """No rank runs on launch.sh's host, so the ranks' watch of it cannot see it die: the
    kernel's SIGUSR1 to the launcher (setpriv --pdeathsig) ends the job, with a
    checkpoint, where both MPIs trained on as orphans."""
    from test_openmpi import wait_until_gone
    setpriv = shutil.which("setpriv")
    if setpriv is None or "--pdeathsig" not in subprocess.run(
            [setpriv, "--help"], capture_output=True, text=True).stdout:
        pytest.skip("setpriv has no --pdeathsig here (util-linux before 2.33)")
    job, ranks = launched_on_2_hosts(digits, tmp_path, "kill")
    try:
        job.proc.send_signal(signal.SIGKILL)
        job.proc.wait()
        took = wait_until_gone(ranks, timeout=40)
    finally:
        job.cleanup()
    out = job.output()
    assert took < 30 and "final validation accuracy" not in out, out
    assert re.search(r"SIGUSR1: stopped at epoch \d+, step \d+; checkpoint ", out), out
