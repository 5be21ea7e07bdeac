"""Which transformers MoE models run their experts on epmoe, by scheme: regenerate the record.

    python scripts/hf_coverage.py [--check | --render]

Builds every ``*ForCausalLM`` that tests/integrations/_hf_models.py discovers in the installed
transformers as a tiny random float32 model on CPU (the fp8 one at hidden and intermediate 128),
runs it through ``"epmoe"`` / ``"epmoe_fp8"`` / ``"epmoe_int8"`` and records what its experts ran:
"epmoe", or "fallback: <the integration's reason>". Writes tests/integrations/coverage.json (model
-> scheme -> cell) and the README's coverage section (between ``<!-- coverage:start -->`` and
``<!-- coverage:end -->``). tests/integrations/test_transformers.py checks the file against what
the integration does; run this after a change that moves a model either way. ``--check`` writes
nothing and exits 1 when either file is stale; ``--render`` only rewrites the README's section from
the JSON, measuring nothing.
"""

import argparse
import json
import os
import re
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup():
    """The test suite's environment: the repository importable, Triton's interpreter on CPU."""
    sys.path.insert(0, REPO)
    import torch

    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py
    torch.set_num_threads(1)  # tiny models: more threads only wait on each other


def measure(log=print):
    """model -> scheme -> cell, for every discovered model (one build per size, shared by the
    schemes)."""
    import epmoe.integrations.transformers as et
    from tests.integrations import _hf_models as H

    et.register()
    out = {}
    for family in H.discover():
        for lm in family.causal_lms:
            t0, cells = time.perf_counter(), {}
            for schemes, fp8 in H.BUILDS:
                try:
                    model = H.build_tiny(lm, **(H.FP8_SIZES if fp8 else {}))
                    cells.update({s: o.cell for s, o in H.outcomes(model, schemes).items()})
                except Exception as e:  # recorded; the test fails on it
                    cells.update(dict.fromkeys(schemes, f"error: {type(e).__name__}: {e}"))
            cells = {s: cells[s].splitlines()[0] for s in H.SCHEMES}
            out[lm.__name__] = cells
            log(f"{lm.__name__:32s} {time.perf_counter() - t0:5.1f}s  {cells}")
    return out


def readme_with(text: str, table: str) -> str:
    """``text`` (the README) with its coverage section replaced by ``table``."""
    from tests.integrations._hf_models import README_MARKERS

    START, END = README_MARKERS
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"README.md: expected one {START} ... {END} section")
    return pattern.sub(lambda _: f"{START}\n{table}\n{END}", text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="write nothing; exit 1 when stale")
    mode.add_argument("--render", action="store_true", help="the README from the JSON only")
    args = p.parse_args(argv)
    _setup()
    from tests.integrations import _hf_models as H

    warnings.simplefilter("ignore")  # transformers' notes on the tiny configs
    coverage = json.loads(_read(H.COVERAGE)) if args.render else measure()
    table = H.coverage_table(coverage)
    print(table.splitlines()[0])
    new = {
        H.COVERAGE: json.dumps(coverage, indent=1) + "\n",
        H.README: readme_with(_read(H.README), table),
    }
    stale = [path for path, text in new.items() if _read(path) != text]
    names = ", ".join(os.path.relpath(path, REPO) for path in stale)
    if args.check:
        print(f"stale: {names}" if stale else "up to date")
        return 1 if stale else 0
    for path in stale:
        with open(path, "w") as f:
            f.write(new[path])
    print(f"wrote {names}" if stale else "up to date")
    return 0


def _read(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


if __name__ == "__main__":
    sys.exit(main())
