"""The README as written: its quickstart and API blocks run; CI runs its install and test lines."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def fenced(info: str) -> str:
    """The body of the README's one fenced block opened with ```<info>."""
    blocks = re.findall(rf"^```{re.escape(info)}\n(.*?)^```$", README, flags=re.M | re.S)
    assert len(blocks) == 1, f"README: expected one ```{info} block, found {len(blocks)}"
    return blocks[0]


@pytest.fixture(scope="module")
def quickstart_ns():
    ns = {"__name__": "readme_quickstart"}
    exec(compile(fenced("python quickstart"), "README.md:quickstart", "exec"), ns)
    return ns


def test_quickstart_runs(quickstart_ns, capsys):
    out = quickstart_ns["out"]
    assert out.shape == (quickstart_ns["T"], quickstart_ns["H"])


def test_api_block_runs_after_quickstart(quickstart_ns):
    ns = dict(quickstart_ns)
    exec(compile(fenced("python api"), "README.md:api", "exec"), ns)
    torch = ns["torch"]
    T, H, K = ns["T"], ns["H"], ns["K"]
    assert ns["out"].dtype == torch.bfloat16 and ns["out"].shape == (T, H)
    assert ns["p"].inv_perm.shape == (T, K) and ns["p"].m_indices.dtype == torch.int32
    live = ns["p"].m_indices >= 0  # (GEMM1 gathering its rows: the copy's bytes)
    assert torch.equal(ns["y_g"][live], ns["y"][live])
    assert ns["out_ll"].shape == (T, H)


def _commands(block: str):
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_ci_runs_the_readme_commands():
    """CI installs with the README's install lines and tests with its test command, as written."""
    install = re.search(r"^## Install\n.*?^```bash\n(.*?)^```$", README, flags=re.M | re.S)
    fresh = re.search(r"^## On a fresh machine.*?^```bash\n(.*?)^```$", README, flags=re.M | re.S)
    assert install and fresh
    ci = [c.removeprefix("python -m ") for c in _commands((REPO / ".ci" / "run").read_text())]
    for cmd in _commands(install.group(1)):
        assert cmd.replace("pip install", "pip install -q") in ci, cmd
    tests = [c for c in _commands(fresh.group(1)) if "pytest" in c]
    assert tests == ["python -m pytest -q -n 2"]
    assert "pytest -q -n 2" in ci
