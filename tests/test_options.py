"""The train options are declared once (mpitrain/options.py): the command line, YAML
files, Config and the docs' table are all made from that table."""
import os

import pytest
import yaml

from mpitrain.options import BY_NAME, DEFAULTS, OPTIONS, Config, markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_docs_table_is_the_one_the_declarations_make():
    with open(os.path.join(ROOT, "docs", "train-options.md")) as f:
        assert f.read() == markdown(), \
            "docs/train-options.md is stale: python -m mpitrain.options > docs/train-options.md"


def test_every_option_is_a_train_flag_with_its_default():
    from mpitrain.cli import build_parser
    args = vars(build_parser().parse_args(["train"]))
    for option in OPTIONS:
        assert args[option.name] == option.default, option.name
    assert set(args) - set(DEFAULTS) == {"command", "command_parser", "config"}


def test_the_choices_are_those_of_the_code_that_takes_them():
    from mpitrain.comm import ALGORITHMS
    from mpitrain.datasets.augment import RATIO, SCALE
    from mpitrain.nets import MODELS
    from mpitrain.optim import OPTIMIZERS
    from mpitrain.options import CROP_RATIO, CROP_SCALE
    assert BY_NAME["allreduce"].choices == ALGORITHMS
    assert set(BY_NAME["model"].choices) == set(MODELS)
    assert set(BY_NAME["optimizer"].choices) == set(OPTIMIZERS)
    assert (CROP_SCALE, CROP_RATIO) == (SCALE, RATIO)


@pytest.mark.parametrize("flag_value,python_value", [
    (["--lr", "0.05"], dict(lr=0.05)),
    (["--milestones", "3", "6"], dict(milestones=[3, 6])),
    (["--crop-scale", "0.35", "1"], dict(crop_scale=(0.35, 1.0))),
    (["--fusion-threshold", "auto"], dict(fusion_threshold="auto")),
    (["--loss-scale", "dynamic"], dict(loss_scale="dynamic")),
    (["--no-overlap"], dict(overlap=False)),
    (["--shard-update"], dict(shard_update=True)),
])
def test_a_value_means_the_same_as_a_flag_in_yaml_and_in_python(flag_value, python_value,
                                                                 tmp_path):
    from mpitrain.cli import apply_config_file, build_parser
    parser = build_parser()
    from_flag = Config(**{k: v for k, v in vars(parser.parse_args(["train", *flag_value]))
                          .items() if k in DEFAULTS})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({k.replace("_", "-"): list(v) if isinstance(v, tuple) else v
                                    for k, v in python_value.items()}))
    argv = ["train", "--config", str(path)]
    args = parser.parse_args(argv)
    apply_config_file(args, parser, argv)
    from_yaml = Config(**{k: v for k, v in vars(args).items() if k in DEFAULTS})
    assert from_flag == from_yaml == Config(**python_value)
    assert from_flag.changed() == {k: tuple(v) if isinstance(v, list) else v
                                   for k, v in python_value.items()}


@pytest.mark.parametrize("values,message", [
    (dict(lr=0), "--lr: 0 must be > 0.0"),
    (dict(epochs=2.5), "--epochs: '2.5' is not a valid int"),
    (dict(model="resnet7"), "--model: 'resnet7': choose from"),
    (dict(crop_scale=[0.5]), "--crop-scale: .*2 values expected"),
    (dict(nesterov="yes"), "--nesterov: 'yes' is not true or false"),
    (dict(density=0), "--density: 0 must be > 0.0"),
    (dict(loss_scale=1e39), "--loss-scale: '1e\\+39' is beyond fp32's range"),
    (dict(batchsize=64), "unknown training options: batchsize"),
])
def test_a_bad_value_is_refused_naming_its_flag(values, message):
    with pytest.raises(ValueError, match=message):
        Config(**values)


def test_poly_power_shapes_the_learning_rate_of_a_run(digits, tmp_path):
    """--schedule poly --poly-power 1: each logged step's rate is the linear decay's
    (optim.learning_rate with power 1), not the default power 2's."""
    import subprocess
    import sys

    from launcher import environment
    from mpitrain.metrics import read_metrics
    from mpitrain.optim import learning_rate
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "mpitrain", "train", "--data-dir", str(digits),
                        "--run-dir", str(run_dir), "--epochs", "2", "--batch-size", "128",
                        "--schedule", "poly", "--poly-power", "1", "--warmup-epochs", "0",
                        "--log-every", "3", "--model", "resnet_small"],
                       capture_output=True, text=True, timeout=300, env=environment(1))
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [s for s in read_metrics(str(run_dir / "metrics.jsonl")) if s["kind"] == "step"]
    per_epoch = max(s["step"] for s in steps)
    assert len(steps) >= 3
    for s in steps:
        at = s["epoch"] - 1 + s["step"] / per_epoch
        assert s["lr"] == pytest.approx(learning_rate(at, 0.1, 2, 0.0, "poly", power=1.0))
        if 0 < at < 2:
            assert s["lr"] != pytest.approx(learning_rate(at, 0.1, 2, 0.0, "poly"))
