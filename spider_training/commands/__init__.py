"""Spider's commands, one module each; installed as console scripts (setup.cfg) and runnable with ``python -m``:

- ``spider-serve`` (:mod:`.serve`): serve a release over HTTP in the shape of OpenAI's API.
- ``spider-generate`` (:mod:`.generate`): sample text from a release (or an untrained preset) on the command line.
- ``spider-evaluate`` (:mod:`.evaluate`): held-out bits per byte of a release (:mod:`spider_training.evaluation`).
- ``spider-compute-map`` (:mod:`.compute_map`): where a release spends its compute on a text, as HTML and PNG.
- ``spider-write-shards`` (:mod:`.write_shards`): encode text into byte shards for training.
- ``spider-convert-tk-train`` (:mod:`.convert_tk_train`): tk-train.py's ``.pt`` checkpoints into safetensors releases.
- ``spider-measure-fp8-gemms`` (:mod:`.measure_fp8_gemms`): the FP8 GEMM table ``--fp8_layers auto`` reads, measured
  on the GPU at hand.
- ``spider-measure-sdpa-backends`` (:mod:`.measure_sdpa_backends`): which SDPA kernel ``--sdpa_backend`` should pick
  on the GPU at hand.
- ``spider-memory-plan`` (:mod:`.memory_plan`): the GPU memory a preset needs at a sequence length, per GPU for
  DDP and FSDP2, on paper.

Training itself is ``spider-train`` / ``train_hf.py`` (:mod:`spider_training.train`). The old paths
``spider_training.<command>`` are aliases until 0.3.0 (:mod:`spider_training.compatibility`).
"""
