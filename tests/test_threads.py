"""Each rank's thread pools at its share of the host's cores under a plain mpiexec (no
thread variables set, as launch.sh would): Numba and the OpenMP runtime size their pools
once, when they load, and a pool larger than the threads a rank runs kept the rest waking
at every parallel kernel and spinning on the other ranks' cores."""
import json
import subprocess
import sys

import pytest

from launcher import command, environment
from mpitrain.launcher import THREAD_VARIABLES, cores

pytestmark = pytest.mark.launches

POOLS = """
import json, os, sys
from mpi4py import MPI
from mpitrain.launcher import size_thread_pools
size_thread_pools(MPI.COMM_WORLD)
import numba
mine = [MPI.COMM_WORLD.rank, numba.config.NUMBA_NUM_THREADS, os.environ.get("OMP_NUM_THREADS")]
every = MPI.COMM_WORLD.gather(mine, root=0)
if MPI.COMM_WORLD.rank == 0:
    print("pools " + json.dumps(every), flush=True)
"""


def pools(ranks, **chosen):
    """[rank, Numba's pool, OMP_NUM_THREADS] of each rank of a `ranks`-rank job started
    with none of the thread variables but `chosen`."""
    env = {k: v for k, v in environment(ranks).items() if k not in THREAD_VARIABLES}
    r = subprocess.run(command(ranks, sys.executable, "-c", POOLS), capture_output=True,
                       text=True, timeout=120, env={**env, **chosen})
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = [line for line in r.stdout.splitlines() if line.startswith("pools ")]
    return json.loads(line[len("pools "):])


def test_each_ranks_pools_are_its_share_of_the_hosts_cores():
    share = max(1, cores() // 2)
    assert pools(2) == [[0, share, str(share)], [1, share, str(share)]]


def test_a_thread_count_the_user_chose_is_left_alone():
    assert pools(2, NUMBA_NUM_THREADS="1") == [[0, 1, None], [1, 1, None]]


def test_train_sizes_its_pools_before_anything_loads_numba(digits, tmp_path):
    """Through the command line: a check of the BLAS choice that loaded Numba before the
    ranks sized their pools left each rank a pool of all the host's cores (the digits job
    7 times slower)."""
    env = {k: v for k, v in environment(2).items() if k not in THREAD_VARIABLES}
    run_dir = tmp_path / "run"
    r = subprocess.run(command(2, sys.executable, "-m", "mpitrain", "train", "--data-dir",
                               str(digits), "--epochs", "1", "--run-dir", str(run_dir)),
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    recorded = json.loads((run_dir / "environment.json").read_text())
    assert recorded["numba_pool"] == max(1, cores() // 2), recorded
