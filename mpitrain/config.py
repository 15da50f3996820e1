"""The run's configuration and environment: YAML files, the run directory, the report.

Precedence of a training option: a flag given on the command line, else the
value in `--config FILE.yaml`, else the default (mpitrain.train.DEFAULTS).
YAML keys are the option names with dashes or underscores (`batch-size: 64` or
`batch_size: 64`); values are checked by the same rules as the flags.
"""
import json
import os
import platform
import time


class ConfigFileError(ValueError):
    """A YAML configuration that cannot be used; the message names the file and key."""


def load_yaml(path, known):
    """{option: raw value} from a YAML mapping; keys normalised to underscores and
    checked against `known` (the option names)."""
    import yaml
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {path} must hold a mapping of option: value, "
                              f"not a {type(data).__name__}")
    options = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigFileError(f"config file {path}: unknown option {key!r}")
        options[name] = value
    return options


def default_run_dir(comm):
    """runs/<timestamp> (-2, -3, ... if taken) chosen by rank 0 and broadcast over the
    Communicator `comm`, so every rank agrees."""
    name = None
    if comm.rank == 0:
        name = stem = time.strftime("runs/%Y%m%d-%H%M%S")
        n = 1
        while os.path.exists(name):
            n += 1
            name = f"{stem}-{n}"
    return comm.bcast(name, root=0)


def environment(comm, device):
    """What the run ran on: world and host sizes, device, library versions (collective
    over the Communicator `comm`)."""
    import h5py
    import mpi4py
    import numba
    import numpy
    from mpi4py import MPI
    hosts = sorted(set(comm.allgather(platform.node())))
    env = dict(world_size=comm.size, nodes=len(hosts), ranks_per_node=comm.host_size,
               hosts=hosts[:16] + ([f"... {len(hosts) - 16} more"] if len(hosts) > 16 else []),
               device=device, mpi_library=MPI.Get_library_version().strip().splitlines()[0],
               mpi_standard=".".join(map(str, MPI.Get_version())), mpi4py=mpi4py.__version__,
               python=platform.python_version(), numpy=numpy.__version__,
               numba=numba.__version__, h5py=h5py.__version__, hdf5=h5py.version.hdf5_version)
    if device.startswith("cuda"):
        import cupy
        env["cupy"] = cupy.__version__
        env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        try:
            env["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        except Exception:
            pass
        try:
            from cupy.cuda import nccl
            env["nccl"] = nccl.get_version()
        except Exception:
            env["nccl"] = None
        try:
            import cudnn
            env["cudnn"] = cudnn.backend_version()
        except Exception:
            env["cudnn"] = None
    return env


def save_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def describe(title, data, width=100):
    """`title: key=value key=value ...` wrapped to `width` columns, for rank 0 to print."""
    import textwrap
    items = " ".join(f"{k}={' '.join(str(v).split())!r}" if len(str(v).split()) > 1 else f"{k}={v}"
                     for k, v in sorted(data.items()))
    return textwrap.fill(items, width, initial_indent=f"{title}: ", subsequent_indent="  ",
                         break_long_words=False, break_on_hyphens=False)
