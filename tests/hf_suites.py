"""transformers' own common test suites (ModelTesterMixin, ConfigTester, TokenizerTesterMixin) for Spider's tests.

The installed transformers wheel has no tests. Its PyPI source distribution ships the top-level files of the
upstream ``tests/`` folder (``test_modeling_common.py``, ``test_configuration_common.py``,
``test_tokenization_common.py`` and the backend mixins they import). This module downloads that sdist once,
for exactly the installed version, extracts only ``tests/`` into a cache folder OUTSIDE the repository and
imports it as the package ``transformers_tests``.

API
---
``TRANSFORMERS_VERSION: str``
    Version of the installed transformers; the suites come from the sdist of the same version.
``PACKAGE = "transformers_tests"``
    Import name of the extracted ``tests/`` folder (its modules: ``transformers_tests.test_modeling_common``...).
``class HFSuitesUnavailable(RuntimeError)``
    Raised when the sdist cannot be downloaded or extracted; the message says what failed and how to fix it.
``cache_root() -> pathlib.Path``
    ``$SPIDER_HF_TESTS_CACHE`` if set, else ``~/.cache/spider``. Holds ``transformers-<ver>.tar.gz`` (under
    ``sdist/``), the extracted ``transformers-<ver>-tests-v<N>/transformers_tests/`` and a lock file.
``suites_dir(version: str | None = None) -> pathlib.Path``
    Download + extract if needed and return the folder of the ``transformers_tests`` package. Safe across
    processes: a file lock (``filelock``) serialises the work, extraction goes to a temporary folder that is
    renamed into place atomically, and a finished folder is reused without any network access.
    Raises ``HFSuitesUnavailable``.
``load_suite(name: str) -> types.ModuleType``
    Import ``transformers_tests.<name>`` (e.g. ``"test_modeling_common"``), registering the package and the
    stand-ins below first. Raises ``HFSuitesUnavailable`` (download) or the module's own ``ImportError``.
``modeling_common``, ``configuration_common``, ``tokenization_common``
    Lazy module attributes (PEP 562): ``from tests.hf_suites import modeling_common`` imports
    ``transformers_tests.test_modeling_common`` at that moment (downloading on first use) and raises
    ``HFSuitesUnavailable`` on failure. In a test module that makes a *collection error*, which stops the
    whole pytest run; prefer ``suite_class`` for base classes.
``suite_class(module: str, name: str) -> type``
    ``getattr(load_suite(module), name)``, e.g. ``suite_class("test_modeling_common", "ModelTesterMixin")``.
    If the suites are unavailable it returns a placeholder class (``Unavailable<name>``) whose test
    ``test_transformers_common_suite_available`` FAILS with the download error (and whose ``__init__`` takes
    any arguments and ``run_common_tests`` fails the same way, for ``ConfigTester``). So a missing download
    fails the suite's tests loudly but lets the rest of the run go on. It never skips.

Stand-ins (what the sdist lacks; all defined here, none copied from upstream):

* ``transformers_tests.generation.test_utils.GenerationTesterMixin`` -- EMPTY class. ``test_modeling_common``
  imports it, and ``ModelTesterMixin.test_generation_tester_mixin_inheritance`` asserts that a tester of a
  model that can ``generate`` inherits it. Inheriting the stand-in (``modeling_common.GenerationTesterMixin``)
  satisfies that check but runs NO generation tests: write your own ``generate`` tests.
* ``transformers_tests.exporters.test_export.ExportTesterMixin`` -- EMPTY base class of ``ModelTesterMixin``;
  no ``torch.export`` tests run.
* ``transformers_tests.utils.test_configuration_utils.config_common_kwargs`` -- used by
  ``ConfigTester.check_config_arguments_init``: non-default values for every public field of
  ``PreTrainedConfig`` in transformers 5.x (written here from ``dataclasses.fields(PreTrainedConfig)``).
* ``transformers_tests/fixtures/sample_text.txt`` -- read (not otherwise used) by
  ``TokenizerTesterMixin.setUpClass`` via ``get_tests_dir()``, which walks up to the first folder whose name
  ends in ``tests``: the package folder ``transformers_tests`` itself. Our own short multilingual text.
* ``transformers_tests/__init__.py`` -- empty; needed for the relative imports, and
  ``test_configuration_common`` runs it through ``direct_transformers_import``.

Not supported: ``PipelineTesterMixin`` (needs ``tests/utils/tiny_model_summary.json``, the upstream
``tests.pipelines`` package and the Hub), the tensor-parallel / FSDP / expert-parallel mixins (need
``tests/distributed_testing_utils.py``), ``test_tokenization_mistral_common``.

The suites import ``parameterized`` (PyPI ``parameterized``): it must be installed with the test extras.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
import unittest
from pathlib import Path

import transformers

TRANSFORMERS_VERSION: str = transformers.__version__
PACKAGE = "transformers_tests"
# Bump when the extracted layout or a stand-in file changes: a new folder name forces a fresh extraction.
_LAYOUT_VERSION = 1
_PIP_TIMEOUT_S = 900

_SAMPLE_TEXT = """\
Spider reads bytes, not words. Every UTF-8 byte is one token, so any text can be encoded.

The quick brown fox jumps over the lazy dog; 0123456789 !"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~

Héllo wörld, ça va? Grüße aus Köln. ¿Dónde está la biblioteca?

Привет, мир. Γειά σου κόσμε. שלום עולם. مرحبا بالعالم.

你好，世界。こんにちは世界。안녕하세요 세계. नमस्ते दुनिया. สวัสดีชาวโลก

Emoji and symbols: 😊 🕷️ ∑ ∞ ≠ → ✓

Tabs\tand  double  spaces, and a line with trailing spaces   
"""


class HFSuitesUnavailable(RuntimeError):
    """transformers' test suites could not be downloaded or extracted (the message says why)."""


def cache_root() -> Path:
    """Folder for the downloaded sdist and extracted suites: ``$SPIDER_HF_TESTS_CACHE`` or ``~/.cache/spider``."""
    env = os.environ.get("SPIDER_HF_TESTS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "spider"


def _config_common_kwargs() -> dict:
    """Stand-in for upstream's ``tests/utils/test_configuration_utils.config_common_kwargs``.

    One non-default value for each public field of transformers 5.x ``PreTrainedConfig`` (see
    ``dataclasses.fields(PreTrainedConfig)``: ``architectures, output_hidden_states, return_dict, dtype,
    chunk_size_feed_forward, id2label, label2id, problem_type``) plus ``output_attentions`` (a property).
    ``is_encoder_decoder`` and ``transformers_version`` are left out, as upstream does. Generation
    parameters are not config fields in v5 (``PreTrainedConfig.__post_init__`` drops them).
    """
    return {
        "return_dict": False,
        "output_hidden_states": True,
        "output_attentions": True,
        "dtype": "float16",  # ConfigTester compares config.dtype with torch.float16
        "chunk_size_feed_forward": 5,
        "architectures": ["SpiderStandInArchitecture"],
        "id2label": {0: "label"},
        "label2id": {"label": 0},
        "problem_type": "regression",
    }


def _final_dir(version: str) -> Path:
    return cache_root() / f"transformers-{version}-tests-v{_LAYOUT_VERSION}"


def _download_sdist(version: str, dest: Path) -> Path:
    """``pip download --no-deps --no-binary :all: transformers==<version>`` into ``dest``; return the archive."""
    dest.mkdir(parents=True, exist_ok=True)
    existing = sorted(dest.glob(f"transformers-{version}.tar.gz"))
    if existing:
        return existing[0]
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", f"transformers=={version}", "-d", tmp,
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HFSuitesUnavailable(f"could not run {' '.join(cmd)}: {exc}") from exc
        archives = sorted(Path(tmp).glob("transformers-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            tail = "\n".join(line[:500] for line in (proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise HFSuitesUnavailable(
                f"`{' '.join(cmd)}` failed (exit {proc.returncode}); transformers' common test suites come from "
                f"the PyPI sdist of the installed version {version}. Needs access to PyPI (a dev/source install "
                f"has no sdist). pip said:\n{tail}"
            )
        target = dest / archives[0].name
        os.replace(archives[0], target)
        return target


def _extract_tests(archive: Path, version: str, final: Path) -> None:
    """Extract ``<sdist>/tests/`` of ``archive`` as ``final/transformers_tests`` (temp folder + atomic rename)."""
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        package = staging / PACKAGE
        package.mkdir()
        try:
            with tarfile.open(archive, "r:gz") as tar:
                count = 0
                for member in tar.getmembers():
                    parts = Path(member.name).parts
                    # "transformers-<ver>/tests/..." ; only regular files and folders
                    if len(parts) < 3 or parts[1] != "tests" or not (member.isfile() or member.isdir()):
                        continue
                    rel = Path(*parts[2:])
                    if rel.is_absolute() or ".." in rel.parts:
                        raise HFSuitesUnavailable(f"{archive}: refusing unsafe member path {member.name!r}")
                    out = package / rel
                    if member.isdir():
                        out.mkdir(parents=True, exist_ok=True)
                        continue
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(member) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    count += 1
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise HFSuitesUnavailable(
                f"{archive} is not a readable transformers sdist ({exc}); delete it and retry"
            ) from exc
        if not (package / "test_modeling_common.py").is_file():
            raise HFSuitesUnavailable(
                f"{archive} has no tests/test_modeling_common.py ({count} files under tests/): this transformers "
                f"{version} sdist does not ship the common test suites"
            )
        (package / "__init__.py").touch()
        fixtures = package / "fixtures"
        fixtures.mkdir(exist_ok=True)
        if not (fixtures / "sample_text.txt").exists():
            (fixtures / "sample_text.txt").write_text(_SAMPLE_TEXT, encoding="utf-8")
        staging.chmod(0o755)  # mkdtemp makes it 0700
        os.rename(staging, final)  # atomic on one filesystem; `final` does not exist (checked under the lock)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def suites_dir(version: str | None = None) -> Path:
    """Return the folder of the extracted ``transformers_tests`` package, downloading/extracting it once.

    Args:
        version: transformers version whose sdist to use; defaults to the installed one.

    Raises:
        HFSuitesUnavailable: pip could not download the sdist, or it has no usable ``tests/`` folder.
    """
    from filelock import FileLock, Timeout

    version = version or TRANSFORMERS_VERSION
    final = _final_dir(version)
    if (final / PACKAGE / "__init__.py").is_file():
        return final / PACKAGE
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HFSuitesUnavailable(
            f"cannot create the cache folder {final.parent} ({exc}); set SPIDER_HF_TESTS_CACHE"
        ) from exc
    try:
        with FileLock(str(final) + ".lock", timeout=_PIP_TIMEOUT_S + 120):
            if not (final / PACKAGE / "__init__.py").is_file():
                if final.exists():  # a broken leftover (should not happen: rename is atomic)
                    shutil.rmtree(final)
                archive = _download_sdist(version, final.parent / "sdist")
                _extract_tests(archive, version, final)
    except Timeout as exc:
        raise HFSuitesUnavailable(
            f"timed out waiting for the lock {exc.lock_file} (another process extracting?)"
        ) from exc
    return final / PACKAGE


def _module(name: str, doc: str, path: list[str] | None = None, **attrs) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    if path is not None:
        module.__path__ = path
    module.__dict__.update(attrs)
    return module


def _install_stand_ins(package_dir: Path) -> None:
    """Put the stand-in modules for files missing from the sdist into ``sys.modules`` (real files win)."""

    class GenerationTesterMixin:
        """Stand-in for upstream's ``tests/generation/test_utils.GenerationTesterMixin`` (not in the sdist).

        EMPTY: it runs no generation tests. It exists so that ``test_modeling_common`` imports, and so that a
        tester of a generating model can inherit it to satisfy ``test_generation_tester_mixin_inheritance``.
        """

    class ExportTesterMixin:
        """Stand-in for upstream's ``tests/exporters/test_export.ExportTesterMixin`` (not in the sdist): EMPTY,
        no ``torch.export`` tests run."""

    GenerationTesterMixin.__module__ = f"{PACKAGE}.generation.test_utils"
    GenerationTesterMixin.__qualname__ = "GenerationTesterMixin"
    ExportTesterMixin.__qualname__ = "ExportTesterMixin"
    ExportTesterMixin.__module__ = f"{PACKAGE}.exporters.test_export"
    stand_ins = {
        "generation": ("test_utils", {"GenerationTesterMixin": GenerationTesterMixin}),
        "exporters": ("test_export", {"ExportTesterMixin": ExportTesterMixin}),
        "utils": ("test_configuration_utils", {"config_common_kwargs": _config_common_kwargs()}),
    }
    for sub, (leaf, attrs) in stand_ins.items():
        if (package_dir / sub / f"{leaf}.py").is_file():
            continue  # a later sdist ships the real file: use it
        parent_name, leaf_name = f"{PACKAGE}.{sub}", f"{PACKAGE}.{sub}.{leaf}"
        if leaf_name in sys.modules:
            continue
        if parent_name not in sys.modules:
            sys.modules[parent_name] = _module(parent_name, "stand-in package (tests/hf_suites.py)", path=[])
        leaf_module = _module(leaf_name, "stand-in module (tests/hf_suites.py): not in the sdist", **attrs)
        sys.modules[leaf_name] = leaf_module
        setattr(sys.modules[parent_name], leaf, leaf_module)


def _register_package() -> None:
    existing = sys.modules.get(PACKAGE)
    if existing is not None:
        return
    package_dir = suites_dir()
    spec = importlib.util.spec_from_file_location(
        PACKAGE, package_dir / "__init__.py", submodule_search_locations=[str(package_dir)]
    )
    if spec is None or spec.loader is None:
        raise HFSuitesUnavailable(f"cannot import {package_dir} as package {PACKAGE}")
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    try:
        spec.loader.exec_module(package)
        _install_stand_ins(package_dir)
    except BaseException:
        sys.modules.pop(PACKAGE, None)
        raise


def load_suite(name: str) -> types.ModuleType:
    """Import ``transformers_tests.<name>`` (e.g. ``"test_modeling_common"``) from the cached sdist.

    Raises:
        HFSuitesUnavailable: the sdist could not be downloaded/extracted.
        ImportError: the suite module itself failed to import (e.g. ``parameterized`` not installed).
    """
    _register_package()
    return importlib.import_module(f"{PACKAGE}.{name}")


_LAZY = {
    "modeling_common": "test_modeling_common",
    "configuration_common": "test_configuration_common",
    "tokenization_common": "test_tokenization_common",
}


def __getattr__(attr: str):
    if attr in _LAZY:
        return load_suite(_LAZY[attr])
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def suite_class(module: str, name: str) -> type:
    """Class ``name`` of suite ``module``, or a placeholder whose tests FAIL with the download error.

    Example: ``ModelTesterMixin = suite_class("test_modeling_common", "ModelTesterMixin")``.

    Raises:
        AttributeError: the suite module has no attribute ``name``.
        ImportError: the suite module failed to import for another reason than the download.
    """
    try:
        return getattr(load_suite(module), name)
    except HFSuitesUnavailable as exc:
        reason = f"transformers' {module}.{name} is unavailable: {exc}"

    class Placeholder:
        def __init__(self, *args, **kwargs):  # accepts ConfigTester(parent, config_class=..., ...)
            if isinstance(self, unittest.TestCase):
                super().__init__(*args, **kwargs)

        def test_transformers_common_suite_available(self):
            raise AssertionError(reason)

        def run_common_tests(self, *args, **kwargs):
            raise AssertionError(reason)

    Placeholder.__name__ = Placeholder.__qualname__ = f"Unavailable{name}"
    Placeholder.__doc__ = f"Placeholder for {name}: the common suite could not be loaded. {reason}"
    return Placeholder
