"""Getting the model out: `export` to safetensors (loaded by the PyTorch twins with
load_state_dict(strict=True)) and to ONNX (run by onnxruntime), both giving mpitrain's
own eval-mode logits; `predict` on digit images agreeing with `eval`; clear exit-2
refusals; atomic writes."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mpitrain import checkpoint
from mpitrain.cli import main
from mpitrain.datasets.h5format import Reader, Writer
from mpitrain.nets import build_model

# image size of each exported network: resnet_small's own 32; AlexNet's smallest size
# whose features are 2x2 (not 1x1), so the adaptive pool and the flatten order matter
SIZES = {"resnet_small": 32, "alexnet_bn": 95}
CLASSES = ["cat", "dog", "eel"]
STEP = 7                        # the global step written into the checkpoints


# ----- helpers and fixtures -----
class Solo:
    """The one-process stand-in for a Communicator that checkpoint.collect needs."""
    rank, size = 0, 1

    @staticmethod
    def gather(value, root=0):
        return [value]


def write_checkpoint(model, cfg, path, rank_spread=0.0):
    """Checkpoint `model` with config `cfg`; with rank_spread, as two ranks whose BatchNorm
    statistics differ by +-spread around the model's (export must average them)."""
    state = checkpoint.collect(model, Solo(), 0, 0, STEP, cfg)
    row = state["buffers"][0]
    spread = np.float32(rank_spread) * np.sign(np.sin(np.arange(row.size, dtype=np.float32)))
    state["buffers"] = np.stack([row + spread, row - spread])
    checkpoint.write(str(path), state)
    return str(path)


def randomised(name, seed=1):
    """A network whose BatchNorm layers do something (statistics and affine away from
    0 and 1) and whose logits are of order 1, so that 1e-4 is a tight tolerance."""
    model = build_model(name, num_classes=len(CLASSES), seed=seed)
    rng = np.random.default_rng(seed)
    for pname, p in model.named_params():
        if p.master.ndim == 1:                          # biases, BN gamma and beta
            p.master += rng.normal(0, 0.2, p.shape).astype(np.float32)
    last = list(model.named_params())[-2][1]            # the classifier's weight
    last.master *= 20
    model.arena.sync_working()
    for bname, b in model.named_buffers():
        b.data[...] = rng.normal(0, 0.2, b.shape) if bname.endswith("mean") \
            else rng.uniform(0.5, 2.0, b.shape)
    return model


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A 3-class data file of 8-bit pixels: the training file the checkpoints name."""
    path = str(tmp_path_factory.mktemp("data") / "tiny.h5")
    rng = np.random.default_rng(0)
    with Writer(path, CLASSES, storage="pixels") as w:
        for i in range(6):
            w.add(i % 3, rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))
        w.commit([120.0, 110.0, 100.0], [60.0, 55.0, 50.0])
    return path


@pytest.fixture(scope="module", params=sorted(SIZES))
def trained(request, tiny_data, tmp_path_factory):
    """(name, model, checkpoint path, NHWC batch, mpitrain's eval logits)."""
    name, size = request.param, SIZES[request.param]
    model = randomised(name)
    cfg = {"model": name, "num_classes": len(CLASSES), "image_size": size, "data": tiny_data,
           "data_dir": "data", "batch_size": 4}
    path = write_checkpoint(model, cfg, tmp_path_factory.mktemp(name) / "checkpoint.h5",
                            rank_spread=0.05)
    x = np.random.default_rng(3).standard_normal((3, size, size, 3)).astype(np.float32)
    logits = model.forward(x, train=False)
    assert np.abs(logits).max() > 1                    # the tolerance below means something
    return name, model, path, x, logits


def export(*argv):
    main(["export", *map(str, argv)])


# ----- safetensors -> PyTorch -----
def test_safetensors_loads_strictly_into_the_torch_twin_with_the_same_logits(trained, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors import safe_open
    from safetensors.torch import load_file

    from mpitrain.tools.bench import reference_torch as rt
    name, model, path, x, logits = trained
    out = tmp_path / f"{name}.safetensors"
    export(path, "--format", "safetensors", out)

    tmodel = rt.twin(model)
    tmodel.load_state_dict(load_file(str(out)), strict=True)
    tmodel.eval()
    with torch.no_grad():
        theirs = tmodel(rt.input_to_torch(x)).numpy()
    assert np.abs(theirs - logits).max() < 1e-4

    with safe_open(str(out), "np") as f:
        meta = f.metadata()
        tracked = [k for k in f.keys() if k.endswith("num_batches_tracked")]
        assert tracked and all(int(f.get_tensor(k)) == STEP for k in tracked)
    assert meta["model"] == name and meta["num_classes"] == "3"
    assert meta["image_size"] == str(SIZES[name]) and float(meta["crop_fraction"]) == 0.875
    assert json.loads(meta["class_names"]) == CLASSES
    assert json.loads(meta["mean"]) == [120.0, 110.0, 100.0]
    assert json.loads(meta["std"]) == [60.0, 55.0, 50.0]
    assert meta["pixel_max"] == "255.0" and meta["pixel_bits"] == "8"


# ----- ONNX -> onnxruntime -----
def test_onnx_runs_in_onnxruntime_with_the_same_logits(trained, tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    name, model, path, x, logits = trained
    out = tmp_path / "new" / f"{name}.onnx"                 # its directory made
    export(path, "--format", "onnx", out)

    onnx.checker.check_model(str(out), full_check=True)
    proto = onnx.load(str(out))
    assert [i.name for i in proto.graph.input] == ["images"]
    assert [o.name for o in proto.graph.output] == ["logits"]
    assert "Dropout" not in {n.op_type for n in proto.graph.node}
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["class_names"]) == CLASSES and meta["model"] == name

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    for batch in (3, 1):                                # the batch dimension is dynamic
        theirs = session.run(["logits"], {"images": nchw[:batch]})[0]
        assert theirs.shape == (batch, len(CLASSES))
        assert np.abs(theirs - logits[:batch]).max() < 1e-4


# ----- refusals and atomic writes -----
@pytest.fixture(scope="module")
def small(tiny_data, tmp_path_factory):
    """A resnet_small checkpoint on the tiny data (3 classes)."""
    cfg = {"model": "resnet_small", "num_classes": 3, "image_size": 32, "data": tiny_data,
           "data_dir": "data", "batch_size": 4}
    return write_checkpoint(randomised("resnet_small"), cfg,
                            tmp_path_factory.mktemp("small") / "checkpoint.h5")


@pytest.mark.parametrize("argv,message", [
    (["{tmp}/none.h5", "--format", "onnx", "{tmp}/m.onnx"],
     "checkpoint {tmp}/none.h5 does not exist"),
    (["{text}", "--format", "onnx", "{tmp}/m.onnx"],
     "cannot read checkpoint {text}: not an HDF5 file (an exported model?); give a "
     "checkpoint-*.h5 that train wrote, or its run directory"),
    (["{small}", "--format", "tflite", "{tmp}/m.tflite"],
     "argument --format: invalid choice: 'tflite'"),
    (["{small}", "--format", "onnx", "{text}/dir/m.onnx"],
     "{text} is a file, so {text}/dir/m.onnx cannot be written; choose another path"),
    (["{small}", "--format", "onnx", "{tmp}"], "{tmp} is a directory; name the file to write"),
    (["{small}", "{tmp}"], "{tmp} is a directory; name the file to write"),
    (["{small}", "--format", "onnx", "{small}"], "{small} is the checkpoint being exported, "
                                                 "which the export would overwrite: name a new "
                                                 "file for it"),
    (["{tmp}/none.h5", "--format", "onnx", "{tmp}/new/dir/m.onnx"],
     "checkpoint {tmp}/none.h5 does not exist"),
    (["{small}", "--format", "safetensors", "{tmp}/m.onnx"],
     "{tmp}/m.onnx ends in .onnx, and --format is safetensors: name it {tmp}/m.safetensors, "
     "or give --format onnx"),
    (["{small}", "{tmp}/m.bin"], "{tmp}/m.bin names no format by its extension: give --format "
                                 "safetensors or --format onnx, or end its name in "
                                 ".safetensors or .onnx"),
])
def test_export_refuses_with_exit_2_naming_the_problem(argv, message, small, tmp_path, capsys):
    text = tmp_path / "notes.h5"
    text.write_text("not a checkpoint")
    fill = {"tmp": tmp_path, "small": small, "text": text}
    with pytest.raises(SystemExit) as exit_:
        export(*[a.format(**fill) for a in argv])
    assert exit_.value.code == 2
    assert message.format(**fill) in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["notes.h5"]     # nothing written, no directory made


@pytest.mark.parametrize("fmt", ["safetensors", "onnx"])
def test_a_missing_package_is_named_with_its_pip_command(fmt, small, tmp_path, capsys,
                                                         monkeypatch):
    monkeypatch.setitem(sys.modules, fmt, None)           # import fails as if not installed
    with pytest.raises(SystemExit) as exit_:
        export(small, "--format", fmt, tmp_path / f"m.{fmt}")
    assert exit_.value.code == 2
    assert f"pip install '{fmt}'" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["checkpoint", "data"])
def test_an_out_that_holds_a_checkpoint_or_data_is_refused_and_kept(which, small, tiny_data,
                                                                    tmp_path, capsys):
    """`export RUN_DIR RUN_DIR/checkpoint-*.h5` overwrote the checkpoint it exported, and
    an OUT that was a data file lost the data: any HDF5 file is refused, and kept."""
    import shutil
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ck = run_dir / f"checkpoint-{STEP:09d}.h5"
    shutil.copy(small, ck)
    out = ck if which == "checkpoint" else tmp_path / "tiny.h5"
    if which == "data":
        shutil.copy(tiny_data, out)
    before = out.read_bytes()
    with pytest.raises(SystemExit) as exit_:
        export(run_dir, out, "--format", "safetensors")
    assert exit_.value.code == 2
    said = "the checkpoint being exported" if which == "checkpoint" else \
        "an HDF5 file (a checkpoint or a data file)"
    assert f"error: {out} is {said}, which the export would overwrite: name a new file for " \
           f"it\n" in capsys.readouterr().err
    assert out.read_bytes() == before


def test_a_run_directory_says_which_checkpoint_it_exports_and_which_it_passes_over(
        small, tmp_path, capsys):
    """A damaged newest checkpoint was passed over without a word: export and predict say
    so on stderr, and export's line names the checkpoint it took."""
    pytest.importorskip("safetensors")
    from PIL import Image
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    good, torn = run_dir / "checkpoint-000000007.h5", run_dir / "checkpoint-000000009.h5"
    good.write_bytes(open(small, "rb").read())
    torn.write_bytes(good.read_bytes()[:2000])
    export(run_dir, tmp_path / "m.safetensors")
    out, err = capsys.readouterr()
    assert f"python -m mpitrain export: passing over {torn}: cannot read checkpoint" in err, err
    assert out.startswith(f"{good} -> {tmp_path / 'm.safetensors'}: resnet_small, "), out
    image = tmp_path / "grey.png"
    Image.new("RGB", (32, 32), (128, 128, 128)).save(image)
    main(["predict", "--checkpoint", str(run_dir), str(image), "--json"])
    out, err = capsys.readouterr()
    assert f"python -m mpitrain predict: passing over {torn}: cannot read checkpoint" in err
    assert json.loads(out)["checkpoint"] == str(good)


def test_a_failed_write_leaves_out_as_it_was(small, tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    from mpitrain.tools import export as ex
    out = tmp_path / "m.safetensors"
    out.write_text("the previous export")

    def torn(path, data):                                 # dies half-way through the bytes
        with open(path, "wb") as f:
            f.write(data[:len(data) // 2])
        raise OSError("disk full")
    monkeypatch.setattr(ex, "_write_bytes", torn)
    with pytest.raises(OSError, match="disk full"):
        ex.export(small, "safetensors", str(out))
    assert out.read_text() == "the previous export"
    assert os.listdir(tmp_path) == ["m.safetensors"]      # no temporary file left


def test_a_sigterm_during_the_write_leaves_no_temporary_file(small, tmp_path):
    """SIGTERM's default action ended export where it stood, leaving its hidden temporary
    file, as large as the model, beside OUT for good: it now unwinds as Ctrl-C does."""
    pytest.importorskip("safetensors")
    out = tmp_path / "m.safetensors"
    out.write_text("the previous export")
    code = ("import os, signal, sys, time\n"
            "from mpitrain import cli\n"
            "from mpitrain.tools import export\n"
            "def write(path, data):                # half the bytes, then the signal\n"
            "    with open(path, 'wb') as f:\n"
            "        f.write(data[:len(data) // 2])\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(60)\n"
            "export._write_bytes = write\n"
            "cli.run(sys.argv[1:])\n")
    r = subprocess.run([sys.executable, "-c", code, "export", small, str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 143 and r.stderr.endswith("mpitrain: terminated, ending the job\n"), \
        (r.returncode, r.stderr)
    assert os.listdir(tmp_path) == ["m.safetensors"]
    assert out.read_text() == "the previous export"


# ----- predict -----
@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """(data dir, checkpoint) of resnet_small trained for one epoch on the digits."""
    root = tmp_path_factory.mktemp("digits")
    r = subprocess.run([sys.executable, "-m", "mpitrain", "train", "--data", "digits",
                        "--data-dir", str(root / "data"), "--run-dir", str(root / "run"),
                        "--epochs", "1", "--batch-size", "64", "--warmup-epochs", "0",
                        "--workers", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return root / "data", checkpoint.latest(str(root / "run"))


def digit_images(data_dir, folder, count):
    """The first `count` validation digits as 16-bit greyscale PNGs (the file's units),
    with their stored pixels."""
    from PIL import Image
    paths, pixels = [], []
    with Reader(str(data_dir / "digits_val.h5")) as reader:
        for i in range(count):
            p = reader.record(i)
            paths.append(str(folder / f"digit{i}.png"))
            Image.fromarray(p[..., 0]).save(paths[-1])
            pixels.append(p)
    return paths, pixels


def test_predict_names_digit_classes_and_agrees_with_eval(digits_run, tmp_path, capsys):
    from mpi4py import MPI

    from mpitrain.tools.evaluate import evaluate_checkpoint
    data_dir, path = digits_run
    images, pixels = digit_images(data_dir, tmp_path, 6)
    main(["predict", "--checkpoint", path, *images, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert [p["image"] for p in result["predictions"]] == images
    for item in result["predictions"]:
        top = item["top"]
        assert len(top) == 5 and all(t["class"] == str(t["index"]) for t in top)
        probs = [t["probability"] for t in top]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-9

    # eval scores the same images labelled with predict's top-1: every one must count
    with Reader(str(data_dir / "digits_train.h5")) as train:
        mean, std, names = train.mean, train.std, train.class_names
    labelled = str(tmp_path / "labelled.h5")
    with Writer(labelled, names, storage="pixels", pixel_dtype=np.uint16) as w:
        for p, item in zip(pixels, result["predictions"]):
            w.add(item["top"][0]["index"], p)
        w.commit(mean, std)
    scores = evaluate_checkpoint(path, labelled, batch_size=len(images), workers=1,
                                 device="cpu", comm=MPI.COMM_SELF)
    assert scores["top1"] == 1.0


def test_predict_text_and_eight_bit_images(digits_run, tmp_path, capsys):
    """An 8-bit image is scaled to the 16-bit digits' white level (1,024)."""
    from PIL import Image

    from mpitrain.tools.predict import load_model, preprocessing
    data_dir, path = digits_run
    (sixteen,), (p,) = digit_images(data_dir, tmp_path, 1)
    eight = str(tmp_path / "digit8.png")
    Image.fromarray(np.rint(p[..., 0] * (255 / 1024)).astype(np.uint8)).save(eight)
    prep = preprocessing(load_model(path)[1])
    assert prep.white == 1024 and prep.bits == 16 and prep.crop_fraction == 1.0
    x = np.empty((2, 32, 32, 3), np.float32)
    prep.load(sixteen, x[0])
    prep.load(eight, x[1])
    exact = (p - np.asarray(prep.mean)) / np.asarray(prep.std)
    assert np.abs(x[0] - exact).max() < 1e-5
    assert np.abs(x[1] - exact).max() < 0.5 * 1024 / 255 / prep.std[0] + 1e-5   # rounding

    main(["predict", "--checkpoint", path, sixteen, eight, "--top", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == sixteen and lines[4] == eight and len(lines) == 8
    assert all(line.strip().split()[1] in [str(c) for c in range(10)]
               for line in lines[1:4] + lines[5:])


def test_a_sixteen_bit_png_for_an_eight_bit_model_is_rounded_as_the_loader_rounds_it(
        small, tmp_path):
    """The loader reads a 16-bit grey PNG as 8 bits, rounded (augment.to_rgb); predict
    scaled it without rounding, up to half a grey level away from what training saw."""
    from PIL import Image

    from mpitrain.tools.predict import load_model, preprocessing
    p16 = np.random.default_rng(4).integers(0, 65536, (50, 60)).astype(np.uint16)
    sixteen, eight = str(tmp_path / "grey16.png"), str(tmp_path / "grey8.png")
    Image.fromarray(p16).save(sixteen)
    Image.fromarray(((p16.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8)).save(eight)
    prep = preprocessing(load_model(small)[1])
    assert prep.bits == 8
    x = np.empty((2, 32, 32, 3), np.float32)
    prep.load(sixteen, x[0])
    prep.load(eight, x[1])
    np.testing.assert_array_equal(x[0], x[1])


def test_predict_with_fewer_than_five_classes_and_stand_in_data(small, tiny_data, tmp_path,
                                                                capsys):
    from PIL import Image
    image = str(tmp_path / "photo.jpg")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 40, 3), np.uint8)).save(image)
    main(["predict", "--checkpoint", small, image, "--json"])
    top = json.loads(capsys.readouterr().out)["predictions"][0]["top"]
    assert sorted(t["class"] for t in top) == CLASSES               # all 3, by name
    probs = [t["probability"] for t in top]
    assert probs == sorted(probs, reverse=True) and abs(sum(probs) - 1) < 1e-9

    # a checkpoint whose training file is gone: refused, naming --data; --data fixes it
    model = randomised("resnet_small")
    gone = write_checkpoint(model, {"model": "resnet_small", "num_classes": 3, "image_size": 32,
                                    "data": str(tmp_path / "moved.h5"), "batch_size": 4},
                            tmp_path / "gone.h5")
    with pytest.raises(SystemExit) as exit_:
        main(["predict", "--checkpoint", gone, image])
    assert exit_.value.code == 2 and "pass --data FILE" in capsys.readouterr().err
    main(["predict", "--checkpoint", gone, image, "--data", tiny_data])
    assert capsys.readouterr().out.splitlines()[0] == image
    nothere = tmp_path / "nothere.h5"       # named by --data, not by the checkpoint
    with pytest.raises(SystemExit) as exit_:
        main(["predict", "--checkpoint", gone, image, "--data", str(nothere)])
    assert exit_.value.code == 2
    assert f"--data {nothere} does not exist; give the run's training file" \
        in capsys.readouterr().err

    # a config that carries mean and std needs no data file: classes by index
    carried = write_checkpoint(model, {"model": "resnet_small", "num_classes": 3,
                                       "image_size": 32, "data": "elsewhere.h5",
                                       "mean": [1, 2, 3], "std": [4, 5, 6], "batch_size": 4},
                               tmp_path / "carried.h5")
    main(["predict", "--checkpoint", carried, image, "--json"])
    top = json.loads(capsys.readouterr().out)["predictions"][0]["top"]
    assert sorted(t["class"] for t in top) == ["0", "1", "2"]


def test_an_unreadable_image_exits_2_naming_it(small, tmp_path, capsys):
    from PIL import Image
    good, bad, cut = (str(tmp_path / n) for n in ("good.png", "bad.png", "cut.png"))
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(good)
    with open(bad, "w") as f:
        f.write("not an image")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)).save(cut)
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) // 2)
    for image in (bad, cut, str(tmp_path / "missing.png")):
        with pytest.raises(SystemExit) as exit_:
            main(["predict", "--checkpoint", small, good, image])
        assert exit_.value.code == 2
        assert f"{image}: not" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:                 # a folder of images
        main(["predict", "--checkpoint", small, str(tmp_path)])
    assert exit_.value.code == 2
    assert f"{tmp_path} is a folder: give its image files ({tmp_path}/*.jpg)" \
        in capsys.readouterr().err


# ----- the ONNX file with its preprocessing: docs/export.md's recipe, predict --onnx -----
EXPORT_DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "export.md")


def onnx_recipe():
    """The Python block of docs/export.md's "The ONNX file in another program", as written
    there."""
    with open(EXPORT_DOC) as f:
        text = f.read()
    start = (text.index("```python\n", text.index("## The ONNX file in another program"))
             + len("```python\n"))
    return text[start:text.index("```", start)]


def odd_sized_images(folder, data_dir=None):
    """cat.jpg (8-bit RGB) and dog.png, 20 x 13 pixels, not the model's square: with
    data_dir, the first two validation digits stretched (dog.png 16-bit grey, in the
    digits' units), else colour gradients (dog.png 8-bit RGB)."""
    from PIL import Image
    rows, cols = np.arange(13) * 8 // 13, np.arange(20) * 8 // 20
    if data_dir is not None:
        with Reader(str(data_dir / "digits_val.h5")) as reader:
            a, b = (reader.record(i)[..., 0][rows][:, cols] for i in (0, 1))
        cat = np.repeat(np.rint(a * (255 / 1024)).astype(np.uint8)[..., None], 3, axis=2)
        dog = b.astype(np.uint16)
    else:
        y, x = np.mgrid[0:13, 0:20]
        cat = np.stack([x * 12, y * 19, (x + y) * 7], axis=2).astype(np.uint8)
        dog = np.stack([255 - x * 12, (x * y) % 256, y * 19], axis=2).astype(np.uint8)
    Image.fromarray(cat).save(folder / "cat.jpg", quality=95)
    Image.fromarray(dog).save(folder / "dog.png")
    return [str(folder / "cat.jpg"), str(folder / "dog.png")]


def all_probabilities(result, classes):
    """(images, classes) probabilities of predict's JSON result (its top covering all)."""
    p = np.full((len(result["predictions"]), classes), np.nan)
    for i, item in enumerate(result["predictions"]):
        for t in item["top"]:
            p[i, t["index"]] = t["probability"]
    return p


@pytest.mark.parametrize("which", ["digits", "small"])
def test_the_documented_onnx_recipe_gives_predicts_probabilities(which, request, tmp_path,
                                                                  monkeypatch, capsys):
    """Digits: crop fraction 1, a 16-bit training file; small: 0.875, 8-bit."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    if which == "digits":
        data_dir, path = request.getfixturevalue("digits_run")
        classes = 10
    else:
        data_dir, path, classes = None, request.getfixturevalue("small"), len(CLASSES)
    images = odd_sized_images(tmp_path, data_dir)
    export(path, "--format", "onnx", tmp_path / "model.onnx")
    capsys.readouterr()
    main(["predict", "--checkpoint", path, *images, "--top", str(classes), "--json"])
    theirs = all_probabilities(json.loads(capsys.readouterr().out), classes)

    monkeypatch.chdir(tmp_path)                 # the recipe names model.onnx, cat.jpg, dog.png
    scope = {}
    exec(onnx_recipe(), scope)
    assert scope["probabilities"].shape == theirs.shape
    assert np.abs(scope["probabilities"] - theirs).max() < 1e-3


def test_predict_onnx_compares_the_file_with_its_checkpoint(digits_run, tmp_path, capsys):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    data_dir, path = digits_run
    images = odd_sized_images(tmp_path, data_dir)
    model = str(tmp_path / "model.onnx")
    export(path, "--format", "onnx", model)
    capsys.readouterr()
    main(["predict", "--checkpoint", path, *images, "--json"])
    mine = json.loads(capsys.readouterr().out)["predictions"]

    main(["predict", "--onnx", model, "--checkpoint", path, *images, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["onnx"] == model and result["model"] == "resnet_small"
    assert result["comparison"]["max_difference"] < 1e-3
    assert result["comparison"] == {**result["comparison"], "checkpoint": path,
                                    "tolerance": 1e-3, "agree": True, "differing_metadata": []}
    for ours, theirs in zip(result["predictions"], mine):
        assert [t["class"] for t in ours["top"]] == [t["class"] for t in theirs["top"]]
        assert max(abs(a["probability"] - b["probability"])
                   for a, b in zip(ours["top"], theirs["top"])) < 1e-3

    main(["predict", "--onnx", model, "--checkpoint", path, *images, "--top", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == images[0] and len(lines) == 7
    assert lines[-1].startswith(f"ONNX vs checkpoint {path}: max |p_onnx - p_checkpoint| = ")
    assert lines[-1].endswith("(tolerance 0.001): agree")
    main(["predict", "--onnx", model, *images, "--top", "2"])      # the file alone
    assert capsys.readouterr().out.splitlines() == lines[:-1]
    # a file whose preprocessing is not the checkpoint's: status 1, naming the field
    proto = onnx.load(model)
    next(p for p in proto.metadata_props if p.key == "crop_fraction").value = "0.5"
    wrong = str(tmp_path / "wrong.onnx")
    onnx.save(proto, wrong)
    with pytest.raises(SystemExit) as exit_:
        main(["predict", "--onnx", wrong, "--checkpoint", path, *images])
    assert exit_.value.code == 1
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        ": DISAGREE; the file's preprocessing differs from the checkpoint's in crop_fraction")
    main(["predict", "--onnx", wrong, "--checkpoint", path, *images, "--tolerance", "1"])
    assert capsys.readouterr().out.splitlines()[-1].endswith("(tolerance 1): agree")


def test_preprocessing_round_trips_through_the_metadata(small):
    from mpitrain.tools.predict import PredictError, Preprocessing, load_model, preprocessing
    cfg = load_model(small)[1]
    assert preprocessing({**cfg, "crop_fraction": 0.5}).crop_fraction == 0.5   # train's option
    prep = preprocessing(cfg)
    assert prep.crop_fraction == 0.875
    meta = prep.metadata()
    assert Preprocessing.from_metadata(meta, prep.source) == prep
    # a file exported before pixel_bits was recorded: the config's rule (8 bits to 255)
    older = {k: v for k, v in meta.items() if k != "pixel_bits"}
    assert Preprocessing.from_metadata(older, prep.source) == prep
    with pytest.raises(PredictError, match="cannot prepare an image"):
        Preprocessing.from_metadata({**meta, "std": "[1, 0, 1]"})
    with pytest.raises(PredictError, match="has no 'mean' in its metadata"):
        Preprocessing.from_metadata({k: v for k, v in meta.items() if k != "mean"})


@pytest.mark.parametrize("argv,message", [
    (["{image}"], "give --checkpoint (a checkpoint or run directory), --onnx FILE"),
    (["--onnx", "{tmp}/none.onnx", "{image}"], "ONNX file {tmp}/none.onnx does not exist"),
    (["--checkpoint", "{small}", "--tolerance", "0.1", "{image}"],
     "--tolerance is for the comparison of --onnx FILE with --checkpoint"),
    (["--onnx", "{text}", "--data", "{text}", "{image}"], "--data stands in for the checkpoint"),
    (["--onnx", "{text}", "--checkpoint", "{small}", "--tolerance", "-1", "{image}"],
     "argument --tolerance: -1 must be > 0.0"),
])
def test_predict_onnx_refuses_with_exit_2_naming_the_problem(argv, message, small, tmp_path,
                                                             capsys):
    text = tmp_path / "notes.onnx"
    text.write_text("not a model")
    fill = {"tmp": tmp_path, "small": small, "text": text, "image": tmp_path / "i.png"}
    with pytest.raises(SystemExit) as exit_:
        main(["predict", *[a.format(**fill) for a in argv]])
    assert exit_.value.code == 2
    assert message.format(**fill) in capsys.readouterr().err


def test_predict_onnx_names_a_missing_onnxruntime_and_a_file_not_exported(small, tmp_path,
                                                                          capsys, monkeypatch):
    text = tmp_path / "notes.onnx"
    text.write_text("not a model")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "onnxruntime", None)       # import fails as if not installed
        with pytest.raises(SystemExit) as exit_:
            main(["predict", "--onnx", str(text), str(tmp_path / "i.png")])
    assert exit_.value.code == 2 and "pip install onnxruntime" in capsys.readouterr().err

    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    model = tmp_path / "model.onnx"
    export(small, "--format", "onnx", model)
    proto = onnx.load(str(model))
    del proto.metadata_props[:]                           # a graph without the preprocessing
    bare = tmp_path / "bare.onnx"
    onnx.save(proto, str(bare))
    for path, said in ((text, f"{text}: onnxruntime cannot load it"),
                       (bare, f"{bare} has no 'pixel_max' in its metadata")):
        with pytest.raises(SystemExit) as exit_:
            main(["predict", "--onnx", str(path), str(tmp_path / "i.png")])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
