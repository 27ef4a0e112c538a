"""The set-up promises: two commands, one package list, a CPU torch, CI runs the README's command."""
import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch-cpu": "torch"}          # conda-forge name -> PyPI name


def _name(spec):
    return re.split(r"[<>=!~ \[]", spec.strip(), maxsplit=1)[0].lower()


def conda_packages():
    names, in_deps = set(), False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if line.startswith("dependencies:"):
            in_deps = True
        elif in_deps and re.match(r"^  - [A-Za-z][^:]*$", line):
            names.add(_name(line[4:]))
    return {CONDA_NAMES.get(n, n) for n in names} - {"python", "pip"}


def test_environment_yml_lists_the_same_packages_as_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pip_names = {_name(d) for d in pyproject["project"]["dependencies"]}
    assert conda_packages() == pip_names
    assert "conda-forge" in (ROOT / "environment.yml").read_text()
    assert "-e ." in (ROOT / "environment.yml").read_text()


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "notebooks/00_start_here.ipynb" in makefile and "--nbval" in makefile


def test_no_cuda_packages_were_installed():
    cuda = [d.metadata["Name"] for d in metadata.distributions()
            if d.metadata["Name"] and d.metadata["Name"].lower().startswith(("nvidia-", "triton"))]
    import torch
    if torch.version.cuda is None:              # a CPU build: nothing CUDA should come with it
        assert cuda == []
