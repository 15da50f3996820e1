"""Which cuDNN plans are timed, and the disk cache of the chosen ones (kernels/cudnn.py):
the rules a CPU can check. The timing itself runs in the `gpu` tests."""
import json
import os

import numpy as np
import pytest

from mpitrain.kernels import cudnn


def test_the_first_plans_are_timed_and_every_plan_where_the_input_has_few_channels():
    never = lambda i: False                                       # noqa: E731
    assert cudnn.plans_to_time(30, 64, never) == list(range(cudnn.TUNE_PLANS))
    assert cudnn.plans_to_time(5, 64, never) == list(range(5))
    assert cudnn.plans_to_time(30, 3, never) == list(range(30))
    assert cudnn.plans_to_time(30, cudnn.TUNE_ALL_BELOW_CHANNELS, never) == list(range(8))


def test_plans_compiled_at_run_time_are_timed_only_the_first_few():
    compiled = {1, 4, 5, 9, 20}
    got = cudnn.plans_to_time(30, 3, lambda i: i in compiled)
    kept = sorted(compiled)[:cudnn.TUNE_COMPILED]
    assert got == [i for i in range(30) if i not in compiled or i in kept]
    assert cudnn.plans_to_time(8, 64, lambda i: True) == list(range(cudnn.TUNE_COMPILED))


def test_the_cache_key_names_the_geometry_the_device_and_the_versions(monkeypatch):
    x, w = np.empty((2, 8, 8, 3), np.float16), np.empty((4, 3, 3, 3), np.float16)
    y = np.empty((2, 8, 8, 4), np.float16)
    key = cudnn.plan_key("fprop", x, w, y, 1, 1, "GPU sm_90")
    assert key.startswith("fprop|(2, 8, 8, 3)|(4, 3, 3, 3)|(2, 8, 8, 4)|<f2|<f2|<f2|1|1|")
    assert "GPU sm_90" in key
    assert key != cudnn.plan_key("fprop", x, w, y, 1, 1, "GPU sm_80")
    assert key != cudnn.plan_key("fprop", x, w, y.astype(np.float32), 1, 1, "GPU sm_90")
    assert key != cudnn.plan_key("wgrad", x, w, y, 1, 1, "GPU sm_90")
    monkeypatch.setattr(cudnn, "DETERMINISTIC", False)
    assert key != cudnn.plan_key("fprop", x, w, y, 1, 1, "GPU sm_90")


def test_chosen_plans_are_kept_in_one_file_replaced_whole(tmp_path):
    path = str(tmp_path / "sub" / "plans.json")
    assert cudnn.load_plans(path) == {}
    cudnn.save_plan("a", "eng0_k2=1", path)
    cudnn.save_plan("b", "eng7", path)
    assert cudnn.load_plans(path) == {"a": "eng0_k2=1", "b": "eng7"}
    assert json.loads(open(path).read()) == {"a": "eng0_k2=1", "b": "eng7"}
    assert sorted(os.listdir(tmp_path / "sub")) == ["plans.json", "plans.json.lock"]  # no .tmp
    with open(path, "w") as f:
        f.write('{"a": ')                                          # a torn file: tuned again
    assert cudnn.load_plans(path) == {}
    cudnn.save_plan("c", "eng1", path)
    assert cudnn.load_plans(path) == {"c": "eng1"}
    cudnn.save_plan("d", "eng1", "")                               # "": memory only
    assert cudnn.load_plans("") == {}


def test_writers_at_once_each_add_their_plans_to_the_others(tmp_path):
    """Every rank of a job may tune and save at the same time into the one file: two
    processes and two threads of each, 60 plans apiece, leave all 240 (a writer once kept
    only its own reading's entries, and writers of the same pid, as on two hosts or in
    two threads, removed each other's temporary file)."""
    import subprocess
    import sys
    path = str(tmp_path / "plans.json")
    code = ("import sys, threading\n"
            "from mpitrain.kernels import cudnn\n"
            "def save(t):\n"
            "    for i in range(60):\n"
            "        cudnn.save_plan(f'{sys.argv[2]}-{t}-{i}', 'eng0', sys.argv[1])\n"
            "threads = [threading.Thread(target=save, args=(t,)) for t in range(2)]\n"
            "[t.start() for t in threads]; [t.join() for t in threads]\n")
    writers = [subprocess.Popen([sys.executable, "-c", code, path, str(w)],
                                stderr=subprocess.PIPE, text=True) for w in range(2)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0], [w.stderr.read() for w in writers]
    assert sorted(cudnn.load_plans(path)) == sorted(f"{w}-{t}-{i}" for w in range(2)
                                                    for t in range(2) for i in range(60))
    assert sorted(os.listdir(tmp_path)) == ["plans.json", "plans.json.lock"]


def test_a_matrix_is_described_as_it_lies_in_memory_transposed_views_too():
    a = np.empty((3, 5), np.float16)
    assert cudnn._matrix(a) == ([1, 3, 5], [15, 5, 1])
    assert cudnn._matrix(a.T) == ([1, 5, 3], [15, 1, 5])       # the same memory, read down
    assert cudnn._nhwc(np.empty((2, 4, 6, 3))) == ([2, 3, 4, 6], [72, 1, 18, 3])


@pytest.mark.gpu
def test_cudnn_matmul_refuses_fp32_whose_products_would_run_in_tf32():
    import cupy
    a = cupy.ones((4, 4), cupy.float32)
    with pytest.raises(cudnn.Unsupported, match="fp16 only"):
        cudnn.matmul(a, a)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False)])
def test_cudnn_matmul_of_plain_and_transposed_operands_against_float64(dtype, ta, tb):
    """The fully connected layer's three products: x W^T, dy W and dy^T x."""
    import cupy
    rng = np.random.default_rng(0)
    M, K, N = 37, 70, 24
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(dtype)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(dtype)
    a_d, b_d = cupy.asarray(a), cupy.asarray(b)
    a_d, b_d, a, b = (a_d.T if ta else a_d), (b_d.T if tb else b_d), (a.T if ta else a), \
        (b.T if tb else b)
    got = cupy.asnumpy(cudnn.matmul(a_d, b_d))
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert got.dtype == dtype and got.shape == (M, N)
    # fp32 sums either way; fp16: the result rounded once
    np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == np.float32 else 1e-3,
                               atol=1e-4 if dtype == np.float32 else 2e-2)


def test_only_an_input_with_fewer_channels_than_the_pad_is_considered_for_padding(monkeypatch):
    """padded_channels keeps C (and touches no GPU) where C is PAD_CHANNELS or more, or
    where padding is off (PAD_CHANNELS 0); bench step prints what it chose and measured."""
    from mpitrain.tools.bench.step import padding_line
    for C in (cudnn.PAD_CHANNELS, 8, 64):
        x, w = np.empty((2, 8, 8, C), np.float16), np.empty((4, 3, 3, C), np.float16)
        assert cudnn.padded_channels(x, w, 1, 1) == C
    monkeypatch.setattr(cudnn, "PAD_CHANNELS", 0)
    x, w = np.empty((2, 8, 8, 3), np.float16), np.empty((4, 3, 3, 3), np.float16)
    assert cudnn.padded_channels(x, w, 1, 1) == 3
    assert cudnn.padding_report() == []
    measured = {"x": [256, 224, 224, 3], "w": [64, 7, 7, 3], "dtype": "float16", "channels": 4,
                "ms": {"3": 1.5, "4": 1.25}}
    assert padding_line(measured) == (
        "first convolution (256x224x224x3, float16): input on 4 channels (pad, forward and "
        "weight gradient: 3 channels 1.500 ms against 4 channels 1.250 ms)")
    assert padding_line(dict(measured, ms=None)).endswith(
        "input on 4 channels, as chosen before (plan cache)")
