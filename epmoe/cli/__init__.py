"""The ``epmoe`` command line: ``env`` (what runs here), ``demo`` (the end-to-end EP MoE job with
per-stage checks) and ``bench`` (the layer per quant scheme and mode against the dense reference and
torch's grouped_mm, with a JSON / markdown / PNG report).

Entry point: :func:`epmoe.__main__.main`. Each subcommand lives in its own module and is importable
without side effects.
"""
