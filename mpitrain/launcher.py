"""What the launcher (mpirun, mpiexec, srun) tells a process through its environment.

Read before MPI starts, or to check MPI against it:

    launched_rank()        this process's rank as the launcher numbered it (0 when not
                           launched by one): rank 0 alone prints argument errors
    launched_size()        (size, variable): how many ranks the launcher started, and the
                           variable that says so; None when nothing says
    output_is_terminal()   whether a progress bar may be drawn on `stream`

and for what starts jobs (launch.sh, the tests, `study`):

    outside_environment()  an environment without the variables a launch sets, for a
                           job started from inside a launched process (or from a
                           singleton: Open MPI's puts its own in the C environment)
    mpi_family()           "mpich" or "openmpi" from MPI's library version string
    installed_mpi()        what launch.sh recorded of a venv's MPI (kind, impl, mpiexec)
    find_mpiexec()         the venv's recorded mpiexec, else the one beside this Python
    mpiexec_family()       "mpich" or "openmpi": the family of that mpiexec
    launch_options()       the options that mpiexec needs for N ranks on this host
    job_environment()      the environment for such a job, with each rank's threads
"""
import os
import sys

# (rank variable, size variable) of each launcher, in order of precedence: MPICH's
# hydra and other PMI launchers, Open MPI's mpirun, PMIx launchers, Slurm's srun (a
# job step's own size: a batch script's SLURM_NTASKS counts tasks it has not started)
LAUNCHERS = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
             ("PMIX_RANK", None), ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"))


def launched_rank():
    for rank, _ in LAUNCHERS:
        if os.environ.get(rank, "").isdigit():
            return int(os.environ[rank])
    return 0


def launched_size():
    for _, size in LAUNCHERS:
        if size and os.environ.get(size, "").isdigit():
            return int(os.environ[size]), size
    return None


def output_is_terminal(stream):
    """A terminal a person watches: Open MPI hands its ranks a pseudo-terminal whatever
    mpirun's own output is (a log file, a pipe), so under Open MPI it never is."""
    return stream.isatty() and "OMPI_COMM_WORLD_SIZE" not in os.environ


# What mpirun/mpiexec (MPICH's hydra, Open MPI's orterun and PMIx) put in the environment
# of the processes they start (and launch.sh's MPITRAIN_LAUNCHER_PID and _HOST, the
# process whose death ends the job: control.LauncherWatch). A job started from such a
# process with these in its environment takes itself for part of the outer job (Open MPI
# refuses to start it).
LAUNCH_VARIABLES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID",
                    "OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE", "OMPI_FIRST_RANKS",
                    "OMPI_APP_CTX_", "OMPI_NUM_APP_CTX", "OMPI_FILE_LOCATION", "OMPI_COMMAND",
                    "OMPI_ARGV", "OMPI_MCA_ess", "OMPI_MCA_orte_", "OMPI_MCA_pmix",
                    "OMPI_MCA_initial_wdir", "OMPI_MCA_mpi_oversubscribe",
                    "OMPI_MCA_mpi_yield_when_idle", "OMPI_MCA_hwloc_base_binding_policy",
                    "OMPI_MCA_shmem_RUNTIME_QUERY_hint", "ORTE_SCHIZO_DETECTION",
                    "MPITRAIN_LAUNCHER_")


def outside_environment(env=None):
    """A copy of `env` (default os.environ) without the launch variables: the environment
    to start another MPI job with. Pass it explicitly: a child started without env= gets
    the C-level environment, where an Open MPI singleton has added its own variables."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if not k.startswith(LAUNCH_VARIABLES)}


def mpi_family(library_version):
    """"openmpi" or "mpich" (MPICH and its derivatives: Intel MPI, MVAPICH), from
    MPI.Get_library_version(); None for another library."""
    if "Open MPI" in library_version:
        return "openmpi"
    if any(name in library_version for name in ("MPICH", "Intel(R) MPI", "MVAPICH")):
        return "mpich"
    return None


def installed_mpi(prefix=None):
    """{kind: wheel|system, impl: mpich|openmpi|unknown, mpiexec: path, library: version}
    as launch.sh recorded it in the venv `prefix` (default: this Python's); None when
    the venv was not made by launch.sh."""
    path = os.path.join(sys.prefix if prefix is None else prefix, ".mpitrain-mpi")
    try:
        with open(path) as f:
            record = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
    except OSError:
        return None
    return record if record.get("mpiexec") else None


def find_mpiexec():
    """The mpiexec launch.sh recorded for this venv, else the one beside this Python (the
    mpich wheel), else the one on PATH; None when there is none."""
    import shutil
    record = installed_mpi()
    if record and os.path.exists(record["mpiexec"]):
        return record["mpiexec"]
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def mpiexec_family(mpiexec):
    """"mpich" or "openmpi": as launch.sh recorded it, else from `mpiexec --version`."""
    import subprocess
    record = installed_mpi()
    if record and record.get("impl") in ("mpich", "openmpi"):
        return record["impl"]
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True)
    text = version.stdout + version.stderr
    return "openmpi" if "Open MPI" in text or "OpenRTE" in text else "mpich"


def cores():
    """The number of cores this process may run on."""
    return len(affinity())


def affinity():
    """The cores this process may run on, sorted (all of them where the system does not
    say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(os.cpu_count()))


def node_cores(comm):
    """The cores that the ranks of this rank's host may run on, together. Collective over
    `comm`."""
    import socket
    host = socket.gethostname()
    return sorted(set().union(*(mine for h, mine in comm.allgather((host, affinity()))
                                if h == host)))


# the variables by which a user sets the threads of a rank (launch.sh sets them too)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "NUMBA_NUM_THREADS")
POOLS = {}      # the ones size_thread_pools set, which are not the user's choice


def thread_share(comm):
    """The threads each rank runs: the cores it may run on (its affinity) divided by the
    ranks of its host that may run on them too, so ranks a launcher pinned to cores of
    their own keep all of theirs; None where the user chose through the environment. MPI
    says who shares the host, however the job was launched (a launcher's own variables,
    such as Slurm's tasks per node, may be unset). Collective over `comm` (an mpi4py
    communicator, or mpitrain's)."""
    import socket
    mine = affinity()
    host = socket.gethostname()
    everyone = comm.allgather((host, mine))
    if any(v in os.environ and os.environ[v] != POOLS.get(v) for v in THREAD_VARIABLES):
        return None
    sharing = sum(1 for h, cores in everyone if h == host and set(cores) & set(mine))
    return max(1, len(mine) // sharing)


def set_threads(threads):
    """From now on the kernels' OpenMP team (threadpoolctl's OpenMP and Numba's own
    setting, at most the NUMBA_NUM_THREADS its pool started with) runs on `threads`
    threads, and so do the GEMMs: cut among the team with BLAS on one thread, or on
    BLAS's own threads where the team cannot run them (kernels.gemm.blas_threads). Loads
    Numba: after size_thread_pools."""
    import numba
    from threadpoolctl import threadpool_limits

    from mpitrain.kernels.gemm import blas_threads
    threadpool_limits(threads, user_api="openmp")
    threadpool_limits(blas_threads(threads), user_api="blas")
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def size_thread_pools(comm):
    """Numba's and the OpenMP runtime's thread pools at this rank's share of its host's
    cores (thread_share), through NUMBA_NUM_THREADS and OMP_NUM_THREADS, before either
    loads: they size their pools once, at all the host's cores, and a pool larger than
    the threads its rank runs keeps the rest waking at every parallel kernel and spinning
    on the cores the host's other ranks need. Nothing where the user chose the threads,
    or Numba is loaded already. Collective."""
    share = thread_share(comm)
    if share is not None and "numba" not in sys.modules:
        POOLS.update(NUMBA_NUM_THREADS=str(share), OMP_NUM_THREADS=str(share))
        os.environ.update(POOLS)


# MPICH's ranks sleep while they wait for a message with this set to 1 (else they spin)
HEAVY_YIELD = "MPIR_CVAR_ENABLE_HEAVY_YIELD"


def launch_options(ranks, family):
    """mpiexec's options for `ranks` ranks on this host. Open MPI: no help messages after
    a rank's exit (a refused job's last line is its own reason), no binding (each rank's
    threads share the cores, as under MPICH) and more ranks than cores allowed. Ranks that
    outnumber the cores yield the core while they wait, rather than spin: Open MPI's
    --oversubscribe says so, MPICH's need ENABLE_HEAVY_YIELD (yields that sleep)."""
    crowded = ranks > cores()
    if family != "openmpi":
        return ["-genv", HEAVY_YIELD, "1"] if crowded else []
    return ["--quiet", "--bind-to", "none"] + (["--oversubscribe"] if crowded else [])


def job_environment(family, threads=None):
    """The environment for a job started from here: this one without launch variables
    (a job started from inside another would join it, or be refused), Open MPI's consent
    to run as root, and, when given, the threads each rank may use: its OpenMP and Numba
    team, which also runs its GEMMs with OpenBLAS on one thread per call
    (kernels/gemm.py)."""
    env = outside_environment()
    if family == "openmpi" and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads),
                   OPENBLAS_NUM_THREADS="1")
    return env
