"""`python -m mpitrain inspect`: what a network is made of, layer by layer.

One forward pass of a zero batch of one image in eval mode, watched through the
containers' run_layer hook (nets/module.py, by mpitrain.checks.leaf_shapes, which train's
checks use too), records every leaf layer's input and output shape; each leaf then
reports its parameters and forward multiply-adds (`Module.macs`).

A model's size depends on its number of classes (the last layer's outputs), so the
totals say both (mpitrain.nets.describe_parameters, as train prints them). With --data,
inspect takes the classes (and the image size) from the data as train does.
"""
import os

from mpitrain.nets import build_model, describe_parameters

DEFAULT_CLASSES = 1000      # inspect without --data or --num-classes: ImageNet's


def layer_table(model_name, image_size=224, num_classes=1000, size_from=None):
    """Rows (name, type, output shape, parameters, multiply-adds) for every leaf layer
    in forward order, and the model (for totals). ConfigError for an image size the
    network cannot take (size_from: the data file it came from, None: --image-size)."""
    from mpitrain.checks import check_image_size
    model = build_model(model_name, num_classes=num_classes)
    shapes = check_image_size(model, model_name, image_size, data=size_from)
    names = {id(m): name.rstrip(".") for name, m in model.named_modules()}
    rows = [(names[id(layer)], type(layer).__name__, tuple(y[1:]), layer.num_params(),
             int(layer.macs(x, y))) for layer, x, y in shapes]
    return rows, model


def report(model_name, image_size=224, num_classes=1000, classes_from=None, size_from=None):
    """The table as text, with totals: parameters and multiply-adds of one image's forward
    pass. classes_from: where the number of classes came from, for the first line;
    size_from: the data file the image size came from (None: --image-size or 224)."""
    rows, model = layer_table(model_name, image_size, num_classes, size_from)
    total_macs = sum(r[4] for r in rows)
    header = ("layer", "type", "output (H, W, C)", "parameters", "multiply-adds")
    cells = [header] + [(n, t, str(s), f"{p:,}", f"{m:,}") for n, t, s, p, m in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]

    def line(c):
        return "  ".join(c[i].ljust(widths[i]) if i < 3 else c[i].rjust(widths[i])
                         for i in range(len(header)))

    out = [f"{model_name}: input ({image_size}, {image_size}, 3), {num_classes} classes"
           + (f" ({classes_from})" if classes_from else ""), "",
           line(header), "  ".join("-" * w for w in widths)]
    out += [line(c) for c in cells[1:]]
    out += ["", f"total parameters:    {describe_parameters(model)}",
            f"total multiply-adds: {total_macs:,} ({_si(total_macs)}) per image, forward",
            f"leaf layers:         {len(rows)}"]
    return "\n".join(out)


def _si(n):
    return f"{n / 1e9:.2f} G" if n >= 1e9 else f"{n / 1e6:.1f} M"


def data_shape(data, data_dir):
    """(number of classes, image size, file) of --data as train reads it
    (checks.resolve_data: a named data set is converted on first use). ConfigError when
    there is no such file."""
    from mpitrain.checks import describe_file, resolve_data
    from mpitrain.options import Config
    path, _, _ = resolve_data(Config(data=data, data_dir=data_dir), need_val=False)
    _, names, size = describe_file(path)
    return len(names), size, path


def run(args):
    """The `inspect` command: the model --model, else train's default with --data, else
    resnet50; its classes from --data (as train builds it), else --num-classes, else
    DEFAULT_CLASSES; the image size from --image-size, else the data, else 224. Errors exit
    with status 2 and the message, as argparse's."""
    from mpitrain.checks import ConfigError
    from mpitrain.datasets.h5format import FormatError
    from mpitrain.options import DEFAULTS
    model = args.model or (DEFAULTS["model"] if args.data else "resnet50")
    try:
        classes, size, source, size_from = args.num_classes, args.image_size, None, None
        if args.data:
            found, stored, path = data_shape(args.data, args.data_dir)
            if classes is not None and classes != found:
                raise ConfigError(f"--num-classes {classes} but --data {args.data} has {found} "
                                  f"classes ({path}); give one or the other")
            classes, size, source = found, size or stored, f"from {path}"
            size_from = None if args.image_size else path
        elif classes is None:
            classes, source = DEFAULT_CLASSES, ("by default; --data or --num-classes for "
                                                "another count")
        print(report(model, image_size=size or 224, num_classes=classes,
                     classes_from=source, size_from=size_from))
    except (ConfigError, FormatError) as e:
        args.command_parser.error(str(e))
