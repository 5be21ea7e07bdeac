"""``epmoe`` command line: ``epmoe env | demo | bench`` (also ``python -m epmoe``)."""

import argparse
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    from epmoe.cli import bench, demo

    p = argparse.ArgumentParser(
        prog="epmoe",
        description="Expert-parallel MoE stages as PyTorch ops: inspect the machine, run the "
        "checked end-to-end demo, or run the benchmark suite.",
    )
    sub = p.add_subparsers(dest="command", metavar="{env,demo,bench}")
    sub.required = True
    sub.add_parser("env", help="versions, GPUs, peer access, usable backends and quant schemes")
    d = sub.add_parser(
        "demo",
        help="spawn local ranks and run the EP MoE layer stage by stage, checked against the "
        "reference",
        description=demo.__doc__.split("\n\n")[0].replace("``", ""),
    )
    demo.add_arguments(d)
    b = sub.add_parser(
        "bench",
        help="run the pytest-benchmark suite and write JSON, markdown and a PNG plot",
        description=bench.__doc__.split("\n\n")[0].replace("``", ""),
    )
    bench.add_arguments(b)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run one subcommand; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = _parser().parse_known_args(argv)
    args.argv = argv
    if args.command == "bench":
        from epmoe.cli import bench

        return bench.main(args, extra)
    if extra:
        _parser().error("unrecognized arguments: " + " ".join(extra))
    if args.command == "env":
        from epmoe.cli import env

        return env.main(args)
    from epmoe.cli import demo

    return demo.main(args)


if __name__ == "__main__":
    sys.exit(main())
