"""pytest configuration for Spider's tests.

* Registers the ``slow`` marker (end-to-end tests; deselect with ``-m "not slow"``) and the markers that
  transformers' common test suites and ``transformers.testing_utils`` decorators put on tests
  (``flash_attn_test``, ``torch_compile_test``, ``is_training_test``, ...), so ``--strict-markers`` works.
* Adds transformers' shared command-line option ``--make-reports`` (as
  ``transformers.testing_utils.pytest_addoption_shared`` does). Upstream's own conftest is not used: it needs
  pytest-xdist and the full upstream checkout.

* Seeds ``torch``, ``numpy`` and ``random`` before every test from ``SPIDER_TEST_SEED`` (default 0) and the test's id,
  so a randomised test draws other inputs under another seed base and still must pass (tolerances are derived, not
  tuned: ``tests.helpers.float_tol``). The base is printed in the pytest header.

``tests`` is a package (``tests/__init__.py``) so that test modules can ``from tests.hf_suites import ...``
and ``import tokenization_spider`` etc. from the repository root: with pytest's default ``prepend`` import
mode the repository root (the first folder above ``tests`` without ``__init__.py``) goes on ``sys.path``.
"""

import os
import random
import zlib

import pytest

#: base of every test's seed; run the suite under several values to check no test depends on one draw
SEED_BASE = int(os.environ.get("SPIDER_TEST_SEED", "0"))

# marker name -> description
MARKERS = {
    "slow": "slow end-to-end test (deselect with -m 'not slow')",
    # used by transformers' common suites (tests/test_*_common.py in the transformers sdist)
    "accelerate_tests": "transformers suite: needs accelerate",
    "flash_attn_test": "transformers suite: flash-attention 2 test",
    "flash_attn_3_test": "transformers suite: flash-attention 3 test",
    "flash_attn_4_test": "transformers suite: flash-attention 4 test",
    "torch_compile_test": "transformers suite: torch.compile test",
    # put on tests by transformers.testing_utils decorators
    "is_agent_test": "transformers: agent test",
    "is_expert_parallel_test": "transformers: expert-parallel test",
    "is_fsdp_test": "transformers: FSDP test",
    "is_pipeline_test": "transformers: pipeline test",
    "is_staging_test": "transformers: test against the Hub staging server",
    "is_tensor_parallel_test": "transformers: tensor-parallel test",
    "is_training_test": "transformers: training test",
    "order": "pytest-order ordering (transformers' run_first); no effect without the pytest-order plugin",
}


def pytest_addoption(parser):
    # transformers.testing_utils.pytest_addoption_shared's option, added here: importing transformers in the
    # controlling process would hold up the start of the pytest-xdist workers (~10 s)
    parser.addoption(
        "--make-reports",
        action="store",
        default=False,
        help="generate report files. The value of this option is used as a prefix to report names",
    )
    # the sizes of the checks python -m bench.gpu_check runs (tests/test_gpu.py, tests/test_training_runs.py); it
    # passes its own flags of these names on
    group = parser.getgroup("spider checks", "sizes of bench.gpu_check's checks")
    group.addoption("--step_repeats", type=int, default=1, help="timed steps after a warm-up; the median is used")
    group.addoption("--fp8_layers", default=None, help="FP8 layer selection (default: auto for 1b, else tk_train)")
    group.addoption("--distributed_preset", default="tiny", help="preset of the DDP/FSDP2 world-size-1 check")
    group.addoption("--distributed_steps", type=int, default=2, help="steps before the FSDP2 checkpoint")
    group.addoption("--distributed_shape", default="2x48", help="BATCHxBYTES per step of the distributed check")
    # tests/test_training_runs.py (default: toy sizes on CPU, the command's defaults on CUDA)
    group.addoption("--main_job_steps", default=None, help="training steps of the main job")
    group.addoption("--main_job_preset", default=None, help="preset of the main job")
    group.addoption("--main_job_args", default=None, help="more flags for the main job's command line, one string")
    group.addoption("--run_1b_steps", default=None, help="training steps of the 1b run")
    group.addoption("--run_1b_preset", default=None, help="preset of the 1b run")
    group.addoption("--run_1b_batch", default=None, help="BATCHxBYTES per step of the 1b run")
    group.addoption("--run_1b_experts", default=None, help="experts_implementation of the 1b run")
    group.addoption("--run_1b_args", default=None, help="more flags for the 1b run's command line, one string")
    group.addoption("--check_allowance_s", type=float, default=None, help="seconds a training check may take")


def pytest_configure(config):
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    if not os.environ.get("PYTEST_XDIST_WORKER") and "HF_DATASETS_CACHE" not in os.environ:
        # the local-text byte cache (spider_training.data.cache) and datasets' own under this run's folder, shared by
        # the workers and subprocesses (they inherit it) and removed at the end, not left in the user's cache
        import tempfile

        config._spider_datasets_cache = tempfile.mkdtemp(prefix="spider-test-datasets-")
        os.environ["HF_DATASETS_CACHE"] = config._spider_datasets_cache
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one intra-op thread per pytest-xdist worker: the workers already fill the cores, and more threads than
        # cores makes every worker slower; the subprocesses tests start inherit OMP_NUM_THREADS=1 unless the test
        # sets its own (measured on 2 cores: the fault, loading and conversion files 154 s -> 132 s)
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Files that hold an end-to-end (``slow``) test run first, the others after them, each group in collection order.

    pytest-xdist's ``--dist loadfile`` hands whole files to the two workers in this order (``--no-loadscope-reorder``
    in setup.cfg; its default order, most tests first, started the one-test 20-kill file, minutes long, last, and the
    run waited on it alone). Minutes-long files first and the many short ones after them fill both workers to the end.
    """
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: collection order within each group


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, transformers, the test modules: ~10^6 objects) out of Python's garbage
    collector: its full collections, which Trainer and accelerate also call, otherwise walk all of them again each
    time (measured on test_train.py: 6.8 s of its 44 s in collections, 1.8 s frozen). Objects made later, by the
    tests, are collected as before."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_report_header(config):
    return f"SPIDER_TEST_SEED={SEED_BASE} (per-test seed = base * 1_000_003 + crc32(test id))"


@pytest.fixture(autouse=True)
def _seed_everything(request):
    """Seed torch, numpy and random per test from :data:`SEED_BASE` and the test id (reproducible per base)."""
    import numpy as np
    import torch

    seed = (SEED_BASE * 1_000_003 + zlib.crc32(request.node.nodeid.encode())) % 2**31
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    yield


def pytest_unconfigure(config):
    folder = getattr(config, "_spider_datasets_cache", None)
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
