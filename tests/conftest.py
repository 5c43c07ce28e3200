"""pytest configuration for Spider's tests.

* Registers the ``slow`` marker (end-to-end tests; deselect with ``-m "not slow"``) and the markers that
  transformers' common test suites and ``transformers.testing_utils`` decorators put on tests
  (``flash_attn_test``, ``torch_compile_test``, ``is_training_test``, ...), so ``--strict-markers`` works.
* Adds transformers' shared command-line options (``--make-reports``) through
  ``transformers.testing_utils.pytest_addoption_shared``. Upstream's own conftest is not used: it needs
  pytest-xdist and the full upstream checkout.

``tests`` is a package (``tests/__init__.py``) so that test modules can ``from tests.hf_suites import ...``
and ``import tokenization_spider`` etc. from the repository root: with pytest's default ``prepend`` import
mode the repository root (the first folder above ``tests`` without ``__init__.py``) goes on ``sys.path``.
"""

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
    from transformers.testing_utils import pytest_addoption_shared

    pytest_addoption_shared(parser)


def pytest_configure(config):
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
