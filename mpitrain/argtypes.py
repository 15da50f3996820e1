"""The types of option values: each takes the text of a command-line value and returns
the value or raises argparse.ArgumentTypeError naming what is wrong (the train options
of mpitrain/options.py, the other commands and check-gpu share them)."""
import argparse
import math
import os


def number(kind, low=None, high=None, low_open=False, high_open=False):
    """A `kind` (int or float) within [low, high] (an end left open where *_open)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if low is not None and (value < low or (low_open and value == low)):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if low_open else '>='} {low}")
        if high is not None and (value > high or (high_open and value == high)):
            raise argparse.ArgumentTypeError(f"{text} must be {'<' if high_open else '<='} {high}")
        return value
    parse.__name__ = kind.__name__          # argparse names the type in its messages
    return parse


class OnOff(argparse.BooleanOptionalAction):
    """--X and --no-X, with the help as written: Python 3.10's BooleanOptionalAction appends
    "(default: ...)" to it, and the help of a flag says its default in its own words."""

    def __init__(self, option_strings, dest, help=None, **kwargs):
        super().__init__(option_strings, dest, help=help, **kwargs)
        self.help = help


def metavar(parse, name):
    """How --help and the docs name the value of an option that names none: N for a count,
    X for a real number (by the __name__ of its type `parse`), else NAME."""
    return {"int": "N", "float": "X"}.get(getattr(parse, "__name__", None), name.upper())


positive_int = number(int, 1)
nonnegative_int = number(int, 0)
positive_float = number(float, 0.0, low_open=True)
density = number(float, 0.0, 1.0, low_open=True)
nonnegative_float = number(float, 0.0)
finite_float = number(float)                            # a range checked where it is used
fraction = number(float, 0.0, 1.0, high_open=True)     # [0, 1)
class_count = number(int, 2)                            # a classifier's outputs


def comma_list(item, choices=None, empty=False):
    """A tuple of comma-separated values, each taken by `item` (a type above) and, with
    `choices`, one of them; "" is the empty tuple where `empty` allows it."""
    def parse(text):
        values = tuple(item(v.strip()) for v in text.split(",") if v.strip())
        if not values and not empty:
            named = f" of {', '.join(choices)}" if choices else ""
            raise argparse.ArgumentTypeError(f"{text!r} names none: give one or more{named}, "
                                             f"separated by commas")
        wrong = [v for v in values if choices is not None and v not in choices]
        if wrong:
            raise argparse.ArgumentTypeError(f"{wrong[0]!r} is not one of {', '.join(choices)}")
        return values
    parse.__name__ = "list"
    return parse


def path(text):
    """A file or directory name, not empty: '' names none, and taken as a path it is the
    current directory (or, as a file's, its parent). Option.convert hands it YAML's values
    as typed (`as_typed`), so that a number or null is refused too, where str() would
    have made a name of it."""
    if isinstance(text, os.PathLike):       # train() called from Python
        text = os.fspath(text)
    if text is None:
        raise argparse.ArgumentTypeError("null is not a path: give a name, or leave the key "
                                         "out for its default")
    if not isinstance(text, str):
        raise argparse.ArgumentTypeError(f"{text!r} is not a path: write a name as text, in "
                                         f"quotes where it would read as a number ('{text}')")
    if not text:
        raise argparse.ArgumentTypeError("'' is an empty path, which names no file or "
                                         "directory: give a name")
    return text


path.__name__ = "path"
path.as_typed = True


def trace_file(text):
    """--trace: a directory (one that exists, or a name ending in /), or a FILE.json, as
    each rank writes FILE.rankN.json (metrics.trace_path); a name without an extension
    gets .json. Another extension is refused: a JSON trace would be written under another
    format's name (--trace data/x.h5: data/x.rank0.h5)."""
    text = path(text)
    stem, ext = os.path.splitext(text)
    if text.endswith(os.sep) or os.path.isdir(text) or ext.lower() in ("", ".json"):
        return text
    raise argparse.ArgumentTypeError(f"{text} ends in {ext}, and each rank writes its trace "
                                     f"as JSON, FILE.rankN.json: name it {stem}.json, or a "
                                     f"directory ending in /")


trace_file.__name__ = "path"
trace_file.as_typed = True


def workers(text):
    """Loader threads: 0 up to the cores this process may run on."""
    from .launcher import cores
    value = nonnegative_int(text)
    if value > cores():
        raise argparse.ArgumentTypeError(
            f"{value} exceeds the {cores()} core(s) this process may run on: loader threads "
            f"beyond the cores only take turns, and take the cores from the training step; "
            f"use at most {cores()}")
    return value


workers.__name__ = "int"


def fusion_threshold(text):
    """A bucket size in bytes, or "auto" (chosen by timing the first steps)."""
    if text == "auto":
        return text
    if not text.strip().lstrip("+-").isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of bytes nor auto")
    return positive_int(text)


fusion_threshold.__name__ = "bytes"


def loss_scale(text):
    """'dynamic' or a positive number."""
    if text == "dynamic":
        return text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive number nor 'dynamic'")
    if value >= 2.0 ** 128:         # the gradients' scale is an fp32 number: this is inf
        raise argparse.ArgumentTypeError(f"{text!r} is beyond fp32's range (below 3.4e38; "
                                         f"loss scales are powers of two up to about 2^24)")
    return value

