"""`python -m mpitrain predict --onnx FILE`: an exported ONNX file run by onnxruntime on
images prepared as `predict` prepares them, and, with --checkpoint, checked against the
checkpoint it was exported from.

The file's metadata (export writes Preprocessing.metadata) rebuilds the checkpoint's
Preprocessing (Preprocessing.from_metadata), so each image goes through the code that
`predict` runs, the loader's validation transform, before the graph sees it: this is
docs/export.md's recipe for running the file in another program, done here.

The check runs the same images through the checkpoint's model as `predict` does and
reports

    max_difference = max over images i and classes c of |p_file[i, c] - p_checkpoint[i, c]|

(softmax probabilities; an image that only one of them gives probabilities for, its
logits not finite in the other, counts as an infinite difference), and fails (exit 1)
above --tolerance: the graph, its preprocessing metadata or the code applying it do not
give the checkpoint's probabilities. TOLERANCE leaves room for the rounding of another
runtime's float32 sums, not for a wrong step (docs/export.md).
"""
import json
import math
import os
import sys

import numpy as np

from .predict import (PredictError, Preprocessing, checkpoint_probabilities, format_text,
                      probabilities, top_classes)

TOLERANCE = 1e-3


def open_onnx(path):
    """(onnxruntime session, Preprocessing, metadata) of ONNX file `path`, an `export
    --format onnx` file; PredictError naming the fix when it is missing, onnxruntime is
    not installed, or the file is not such an export."""
    if not os.path.isfile(path):
        raise PredictError(f"ONNX file {path} does not exist" if not os.path.exists(path)
                           else f"ONNX file {path} is not a file")
    try:
        import onnxruntime
    except ImportError:
        raise PredictError("--onnx runs the file with onnxruntime, which is not installed: "
                           "pip install onnxruntime (or pip install -e '.[test]' in the "
                           "checkout)") from None
    try:
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as e:      # onnxruntime's errors derive from Exception alone
        raise PredictError(f"{path}: onnxruntime cannot load it ({e}); give a file written "
                           f"by `export --format onnx`") from None
    meta = session.get_modelmeta().custom_metadata_map
    prep = Preprocessing.from_metadata(meta, path)
    inputs, outputs = session.get_inputs(), session.get_outputs()
    size, classes = prep.image_size, len(prep.class_names)
    if [i.name for i in inputs] != ["images"] or inputs[0].shape[1:] != [3, size, size] \
            or [o.name for o in outputs] != ["logits"] or outputs[0].shape[1:] != [classes]:
        raise PredictError(f"{path}: its graph does not take images (batch, 3, {size}, {size}) "
                           f"and give logits (batch, {classes}), as its metadata says; give a "
                           f"file written by `export --format onnx`")
    return session, prep, meta


def predict_onnx(path, images, checkpoint=None, data=None, top=5, batch_size=32,
                 tolerance=TOLERANCE):
    """predict's result for ONNX file `path`: {"onnx", "model", "normalisation" (the file),
    "predictions"}; with `checkpoint` (and `data`, as predict's), also "comparison":
    {"checkpoint", "max_difference" (None where infinite), "tolerance", "agree",
    "differing_metadata": the preprocessing fields in which the file and the checkpoint
    differ}."""
    session, prep, meta = open_onnx(path)
    probs = probabilities(lambda x: session.run(["logits"], {"images": x})[0], prep, images,
                          batch_size, layout="NCHW")
    result = {"onnx": path, "model": meta.get("model"), "normalisation": path,
              "predictions": top_classes(images, probs, prep.class_names, top)}
    if checkpoint is None:
        return result
    theirs, _, their_prep = checkpoint_probabilities(checkpoint, images, data, batch_size)
    if theirs.shape != probs.shape:
        raise PredictError(f"{path} gives {probs.shape[1]} classes, checkpoint {checkpoint} "
                           f"{theirs.shape[1]}: not an export of that checkpoint")
    difference = max_difference(probs, theirs)
    ours, other = prep.metadata(), their_prep.metadata()
    result["comparison"] = {
        "checkpoint": checkpoint,
        "max_difference": difference if math.isfinite(difference) else None,
        "tolerance": tolerance, "agree": difference <= tolerance,
        "differing_metadata": sorted(k for k in ours if ours[k] != other[k])}
    return result


def max_difference(p, q):
    """max |p - q| over the images both give probabilities for (rows of finite values);
    inf where one gives probabilities and the other does not."""
    p_ok, q_ok = np.isfinite(p).all(axis=1), np.isfinite(q).all(axis=1)
    if (p_ok != q_ok).any():
        return math.inf
    return float(np.abs(p[p_ok] - q[p_ok]).max(initial=0.0))


def format_comparison(c):
    """One line: the difference, the tolerance and the verdict (and why, when it fails)."""
    difference = "inf" if c["max_difference"] is None else f"{c['max_difference']:.2g}"
    line = (f"ONNX vs checkpoint {c['checkpoint']}: max |p_onnx - p_checkpoint| = "
            f"{difference} (tolerance {c['tolerance']:g}): "
            f"{'agree' if c['agree'] else 'DISAGREE'}")
    if not c["agree"] and c["differing_metadata"]:
        line += (f"; the file's preprocessing differs from the checkpoint's in "
                 f"{', '.join(c['differing_metadata'])}")
    return line


def run(args):
    """`predict --onnx`: errors exit with status 2 and the message, as argparse's; a
    comparison above the tolerance exits with status 1 after printing the results."""
    try:
        result = predict_onnx(args.onnx, args.images, args.checkpoint, args.data, args.top,
                              args.batch_size, args.tolerance)
    except PredictError as e:
        args.command_parser.error(str(e))
    comparison = result.get("comparison")
    if args.json:
        print(json.dumps(result, allow_nan=False))     # JSON has no NaN
    else:
        print(format_text(result))
        if comparison:
            print(format_comparison(comparison))
    if comparison and not comparison["agree"]:
        sys.exit(1)
