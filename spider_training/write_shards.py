"""Moved to :mod:`spider_training.commands.write_shards`: this path is an alias, removed in 0.3.0
(listed in :mod:`spider_training.compatibility`)."""

from spider_training.compatibility import forward_module

forward_module(__name__)
