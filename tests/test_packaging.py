"""The set-up promises: two commands, one package list, a CPU torch, CI runs the README's command."""
import re
import sys
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
    assert "-e .[test]" in (ROOT / "environment.yml").read_text(), "conda users get the test extras too"
    assert '-e ".[test]"' in (ROOT / "Makefile").read_text()


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "notebooks/00_start_here.ipynb" in makefile and "--nbval" in makefile


def _canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _required_by(root):
    """Every distribution `root` needs, directly or through others (markers and extras included:
    an upper bound of what installing it may have pulled in)."""
    from packaging.requirements import Requirement
    seen, todo = set(), [root]
    while todo:
        try:
            requires = metadata.distribution(todo.pop()).requires or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            name = _canonical(Requirement(spec).name)
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def _inside(dist, prefix):
    return Path(dist.locate_file("")).resolve().is_relative_to(Path(prefix).resolve())


def test_no_cuda_packages_were_installed():
    """The Makefile keeps a torch that python3 could already import (a CUDA build, say: the venv
    then sees it through --system-site-packages) or installs the CPU wheel into .venv. Either
    way pplab pulls in no CUDA package of its own: every nvidia-*/triton distribution here is
    one that torch itself requires (none for a CPU build), none sits in a venv that did not
    install torch, and a torch installed into the venv is the CPU build."""
    import torch
    cuda = [d for d in metadata.distributions()
            if d.metadata["Name"] and _canonical(d.metadata["Name"]).startswith(("nvidia-", "triton"))]
    needed = _required_by("torch")
    assert [d.metadata["Name"] for d in cuda if _canonical(d.metadata["Name"]) not in needed] == []
    if sys.prefix != sys.base_prefix:                  # a venv (the Makefile's .venv)
        if _inside(metadata.distribution("torch"), sys.prefix):     # torch installed by `make`
            assert torch.version.cuda is None, f"make installed a CUDA build of torch {torch.__version__}"
            assert cuda == []
        else:                                          # a torch python3 already had: nothing CUDA added
            assert [d.metadata["Name"] for d in cuda if _inside(d, sys.prefix)] == []


def test_every_test_file_and_notebook_belongs_to_a_chapter():
    """`make test CH=04` runs what tests/chapters.py marks ch04: a file missing from its table
    would run in no chapter's run."""
    from chapters import CHAPTERS, TEST_FILES, chapters_of, exercise_chapters
    files = sorted((ROOT / "tests").rglob("test_*.py")) + sorted((ROOT / "notebooks").glob("*.ipynb")) \
        + sorted((ROOT / "solutions").glob("*.ipynb"))
    assert [f.name for f in files if not chapters_of(f)] == [], "add a line to TEST_FILES in tests/chapters.py"
    assert sorted(set(TEST_FILES) - {f.stem for f in files}) == [], "tests/chapters.py names files that are gone"
    assert {c for f in files for c in chapters_of(f)} == set(CHAPTERS)
    assert len(exercise_chapters()) == len(list((ROOT / "solutions").glob("*.ipynb")))
    assert chapters_of(ROOT / "tests" / "test_checks.py", {"exercise_id": "bubble_fraction"}) == ["04"]
    assert chapters_of(ROOT / "notebooks" / "04b_schedules_and_torch.ipynb") == ["04"]
    assert "-m ch$(CH)" in (ROOT / "Makefile").read_text()



def test_a_notebook_kernel_that_died_at_start_is_started_again_but_a_silent_one_is_not():
    """conftest.py's guard against two kernels taking the same free port (make test's two processes)."""
    import pytest
    from conftest import _start_kernel_again_if_it_died
    calls = []

    def dies(times, message="Kernel died before replying to kernel_info"):
        def start(**kwargs):
            calls.append(kwargs)
            if len(calls) <= times:
                raise RuntimeError(message)
            return "km", "kc"
        return start

    assert _start_kernel_again_if_it_died(dies(2))(startup_timeout=5) == ("km", "kc") and len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="died"):                    # three deaths: the error stands
        _start_kernel_again_if_it_died(dies(3))(startup_timeout=5)
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="didn't respond"):          # a silent kernel: not retried
        _start_kernel_again_if_it_died(dies(1, "Kernel didn't respond in 5 seconds"))(startup_timeout=5)
    assert len(calls) == 1
