"""Adapters to the engines users already run. Each submodule imports its engine lazily.

* :mod:`epmoe.integrations.transformers`: Hugging Face transformers experts backends
  (``experts_implementation="epmoe"``); ``import epmoe.integrations.transformers as et;
  et.register()``.
"""
