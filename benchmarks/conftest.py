"""Benchmarks time one process: without ``-n``, xdist's ``--dist loadgroup`` (pyproject's addopts,
for the tests) is turned off, or pytest-benchmark would disable every benchmark it was asked to run
(``--benchmark-enable`` writing no figures)."""

import pytest


@pytest.hookimpl(tryfirst=True)  # (before pytest-benchmark's own configure reads the option)
def pytest_configure(config):
    if not getattr(config.option, "numprocesses", None):
        config.option.dist = "no"
