"""Atomic, resumable checkpoints: one HDF5 file per checkpoint, written by rank 0.

File layout (no pickle anywhere; format_version 1):

    /master            (P,)  master weights (fp32; fp64 under --precision fp64): the
                             parameters one after another, as the arena holds them but
                             without its alignment padding
    /momentum          (P,)  the arena's momentum buffer, likewise (under --shard-update
                             gathered from every rank's shard: the same file either way)
    /buffers           (R, B) BatchNorm running statistics of each of the R ranks that
                             wrote it (the rows are equal after an evaluation, which
                             averages them; mid-epoch they differ, and keeping every
                             rank's row is what makes a mid-epoch resume exact)
    /residual          (R, P) top-k runs only: each rank's residual (mpitrain.comm.topk),
                             packed like /master; restored to each rank when as many
                             ranks resume, else started from zero
    /params/name, /params/offset, /params/shape   the arena's table, checked on load
    /buffer_names, /buffer_shapes
    /optimizer/<key>   arrays of optimizer.state_dict() (arena-sized ones packed like
                       /master; scalars are attributes of the group)
    attributes of /:   format_version, epoch, step (the loader position of the next batch),
                       global_step, world_size, config (JSON), scaler (JSON), rng (JSON:
                       a list per rank of the bit-generator states of Dropout layers),
                       progress (JSON: the loss, and the training top-1 hits and
                       images, summed since the last log line),
                       complete = True (written last)

Every numeric array is stored in chunks with HDF5's Fletcher-32 checksum, which HDF5
checks on every read: a file changed after its write (a flipped bit on a disk or in a
copy) is refused as corrupt, never loaded as other weights. Files without the
checksums read as before.

Writing: the file is built in memory, and its bytes are written to a temporary file
`.NAME.tmp` in the same directory, flushed and fsync'ed, then renamed over NAME with
os.replace (atomic on POSIX), and the directory is fsync'ed. A crash at any point leaves
the previous checkpoints as they were; a stray `.tmp` is ignored by `latest()` and removed
by the next `prune()`.
"""
import errno
import glob
import json
import os
import re

import numpy as np

from .files import fsync


FORMAT_VERSION = 1
INCOMPLETE = "incomplete (its write was cut short)"
ANOTHER = "give a checkpoint-*.h5 that train wrote, or its run directory (its newest complete one)"
PATTERN = "checkpoint-{global_step:09d}.h5"
_NAME = re.compile(r"^checkpoint-(\d+)\.h5$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: unreadable, incomplete, or for another model."""


class CheckpointHeld(CheckpointError):
    """A checkpoint that cannot be read now (locked by another process, or not readable by
    this user), although it may be whole: never passed over for an older one, which a
    resumed run would then train on and write over it."""


def dropout_layers(model):
    from mpitrain.nets.activation import Dropout
    return [m for _, m in model.named_modules() if isinstance(m, Dropout)]


def rng_states(model):
    """JSON-able bit-generator states of the model's own generators (Dropout masks)."""
    return [layer.rng.bit_generator.state for layer in dropout_layers(model)]


def set_rng_states(model, states):
    layers = dropout_layers(model)
    if len(states) != len(layers):
        raise CheckpointError(f"the checkpoint has {len(states)} dropout generator states, "
                              f"the model {len(layers)} dropout layers")
    for layer, state in zip(layers, states):
        layer.rng.bit_generator.state = state


def reseed_dropout(model, seed, rank, global_step):
    """Dropout layer i's generator seeded from (seed, rank, i, global_step): a run resumed
    on another number of ranks, whose saved generators are one per old rank, still draws
    different masks on every rank (as build_model seeds them from the rank)."""
    for i, layer in enumerate(dropout_layers(model)):
        layer.seed((seed, rank, i, global_step))


def collect(model, comm, epoch, step, global_step, config, optimizer=None, scaler=None,
            progress=None, residual=None):
    """Everything a checkpoint holds, as host arrays and JSON-able values, on rank 0
    (None on the other ranks). Collective over the Communicator `comm`. progress: the
    trainer's JSON-able bookkeeping between two log lines (the loss summed since the
    last one), so that a resumed run logs what the uninterrupted one would. residual:
    this rank's top-k residual (arena layout; given on every rank or on none)."""
    rows = comm.gather(model.buffer_arena.pack(model.buffer_arena.data), root=0)
    residuals = None if residual is None else comm.gather(model.arena.pack(residual), root=0)
    rngs = comm.gather(rng_states(model), root=0)
    # a sharded optimizer (mpitrain.shard) gathers its state here, the momentum included
    opt_state = dict(optimizer.state_dict()) if hasattr(optimizer, "state_dict") else {}
    if comm.rank != 0:
        return None
    a = model.arena
    momentum = opt_state.pop("momentum", a.momentum)
    state = dict(master=a.pack(a.master), momentum=a.pack(momentum), buffers=np.stack(rows),
                 names=[p.name for p in a.params],
                 offsets=np.cumsum([0] + [p.size for p in a.params[:-1]]).tolist(),
                 shapes=[list(p.shape) for p in a.params],
                 buffer_names=[b.name for b in model.buffer_arena.buffers],
                 buffer_shapes=[list(b.shape) for b in model.buffer_arena.buffers],
                 epoch=int(epoch), step=int(step), global_step=int(global_step),
                 world_size=comm.size, config=config, rng=rngs, optimizer={}, scaler=None,
                 progress=progress or {},
                 residual=None if residuals is None else np.stack(residuals))
    state["optimizer"] = {k: a.pack(v) if hasattr(v, "shape") else v
                          for k, v in opt_state.items()}
    if scaler is not None and hasattr(scaler, "state_dict"):
        state["scaler"] = scaler.state_dict()
    return state


# bytes beside the arrays: the parameter table, the JSON attributes, HDF5's own structures
HEADROOM = 256 << 10
# at most this many elements in an array's chunk (a row's, in a table of one row per
# rank), each chunk with its checksum and an index entry of about CHUNK_ENTRY bytes; a
# row is cut into equal chunks, as its last is stored whole
CHUNK = 1 << 16
CHUNK_ENTRY = 64


def expected_size(model, ranks, arena_arrays):
    """Bytes a checkpoint of `model` written by `ranks` ranks takes at most, before one
    exists: `arena_arrays` packed arrays of the parameters' size in the master's dtype
    (master, momentum, the optimizer's own, one top-k residual per rank), each rank's
    BatchNorm statistics, the chunks' index entries and padding, and HEADROOM."""
    item = model.arena.dtype.itemsize          # 4, or 8 under --precision fp64
    params = sum(p.size for p in model.arena.params)
    buffers = sum(b.size for b in model.buffer_arena.buffers)
    data = item * (arena_arrays * params + ranks * buffers)
    chunks = data // (item * CHUNK) + arena_arrays + ranks      # at most, a row's cut up
    return data + chunks * (CHUNK_ENTRY + 4) + HEADROOM      # + a last chunk's padding


def write(path, state, before_rename=None, image=None):
    """Write `state` (from collect) to `path` atomically; returns path. image: the file's
    bytes, file_image(state), where the caller has made them already.

    The HDF5 file is built in memory and its bytes written with plain writes: a file
    system that fills up then fails a write (an OSError, the temporary file removed),
    never HDF5's own flush at close, whose failure leaves h5py's objects broken (noise
    on stderr, a crash at exit). before_rename(tmp_path) is called after the temporary
    file is complete and synced, just before the rename (tests use it to fail at that
    point).
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp")
    image = file_image(state) if image is None else image
    try:
        with open(tmp, "wb") as f:
            f.write(image)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync(directory)                # the rename itself survives a crash
    return path


def file_image(state):
    """The bytes of the checkpoint file of `state`, in the layout above."""
    import h5py
    with h5py.File("checkpoint", "w", driver="core", backing_store=False) as f:
        put(f, "master", state["master"])
        put(f, "momentum", state["momentum"])
        put(f, "buffers", state["buffers"])
        if state.get("residual") is not None:
            put(f, "residual", state["residual"])
        text = h5py.string_dtype()
        f["params/name"] = np.array(state["names"], dtype=object).astype(text)
        put(f, "params/offset", np.asarray(state["offsets"], np.int64))
        f["params/shape"] = json.dumps(state["shapes"])
        f["buffer_names"] = np.array(state["buffer_names"], dtype=object).astype(text) \
            if state["buffer_names"] else np.zeros(0, text)
        f["buffer_shapes"] = json.dumps(state["buffer_shapes"])
        group = f.create_group("optimizer")
        for key, value in state["optimizer"].items():
            if isinstance(value, np.ndarray):
                put(group, key, value)
            else:
                group.attrs[key] = value
        for key in ("epoch", "step", "global_step", "world_size"):
            f.attrs[key] = state[key]
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["config"] = json.dumps(state["config"], sort_keys=True)
        f.attrs["scaler"] = json.dumps(state["scaler"])
        f.attrs["rng"] = json.dumps(state["rng"])
        f.attrs["progress"] = json.dumps(state["progress"])
        f.attrs["complete"] = True
        f.flush()
        return f.id.get_file_image()


def put(group, name, array):
    """group[name] = array, a vector or a table of one row per rank, in chunks of CHUNK
    elements of a row with a Fletcher-32 checksum each, where it has elements (HDF5
    cannot chunk an empty array)."""
    array = np.asarray(array)
    if array.size and array.ndim in (1, 2):
        row = array.shape[-1]
        piece = -(-row // -(-row // CHUNK))         # the row in equal chunks of <= CHUNK
        group.create_dataset(name, data=array, chunks=(1,) * (array.ndim - 1) + (piece,),
                             fletcher32=True)
    else:
        group[name] = array


def read(path):
    """The state stored in `path` (as from collect), or CheckpointError saying why not."""
    import h5py
    try:
        with h5py.File(path, "r") as f:
            state = _parts(f, path)
            for key in ARRAYS:
                if state[key] is not None:
                    state[key] = state[key][...]
            state["optimizer"] = {k: v[...] if isinstance(v, h5py.Dataset) else v
                                  for k, v in state["optimizer"].items()}
            return state
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise unreadable(path, e) from e


# the parts of a checkpoint that are arrays, read last (_parts)
ARRAYS = ("master", "momentum", "buffers", "residual")


def _parts(f, path):
    """The state in the open checkpoint file `f` (of `path`), its ARRAYS and the
    optimizer's as h5py datasets, not yet read, after checking every part against what
    train writes (CheckpointError where incomplete or of another format version;
    ValueError, TypeError or KeyError where a part is not train's)."""
    if not _is_true(f.attrs.get("complete", False)):
        raise CheckpointError(f"{path} is {INCOMPLETE}; {ANOTHER}")
    version = _whole(f.attrs, "format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {version}; this mpitrain reads "
                              f"version {FORMAT_VERSION}")
    opt = f["optimizer"]
    state = dict(
        master=f["master"], momentum=f["momentum"], buffers=f["buffers"],
        residual=f["residual"] if "residual" in f else None,
        names=[n.decode() if isinstance(n, bytes) else n for n in f["params/name"][...]],
        offsets=f["params/offset"][...].tolist(),
        shapes=_json("params/shape", f["params/shape"][()]),
        buffer_names=[n.decode() if isinstance(n, bytes) else n for n in f["buffer_names"][...]],
        buffer_shapes=_json("buffer_shapes", f["buffer_shapes"][()]),
        optimizer={**{k: opt[k] for k in opt}, **dict(opt.attrs)},
        **{key: _whole(f.attrs, key) for key in ("epoch", "step", "global_step", "world_size")},
        **{key: _json(key, f.attrs[key]) for key in ("config", "scaler", "rng")},
        progress=_json("progress", f.attrs.get("progress", "{}")), path=path)
    check_parts(state)
    return state


def _is_true(value):
    """Whether an attribute is the boolean True that train writes (a string is not)."""
    return isinstance(value, (bool, np.bool_)) and bool(value)


def _whole(attrs, key):
    """attrs[key] as the whole number >= 0 that train writes there, else ValueError."""
    value = attrs[key]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < 0:
        shown = value.item() if isinstance(value, np.generic) else value
        raise ValueError(f"its attribute {key} is {shown!r}, not a whole number >= 0")
    return int(value)


def _json(key, text):
    """The JSON value `text` of a checkpoint's part `key`, else ValueError naming it."""
    try:
        return json.loads(text)
    except (ValueError, TypeError) as e:
        raise ValueError(f"its {key} is not the JSON train writes ({e})") from None


def check_parts(state):
    """ValueError where the arrays of `state` (from _parts: arrays or h5py datasets) do not
    have the shapes and dtypes that its parameter and buffer tables give (a file changed
    since, or not written by train)."""
    params = sum(int(np.prod(s)) for s in state["shapes"])
    buffers = sum(int(np.prod(s)) for s in state["buffer_shapes"])
    tables = {len(state["names"]), len(state["shapes"]), len(state["offsets"])}
    if len(tables) > 1 or len(state["buffer_names"]) != len(state["buffer_shapes"]):
        raise ValueError("its parameter or buffer table has parts of different lengths")
    master = state["master"]
    for name, array, rows in (("master", master, None), ("momentum", state["momentum"], None),
                              ("buffers", state["buffers"], True),
                              ("residual", state["residual"], True)):
        if array is None:
            continue
        size = buffers if name == "buffers" else params
        shape_ok = array.ndim == 2 and array.shape[1] == size if rows else \
            array.shape == (size,)
        dtype_ok = array.dtype in (np.float32, np.float64) and \
            (name == "buffers" or array.dtype == master.dtype)
        if not (shape_ok and dtype_ok):
            dtype = "float32 or float64" if name in ("master", "buffers") else master.dtype
            raise ValueError(f"its /{name} holds {array.dtype} of shape {array.shape}, where "
                             f"its tables give {'rows of ' if rows else ''}{size} values of "
                             f"{dtype}")


def read_config(path):
    """The resolved training configuration stored in a checkpoint."""
    return _attribute(path, lambda f: _json("config", f.attrs["config"]))


def read_global_step(path):
    """The global step a checkpoint was written at."""
    return _attribute(path, lambda f: _whole(f.attrs, "global_step"))


def read_position(path):
    """(epoch, step): the loader position a checkpoint resumes at, its whole epochs
    done and the steps of the next."""
    return _attribute(path, lambda f: (_whole(f.attrs, "epoch"), _whole(f.attrs, "step")))


def _attribute(path, get):
    """get(f) of the open file `path`, or its CheckpointError."""
    import h5py
    try:
        with h5py.File(path, "r") as f:
            return get(f)
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise unreadable(path, e) from e


def unreadable(path, e):
    """The CheckpointError of `path` that h5py could not open (OSError), that lacks a part
    (KeyError) or holds one that is not what train writes (ValueError, TypeError), saying
    what the file is where that is the reason; CheckpointHeld where it cannot be read now."""
    import h5py
    if isinstance(e, OSError) and e.errno in (errno.EAGAIN, errno.EACCES, errno.EPERM):
        held = ("another process holds it open for writing (HDF5 locks the file): close "
                "it there" if e.errno == errno.EAGAIN else
                "this user may not read it: let it read the file")
        return CheckpointHeld(f"cannot read checkpoint {path}: {held}, then run again")
    if not os.path.exists(path):
        why = "no such file"
    elif isinstance(e, (ValueError, TypeError)):
        why = (f"corrupt: {e} (the file changed after it was written, or train did not "
               f"write it; move it aside, and its run directory gives the checkpoint "
               f"before it)")
    elif isinstance(e, KeyError):
        with h5py.File(path, "r") as f:
            begun = "master" in f and not f.attrs.get("complete", False)
        why = INCOMPLETE if begun else "an HDF5 file without a checkpoint's parts (a data file?)"
    elif os.path.isfile(path) and not h5py.is_hdf5(path):
        why = "not an HDF5 file (an exported model?)"
    elif "truncated file" in str(e):        # HDF5's words for a file cut short
        why = f"{INCOMPLETE}: {e}"
    elif "filter returned failure" in str(e) or "checksum" in str(e):
        # the Fletcher-32 check of a read, the one filter of a checkpoint's arrays
        why = (f"corrupt: its data no longer match their checksums (the file changed "
               f"after it was written; move it aside, and its run directory gives the "
               f"checkpoint before it): {e}")
    else:
        why = str(e)
    return CheckpointError(f"cannot read checkpoint {path}: {why}; {ANOTHER}")


def check_matches(state, model):
    """Refuse a checkpoint whose parameter table differs from the model's, naming the
    first difference (a different number of classes shows up as fc.weight's shape)."""
    a = model.arena
    mine = [(p.name, list(p.shape)) for p in a.params]
    theirs = list(zip(state["names"], state["shapes"]))
    if mine == theirs and state["master"].size == sum(p.size for p in a.params):
        return
    for (n1, s1), (n2, s2) in zip(mine, theirs):
        if (n1, s1) != (n2, s2):
            raise CheckpointError(f"checkpoint {state.get('path', '')} does not fit the model: "
                                  f"parameter {n2} has shape {tuple(s2)} in the checkpoint, "
                                  f"the model has {n1} {tuple(s1)} (a different model or "
                                  f"number of classes?)")
    raise CheckpointError(f"checkpoint {state.get('path', '')} has {len(theirs)} parameters, "
                          f"the model {len(mine)}: a different model")


def nonfinite_tensors(state):
    """The names of the tensors of `state` (from read) that hold an inf or a NaN: master
    weights, and BatchNorm statistics of any rank that wrote it."""
    found = []
    for packed, names, shapes in ((state["master"][None], state["names"], state["shapes"]),
                                  (state["buffers"], state["buffer_names"],
                                   state["buffer_shapes"])):
        start = 0
        for name, shape in zip(names, shapes):
            size = int(np.prod(shape))
            if not np.isfinite(packed[:, start:start + size]).all():
                found.append(name)
            start += size
    return found


def check_finite(state):
    """Refuse a checkpoint whose weights or BatchNorm statistics are not all finite: its
    model's every output would be NaN, which scores as no result at all."""
    bad = nonfinite_tensors(state)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointError(f"checkpoint {state.get('path', '')} holds non-finite values "
                              f"(inf or NaN) in {len(bad)} tensor(s): {shown}; its training had "
                              f"diverged: use an earlier checkpoint of the run")


def restore(path, model, comm, optimizer=None, scaler=None):
    """Load `path` on rank 0 and broadcast it into every rank's model (master, working copy,
    momentum, BatchNorm buffers, dropout generators), optimizer and scaler.

    Returns the checkpoint's metadata (epoch, step, global_step, world_size, config).
    A checkpoint that does not fit the model or holds non-finite weights is refused
    (CheckpointError on every rank). Collective over the Communicator `comm`. With as
    many ranks as wrote it, every rank gets its own BatchNorm statistics and generator
    state back; with a different number, every rank gets the mean of the saved
    statistics and rank 0's generator states.
    """
    state, error = None, None
    if comm.rank == 0:
        try:
            state = read(path)
            check_matches(state, model)
            check_finite(state)
        except CheckpointError as e:
            error = str(e)
    error = comm.bcast(error, root=0)
    if error:
        raise CheckpointError(error)
    meta = None
    if comm.rank == 0:
        meta = {k: state[k] for k in ("epoch", "step", "global_step", "world_size", "config",
                                      "scaler", "rng", "progress", "path")}
        meta["optimizer"] = {k: v for k, v in state["optimizer"].items()
                             if not isinstance(v, np.ndarray)}
        meta["optimizer_arrays"] = sorted(k for k, v in state["optimizer"].items()
                                          if isinstance(v, np.ndarray))
    meta = comm.bcast(meta, root=0)
    a = model.arena
    _restore_arena(comm, a, a.master, state["master"] if state else None)
    a.sync_working()
    # a sharded optimizer has no arena.momentum: it keeps its shard of this one
    momentum = a.zeros() if a.momentum is None else a.momentum
    _restore_arena(comm, a, momentum, state["momentum"] if state else None)
    buffers = model.buffer_arena
    rows = None
    if comm.rank == 0:
        rows = list(state["buffers"]) if meta["world_size"] == comm.size \
            else [state["buffers"].mean(axis=0)] * comm.size
    buffers.unpack(comm.scatter(rows, root=0), buffers.data)
    rngs = meta["rng"]
    if len(rngs) == comm.size:
        set_rng_states(model, rngs[comm.rank])
    else:       # another number of ranks: each rank's masks go on from a seed of its own
        reseed_dropout(model, meta["config"].get("seed", 0), comm.rank, meta["global_step"])
    if optimizer is not None and hasattr(optimizer, "load_state_dict"):
        opt = dict(meta["optimizer"], momentum=momentum)
        for key in meta["optimizer_arrays"]:
            opt[key] = a.zeros()
            _restore_arena(comm, a, opt[key], state["optimizer"][key] if state else None)
        optimizer.load_state_dict(opt)
    if scaler is not None and hasattr(scaler, "load_state_dict") and meta["scaler"] is not None:
        scaler.load_state_dict(meta["scaler"])
    return meta


def restore_residual(path, arena, residual, comm, say=print):
    """Each rank's top-k residual from `path` into `residual` (arena layout), when as many
    ranks wrote it; otherwise zeros, and rank 0 says why: a residual is what its rank
    held back of its own share of the batches, which another rank count reshuffles.
    Call after restore(), which has checked the file. Collective over `comm`."""
    rows, why = [None] * comm.size, None
    if comm.rank == 0:
        import h5py
        with h5py.File(path, "r") as f:
            saved = f["residual"][...] if "residual" in f else None
        if saved is None:
            why = "it was written without --compress topk"
        elif saved.shape[0] != comm.size:
            why = f"it holds the residuals of {saved.shape[0]} rank(s), this run has {comm.size}"
        else:
            rows = list(saved)
    mine = comm.scatter(rows, root=0)
    residual[...] = 0
    if mine is not None:
        arena.unpack(mine, residual)
    if why:
        say(f"warning: the top-k residuals start from zero: {why} ({path})", flush=True)


def _restore_arena(comm, arena, target, packed):
    """Rank 0 unpacks a checkpoint array into `target` (an arena-sized buffer); every rank
    then gets rank 0's copy."""
    if comm.rank == 0:
        arena.unpack(packed, target)
    comm.broadcast(target, root=0)


def step_of(name):
    """The global step in a checkpoint's file name (None for other names)."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def checkpoints(directory):
    """Complete-looking checkpoint files in `directory`, oldest first (by global step)."""
    found = []
    for path in glob.glob(os.path.join(directory, "checkpoint-*.h5")):
        m = _NAME.match(os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def latest(directory, passed_over=None):
    """The newest checkpoint in `directory` whose every part is what train writes (read
    as far as _parts reads: the arrays' checksums are checked when read), or None;
    passed_over(path, error) is called for each newer one that is not, with its
    CheckpointError (a CheckpointHeld where it may be whole, but cannot be read now)."""
    for path in reversed(checkpoints(directory)):
        try:
            _attribute(path, lambda f: _parts(f, path))
            return path
        except CheckpointError as e:
            error = e
        if passed_over is not None:
            passed_over(path, error)
    return None


def prune(directory, keep, protect=()):
    """Delete all but the newest `keep` checkpoints, except those in `protect` (the last
    one written before a divergence began), and any leftover temporary files."""
    for path in checkpoints(directory)[:-keep] if keep > 0 else []:
        if path not in protect:
            os.remove(path)
    for tmp in glob.glob(os.path.join(directory, ".checkpoint-*.h5.tmp")):
        os.remove(tmp)
