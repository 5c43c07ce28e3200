"""Spider's training library, one job per module, and its commands.

The run: ``train`` (what ``train_hf.py`` / ``spider-train`` launches: wires the pieces below), ``arguments``
(``SpiderTrainingArguments``: every setting of a run, and its command line), ``trainer`` (``SpiderTrainer``, the
``transformers.Trainer`` subclass), ``console`` (start-up summary, quiet imports).
Data: ``data`` (byte-level datasets: local text encoded once into a memory-mapped byte cache, byte shards, streamed
sources that resume from a saved position, rank/worker sharding).
Speed and precision, applied to the model from here: ``fp8`` (FP8 per layer where it measured faster),
``tile_kernels_moe`` (TileKernels MoE kernels, CPU fallbacks), ``compile`` (per-layer ``torch.compile``), ``sdpa``
(attention kernels), ``mixed_precision`` (bf16 autocast around the experts), ``optim`` (Muon + AdamW).
Measuring itself: ``throughput`` (FLOPs, MFU), ``step_times`` (step wall times), ``profiling`` (host syncs),
``metrics`` (held-out bits per byte), ``evaluation`` (a model judged on held-out text, ``spider-evaluate``),
``memory_plan`` (memory on paper), ``peers`` (the DeepseekV3 peer's config, the dense peers').
Robustness: ``checkpointing`` (atomic checkpoints), ``preemption`` (graceful stop), ``nonfinite`` (skipped NaN steps),
``run_lock`` (one run per output folder).
Releases: ``release`` (the folder ``from_pretrained`` loads), ``model_card``, ``hub`` (pushes that never stall
training), ``sft`` (TRL fine-tuning).
Commands (``commands/``: ``spider-serve``, ``spider-generate``, ``spider-evaluate``, ``spider-compute-map``,
``spider-write-shards``, ``spider-convert-tk-train``, ``spider-measure-fp8-gemms``, ``spider-measure-sdpa-backends``);
``shapes``: their ``BATCHxBYTES`` flags, parsed without importing torch.
Old module paths kept as aliases, with the version that removes each: ``compatibility``."""
