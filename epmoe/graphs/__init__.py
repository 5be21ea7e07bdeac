"""CUDA-graph runners: LL decode (one graph per batch size) and worst-case HT prefill."""

from epmoe.graphs.runner import DecodeGraphRunner, PrefillGraphRunner

__all__ = ["DecodeGraphRunner", "PrefillGraphRunner"]
