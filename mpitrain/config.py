"""The run's configuration and environment: YAML files, the run directory, the report.

Precedence of a training option: a flag given on the command line, else the
value in `--config FILE.yaml`, else the default (mpitrain.options).
YAML keys are the option names with dashes or underscores (`batch-size: 64` or
`batch_size: 64`); values are checked by the same rules as the flags.
"""
import os
import platform
import subprocess
import time

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # holds the package
RUNS = "runs"        # where runs go without --run-dir: runs/<timestamp>


class ConfigFileError(ValueError):
    """A YAML configuration that cannot be used; the message names the file and key."""


def load_yaml(path, known):
    """{option: raw value} from a YAML mapping; keys normalised to underscores and
    checked against `known` (the option names)."""
    import yaml
    try:
        with open(path) as f:
            text = f.read()
        data = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigFileError(f"config file {path} is not text (a data file or a checkpoint?): "
                              f"give a YAML file of option: value lines") from None
    except yaml.YAMLError as e:     # one line: the problem, and where YAML met it
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        raise ConfigFileError(f"config file {path} is not valid YAML: {problem}{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {path} must hold a mapping of option: value, "
                              f"not a {type(data).__name__}")
    check_unique_keys(path, node)
    options = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigFileError(f"config file {path}: unknown option {key!r}")
        options[name] = value
    return options


def check_unique_keys(path, mapping):
    """Refuse an option the YAML mapping node `mapping` gives twice, as the same key or
    spelled once with dashes and once with underscores: YAML keeps the last one without
    a word, and the other would be ignored."""
    seen = {}
    for key, _ in mapping.value:
        name = str(key.value).replace("-", "_")
        line = key.start_mark.line + 1
        if name in seen:
            first, at = seen[name]
            raise ConfigFileError(f"config file {path}: {key.value!r} (line {line}) gives "
                                  f"{first!r} (line {at}) again, and one of them would be "
                                  f"ignored: keep one")
        seen[name] = (key.value, line)


def default_run_dir():
    """Make and return runs/<timestamp> (-2, -3, ... if taken). os.mkdir claims a name or
    fails, so two jobs started in the same second (a Slurm array) get two directories.
    Rank 0 calls it; OSError when runs/ cannot be written."""
    os.makedirs(RUNS, exist_ok=True)
    name = stem = os.path.join(RUNS, time.strftime("%Y%m%d-%H%M%S"))
    n = 1
    while True:
        try:
            os.mkdir(name)
            return name
        except FileExistsError:
            n += 1
            name = f"{stem}-{n}"


class RunDirInUse(RuntimeError):
    """Another live job holds the run directory's lock; the message names it."""


class RunLock:
    """RUN_DIR/.lock, held (flock) by rank 0 of the job writing into RUN_DIR, for the
    whole job: a second job into the same directory is refused while the first lives.
    The file names its holder (host, pid, start time) for the refusal's message; the
    kernel drops the lock when the holder dies, however it dies, so a file left by a
    killed job holds nothing. `release()` removes the file while still holding it, as
    leaving a `with` block does. flag: the option that named the directory, for the
    refusal. made: this job made the directory, so a release that leaves it empty (a
    run refused before it wrote anything) removes it too."""

    NAME = ".lock"

    def __init__(self, run_dir, flag="--run-dir", made=False):
        import fcntl
        import socket
        self.path, self.made = os.path.join(run_dir, self.NAME), made
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 1000).decode(errors="replace").strip()
                os.close(fd)
                raise RunDirInUse(f"{flag} {run_dir} is in use by a running job "
                                  f"({holder or 'holder unknown'}): wait for it to end, or "
                                  f"give another {flag}") from None
            # a holder that released it removed the file: this lock would hold a name
            # no longer in the directory, so take the new file's instead
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}, started {started}\n"
                 .encode())

    def release(self):
        if self.fd is not None:
            os.unlink(self.path)
            os.close(self.fd)
            self.fd = None
            if self.made:
                try:
                    os.rmdir(os.path.dirname(self.path))
                except OSError:             # not empty: the run wrote into it
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def link_latest(run_dir):
    """runs/latest -> the newest run under runs/ (the default runs' directory), replaced
    atomically; a run directory elsewhere leaves it alone."""
    real = os.path.realpath(run_dir)            # runs/latest itself: the run it names
    parent = os.path.dirname(real)
    if parent != os.path.realpath(RUNS):
        return
    link = os.path.join(parent, "latest")
    spare = f"{link}.{os.getpid()}"
    try:
        os.symlink(os.path.basename(real), spare)
        os.replace(spare, link)
    except OSError:                     # a file system without links: nothing to point
        if os.path.lexists(spare):
            os.unlink(spare)


def environment(comm, device):
    """What the run ran on: world and host sizes, device, library versions (collective
    over the Communicator `comm`)."""
    import h5py
    import mpi4py
    import numba
    import numpy
    from mpi4py import MPI
    names = comm.allgather(platform.node())         # each rank's host
    hosts = sorted(set(names))
    env = dict(source=comm.bcast(source_version() if comm.rank == 0 else None),
               world_size=comm.size, nodes=len(hosts),
               hosts=hosts[:16] + ([f"... {len(hosts) - 16} more"] if len(hosts) > 16 else []),
               ranks_per_host=[names.count(h) for h in hosts[:16]],
               device=device, mpi_library=mpi_library(),
               mpi_standard=".".join(map(str, MPI.Get_version())), mpi4py=mpi4py.__version__,
               python=platform.python_version(), numpy=numpy.__version__,
               numba=numba.__version__, h5py=h5py.__version__, hdf5=h5py.version.hdf5_version)
    if device.startswith("cuda"):       # nothing GPU-related is imported on a CPU run
        env.update(gpu_environment())
    else:
        from mpitrain.kernels import gemm
        env["gemm"] = gemm.describe(numba.get_num_threads())
        # fixed when Numba loaded: a pool larger than a rank's share of the host's cores
        # slows every rank (launcher.size_thread_pools)
        env["numba_pool"] = numba.config.NUMBA_NUM_THREADS
    return env


def source_version(root=CHECKOUT):
    """The code that ran: `git describe --always --dirty` of the checkout `root` (a commit,
    "-dirty" when files differ from it), or where it is no git checkout (or git is
    missing) the installed package's version."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return checkout_version(root) or f"mpitrain {version('mpitrain')}"
    except PackageNotFoundError:
        return None


def checkout_version(root=CHECKOUT):
    """`git describe --always --dirty` of the checkout `root`; None where it is no git
    checkout, or git is missing."""
    try:
        out = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty",
                              "--abbrev=12"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and os.path.exists(os.path.join(root, ".git")):
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return None


# The packages --version names where they are installed: those a step's numbers and a
# job's launch depend on
VERSIONED = ("numpy", "numba", "h5py", "mpi4py", "mpich", "mkl", "cupy-cuda12x", "cupy-cuda13x")


def versions():
    """`python -m mpitrain --version`: mpitrain's version and checkout, then Python's and
    the installed packages' of VERSIONED (read from their metadata, none imported)."""
    from importlib.metadata import PackageNotFoundError, version

    from mpitrain import __version__

    def installed(name):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return None
    checkout = checkout_version()
    libraries = ", ".join(filter(None, map(installed, VERSIONED)))
    return (f"mpitrain {__version__}" + (f" (checkout {checkout})" if checkout else "")
            + f"\nPython {platform.python_version()} on {platform.system()} "
              f"{platform.machine()}; {libraries}")


def gpu_environment():
    """CuPy, the CUDA runtime and driver, the GPU, NCCL and cuDNN: each a version, or None
    where it is missing, with `cudnn_reason` saying why cuDNN is not used."""
    env = dict.fromkeys(("cupy", "cuda_runtime", "cuda_driver", "gpu", "nccl", "cudnn",
                         "cudnn_frontend"))
    try:
        import cupy
        env["cupy"] = cupy.__version__
        runtime = cupy.cuda.runtime
        env["cuda_runtime"] = _cuda_version(runtime.runtimeGetVersion())
        env["cuda_driver"] = _cuda_version(runtime.driverGetVersion())
        env["gpu"] = runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    except Exception as e:              # not installed, or no usable GPU
        env["cupy_error"] = f"{type(e).__name__}: {e}"
    try:
        from mpitrain.comm import nccl
        env["nccl"] = nccl.version()
    except Exception as e:
        env["nccl"] = f"unavailable ({type(e).__name__}: {e})"
    env.update(_cudnn_versions())
    return env


def _cudnn_versions():
    """cuDNN's backend and frontend versions and the reasons cuDNN is not used (fp32, fp16),
    from the kernels' probe (mpitrain.kernels.cudnn.report())."""
    try:
        from mpitrain.kernels import cudnn as probe
        r = probe.report()
        return {"cudnn_reason": r["reason"], "cudnn": r["cudnn"],
                "cudnn_frontend": r["cudnn_frontend"], "cudnn_fp16_reason": r["float16_reason"]}
    except Exception as e:              # the probe itself failed: say so
        return {"cudnn_reason": f"the cuDNN probe failed ({type(e).__name__}: {e})"}


def _cuda_version(code):
    """CUDA's integer version (1000 * major + 10 * minor) as "major.minor"."""
    return f"{code // 1000}.{code % 1000 // 10}"


def mpi_library():
    """The first line of the MPI library's version string (Open MPI's ends in a NUL byte)."""
    from mpi4py import MPI
    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]


def describe(title, data, width=100):
    """`title: key=value key=value ...` wrapped to `width` columns, for rank 0 to print. A
    list is its items joined by commas, as on a command line; a value with spaces is
    quoted, its runs of spaces made one, and never split across lines: a line breaks
    between items only (an item longer than a line overruns it)."""
    text = {k: ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
            for k, v in data.items()}
    items = [f"{k}={' '.join(v.split())!r}" if len(v.split()) > 1 else f"{k}={v}"
             for k, v in sorted(text.items())]
    lines = [f"{title}:"]
    for item in items:
        if len(lines[-1]) + 1 + len(item) > width and lines[-1] != f"{title}:":
            lines.append(" ")
        lines[-1] += " " + item
    return "\n".join(lines)
