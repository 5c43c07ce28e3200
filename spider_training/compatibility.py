"""Every compatibility alias Spider keeps, in one table (:data:`ALIASES`), each with the version that removes it.

An alias is an old spelling that still works: a module path from before the commands moved into
``spider_training/commands/``, a config field or command-line value renamed since. Old checkpoint and release layouts
are not aliases: they are converted once, at load (``conversion_spider.py``, ``spider_training.checkpointing``), and
stay readable. Module aliases warn with a ``FutureWarning`` naming their replacement and removal version
(:func:`forward_module`); the others warn where they are read (a logged warning, or transformers' own
``deprecate_kwarg``). tests/test_compatibility.py checks that the table and the code agree.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Alias:
    """`old` still means `new` until the release `removed_in`; `where` is the file that reads it."""

    old: str
    new: str
    removed_in: str
    where: str


#: The package version that drops the aliases added before 0.2 (setup.cfg's version is 0.1.0).
REMOVED_IN = "0.3.0"

ALIASES: tuple[Alias, ...] = (
    *(
        Alias(f"spider_training.{name}", f"spider_training.commands.{name}", REMOVED_IN, f"spider_training/{name}.py")
        for name in ("write_shards", "convert_tk_train", "compute_map", "serve", "generate")
    ),
    Alias(
        "spider_training.convert_seed",
        "spider_training.commands.convert_tk_train",
        REMOVED_IN,
        "spider_training/convert_seed.py",
    ),  # fmt: skip
    Alias(
        "SpiderConfig(moe_implementation=...), config.moe_implementation",
        "experts_implementation",
        REMOVED_IN,
        "configuration_spider.py",
    ),  # fmt: skip
    Alias(
        "spider_training.commands.write_shards --format seed",
        "--format headerless",
        REMOVED_IN,
        "spider_training/commands/write_shards.py",
    ),  # fmt: skip
    Alias(
        'byte shards\' metadata.json "format": "seed"',
        '"format": "headerless"',
        REMOVED_IN,
        "spider_training/data/shards.py",
    ),  # fmt: skip
    Alias(
        "spider_training.commands.convert_tk_train --dtype seed",
        "--dtype checkpoint",
        REMOVED_IN,
        "spider_training/commands/convert_tk_train.py",
    ),  # fmt: skip
    Alias(
        "SpiderModel/SpiderForConditionalGeneration.forward(past_key_values=...)",
        "cache=...",
        "transformers 5.40.0",
        "modeling_spider.py",
    ),  # fmt: skip
)


def forward_module(name: str) -> None:
    """Make the alias module `name` (an entry of :data:`ALIASES`) be the module it names: imported, it is that module
    (``sys.modules[name]`` replaced, so ``from old import x`` works); run with ``python -m``, it runs that module as
    ``__main__``. Call it from the alias module's body with ``__name__``.

    Warns:
        FutureWarning: naming the new path and the version that removes the alias.
    Raises:
        KeyError: `name` is not a module alias of :data:`ALIASES`.
    """
    module_name = name if name != "__main__" else sys.argv[0]
    alias = next((a for a in ALIASES if a.old == name or a.where == _relative(module_name)), None)
    if alias is None:
        raise KeyError(f"{name} is not a module alias listed in spider_training.compatibility.ALIASES")
    warnings.warn(
        f"{alias.old} has moved to {alias.new}; the old path is removed in {alias.removed_in}", FutureWarning, 3
    )
    if name == "__main__":
        runpy.run_module(alias.new, run_name="__main__", alter_sys=True)
    else:
        sys.modules[name] = importlib.import_module(alias.new)


def _relative(path: str) -> str:
    """`path` (a module file) as ``spider_training/NAME.py``, how :attr:`Alias.where` names it."""
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:])
