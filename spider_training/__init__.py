"""Training components for Spider, one job per module: ``data`` (byte-level datasets: text sources encoded on the fly,
byte shards read through ``np.memmap``, rank/worker sharding, the mock corpus; ``write_shards`` is its shard writer
command), ``fp8`` (FP8 training setup), ``tile_kernels_moe`` (TileKernels MoE kernels with CPU fallbacks),
``checkpointing`` (saving and resuming training state), ``hub`` (Hugging Face Hub upload), ``trainer`` (the
``transformers.Trainer`` subclass), ``train`` (the run ``train_hf.py`` launches), ``console`` (its start-up summary and
quiet imports), ``arguments`` (``SpiderTrainingArguments``, every setting of a run, and its command line) and
``convert_tk_train`` (tk-train.py's ``.pt`` checkpoints -> safetensors, through the weights-only unpickler)."""
