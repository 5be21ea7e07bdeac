"""The ``epmoe`` command line: ``env`` (what runs here), ``demo`` (the end-to-end EP MoE job with
per-stage checks) and ``bench`` (the pytest-benchmark suite with a JSON / markdown / PNG report).

Entry point: :func:`epmoe.__main__.main`. Each subcommand lives in its own module and is importable
without side effects.
"""
