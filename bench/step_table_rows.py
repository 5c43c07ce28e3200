"""The step table's rows and shapes by name (:mod:`bench.step_table` runs them), without importing torch:
``python -m bench.gpu_check`` checks ``--step_table_models`` against them before it imports the models, so a bad flag
costs an interpreter start."""

STEP_TABLE_SHAPES = ((32, 256), (8, 2048))
#: the compiled FP8 rows (on request; issue 51): row -> (torchao recipe, ``--fp8_experts``). FP8 is judged under
#: ``torch.compile``, where torchao states its gains (eager ``Float8Linear`` pays separate amax and cast kernels)
FP8_COMPILED_ROWS = {
    "spider_fp8_compiled": ("tensorwise", "auto"),
    "spider_fp8_bf16_experts_compiled": ("tensorwise", "off"),
    "spider_fp8_rowwise_compiled": ("rowwise", "auto"),
}
#: the step table's rows at each shape (bench/README.md, "Module notes": the order they run in)
STEP_TABLE_MODELS = ("spider", "spider_word_rate", "deepseek_v3", "llama_dense", "spider_fp8", "spider_compiled")
#: every row kind ``--step_table_models`` may name (``spider_eager_experts``: the experts looped over, as the
#: per-expert layout ran them)
STEP_TABLE_MODEL_CHOICES = (
    *STEP_TABLE_MODELS,
    "spider_eager_experts",
    "spider_word_rate_compiled",
    "spider_tk_train_recipe_compiled",
    "spider_compiled_automatic_dynamic",
    *FP8_COMPILED_ROWS,
)
#: row names of earlier versions, still accepted by ``--step_table_models`` (tk-train.py was called "the seed")
DEPRECATED_ROW_NAMES = {"spider_seed_recipe_compiled": "spider_tk_train_recipe_compiled"}
#: tk-train.py's micro-batch (``tk-train.py``: 112 windows of 256 bytes, activation checkpointing): the
#: ``spider_tk_train_recipe`` row after the table
TK_TRAIN_RECIPE_SHAPE = (112, 256)
