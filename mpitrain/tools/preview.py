"""`python -m mpitrain preview`: one batch as the loader gives it to the network, as a PNG.

The batch is read as `train` reads it (checks.resolve_data: the data's image size and
transform, with --augment, --crop-scale, --crop-ratio and --crop-fraction over them;
the run's seed, so the first training batch of a run with that seed), the normalisation
undone,

    pixel = x * std + mean,   shown as pixel / white   (white: 255, or a 16-bit file's
                                                        full intensity, h5format.white_level)

and the images laid out in a grid, each under its label's name. The file is written
under a temporary name and renamed when complete.
"""
import math
import os

import numpy as np

LABEL_HEIGHT = 14       # pixels under each image for its label
MIN_TILE = 64           # small images are enlarged (nearest neighbour) to at least this


def check_no_training_options(cfg):
    """Refuse augmentation's options for the validation images, which take none of them."""
    from mpitrain.checks import ConfigError
    from mpitrain.options import BY_NAME
    given = ["--no-augment" if key == "augment" and getattr(cfg, key) is False
             else BY_NAME[key].flag for key in ("augment", "crop_scale", "crop_ratio")
             if getattr(cfg, key) is not None]
    if given:
        raise ConfigError(f"--split val shows validation images (a centre crop of "
                          f"--crop-fraction), which take no augmentation: drop "
                          f"{' and '.join(given)}, or show --split train")


def preview(cfg, split, batch, out, say=print):
    """Write `batch` images of `split` ("train" or "val") of cfg's data (train's options:
    data, val_data, data_dir, image_size, augment, crop_*, seed) to the PNG `out`.
    Returns the number of images drawn. Raises checks.ConfigError for bad options."""
    from mpi4py import MPI

    from mpitrain.checks import ConfigError, describe_file, resolve_data
    from mpitrain.files import output_problem, write_atomic
    from mpitrain.datasets.h5format import Reader, white_level
    from mpitrain.datasets.loader import Loader
    problem = output_problem(out) or (None if out.lower().endswith(".png") else
                                      f"{out} does not end in .png, the format written; "
                                      f"name it {os.path.splitext(out)[0]}.png")
    if problem:
        raise ConfigError(f"--out {problem}")
    if split == "val":
        check_no_training_options(cfg)
    train_file, val_file, transform = resolve_data(cfg, MPI.COMM_SELF, need_val=split == "val")
    if split == "train" and transform["augment"] and cfg.crop_fraction is not None:
        raise ConfigError("--crop-fraction sets the validation images' centre crop, and --split "
                          "train shows augmented training images (random crops), which do "
                          "not use it: drop --crop-fraction, or show --split val")
    path = train_file if split == "train" else val_file
    count = describe_file(path)[0]
    # the training file's size, as train and eval take it for both splits
    size = cfg.image_size or describe_file(train_file)[2]
    batch = min(batch, count)
    options = transform if split == "train" else dict(crop_fraction=transform["crop_fraction"])
    with Reader(path) as reader:
        white = white_level(reader)
    with Loader(path, batch, train=split == "train", image_size=size, workers=0, prefetch=1,
                seed=cfg.seed, **options) as loader:
        x, y = next(iter(loader))
        # (batch, size, size, 3) in [0, 1]
        pixels = np.clip((x * loader.std + loader.mean) / white, 0.0, 1.0)
        names = [loader.class_names[i] for i in y]
    image = grid(pixels, names)
    write_atomic(out, lambda tmp: image.save(tmp, format="PNG"))
    crops = (f"random-resized crops of {transform['scale'][0]:g}-{transform['scale'][1]:g} "
             f"of the area, width/height {transform['ratio'][0]:g}-{transform['ratio'][1]:.4g}"
             f", flips" if split == "train" and transform["augment"] else
             f"centre crop of {options['crop_fraction']:g} of the short side")
    say(f"preview: {batch} {split} images of {path} at {size}x{size} ({crops}, seed "
        f"{cfg.seed}) -> {out}")
    return batch


def grid(pixels, names):
    """A Pillow RGB image of the (n, h, w, 3) values in [0, 1], in rows of up to 8, each
    over its name."""
    from PIL import Image, ImageDraw
    n, h, w, _ = pixels.shape
    zoom = max(1, math.ceil(MIN_TILE / min(h, w)))
    th, tw = h * zoom, w * zoom
    cols = min(n, 8)
    rows = -(-n // cols)
    sheet = Image.new("RGB", (cols * (tw + 2), rows * (th + LABEL_HEIGHT + 2)), "white")
    draw = ImageDraw.Draw(sheet)
    tiles = np.round(pixels * 255).astype(np.uint8).repeat(zoom, axis=1).repeat(zoom, axis=2)
    for i in range(n):
        left, top = (i % cols) * (tw + 2) + 1, (i // cols) * (th + LABEL_HEIGHT + 2) + 1
        sheet.paste(Image.fromarray(tiles[i]), (left, top))
        draw.text((left, top + th + 1), names[i][:max(4, tw // 6)], fill="black")
    return sheet
