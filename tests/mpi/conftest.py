"""Under mpirun every rank runs the same tests; rank 0 alone reports.

The other ranks' pytest report goes to a temporary file, shown on stderr only
when that rank's session failed, so a failure seen by one rank is never lost.
A test that blocks (a rank left a collective) aborts the whole job, naming it.
"""
import sys
import tempfile
import threading

import pytest
from _pytest.config import create_terminal_writer


WATCHDOG_S = 120


@pytest.fixture(autouse=True)
def watchdog(request):
    """Abort the whole job, naming the test, if a test blocks (a rank left a collective)."""
    from mpi4py import MPI

    from mpitrain.control import end_job

    def fire():
        print(f"\nrank {MPI.COMM_WORLD.rank}: {request.node.nodeid} still running after "
              f"{WATCHDOG_S} s; aborting the job", flush=True)
        end_job(MPI.COMM_WORLD, 1)
    timer = threading.Timer(WATCHDOG_S, fire)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


@pytest.fixture(scope="module")
def comm():
    """A Communicator of the world, for one test module (freed at its end)."""
    from mpi4py import MPI

    from mpitrain.comm import Communicator
    c = Communicator(MPI.COMM_WORLD)
    yield c
    c.free()


@pytest.fixture
def shared_dir():
    """A directory every rank sees (made by rank 0), removed afterwards."""
    import shutil

    from mpi4py import MPI
    world = MPI.COMM_WORLD
    path = world.bcast(tempfile.mkdtemp(prefix="mpitrain-test-") if world.rank == 0 else None)
    yield path
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(path)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.rank
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if rank == 0 or reporter is None:
        return
    config._rank = rank
    config._rank_log = tempfile.TemporaryFile(mode="w+")
    reporter._tw = create_terminal_writer(config, file=config._rank_log)


def pytest_sessionfinish(session, exitstatus):
    session.config._exitstatus = exitstatus


def pytest_unconfigure(config):
    log = getattr(config, "_rank_log", None)
    if log is None:
        return
    if getattr(config, "_exitstatus", 1) != 0:
        log.seek(0)
        sys.stderr.write(f"----- pytest report of rank {config._rank} -----\n{log.read()}")
        sys.stderr.flush()
    log.close()
