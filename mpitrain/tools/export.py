"""`python -m mpitrain export`: a checkpoint's model as safetensors (for PyTorch) or ONNX.

Both files hold the eval-mode network of the checkpoint (fp32 master weights,
BatchNorm running statistics averaged over the ranks that wrote it; see
mpitrain.tools.predict.load_model) in torchvision's layout, and the run's preprocessing
(image size, crop fraction, mean and std, class names: mpitrain.tools.predict.Preprocessing)
as metadata. Neither needs torch. Images are prepared for either file exactly as
`predict` prepares them by Preprocessing.from_metadata(the file's metadata).inputs(paths,
"NCHW"); `predict --onnx FILE --checkpoint CHECKPOINT` checks an ONNX file so.

safetensors (package `safetensors`)
    torchvision's state_dict: its names (mpitrain's parameter names already are) and
    layouts, so `load_state_dict(strict=True)` of the torchvision-shaped model takes
    it; BatchNorm layers also get torch's `num_batches_tracked` (the checkpoint's
    global step: one batch per training step).
ONNX (package `onnx`, graph built with onnx.helper, checked with onnx.checker)
    input `images` (batch, 3, H, W) float32 NCHW at the checkpoint's image size,
    output `logits` (batch, classes); the batch dimension is dynamic. Eval mode:
    BatchNormalization ops with the running statistics, no Dropout. Opset 17.

Layouts: mpitrain computes in NHWC, torch and ONNX in NCHW, which changes two things:

    convolution weights  ours OHWI, torch OIHW:  torch = ours.transpose(0, 3, 1, 2)
    a Linear after a     ours flattens (N, H, W, C) in (H, W, C) order, torch (N, C, H, W)
    Flatten              in (C, H, W) order: the same weight must read its input columns
                         in the other order, so its columns are permuted alike

Files are written to a temporary name in OUT's directory and renamed over OUT when
complete: a failure never leaves a half-written OUT.
"""
import os

import numpy as np

from ..backend import to_numpy
from ..files import output_problem, write_atomic
from .predict import PredictError, load_model, preprocessing, read_config

FORMATS = ("safetensors", "onnx")
OPSET = 17
IR_VERSION = 8          # opset 17's own IR version, not the newest onnx knows: every runtime
                        # that runs opset 17 reads the file
PACKAGES = {"safetensors": "safetensors", "onnx": "onnx"}


class ExportError(ValueError):
    """An export that cannot be done; the message names the problem and the fix."""


# ----- layouts: mpitrain's (NHWC) to torchvision's (NCHW) and back -----
def to_torch_layout(a, flat_hwc=None):
    """A parameter in torch's layout: OHWI -> OIHW; a Linear weight (out, H*W*C) whose
    input is flattened from (H, W, C) = flat_hwc -> columns in (C, H, W) order."""
    if a.ndim == 4:
        return a.transpose(0, 3, 1, 2)
    if flat_hwc is not None:
        return a.reshape(a.shape[0], *flat_hwc).transpose(0, 3, 1, 2).reshape(a.shape[0], -1)
    return a


def from_torch_layout(a, flat_hwc=None):
    """The inverse of to_torch_layout: OIHW -> OHWI; columns (C, H, W) -> (H, W, C)."""
    if a.ndim == 4:
        return a.transpose(0, 2, 3, 1)
    if flat_hwc is not None:
        h, w, c = flat_hwc
        return a.reshape(a.shape[0], c, h, w).transpose(0, 2, 3, 1).reshape(a.shape[0], -1)
    return a


def flattened(model):
    """name -> (H, W, C) of the activation a Flatten hands to that Linear weight.

    AlexNet's classifier.1 reads the 256 channels of its adaptive pool's fixed 6x6
    output, whatever the image size; a ResNet flattens nothing (its global average
    pool leaves (N, C), the same in either layout)."""
    from mpitrain.nets.alexnet import CONVS, AlexNet
    if isinstance(model, AlexNet):
        return {"classifier.1.weight": (*model.avgpool.output_size, CONVS[-1][0])}
    return {}


def torch_state_dict(model, batches_tracked=0):
    """torchvision's state_dict of `model` as NumPy arrays (the master dtype): every
    parameter in torch's layout, the BatchNorm running statistics, and each BatchNorm's
    num_batches_tracked (int64 scalar)."""
    from mpitrain.nets.batchnorm import BatchNorm2d
    flat = flattened(model)
    state = {name: to_torch_layout(to_numpy(p.master), flat.get(name))
             for name, p in model.named_params()}
    state.update((name, to_numpy(b.data)) for name, b in model.named_buffers())
    for name, m in model.named_modules():
        if isinstance(m, BatchNorm2d):
            state[f"{name}num_batches_tracked"] = np.array(batches_tracked, np.int64)
    return {k: np.asarray(v, order="C") for k, v in state.items()}   # 0-d stays 0-d


# ----- ONNX -----
class _OnnxGraph:
    """The eval-mode forward of an mpitrain network as ONNX nodes, NCHW.

    `emit(module, x, shape)` appends the nodes of one module to input tensor x of shape
    (C, H, W) (or (F,) after a flatten) and returns its output's (name, shape). Weights
    are initializers named as the state_dict, in torch's layout."""

    def __init__(self, model, state):
        from onnx import helper, numpy_helper
        self.helper, self.numpy_helper = helper, numpy_helper
        self.state, self.flat = state, flattened(model)
        self.names = {id(m): name.rstrip(".") for name, m in model.named_modules()}
        self.nodes, self.initializers = [], []
        self.pending_flatten = None         # (H, W, C) flattened, until a Linear takes it

    def tensor(self, name, array=None):
        """Add initializer `name` (the state_dict's array unless given); returns name."""
        array = self.state[name] if array is None else array
        self.initializers.append(self.numpy_helper.from_array(
            np.ascontiguousarray(array, np.float32), name))
        return name

    def node(self, op, inputs, name, **attrs):
        self.nodes.append(self.helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def emit(self, m, x, shape):
        from mpitrain.nets import activation, alexnet, batchnorm, conv, linear, pool, resnet
        from mpitrain.nets.module import Sequential
        name = self.names.get(id(m), "")
        if isinstance(m, (resnet.ResNet, alexnet.AlexNet, Sequential)):
            for child in (m.sequence if isinstance(m, resnet.ResNet) else
                          m.stages if isinstance(m, alexnet.AlexNet) else m.layers):
                x, shape = self.emit(child, x, shape)
            return x, shape
        if isinstance(m, resnet._Block):    # relu(main(x) + shortcut(x))
            y, out = x, shape
            for layer in m.main:
                y, out = self.emit(layer, y, out)
            shortcut = x if m.downsample is None else self.emit(m.downsample, x, shape)[0]
            return self.node("Relu", [self.node("Add", [y, shortcut], f"{name}.add")],
                             f"{name}.relu"), out
        if isinstance(m, conv.Conv2d):
            c, h, w = shape
            inputs = [x, self.tensor(f"{name}.weight")]
            if m.bias is not None:
                inputs.append(self.tensor(f"{name}.bias"))
            y = self.node("Conv", inputs, name, kernel_shape=[m.k, m.k],
                          strides=[m.stride, m.stride], pads=[m.padding] * 4)
            return y, (m.out_channels, *_pooled((h, w), m.k, m.stride, m.padding))
        if isinstance(m, batchnorm.BatchNorm2d):
            inputs = [x] + [self.tensor(f"{name}.{k}")
                            for k in ("weight", "bias", "running_mean", "running_var")]
            y = self.node("BatchNormalization", inputs, name, epsilon=m.eps)
            return (self.node("Relu", [y], f"{name}.relu") if m.relu else y), shape
        if isinstance(m, activation.ReLU):
            return self.node("Relu", [x], name), shape
        if isinstance(m, activation.Dropout):       # the identity in eval mode
            return x, shape
        if isinstance(m, (pool.MaxPool2d, pool.AvgPool2d)):
            # MaxPool's padding never wins a max, as ours with -inf; AvgPool counts the
            # padding's zeros, as ours (count_include_pad)
            extra = {} if isinstance(m, pool.MaxPool2d) else {"count_include_pad": 1}
            op = "MaxPool" if isinstance(m, pool.MaxPool2d) else "AveragePool"
            y = self.node(op, [x], name, kernel_shape=[m.k, m.k], strides=[m.stride] * 2,
                          pads=[m.padding] * 4, **extra)
            return y, (shape[0], *_pooled(shape[1:], m.k, m.stride, m.padding))
        if isinstance(m, pool.AdaptiveAvgPool2d):
            return self.adaptive_pool(m, name, x, shape)
        if isinstance(m, pool.GlobalAvgPool2d):
            y = self.node("GlobalAveragePool", [x], f"{name}.pool")
            return self.node("Flatten", [y], name, axis=1), (shape[0],)
        if isinstance(m, linear.Flatten):
            c, h, w = shape
            self.pending_flatten = (h, w, c)
            return self.node("Flatten", [x], name, axis=1), (c * h * w,)
        if isinstance(m, linear.Linear):
            # its weight's columns were permuted for the flatten `flattened` names; any
            # other flatten must be of a 1x1 map, whose order is the same in both layouts
            flat = self.flat.get(f"{name}.weight")
            taken, self.pending_flatten = self.pending_flatten, None
            if taken != flat and not (flat is None and taken[:2] == (1, 1)):
                raise ExportError(f"{name} follows a flatten of (H, W, C) = {taken}, which "
                                  f"mpitrain.tools.export.flattened does not give it")
            inputs = [x, self.tensor(f"{name}.weight")]
            if m.bias is not None:
                inputs.append(self.tensor(f"{name}.bias"))
            return self.node("Gemm", inputs, name, transB=1), (m.out_features,)
        raise ExportError(f"no ONNX form for layer {name or '(model)'} "
                          f"({type(m).__name__})")

    def adaptive_pool(self, m, name, x, shape):
        """Adaptive average pooling as two matrix products with PyTorch's bins (the
        matrices of nets/pool.py): y = A_h x A_w^T on every (n, c) plane. ONNX has no
        adaptive pool; the bins depend on the input size, fixed here by the image size."""
        from mpitrain.nets.pool import adaptive_bins
        c, h, w = shape
        oh, ow = m.output_size
        if (h, w) == (oh, ow):
            return x, shape
        aw_t = self.tensor(f"{name}.bins_w", adaptive_bins(w, ow).T)     # (W, Ow)
        ah = self.tensor(f"{name}.bins_h", adaptive_bins(h, oh))         # (Oh, H)
        rows = self.node("MatMul", [x, aw_t], f"{name}.w")               # (N, C, H, Ow)
        return self.node("MatMul", [ah, rows], name), (c, oh, ow)        # (N, C, Oh, Ow)


def _pooled(hw, k, stride, padding):
    """Output (H, W) of a k x k window sliding with `stride` over `padding`-padded (H, W)."""
    return tuple((n + 2 * padding - k) // stride + 1 for n in hw)


def onnx_model(model, image_size, metadata, batches_tracked=0):
    """The onnx.ModelProto of `model` at image_size x image_size inputs (save_onnx checks
    it with onnx.checker)."""
    from onnx import TensorProto, helper
    graph = _OnnxGraph(model, torch_state_dict(model, batches_tracked))
    out, shape = graph.emit(model, "images", (3, image_size, image_size))
    if graph.nodes[-1].output[0] != out or len(shape) != 1:
        raise ExportError("the network does not end in a node giving (batch, classes)")
    graph.nodes[-1].output[0] = "logits"        # the graph's output, by its public name
    proto = helper.make_model(
        helper.make_graph(
            graph.nodes, metadata.get("model", "mpitrain"),
            [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                           ["batch", 3, image_size, image_size])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", shape[0]])]),
        opset_imports=[helper.make_opsetid("", OPSET)], producer_name="mpitrain",
        doc_string="mpitrain network in eval mode; input: images, NCHW float32, "
                   "prepared as the metadata says: mpitrain.tools.predict.Preprocessing."
                   "from_metadata(metadata).inputs(paths, 'NCHW')")
    proto.graph.initializer.extend(graph.initializers)   # once: make_model copies its graph
    proto.ir_version = IR_VERSION
    helper.set_model_props(proto, metadata)
    return proto


# ----- files -----
def save_safetensors(model, out, metadata, batches_tracked=0):
    from safetensors.numpy import save
    tensors = {k: v.astype(np.float32, copy=False) if v.dtype.kind == "f" else v
               for k, v in torch_state_dict(model, batches_tracked).items()}
    # "format": "pt" tells torch-side loaders (transformers, safetensors.torch) what it holds;
    # the bytes are written by open(), so the file gets the umask's mode like any other
    data = save(tensors, metadata={"format": "pt", **metadata})
    write_atomic(out, lambda tmp: _write_bytes(tmp, data))


def save_onnx(model, out, metadata, image_size, batches_tracked=0):
    import onnx
    data = onnx_model(model, image_size, metadata, batches_tracked).SerializeToString()
    onnx.checker.check_model(data, full_check=True)      # full_check: shape inference too
    write_atomic(out, lambda tmp: _write_bytes(tmp, data))


def _write_bytes(path, data):
    with open(path, "wb") as f:
        f.write(data)


# ----- the command -----
def format_of(fmt, out):
    """--format, else the format OUT's extension names; refused where the two disagree
    or neither names one."""
    stem, ext = os.path.splitext(out)
    named = ext[1:].lower() if ext[1:].lower() in FORMATS else None
    if fmt is None and named is None:
        raise ExportError(f"{out} names no format by its extension: give --format "
                          f"{' or --format '.join(FORMATS)}, or end its name in "
                          f"{' or '.join('.' + f for f in FORMATS)}")
    if fmt is not None and named not in (None, fmt):
        raise ExportError(f"{out} ends in {ext}, and --format is {fmt}: name it {stem}.{fmt}, "
                          f"or give --format {named}")
    return fmt or named


def check_output(fmt, out, checkpoint=None):
    """Refuse an unknown format, and an OUT that cannot or must not be written
    (check_out)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    check_out(out, checkpoint)


def check_out(out, checkpoint=None):
    """Refuse an OUT that cannot be written (files.output_problem: a directory, a path
    through a file, no write permission), and one whose file holds what an export must not
    replace: the checkpoint being exported, or any other HDF5 file (a checkpoint or a data
    set, which the rename over OUT would destroy)."""
    problem = output_problem(out)
    if problem is None and os.path.isfile(out):
        import h5py
        if checkpoint is not None and os.path.exists(checkpoint) \
                and os.path.samefile(out, checkpoint):
            problem = (f"{out} is the checkpoint being exported, which the export would "
                       f"overwrite: name a new file for it")
        elif h5py.is_hdf5(out):
            problem = (f"{out} is an HDF5 file (a checkpoint or a data file), which the "
                       f"export would overwrite: name a new file for it")
    if problem:
        raise ExportError(problem)


def check_package(fmt):
    """Refuse a format whose package is missing, with the command that installs it."""
    try:
        __import__(PACKAGES[fmt])
    except ImportError:
        raise ExportError(f"the {fmt} format needs the package {PACKAGES[fmt]}, which is not "
                          f"installed: pip install '{PACKAGES[fmt]}' (or pip install -e "
                          f"'.[export]' in the checkout)") from None


def export(path, fmt, out, data=None):
    """Write checkpoint `path`'s model to `out` in format `fmt` ("safetensors" or "onnx");
    `data` stands in for a training file that is not where the checkpoint's config says.
    Returns {"out", "format", "model", "parameters", "metadata"}."""
    check_output(fmt, out, path)
    try:
        read_config(path)               # a missing or unreadable checkpoint, before the package
        check_package(fmt)
        model, cfg, state = load_model(path)
        prep = preprocessing(cfg, data)
    except PredictError as e:
        raise ExportError(str(e)) from None
    metadata = {"model": cfg["model"], "num_classes": str(cfg["num_classes"]),
                "checkpoint": os.path.basename(path), "global_step": str(state["global_step"]),
                "layout": "torchvision: NCHW activations, OIHW convolution weights",
                **prep.metadata()}
    steps = state["global_step"]
    if fmt == "safetensors":
        save_safetensors(model, out, metadata, steps)
    else:
        save_onnx(model, out, metadata, prep.image_size, steps)
    return {"out": out, "format": fmt, "model": cfg["model"],
            "parameters": int(model.num_params()), "metadata": metadata}


def run(args):
    """The `export` command: errors exit with status 2 and the message, as argparse's."""
    try:
        check_out(args.out, args.checkpoint)     # first: a directory names no format
        args.format = format_of(args.format, args.out)
        result = export(args.checkpoint, args.format, args.out, args.data)
    except ExportError as e:
        args.command_parser.error(str(e))
    size, classes = result["metadata"]["image_size"], result["metadata"]["num_classes"]
    print(f"{args.checkpoint} -> {result['out']}: {result['model']}, "
          f"{result['parameters']:,} parameters ({classes} classes), input {size}x{size}, "
          f"as {args.format}")
