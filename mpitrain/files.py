"""Files written whole: what every writer of the project's outputs (run reports, exports,
images, cuDNN's plan cache) goes through. Standard library only, so that any module,
the kernels' too, may use it."""
import json
import os
import secrets


def write_atomic(out, write):
    """Run write(tmp) for a temporary path beside `out`, fsync it, rename it over `out` and
    fsync the directory (the rename itself survives a crash); on any failure remove the
    temporary file and leave `out` as it was (a full disk leaves the old file or none,
    never a truncated one). `out`'s directory is made where missing. An error of the
    system on the temporary file, or on no file, is raised naming `out`. The temporary
    name is the process's and random: writers on other hosts (the same pid) or threads
    of one process never share it."""
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(out)}.tmp-{os.getpid()}-"
                                  f"{secrets.token_hex(4)}")
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, out)
        fsync(directory)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.errno is not None and e.filename in (tmp, None):
            e.filename = out        # the file the user named, not the one just removed
        raise


def fsync(path):
    """Flush the file or directory `path` to its storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_text(out, text):
    """Write the string `text` to `out` whole (write_atomic)."""
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    write_atomic(out, write)


def save_json(out, data, sort_keys=True, indent=2):
    """Write `data` to `out` as JSON, whole (write_atomic); sort_keys=False keeps each
    dict's order, indent=None writes it on one line. OSError when it cannot be written."""
    save_text(out, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")


def output_problem(out):
    """None when the file `out` can be written, its directory made where missing (as
    mkdir -p: the nearest directory that exists is one this process may write in); else
    what stops it, with the fix, for a refusal before any work."""
    if os.path.isdir(out):
        return f"{out} is a directory; name the file to write"
    nearest = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(nearest):
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        return f"{nearest} is a file, so {out} cannot be written; choose another path"
    if not os.access(nearest, os.W_OK | os.X_OK):
        return f"{nearest} is not writable, so {out} cannot be written; choose another path"
    return None
