"""`python -m mpitrain predict`: the top classes of image files under a checkpoint's model.

One process, no MPI: the checkpoint is read here, its model rebuilt in fp32 from
the master weights (whatever the training precision), with the BatchNorm running
statistics averaged over the ranks that wrote it (as `eval` does before scoring),
and run in eval mode.

The input is prepared as the checkpoint's run prepared its validation images
(`Preprocessing`, which `export` also records in its files' metadata):

    resize + centre crop   the validation transform of datasets/augment.py at the
                           run's image size and crop fraction (the digits preset:
                           1.0, the whole image; any other data: 0.875)
    normalise              (pixel - mean) / std per channel, with the training
                           file's mean and std, in that file's stored pixel units

mean and std are the training data file's (attributes `mean`, `std` of
docs/data-format.md), which a run copies into its config: they are read from the
checkpoint's config, or, with `--data FILE`, from that file (the training file, or its
validation file, which carries the training split's values too); a checkpoint whose
config has no copy reads them from the training file its config names (the digits
preset: DATA_DIR/digits_train.h5). Class names come from the config, else from that
file.

Pixel units. An 8-bit image (JPEG, PNG, anything Pillow reads) is 0..255. A data
file of 8-bit images stores those units; a 16-bit pixel file stores its own
(the digits: p = 64 x, 0..1024 for scikit-learn's values 0..16). So an 8-bit
image is scaled to the file's white level (its largest stored value: 1024 for
the digits) and a 16-bit greyscale PNG is taken in the file's stored units as
it is (the pixels of a record of that file, written out, come back exactly); for a
file of 8-bit images it is rounded to 8 bits, as the loader reads it (augment.to_rgb).

Exported files carry this preprocessing as metadata (`Preprocessing.metadata`), and
`Preprocessing.from_metadata` rebuilds it from them, so that an exported model's
inputs are made by this very code (`Preprocessing.inputs`); `predict --onnx FILE`
(mpitrain/tools/onnx_predict.py) runs an ONNX file so and checks it against the checkpoint.
"""
import io
import json
import os
from dataclasses import dataclass

import numpy as np

from .. import checkpoint


class PredictError(ValueError):
    """A checkpoint, data file or image that cannot be used; the message names it."""


# ----- the checkpoint's model, on one process -----
def load_model(path):
    """(model, config, state) of checkpoint `path`: the network in fp32 on the host with
    the master weights and the ranks' mean BatchNorm statistics, ready for
    model.forward(x, train=False); state is checkpoint.read's dict."""
    from mpitrain.nets import build_model
    read_config(path)
    try:
        state = checkpoint.read(path)
        cfg = state["config"]
        model = build_model(cfg["model"], num_classes=cfg["num_classes"], seed=0)
        checkpoint.check_matches(state, model)
        checkpoint.check_finite(state)
    except checkpoint.CheckpointError as e:
        raise PredictError(str(e)) from None
    except (KeyError, ValueError) as e:     # a config without the model, or an unknown one
        raise PredictError(f"cannot use checkpoint {path}: {e}") from None
    arena = model.arena
    arena.unpack(state["master"], arena.master)
    arena.sync_working()
    # one row of BatchNorm statistics per rank that wrote it (they differ mid-epoch)
    model.buffer_arena.unpack(state["buffers"].mean(axis=0), model.buffer_arena.data)
    return model, cfg, state


def read_config(path):
    """The training config stored in checkpoint `path` (a quick read of its attributes),
    or PredictError saying why the file cannot be used."""
    if not os.path.isfile(path):
        raise PredictError((f"checkpoint {path} does not exist" if not os.path.exists(path)
                            else f"checkpoint {path} is not a file") + f"; {checkpoint.ANOTHER}")
    try:
        return checkpoint.read_config(path)
    except checkpoint.CheckpointError as e:
        raise PredictError(str(e)) from None


# ----- the checkpoint's input pipeline -----
@dataclass
class Preprocessing:
    """How images are turned into the model's input: the run's validation transform."""
    image_size: int
    crop_fraction: float
    mean: list              # per channel (R, G, B), in the training file's stored units
    std: list
    white: float            # the stored value of full intensity (255 for 8-bit data)
    bits: int               # bits per stored pixel of the training file: 8 or 16
    class_names: list
    source: str             # where mean and std came from

    def metadata(self):
        """The string metadata that export writes into its files; from_metadata reads it."""
        return {"image_size": str(self.image_size), "crop_fraction": repr(self.crop_fraction),
                "mean": json.dumps(self.mean), "std": json.dumps(self.std),
                "pixel_max": repr(self.white), "pixel_bits": str(self.bits),
                "class_names": json.dumps(self.class_names),
                "preprocessing": "RGB; the centred square of side crop_fraction x the short "
                                 "side (fractional, not rounded), resized in one pass to "
                                 "image_size x image_size (Pillow's antialiased bilinear, on "
                                 "unrounded values); (pixel - mean) / std per channel, pixels "
                                 "in units where pixel_max is full intensity (8-bit images: "
                                 "x pixel_max / 255). Exactly: mpitrain.tools.predict.Preprocessing"
                                 ".from_metadata(these).inputs(paths, 'NCHW')"}

    @classmethod
    def from_metadata(cls, meta, source="the file"):
        """The Preprocessing that an exported file's metadata records (`metadata`'s
        inverse; `source` names the file in errors and in .source). With it, another
        program prepares images exactly as predict does:

            session = onnxruntime.InferenceSession("model.onnx",
                                                   providers=["CPUExecutionProvider"])
            prep = Preprocessing.from_metadata(session.get_modelmeta().custom_metadata_map)
            logits = session.run(["logits"], {"images": prep.inputs(paths, "NCHW")})[0]
        """
        try:
            white = float(meta["pixel_max"])
            prep = cls(int(meta["image_size"]), float(meta["crop_fraction"]),
                       json.loads(meta["mean"]), json.loads(meta["std"]), white,
                       # metadata without pixel_bits: the config's rule
                       int(meta.get("pixel_bits", stored_bits(white))),
                       json.loads(meta["class_names"]), source)
        except KeyError as e:
            raise PredictError(f"{source} has no {e.args[0]!r} in its metadata: not a file of "
                               f"mpitrain's export; export the checkpoint again") from None
        except (ValueError, TypeError) as e:
            raise PredictError(f"{source}: unreadable preprocessing metadata ({e}); export "
                               f"the checkpoint again") from None
        mean, std = np.asarray(prep.mean, np.float64), np.asarray(prep.std, np.float64)
        if not (prep.image_size > 0 and 0 < prep.crop_fraction <= 1 and prep.bits in (8, 16)
                and mean.shape == std.shape == (3,) and np.isfinite(mean).all()
                and np.isfinite(std).all() and (std > 0).all() and white > 0):
            raise PredictError(f"{source}: its preprocessing metadata cannot prepare an image "
                               f"(image_size {prep.image_size}, crop_fraction "
                               f"{prep.crop_fraction}, mean {prep.mean}, std {prep.std}, "
                               f"pixel_max {white}, pixel_bits {prep.bits}); export the "
                               f"checkpoint again")
        return prep

    def augment(self, bits):
        """The validation transform for images of `bits` bits per channel: mean and std
        moved into the image's units, since (k p - mean) / std = (p - mean/k) / (std/k)
        for an image whose pixel p stands for k p in the file's units."""
        from mpitrain.datasets.augment import Augment
        # 8-bit full intensity is the file's white level; a 16-bit image is in a 16-bit
        # file's own units
        k = self.white / 255 if bits == 8 else 1.0
        return Augment(self.image_size, np.asarray(self.mean) / k, np.asarray(self.std) / k,
                       train=False, crop_fraction=self.crop_fraction)

    def load(self, path, out):
        """Read image file `path` and write its normalised (size, size, 3) input into `out`."""
        record, bits = read_image(path)
        if bits > self.bits:            # 16 bits for a file of 8-bit images: read as the
            record, bits = np.fromfile(path, np.uint8), 8       # loader reads it (to_rgb)
        try:
            self.augment(bits)(record, out)
        except (OSError, ValueError) as e:
            raise PredictError(f"{path}: cannot be decoded ({e})") from None

    def inputs(self, paths, layout="NHWC"):
        """The model's input for image files `paths`, each prepared by `load`: float32
        (N, size, size, 3), mpitrain's layout; layout "NCHW" gives (N, 3, size, size),
        the exported ONNX graph's input `images` (and torch's layout)."""
        if layout not in ("NHWC", "NCHW"):
            raise ValueError(f"layout {layout!r}: choose NHWC or NCHW")
        x = np.empty((len(paths), self.image_size, self.image_size, 3), np.float32)
        for i, path in enumerate(paths):
            self.load(path, x[i])
        return x if layout == "NHWC" else np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def read_image(path):
    """(record, bits) of image file `path`: the encoded bytes of an 8-bit image (decoded
    by the loader's own code, datasets/augment.py), or (H, W, 3) uint16 pixels of a
    16-bit greyscale one, which that code would scale to 8 bits."""
    from PIL import Image, UnidentifiedImageError
    if os.path.isdir(path):
        raise PredictError(f"{path} is a folder: give its image files ({path}/*.jpg)")
    try:
        with open(path, "rb") as f:
            data = f.read()
        image = Image.open(io.BytesIO(data))
        image.load()                        # a truncated file fails here, not later
    except UnidentifiedImageError:
        raise PredictError(f"{path}: not an image (no format Pillow reads)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise PredictError(f"{path}: not a readable image ({e})") from None
    from mpitrain.datasets.augment import SIXTEEN_BIT_MODES
    if image.mode in SIXTEEN_BIT_MODES:
        grey = np.clip(np.asarray(image), 0, 65535).astype(np.uint16)
        return np.repeat(grey[..., None], 3, axis=2), 16
    return np.frombuffer(data, np.uint8), 8


def training_file(cfg):
    """The training data file the checkpoint's config names (checks.run_data_files)."""
    from ..checks import run_data_files
    return cfg.get("data") and run_data_files(cfg)[0]


def check_normalisation(cfg):
    """Refuse a checkpoint config whose mean, std or white level cannot normalise an
    image: not finite, or a std or white level that is not positive."""
    values = {"mean": cfg["mean"], "std": cfg["std"], "pixel_max": [cfg.get("pixel_max", 255)]}
    for name, v in values.items():
        v = np.asarray(v, np.float64)
        if v.shape != (1 if name == "pixel_max" else 3,) or not np.isfinite(v).all() \
                or (name != "mean" and not (v > 0).all()):
            raise PredictError(f"the checkpoint's normalisation {name} is {v.tolist()}: not "
                               f"{'finite numbers' if name == 'mean' else 'positive'} for each "
                               f"channel; pass --data FILE (its training data file) to read "
                               f"the normalisation from there")


def stored_bits(white):
    """Bits per stored pixel of data whose full intensity is `white`, where nothing records
    them: 8 up to 255, else 16."""
    return 8 if white <= 255 else 16


def preprocessing(cfg, data=None):
    """The Preprocessing of a checkpoint's config; `data` (a data file of the same
    training split) stands in for a training file that is not where the config says."""
    from ..checks import crop_fraction
    classes = cfg["num_classes"]
    size, crop = cfg.get("image_size") or 224, crop_fraction(cfg)
    names = cfg.get("class_names")
    if data is None and "mean" in cfg and "std" in cfg:       # the config carries them
        white = float(cfg.get("pixel_max", 255))
        check_normalisation(cfg)
        return Preprocessing(size, crop, list(cfg["mean"]), list(cfg["std"]), white,
                             stored_bits(white),
                             names or [str(i) for i in range(classes)], "checkpoint")
    if data is not None and not os.path.exists(data):
        raise PredictError(f"--data {data} does not exist; give the run's training file, or "
                           f"its validation file (it carries the same mean and std)")
    path = data or training_file(cfg)
    if not path or not os.path.exists(path):
        raise PredictError(f"the normalisation (mean, std) is in the training data file, and "
                           f"{path or 'none'} (named by the checkpoint's config: data="
                           f"{cfg.get('data')!r}, data_dir={cfg.get('data_dir')!r}) is not "
                           f"here; pass --data FILE (the training file, or its validation "
                           f"file: it carries the same mean and std)")
    from mpitrain.datasets.h5format import FormatError, Reader, white_level
    try:
        with Reader(path) as reader:
            if len(reader.class_names) != classes:
                raise PredictError(f"{path} has {len(reader.class_names)} classes, the "
                                   f"checkpoint's model {classes}: not its training data")
            if names and list(reader.class_names) != list(names):
                raise PredictError(f"{path} has other class names than the checkpoint: "
                                   f"not its training data")
            bits = 8 * reader.images.dtype.itemsize if reader.storage == "pixels" else 8
            return Preprocessing(size, crop, reader.mean.tolist(), reader.std.tolist(),
                                 white_level(reader), bits, list(reader.class_names), path)
    except FormatError as e:
        raise PredictError(str(e)) from None


# ----- the command -----
NONFINITE = "the model's logits for this image are not finite (inf or NaN): no prediction"


def softmax(logits):
    """Row-wise probabilities, in float64: exp(l - max l) / sum exp(l - max l)."""
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def probabilities(forward, prep, images, batch_size=32, layout="NHWC"):
    """(len(images), classes) float64 softmax of forward(x) over the image files, x being
    `batch_size` of them at a time as prep.inputs(paths, layout)."""
    return np.concatenate([softmax(forward(prep.inputs(images[start:start + batch_size],
                                                        layout)))
                           for start in range(0, len(images), batch_size)])


def checkpoint_probabilities(path, images, data=None, batch_size=32):
    """(probabilities, config, Preprocessing) of the image files under checkpoint `path`'s
    eval-mode model, each image prepared as the checkpoint's run prepared validation images."""
    model, cfg, _ = load_model(path)
    prep = preprocessing(cfg, data)
    return (probabilities(lambda x: model.forward(x, train=False), prep, images, batch_size),
            cfg, prep)


def top_classes(images, probs, class_names, top=5):
    """predict's "predictions": per image its `top` most probable classes, most probable
    first (ties: the lower index, as argmax); "top": None and "error" where its
    probabilities are not finite."""
    predictions = []
    for image, p in zip(images, probs):
        if not np.isfinite(p).all():        # no class is more probable than another
            predictions.append({"image": image, "top": None, "error": NONFINITE})
            continue
        best = np.argsort(-p, kind="stable")[:min(top, len(p))]
        predictions.append({"image": image, "top": [
            {"class": class_names[c], "index": int(c), "probability": float(p[c])}
            for c in best]})
    return predictions


def predict(path, images, data=None, top=5, batch_size=32):
    """The `top` most probable classes of each image file under checkpoint `path`:
    {"checkpoint", "model", "normalisation" ("checkpoint", or the file mean and std came
    from),
    "predictions": [{"image", "top": [{"class", "index", "probability"}]}]}, most
    probable first (ties: the lower index, as argmax). An image whose logits are not
    finite has "top": None and "error" saying so."""
    probs, cfg, prep = checkpoint_probabilities(path, images, data, batch_size)
    return {"checkpoint": path, "model": cfg["model"], "normalisation": prep.source,
            "predictions": top_classes(images, probs, prep.class_names, top)}


def format_text(result):
    """One block per image: its path, then a line per class, most probable first."""
    lines = []
    for item in result["predictions"]:
        lines.append(item["image"])
        if item["top"] is None:
            lines.append(f"  {item['error']}")
            continue
        lines += [f"  {t['probability']:8.2%}  {t['class']}" for t in item["top"]]
    return "\n".join(lines)


def run(args):
    """The `predict` command: errors exit with status 2 and the message, as argparse's."""
    try:
        result = predict(args.checkpoint, args.images, args.data, args.top, args.batch_size)
    except PredictError as e:
        args.command_parser.error(str(e))
    if args.json:
        print(json.dumps(result, allow_nan=False))     # JSON has no NaN
    else:
        print(format_text(result))
