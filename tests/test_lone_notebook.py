"""Learners where they run: Binder, Colab, and any notebook opened alone.

* Binder: `repo2docker --no-build` on this repository gives the Dockerfile Binder would build. Its
  base image, its steps and its user are checked, and its install is replayed in a fresh
  environment as a non-root user. Then chapter 0, copied alone into an empty folder, runs there.
* Colab: every notebook's first code cell installs pplab when it is missing. Here that cell runs in a
  fresh environment without pplab, installing the wheel built from this checkout (PPLAB_INSTALL).
  Then every module of pplab imports from an empty folder, and the environment's torch is kept.
* A function defined in a notebook cell launches under spawn, the start method a Colab GPU
  runtime needs once a cell has touched CUDA.

The fresh environments reuse the course's installed packages (torch among them, never downloaded
again) through one .pth file, which points to a folder of links to every distribution of this
environment except pplab. pip installs with --no-index: nothing is downloaded.
"""
import importlib.util
import json
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("install_cell", ROOT / "tools" / "install_cell.py")
install_cell = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(install_cell)

LEARNER = 65534                                   # nobody: Binder's user is not root either
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"


# -- what the notebooks and the README say -----------------------------------------------------

def test_every_notebook_starts_with_the_install_lines_and_the_readme_links_each_chapter():
    assert install_cell.out_of_date() == [], "run: python tools/install_cell.py --write"
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert f"/v{version}/pplab-{version}-py3-none-any.whl" in install_cell.INSTALL_LINES
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        first = next(c for c in nbformat.read(path, 4).cells if c.cell_type == "code")
        assert first.source.startswith(install_cell.INSTALL_LINES.rstrip("\n")), path.name
        assert f"notebooks/{path.name})" in (ROOT / "README.md").read_text(), f"no Colab link to {path.name}"
    assert "?urlpath=lab/tree/notebooks/00_start_here.ipynb" in (ROOT / "README.md").read_text()


def test_chapter_0s_course_map_names_every_notebook():
    """Was an assertion in chapter 0 itself, which failed when the notebook was copied alone."""
    cells = nbformat.read(ROOT / "notebooks" / "00_start_here.ipynb", 4).cells
    course_map = next(c.source for c in cells if c.source.startswith("## The map of the course"))
    named = {name for row in course_map.splitlines() if row.startswith("|")
             for name in re.findall(r"`(\w+)`", row.split("|")[2])}
    assert named == {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}


# -- fresh environments ------------------------------------------------------------------------

def _clean_env(**extra):
    """This process's environment without what would let the checkout's pplab in (PYTHONPATH) or
    change how the notebooks behave under the tests."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PPLAB_PREDICTIONS_MUST_MATCH", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    return {**env, **extra}


def _as_learner(argv):
    """argv run as an ordinary user where this is root (CI is), as it is otherwise."""
    if os.getuid() != 0:
        return argv
    return ["setpriv", f"--reuid={LEARNER}", f"--regid={LEARNER}", "--clear-groups", "--"] + argv


def _owned_by_learner(path: Path) -> None:
    if os.getuid() == 0:
        for folder, dirs, files in os.walk(path):
            for name in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
                os.lchown(name, LEARNER, LEARNER)


@pytest.fixture(scope="module")
def scratch():
    """A folder the learner can write (pytest's tmp_path is root's own where this is root)."""
    folder = Path(tempfile.mkdtemp(prefix="pplab-lone-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def python(scratch):
    """A Python of this version that the learner can run: this one, or the system's (this one
    may sit in a folder only root can enter, as pyenv's under /root)."""
    for candidate in (os.path.realpath(sys.executable), f"/usr/bin/{PY}", f"/usr/local/bin/{PY}"):
        probe = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)"  # it and its children
        if os.path.exists(candidate) and subprocess.run(_as_learner([candidate, "-c", probe]),
                                                        capture_output=True).returncode == 0:
            return candidate
    pytest.skip(f"no {PY} on this machine that an ordinary user may run")


@pytest.fixture(scope="module")
def dependencies(scratch, python):
    """A folder of links to every installed distribution except pplab: what a fresh environment
    sees through its .pth file (the learner must be able to read them)."""
    folder = scratch / "dependencies"
    folder.mkdir()
    for packages in site.getsitepackages():
        for entry in Path(packages).iterdir():
            name = entry.name.lower()
            if name.startswith(("pplab", "__editable__", "_pplab")) or name.endswith(".pth") or name == "__pycache__":
                continue
            if not (folder / entry.name).exists():
                (folder / entry.name).symlink_to(entry)
    probe = subprocess.run(_as_learner([python, "-c", f"import sys; sys.path.insert(0, {str(folder)!r}); import torch"]),
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"an ordinary user cannot import this environment's torch: {probe.stderr.strip()[-300:]}")
    return folder


def _copy_tracked(dest: Path) -> None:
    """The repository's files as git knows them (as a clone has them: no .venv, no build output)."""
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def _fresh_env(where: Path, python: str, dependencies: Path, learner: bool) -> Path:
    """A new venv (no pplab) that sees the course's other packages through a .pth file."""
    run = _as_learner if learner else list
    subprocess.run(run([python, "-m", "venv", "--without-pip", str(where)]), check=True)
    packages = where / "lib" / PY / "site-packages"
    (packages / "course_dependencies.pth").write_text(f"{dependencies}\n")
    return where / "bin" / "python"


def _where_things_come_from(python: Path, cwd: Path, env, learner: bool) -> dict:
    code = ("import json, pathlib, torch, pplab, pplab.checks, pplab.hybrid\n"
            "from pplab.data import TEXT\n"
            "files = [p for p in pathlib.Path(pplab.__file__).parent.rglob('*') if '__pycache__' not in p.parts]\n"
            "print(json.dumps({'pplab': pplab.__file__, 'version': pplab.__version__, 'torch': torch.__file__,\n"
            "                  'files': sum(p.is_file() for p in files), 'text': len(TEXT)}))")
    out = subprocess.run((_as_learner if learner else list)([str(python), "-c", code]), cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_first_cell_installs_the_wheel_in_a_fresh_environment_keeping_torch(scratch, python, dependencies):
    """What a Colab learner gets: chapter 0's first cell, run where pplab is missing, installs pplab
    (here the wheel built from this checkout: PPLAB_INSTALL) with every file of the package, and
    pplab then imports from an empty folder next to the torch that was already there."""
    source, wheels = scratch / "source", scratch / "wheels"
    _copy_tracked(source)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(source)], capture_output=True, text=True, env=_clean_env(), cwd=scratch)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("pplab-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "pplab"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert tracked, "git ls-files found no file of pplab"
    assert sorted(set(tracked) - in_wheel) == [], "files of pplab that the wheel leaves out"

    env_python = _fresh_env(scratch / "colab", sys.executable, dependencies, learner=False)
    empty = scratch / "colab-notebook"
    empty.mkdir()
    env = _clean_env(PPLAB_INSTALL=f"{wheel} --no-index", HOME=str(scratch / "colab-home"))
    first_cell = next(c.source for c in nbformat.read(ROOT / "notebooks" / "00_start_here.ipynb", 4).cells
                      if c.cell_type == "code")
    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            "shell = InteractiveShell.instance()\n"
            f"result = shell.run_cell({first_cell!r})\n"
            "assert result.success, result.error_in_exec\n"
            "import pplab; print('installed at', pplab.__file__)")
    ran = subprocess.run([str(env_python), "-c", code], cwd=empty, env=env, capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0 and "installed at" in ran.stdout, ran.stdout[-2000:] + ran.stderr[-3000:]

    found = _where_things_come_from(env_python, empty, env, learner=False)
    packages = scratch / "colab" / "lib" / PY / "site-packages"
    assert Path(found["pplab"]).is_relative_to(packages), f"pplab came from {found['pplab']}, not the fresh environment"
    assert Path(found["torch"]).is_relative_to(dependencies), "torch was installed again"
    assert not list(packages.glob("torch*")), "pip put a torch into the fresh environment"
    assert found["version"] == install_cell.VERSION and found["text"] > 1000
    assert found["files"] == len(tracked), "the installed pplab has not the files of the checkout's"
    assert list(empty.iterdir()) == [], "importing pplab wrote into the notebook's folder"


# -- Binder ------------------------------------------------------------------------------------

def _dockerfile(scratch) -> tuple[str, str]:
    """The Dockerfile repo2docker would build for this repository (as mybinder.org: uid 1000), and its log."""
    out = subprocess.run([sys.executable, "-m", "repo2docker", "--no-build", "--debug", "--user-id", "1000",
                          "--user-name", "jovyan", str(ROOT)], cwd=scratch, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FROM " in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout, out.stderr


def _assemble_steps(dockerfile: str) -> list[tuple[str, str]]:
    """(user, command) of every RUN after the repository is copied in: what installs from it."""
    steps, user, copied = [], None, False
    for line in dockerfile.splitlines():
        if line.startswith("USER "):
            user = line.split(None, 1)[1]
        elif re.match(r"COPY .*\bsrc/ \$\{REPO_DIR\}/", line):
            copied = True
        elif copied and line.startswith("RUN "):
            steps.append((user, line[4:]))
        elif copied and line.startswith("LABEL "):
            break
    return steps


@pytest.mark.timeout(300)
def test_binder_image_installs_pplab_with_cpu_torch_as_its_user_and_runs_chapter_0_alone(scratch, python, dependencies):
    dockerfile, log = _dockerfile(scratch)
    requirements = re.sub(r"(?m)^#.*\n", "", (ROOT / "binder" / "requirements.txt").read_text())

    assert re.search(r"^FROM docker\.io/library/buildpack-deps:", dockerfile, re.M), "not repo2docker's base image"
    assert f"python={sys.version_info.major}.{sys.version_info.minor}" in log, "binder/runtime.txt: the course's Python"
    assert not re.search(r"cu\d{2,3}|nvidia|cuda", dockerfile + requirements, re.I), "a CUDA index or package"
    indexes = re.findall(r"--(?:extra-)?index-url\s+(\S+)", requirements)
    assert indexes and all(url.rstrip("/").endswith("/whl/cpu") for url in indexes), indexes
    assert re.search(r"^torch==[\d.]+\+cpu$", requirements, re.M), "torch pinned to a CPU build"
    assert re.search(r"^\.$", requirements, re.M) and "-e ." not in requirements, "pplab installed, not editable"
    steps = _assemble_steps(dockerfile)
    assert any('pip install --no-cache-dir -r "binder/requirements.txt"' in cmd for _, cmd in steps), dockerfile
    assert all(user == "${NB_USER}" for user, _ in steps), steps
    assert re.findall(r"^USER (.+)$", dockerfile, re.M)[-1] == "${NB_USER}", "the image must run as its user"
    assert "COPY --chown=1000:1000 src/ ${REPO_DIR}/" in dockerfile, "the repository belongs to the image's user"

    # Replay: the repository copied in (its files as git knows them), then each step, as the learner,
    # in a fresh environment standing for the image's ${KERNEL_PYTHON_PREFIX}.
    binder = scratch / "binder"
    home, prefix, lone = binder / "home", binder / "env", binder / "lone"
    _copy_tracked(home)
    lone.mkdir()
    shutil.copy(ROOT / "notebooks" / "00_start_here.ipynb", lone)
    _owned_by_learner(binder)
    env_python = _fresh_env(prefix, python, dependencies, learner=True)
    env = _clean_env(HOME=str(home), PATH=f"{prefix}/bin:{os.environ['PATH']}")
    for _, cmd in steps:
        cmd = cmd.replace("${KERNEL_PYTHON_PREFIX}/bin/pip", f"{env_python} -m pip")     # its pip: the course's
        cmd = cmd.replace("${KERNEL_PYTHON_PREFIX}", str(prefix))
        cmd = cmd.replace("pip install", "pip install --no-index --no-build-isolation")   # nothing downloaded
        ran = subprocess.run(_as_learner(shlex.split(cmd)), cwd=home, env=env, capture_output=True, text=True,
                             timeout=240)
        assert ran.returncode == 0, f"{cmd}\n{ran.stdout[-2000:]}\n{ran.stderr[-3000:]}"

    found = _where_things_come_from(env_python, lone, env, learner=True)
    assert Path(found["pplab"]).is_relative_to(prefix / "lib" / PY / "site-packages"), found["pplab"]
    assert Path(found["torch"]).is_relative_to(dependencies), "the replay installed torch again"

    run = ("import nbformat, nbclient, sys\n"
           "nb = nbformat.read('00_start_here.ipynb', 4)\n"
           "nb.cells.append(nbformat.v4.new_code_cell('import pplab, sys; print(pplab.__file__, sys.executable)'))\n"
           "nbclient.NotebookClient(nb, timeout=240, kernel_name='python3').execute()\n"
           "print(nb.cells[-1].outputs[0].text)\n")
    ran = subprocess.run(_as_learner([str(env_python), "-c", run]), cwd=lone, env=env, capture_output=True,
                         text=True, timeout=280)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-5000:]
    kernel_pplab, kernel_python = ran.stdout.split()[-2:]
    assert Path(kernel_pplab).is_relative_to(prefix) and kernel_python == str(env_python), ran.stdout[-500:]
    assert sorted(p.name for p in lone.iterdir()) == ["00_start_here.ipynb"], "chapter 0 left files beside itself"


# -- a function defined in a cell, under Colab's start methods ----------------------------------

@pytest.mark.timeout(200)
def test_a_function_defined_in_a_notebook_cell_launches_under_spawn(tmp_path):
    """Under spawn, fn is shipped by value (cloudpickle) because a fresh interpreter cannot import
    the kernel's __main__. A Colab GPU runtime spawns once a cell has touched CUDA: this CPU
    machine stands for it by making torch.cuda.is_initialized() say so inside the kernel."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "import torch, torch.distributed as dist, pplab\n"
        "SCALE = 3.0",
        "class Scaled(torch.nn.Module):                 # a class defined in the notebook\n"
        "    def forward(self, x):\n"
        "        return x * SCALE\n"
        "def offset():                                  # a helper the launched function calls\n"
        "    return dist.get_rank() + 1\n"
        "def step(n):\n"
        "    t = Scaled()(torch.full((n,), float(offset())))\n"
        "    pplab.comm.all_reduce(t)\n"
        "    return t.tolist()\n"
        "assert step.__module__ == '__main__'",
        "forked = pplab.launch(step, 2, world_size=2, timeout=120)\n"
        "torch.cuda.is_initialized = lambda: True       # as after torch.zeros(1, device='cuda') on a GPU runtime\n"
        "spawned = pplab.launch(step, 2, world_size=2, timeout=120)\n"
        "print(forked.start_method, spawned.start_method, spawned[1])\n"
        "assert (forked.start_method, spawned.start_method) == ('fork', 'spawn')\n"
        "assert list(forked) == list(spawned) == [[9.0, 9.0]] * 2")]
    from nbclient import NotebookClient
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert nb.cells[-1].outputs[0].text.split()[:2] == ["fork", "spawn"]
