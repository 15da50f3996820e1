"""The commands around training, each reached through `python -m mpitrain <command>`
(mpitrain/cli.py). They use the core (mpitrain/, nets/, kernels/, datasets/); the core
never imports them.

    evaluate.py      eval: top-1/top-5 of a checkpoint on a data file, distributed
    plot.py          plot: PNG curves of a run's metrics, and the batch study's plot
    predict.py       predict: top-k classes of image files under a checkpoint's model
    onnx_predict.py  predict --onnx: an exported ONNX file under onnxruntime
    export.py        export: a checkpoint's model as safetensors or ONNX
    preview.py       preview: one batch as the loader gives it, as a PNG grid
    inspect.py       inspect: the table of layers, their shapes, parameters and MACs
    study.py         study large-batch: accuracy against the global batch
    simulate.py      simulate: the alpha-beta cost model of a step on N ranks
    check_gpu.py     check-gpu: prove the GPU path on a GPU machine
    bench/           bench step, update, comm, data: the benchmarks

Nothing is imported here: `python -m mpitrain.tools.check_gpu` runs with the standard
library alone.
"""
