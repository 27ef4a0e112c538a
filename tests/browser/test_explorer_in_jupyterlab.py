"""The pipeline explorer in a real browser: JupyterLab, driven by Playwright in Debian's chromium.

Run with `make browser-test` (it installs chromium and playwright when missing). What a
learner does: open 04_pipeline in JupyterLab, run all cells, change the explorer's schedule
and m. Checked: the figure is redrawn each time (new image bytes, new title), the controls
sit in rows inside the widget with none cut off and no slider squeezed to its handle, and
only the controls that apply to the schedule show.

The JupyterLab server and the browser are stopped however the test ends.
"""
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.skipif(os.environ.get("PPLAB_BROWSER") != "1",
                                reason="the browser test runs with `make browser-test`")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "04_pipeline.ipynb"
RUN_ALL_TIMEOUT = 900            # seconds: the notebook runs real ranks; a loaded 2-core box is slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no chromium on PATH: `make browser-test` installs Debian's (apt-get install chromium)")


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on a free port with a token, serving a copy of the notebook
    (JupyterLab autosaves: the repository's copy must stay as committed)."""
    shutil.copy(ROOT / "notebooks" / NOTEBOOK, tmp_path / NOTEBOOK)
    port, token = _free_port(), os.urandom(16).hex()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"))
    # as a learner runs it: the predict cells empty, no worked answer that must match (conftest.py)
    env.pop("PPLAB_PREDICTIONS_MUST_MATCH", None)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={tmp_path}", "--ServerApp.port_retries=0",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "jupyter.log", "wb")
    server = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)         # its own process group: kernels go with it
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyter.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url, token
    finally:
        # kernels (and the ranks a notebook launched) may sit in sessions of their own:
        # note them all, stop the server (it shuts its kernels down), then end any left
        try:
            family = psutil.Process(server.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.wait()
        for proc in family:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        log.close()


def _image_bytes(page, img) -> str:
    """A hash of the bytes the <img> shows (its src is a data: URL of the PNG)."""
    data = page.evaluate("""async (img) => {
        const r = await fetch(img.src); const b = new Uint8Array(await r.arrayBuffer());
        return Array.from(b.slice(0, 4096)).join(',') + ':' + b.length + ':' + b.reduce((a, x) => (a * 31 + x) >>> 0, 7);
    }""", img.element_handle())
    return hashlib.sha256(data.encode()).hexdigest()


def _control(explorer, label):
    """The widget whose description is exactly `label`."""
    return explorer.locator(".widget-inline-hbox").filter(     # sliders: a label; checkboxes: a span
        has=explorer.page.locator(f"label.widget-label:text-is('{label}'), span:text-is('{label}')")).first


def _wait_redraw(page, img, old_src, what):
    deadline = time.monotonic() + 120
    while img.get_attribute("src") == old_src:
        if time.monotonic() > deadline:
            pytest.fail(f"the figure was not redrawn after {what}")
        page.wait_for_timeout(200)


def _check_layout(explorer, names_shown, names_hidden):
    grid = explorer.locator(".widget-gridbox").first
    g = grid.bounding_box()
    tops = set()
    for name in names_shown:
        c = _control(explorer, name)
        assert c.is_visible(), f"control {name!r} should show"
        b = c.bounding_box()
        assert g["x"] - 1 <= b["x"] and b["x"] + b["width"] <= g["x"] + g["width"] + 1, \
            f"control {name!r} is cut off: {b} outside the widget {g}"
        assert b["width"] >= 150, f"control {name!r} is squeezed to {b['width']:.0f} px"
        track = c.locator(".noUi-target, .slider-container")
        if track.count():
            assert track.first.bounding_box()["width"] >= 80, f"the slider {name!r} collapsed to its handle"
        tops.add(round(b["y"]))
    assert len(tops) >= 2, "the controls should wrap into rows, not sit in one line"
    for name in names_hidden:
        assert not _control(explorer, name).is_visible(), f"control {name!r} does not apply and should be hidden"


def test_explorer_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import sync_playwright

    url, token = lab
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/{NOTEBOOK}?token={token}")
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)
            # the kernel must be up before "Run All", or JupyterLab asks which kernel to start
            page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"\| Idle")).first.wait_for(timeout=180_000)
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            explorer = page.locator(".jp-OutputArea-output").filter(has=page.locator(".widget-gridbox")).last
            img = explorer.locator(".widget-html-content img").first
            deadline = time.monotonic() + RUN_ALL_TIMEOUT
            while not img.is_visible():
                dialog = page.locator(".jp-Dialog .jp-mod-accept")
                if dialog.count():                      # "Select Kernel": take the notebook's own
                    dialog.first.click()
                errors = page.locator("[data-mime-type='application/vnd.jupyter.error']")
                if errors.count():
                    pytest.fail("a cell failed in JupyterLab:\n" + errors.first.inner_text()[-2000:])
                if time.monotonic() > deadline:
                    page.screenshot(path=str(tmp_path / "timeout.png"))
                    pytest.fail(f"the explorer did not appear within {RUN_ALL_TIMEOUT} s")
                page.wait_for_timeout(1000)
            explorer.scroll_into_view_if_needed()
            assert img.get_attribute("title").startswith("1f1b: p=4, m=8")

            _check_layout(explorer, ["schedule", "p", "m", "t_f", "t_b", "memory"],
                          ["v", "t_w (0: t_b/2)", "comm lanes", "send → recv arrows"])

            # the schedule: 1F1B -> GPipe
            src, data = img.get_attribute("src"), _image_bytes(page, img)
            _control(explorer, "schedule").locator("select").select_option("gpipe")
            _wait_redraw(page, img, src, "choosing gpipe")
            assert _image_bytes(page, img) != data
            assert img.get_attribute("title").startswith("gpipe: p=4, m=8")

            # m: 8 -> 4, typed into the slider's readout as a learner would
            src, data = img.get_attribute("src"), _image_bytes(page, img)
            readout = _control(explorer, "m").locator(".widget-readout")
            readout.click()
            page.keyboard.press("Control+A")
            page.keyboard.type("4")
            page.keyboard.press("Enter")
            _wait_redraw(page, img, src, "setting m = 4")
            assert _image_bytes(page, img) != data
            assert img.get_attribute("title").startswith("gpipe: p=4, m=4")

            # interleaved: v applies now; ZB-V: t_w does, v does not (always 2 chunks)
            src = img.get_attribute("src")
            _control(explorer, "schedule").locator("select").select_option("interleaved-1f1b")
            _wait_redraw(page, img, src, "choosing interleaved-1f1b")
            _check_layout(explorer, ["schedule", "p", "m", "v", "t_f", "t_b"], ["t_w (0: t_b/2)"])
            src = img.get_attribute("src")
            _control(explorer, "schedule").locator("select").select_option("zb-v")
            _wait_redraw(page, img, src, "choosing zb-v")
            assert "(p-1)/(v·m)" not in img.get_attribute("title")
            _check_layout(explorer, ["schedule", "p", "m", "t_f", "t_b", "t_w (0: t_b/2)"], ["v"])
            page.screenshot(path=str(tmp_path / "explorer.png"), full_page=False)
        finally:
            browser.close()
