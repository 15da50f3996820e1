"""Non-finite numbers are never a result: a checkpoint with NaN weights is refused by
eval, export and predict (exit 2, naming the tensor); a model whose logits overflow
scores them as wrong and the command fails (exit 1, saying how many); equal logits
score as argmax picks, not all right; data files with a NaN mean or std are refused when
opened; predict --json stays JSON."""
import json

import h5py
import numpy as np
import pytest

from test_bad_input import quick, refused
from test_checkpoint import run
from mpitrain import checkpoint
from test_export import CLASSES, Solo, randomised, tiny_data  # noqa: F401 (a fixture)


def write_checkpoint(model, cfg, path):
    """Checkpoint `model` as one rank writes it."""
    return checkpoint.write(str(path), checkpoint.collect(model, Solo(), 0, 0, 7, cfg))


def checkpoint_of(model, tiny_data, path):
    return write_checkpoint(model, {"model": "resnet_small", "num_classes": len(CLASSES),
                                    "image_size": 32, "data": tiny_data, "data_dir": "data",
                                    "batch_size": 6}, path)


@pytest.fixture(scope="module")
def nan_checkpoint(tiny_data, tmp_path_factory):
    """resnet_small with one NaN in its first convolution's weights."""
    model = randomised("resnet_small")
    name, p = next(iter(model.named_params()))
    p.master.reshape(-1)[5] = np.nan
    model.arena.sync_working()
    return name, checkpoint_of(model, tiny_data, tmp_path_factory.mktemp("nan") / "nan.h5")


@pytest.fixture(scope="module")
def overflowing(tiny_data, tmp_path_factory):
    """resnet_small whose finite classifier weights are so large that every logit
    overflows float32."""
    model = randomised("resnet_small")
    list(model.named_params())[-2][1].master[...] = 3e38
    model.arena.sync_working()
    return checkpoint_of(model, tiny_data, tmp_path_factory.mktemp("big") / "big.h5")


@pytest.fixture(scope="module")
def constant(tiny_data, tmp_path_factory):
    """resnet_small whose classifier's weights and bias are zero: every logit is 0."""
    model = randomised("resnet_small")
    for _, p in list(model.named_params())[-2:]:
        p.master[...] = 0
    model.arena.sync_working()
    return checkpoint_of(model, tiny_data, tmp_path_factory.mktemp("zero") / "zero.h5")


def no_nan(text):
    def refuse(constant):
        raise AssertionError(f"{constant} in JSON: {text}")
    return json.loads(text, parse_constant=refuse)


def test_eval_refuses_a_checkpoint_with_nan_weights(nan_checkpoint, tiny_data):
    name, path = nan_checkpoint
    r = quick("eval", "--checkpoint", path, "--data", tiny_data)
    refused(r, f"checkpoint {path} holds non-finite values (inf or NaN) in 1 tensor(s): {name}",
            "use an earlier checkpoint")
    assert "top-1" not in r.stdout


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.launches)])
def test_eval_of_overflowing_logits_counts_them_wrong_and_fails(overflowing, tiny_data, ranks):
    """Each rank scores 6 / ranks images: the non-finite ones are summed over the ranks."""
    args = ("eval", "--checkpoint", overflowing, "--data", tiny_data, "--json")
    r = quick(*args) if ranks == 1 else run(ranks, *args)
    assert r.returncode == 1, r.stdout + r.stderr
    result = no_nan(r.stdout)
    assert result["top1"] == 0.0 and result["nonfinite"] == 6 and result["images"] == 6
    assert "6 of 6 images gave non-finite logits (inf or NaN) and were counted wrong" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_model_whose_logits_are_all_equal_is_right_only_on_the_first_class(constant,
                                                                           tiny_data):
    """Tied logits go to the lower class, as argmax (and predict) breaks ties: the 2 of
    the 6 images that are of class 0, not all of them."""
    r = quick("eval", "--checkpoint", constant, "--data", tiny_data, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    result = no_nan(r.stdout)
    assert result["images"] == 6 and result["top1"] == pytest.approx(2 / 6), result


@pytest.mark.parametrize("fmt", ["safetensors", "onnx"])
def test_export_refuses_nan_weights_and_writes_nothing(nan_checkpoint, tmp_path, fmt):
    pytest.importorskip(fmt)
    name, path = nan_checkpoint
    r = quick("export", path, "--format", fmt, str(tmp_path / f"m.{fmt}"))
    refused(r, f"holds non-finite values (inf or NaN) in 1 tensor(s): {name}")
    assert list(tmp_path.iterdir()) == []


def test_predict_refuses_nan_weights(nan_checkpoint, tmp_path):
    from PIL import Image
    image = str(tmp_path / "a.png")
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(image)
    name, path = nan_checkpoint
    refused(quick("predict", "--checkpoint", path, image, "--json"),
            f"in 1 tensor(s): {name}")


def test_predict_json_of_overflowing_logits_is_json_with_an_error(overflowing, tmp_path):
    from PIL import Image
    image = str(tmp_path / "a.png")
    Image.fromarray(np.full((40, 40, 3), 200, np.uint8)).save(image)
    r = quick("predict", "--checkpoint", overflowing, image, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    (item,) = no_nan(r.stdout)["predictions"]
    assert item["top"] is None and "not finite" in item["error"]
    text = quick("predict", "--checkpoint", overflowing, image)
    assert text.stdout.splitlines()[1].strip().startswith("the model's logits for this image")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_checkpoint_config_with_non_finite_normalisation_is_refused(tiny_data, tmp_path, value):
    from PIL import Image
    image = str(tmp_path / "a.png")
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(image)
    path = write_checkpoint(randomised("resnet_small"), {
        "model": "resnet_small", "num_classes": 3, "image_size": 32, "data": "elsewhere.h5",
        "mean": [1.0, value, 3.0], "std": [4, 5, 6], "batch_size": 4}, tmp_path / "c.h5")
    refused(quick("predict", "--checkpoint", path, image), "the checkpoint's normalisation mean")


# ----- data files -----
def with_stats(src, dst, **stats):
    with h5py.File(src, "r") as f, h5py.File(dst, "w") as g:
        for key in f:
            f.copy(key, g)
        g.attrs.update(f.attrs)
        for key, value in stats.items():
            g[key][...] = value


@pytest.mark.parametrize("which", ["training", "validation"])
@pytest.mark.parametrize("stat", ["mean", "std"])
def test_a_data_file_with_a_nan_statistic_is_refused_when_opened(which, stat, tmp_path):
    from mpitrain.datasets.convert import convert_synthetic
    train, val = str(tmp_path / "s.h5"), str(tmp_path / "s_val.h5")
    convert_synthetic(train, 32, (24, 24), classes=2)
    convert_synthetic(val, 8, (24, 24), classes=2)
    bad = str(tmp_path / "bad.h5")
    with_stats(train if which == "training" else val, bad, **{stat: [np.nan, 1.0, 1.0]})
    files = (bad, val) if which == "training" else (train, bad)
    r = quick("train", "--data", files[0], "--val-data", files[1], "--batch-size", "8",
              "--epochs", "1", "--run-dir", str(tmp_path / "run"))
    refused(r, f"{bad}: {stat} must be", "convert the data again")
    assert "try a lower --lr" not in r.stderr
    assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.launches)])
def test_train_whose_validation_logits_overflow_fails_its_final_line(tmp_path, ranks):
    """A training file whose std is so small that normalised pixels overflow: under fp16's
    loss scaling every step is skipped, and validation, which normalises as the training
    file does, gets NaN logits only. The run says so and exits 1, never 100%."""
    from mpitrain.datasets.convert import convert_synthetic
    train, val = str(tmp_path / "s.h5"), str(tmp_path / "s_val.h5")
    convert_synthetic(str(tmp_path / "t.h5"), 32, (24, 24), classes=2)
    with_stats(str(tmp_path / "t.h5"), train, std=[1e-30] * 3)
    convert_synthetic(val, 8, (24, 24), classes=2)
    args = ("train", "--data", train, "--val-data", val, "--batch-size", "8", "--epochs", "1",
            "--image-size", "24", "--workers", "1", "--precision", "fp16",
            "--run-dir", str(tmp_path / "run"))
    r = quick(*args) if ranks == 1 else run(ranks, *args)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "final validation accuracy: 0.00% top-1 (8 images" in r.stdout
    assert "not a result" in r.stdout and "100.00%" not in r.stdout
    assert ("the final evaluation: 8 of 8 images gave non-finite logits (inf or NaN) and were "
            "counted wrong") in r.stderr
    evals = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")
             if '"eval"' in x]
    assert evals[-1]["nonfinite"] == 8 and evals[-1]["top1"] == 0.0
    # its checkpoint is not a model to resume, evaluate or export
    assert "no checkpoint of the final model: those from step 4 on, whose logits were not " \
           "finite, were set aside as diverged-*; the last good checkpoint is none" in r.stdout
    assert sorted(p.name for p in (tmp_path / "run").glob("*checkpoint*")) \
        == ["diverged-checkpoint-000000004.h5"]


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.launches)])
def test_training_losses_that_are_not_finite_are_said_never_averaged_as_zero(tmp_path, ranks):
    """A training file whose std overflows its normalised pixels: under fp16's loss scaling
    every step's loss is NaN and the step is skipped. Each line says the loss is not
    finite (null in metrics.jsonl, with how many were not), never a mean of 0."""
    from mpitrain.datasets.convert import convert_synthetic
    train, val = str(tmp_path / "s.h5"), str(tmp_path / "s_val.h5")
    convert_synthetic(str(tmp_path / "t.h5"), 32, (24, 24), classes=2)
    with_stats(str(tmp_path / "t.h5"), train, std=[1e-30] * 3)
    convert_synthetic(val, 8, (24, 24), classes=2)
    args = ("train", "--data", train, "--val-data", val, "--batch-size", "8", "--epochs", "1",
            "--image-size", "24", "--workers", "1", "--precision", "fp16", "--log-every", "2",
            "--run-dir", str(tmp_path / "run"))
    r = quick(*args) if ranks == 1 else run(ranks, *args)
    assert "step 2/4  loss not finite  top1 0.0%" in r.stdout, r.stdout + r.stderr
    assert "loss 0.0000" not in r.stdout
    steps = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl") if '"step"' in x]
    assert [(s["loss"], s["losses_not_finite"]) for s in steps] == [(None, 2 * ranks)] * 2


def test_a_sixteen_bit_file_without_a_white_level_is_refused(tmp_path):
    """All-black 16-bit pixels: the white level an 8-bit image is scaled to would be 0."""
    from mpitrain.datasets.h5format import Writer
    black = str(tmp_path / "black.h5")
    with Writer(black, ["a", "b"], storage="pixels", pixel_dtype=np.uint16) as w:
        for i in range(16):
            w.add(i % 2, np.zeros((8, 8, 3), np.uint16))
        w.commit([0.0] * 3, [1.0] * 3)
    (tmp_path / "black_val.h5").write_bytes((tmp_path / "black.h5").read_bytes())
    r = quick("train", "--data", black, "--val-data", str(tmp_path / "black_val.h5"),
              "--batch-size", "8", "--run-dir", str(tmp_path / "run"))
    refused(r, f"{black}: its 16-bit images are all black")
