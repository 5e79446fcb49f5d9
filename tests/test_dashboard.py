"""`localserve top`: view.py's logic, and the textual app driven headless with scripted snapshots."""

from __future__ import annotations

import copy
import datetime as dt
import difflib
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from localserve.client import DaemonError
from localserve.engine.stats import EngineStats
from localserve.tui import view
from localserve.tui.app import ConfirmUnload, Dashboard, HelpScreen
from localserve.errors import LocalserveError

SNAPSHOTS = Path(__file__).parent / "snapshots"
NOW = dt.datetime(2026, 11, 21, 10, 2, 3, tzinfo=dt.timezone.utc).timestamp()
SIZE = (120, 40)


def iso(offset_s: float) -> str:
    return dt.datetime.fromtimestamp(NOW + offset_s, dt.timezone.utc).isoformat(timespec="seconds")


def engine(**overrides: Any) -> dict[str, Any]:
    return {
        "kv_blocks_total": 512, "kv_blocks_used": 40, "kv_blocks_cached": 10, "kv_block_size": 16,
        "kv_cache_dtype": "float32", "cpu_blocks_total": 0, "cpu_blocks_used": 0,
        "num_running": 3, "num_waiting": 1, "num_swapped": 0, "num_preemptions": 0, "num_recomputes": 0,
        "swap_out_blocks": 0, "swap_in_blocks": 0, "prefix_cache_queries": 10, "prefix_cache_hits": 4,
        "prefix_cache_cpu_hits": 0, "num_prompt_tokens_total": 1000, "num_generated_tokens_total": 500,
        "num_finished_requests": 7, "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
        "spec_decode_num_accepted_tokens": 0, "prompt_tokens_per_s": 120.5, "generation_tokens_per_s": 80.2,
        **overrides,
    }


def snapshot(**overrides: Any) -> dict[str, Any]:
    """A daemon with two models: a small one on the CPU and a partly offloaded one on a GPU."""
    stories = {
        "name": "stories:latest", "path": "/models/stories260K.gguf", "format": "gguf", "quantization": "F32 100%",
        "loaded_at": iso(-120), "expires_at": iso(252), "keep_alive_s": 300.0, "requests_in_flight": 4,
        "max_model_len": 2048,
        "memory": {"device": "cpu", "weights_bytes": 1185376, "host_weights_bytes": 0,
                   "kv_cache_bytes": 67108864, "cpu_kv_cache_bytes": 0},
        "engine": engine(),
        "requests": [
            {"request_id": "aaaa1111bbbb", "status": "running", "prompt_tokens": 12, "output_tokens": 30, "age_s": 1.5},
            {"request_id": "bbbb2222cccc", "status": "running", "prompt_tokens": 50, "output_tokens": 10, "age_s": 4.0},
            {"request_id": "cccc3333dddd", "status": "running", "prompt_tokens": 5, "output_tokens": 90, "age_s": 3.0},
            {"request_id": "dddd4444eeee", "status": "waiting", "prompt_tokens": 700, "output_tokens": 0, "age_s": 0.2},
        ],
        "recent": {"requests": 7, "ttft_ms_p50": 12.0, "ttft_ms_p99": 40.0, "tpot_ms_p50": 5.0, "tpot_ms_p99": 9.0},
    }
    qwen = {
        "name": "qwen:q4_k_m", "path": "/models/qwen.gguf", "format": "gguf", "quantization": "Q4_K_M 98%",
        "loaded_at": iso(-60), "expires_at": None, "keep_alive_s": None, "requests_in_flight": 1,
        "max_model_len": 4096,
        "memory": {"device": "cuda", "weights_bytes": 4 << 30, "host_weights_bytes": 2 << 30,
                   "kv_cache_bytes": 1 << 30, "cpu_kv_cache_bytes": 0},
        "engine": engine(kv_blocks_total=2048, kv_blocks_used=1536, cpu_blocks_total=1024, cpu_blocks_used=256,
                         kv_cache_dtype="float16", num_running=1, num_waiting=0, num_finished_requests=2,
                         prefix_cache_queries=0, prefix_cache_hits=0,
                         prompt_tokens_per_s=10.0, generation_tokens_per_s=20.0),
        "requests": [
            {"request_id": "eeee5555ffff", "status": "running", "prompt_tokens": 100, "output_tokens": 200,
             "age_s": 10.0},
        ],
        "recent": {"requests": 2, "ttft_ms_p50": 30.5, "ttft_ms_p99": 61.0, "tpot_ms_p50": 15.0, "tpot_ms_p99": None},
    }
    stats = {
        "version": "0.1.0", "ready": True, "draining": False, "started_at": iso(-123), "uptime_s": 123.4,
        "host": {"device": "cuda", "device_name": "NVIDIA H200", "cpu_percent": 12.5,
                 "memory_total_bytes": 24 << 30, "memory_used_bytes": 8 << 30,
                 "gpus": [{"index": 0, "name": "NVIDIA H200", "utilization_percent": 87,
                           "memory_used_bytes": 70 << 30, "memory_total_bytes": 140 << 30}]},
        "known_models": ["stories:latest", "qwen:q4_k_m"],
        "models": [stories, qwen],
        "events": [
            {"seq": 1, "time": iso(-120), "kind": "load", "model": "stories:latest", "message": "loaded in 1.2 s"},
            {"seq": 2, "time": iso(-60), "kind": "load", "model": "qwen:q4_k_m", "message": "loaded in 9.8 s"},
        ],
    }
    stats.update(overrides)
    return stats


def with_engine(stats: dict[str, Any], model: int = 0, **counters: Any) -> dict[str, Any]:
    stats = copy.deepcopy(stats)
    stats["models"][model]["engine"].update(counters)
    return stats


class FakeSource:
    """Hands out scripted snapshots (or raises scripted errors) one per call; repeats the last."""

    def __init__(self, script: list[dict[str, Any] | Exception]) -> None:
        self.script = script
        self.calls = 0
        self.unloaded: list[str] = []
        self.unload_error: Exception | None = None

    def stats(self) -> dict[str, Any]:
        item = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if isinstance(item, Exception):
            raise item
        return item

    def unload(self, name: str) -> dict[str, Any]:
        if self.unload_error is not None:
            raise self.unload_error
        self.unloaded.append(name)
        return {"model": name, "unloaded": True}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # textual runs on asyncio


# -- the screen as text ------------------------------------------------------------------


def screen_text(app: Dashboard) -> str:
    """The active screen as plain text, one line per terminal row (trailing blanks dropped).

    The compositor renders the same strips the terminal would get; their text (without
    styles) is stable for a fixed size, snapshot and clock, unlike the SVG screenshot,
    whose markup carries generated class names."""
    strips = app.screen._compositor.render_strips()
    return "\n".join(strip.text.rstrip() for strip in strips) + "\n"


def widget_text(app: Dashboard, selector: str) -> str:
    """The part of the screen a widget covers (its border and title included)."""
    region = app.query_one(selector).region
    lines = screen_text(app).splitlines()[region.y:region.bottom]
    return "\n".join(line[region.x:region.right] for line in lines)


def flowing_text(app: Dashboard, selector: str) -> str:
    """A panel's inside as one line (wrapped lines joined, runs of spaces collapsed)."""
    lines = widget_text(app, selector).splitlines()[1:-1]
    return " ".join(" ".join(line.strip("│").split()) for line in lines)


def dashboard(source: FakeSource, **options: Any) -> Dashboard:
    # A long interval: the timer never fires, the tests call tick() when they mean one.
    return Dashboard(source, interval=3600, url="http://127.0.0.1:8000", clock=lambda: NOW,
                     tz=dt.timezone.utc, **options)


async def started(app: Dashboard, pilot: Any) -> None:
    await app.workers.wait_for_complete()  # the first fetch, made on mount
    await pilot.pause()


async def tick(app: Dashboard, pilot: Any) -> None:
    await app.tick()
    await pilot.pause()


# -- the app -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_panels_show_the_numbers() -> None:
    app = dashboard(FakeSource([snapshot()]))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        header = widget_text(app, "#header")
        assert "v0.1.0" in header and "up 2m 03s" in header and "connected" in header
        assert "NVIDIA H200" in header and "GPU0 87% 70.00/140.00 GiB" in header
        assert "CPU 12%" in header and "RAM 8.00/24.00 GiB" in header

        models = widget_text(app, "#models")
        assert "stories:latest" in models and "gguf F32 100%" in models and "1.13 MiB" in models
        assert "in 4m 12s" in models
        assert "qwen:q4_k_m" in models and "Q4_K_M 98%" in models and "cuda + 2.00 GiB host" in models
        assert "forever" in models

        kv = widget_text(app, "#kv")  # the first model is selected
        assert "KV cache · stories:latest" in kv and "40/512" in kv and "no CPU tier" in kv
        assert "40% (4/10)" in kv and "float32" in kv

        scheduler = widget_text(app, "#scheduler")
        assert "running   4" in scheduler and "waiting   1" in scheduler and "finished  9" in scheduler

        throughput = widget_text(app, "#throughput")
        assert "130.5" in throughput and "100.2" in throughput  # summed over the two models

        latency = widget_text(app, "#latency")
        assert "stories:latest" in latency and "12.0" in latency and "40.0" in latency
        assert "5.0" in latency and "9.0" in latency and "61.0" in latency

        requests = widget_text(app, "#requests")
        assert "Requests (5)" in requests
        assert "aaaa1111" in requests and "waiting" in requests and "20.0" in requests  # 30 tokens / 1.5 s

        events = flowing_text(app, "#events")
        assert "load" in events and "loaded in 1.2 s" in events and "loaded in 9.8 s" in events


@pytest.mark.anyio
async def test_selecting_another_model_moves_the_kv_panel() -> None:
    app = dashboard(FakeSource([snapshot()]))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await pilot.press("down")
        kv = widget_text(app, "#kv")
        assert "KV cache · qwen:q4_k_m" in kv and "1536/2048" in kv and "256/1024" in kv
        assert "prefix hits -" in kv
        await tick(app, pilot)  # a refresh keeps the selection
        assert app.selected_model == "qwen:q4_k_m"


@pytest.mark.anyio
async def test_the_kv_panel_follows_the_busiest_model_until_one_is_picked() -> None:
    busy_qwen = copy.deepcopy(snapshot())
    busy_qwen["models"][0]["requests_in_flight"] = 0  # stories idle, qwen busy
    app = dashboard(FakeSource([busy_qwen, snapshot()]))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        assert "KV cache · qwen:q4_k_m" in widget_text(app, "#kv")  # opens on the busy one
        await tick(app, pilot)  # now stories is the busier: the panel follows
        assert app.selected_model == "stories:latest"
        await pilot.press("down")  # the user picks qwen: it stays, whatever is busiest
        await tick(app, pilot)
        assert app.selected_model == "qwen:q4_k_m"


@pytest.mark.anyio
async def test_a_model_being_loaded_is_shown_with_its_progress_and_waiting_requests() -> None:
    loading = [{"name": "llama:8b", "phase": "loading weights", "fraction": 0.42, "elapsed_s": 11.0,
                "requests_waiting": 8}]
    app = dashboard(FakeSource([snapshot(loading=loading)]))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        models = widget_text(app, "#models")
        assert "llama:8b" in models and "loading: loading weights 42%" in models and "for 11s" in models
        row = [line for line in models.splitlines() if "llama:8b" in line][0]
        assert row.rstrip("│ ").endswith("8")  # in flight: the requests waiting for it


def request_order(app: Dashboard) -> list[str]:
    lines = widget_text(app, "#requests").splitlines()[2:]  # the border and the header
    return [line.split()[1] for line in lines if line.strip("│ ╰─╯")]


@pytest.mark.anyio
async def test_s_cycles_the_requests_sort() -> None:
    app = dashboard(FakeSource([snapshot()]))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        assert "sort: age" in widget_text(app, "#requests")
        assert request_order(app) == ["eeee5555", "bbbb2222", "cccc3333", "aaaa1111", "dddd4444"]
        await pilot.press("s")
        assert "sort: tokens/s" in widget_text(app, "#requests")
        # 30, 20, 20 (the request id breaks the tie), 2.5, 0 tokens/s
        assert request_order(app) == ["cccc3333", "aaaa1111", "eeee5555", "bbbb2222", "dddd4444"]
        await pilot.press("s")
        assert request_order(app)[0] == "eeee5555"  # generated: 200 tokens
        await pilot.press("s")
        assert request_order(app)[0] == "dddd4444"  # prompt: 700 tokens


@pytest.mark.anyio
async def test_p_pauses_refreshing() -> None:
    source = FakeSource([snapshot()])
    app = dashboard(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await tick(app, pilot)
        assert source.calls == 2
        await pilot.press("p")
        assert "paused" in widget_text(app, "#status")
        await tick(app, pilot)
        await tick(app, pilot)
        assert source.calls == 2
        await pilot.press("p")
        await tick(app, pilot)
        assert source.calls == 3 and "paused" not in widget_text(app, "#status")


@pytest.mark.anyio
async def test_question_mark_opens_help() -> None:
    app = dashboard(FakeSource([snapshot()]))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert "unload the selected model" in screen_text(app)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@pytest.mark.anyio
async def test_u_asks_then_n_cancels_and_y_unloads_the_selected_model() -> None:
    source = FakeSource([snapshot()])
    app = dashboard(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await pilot.press("u")
        assert isinstance(app.screen, ConfirmUnload) and app.screen.model == "stories:latest"
        await pilot.press("n")
        await app.workers.wait_for_complete()
        assert not isinstance(app.screen, ConfirmUnload) and source.unloaded == []

        await pilot.press("down", "u", "y")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert source.unloaded == ["qwen:q4_k_m"]
        assert "unload qwen:q4_k_m asked from top" in flowing_text(app, "#events")

        source.unload_error = DaemonError("the daemon answered 404: no such model", 404)
        await pilot.press("u", "y")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "unload failed: the daemon answered 404" in flowing_text(app, "#events")


@pytest.mark.anyio
async def test_q_quits() -> None:
    app = dashboard(FakeSource([snapshot()]))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


@pytest.mark.anyio
async def test_a_lost_daemon_shows_disconnected_then_data_again() -> None:
    source = FakeSource([snapshot(), LocalserveError("connection refused"), snapshot(uptime_s=200.0)])
    app = dashboard(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await tick(app, pilot)
        assert "disconnected (retrying)" in widget_text(app, "#header")
        assert "connection refused" in flowing_text(app, "#events")
        await tick(app, pilot)
        header = widget_text(app, "#header")
        assert "connected" in header and "disconnected" not in header and "up 3m 20s" in header
        assert "reconnect" in flowing_text(app, "#events")
        assert flowing_text(app, "#events").count("loaded in 1.2 s") == 1  # the daemon's events, once


@pytest.mark.anyio
async def test_a_daemon_that_is_down_from_the_start() -> None:
    app = dashboard(FakeSource([LocalserveError("cannot reach the daemon")]))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        assert "disconnected (retrying)" in widget_text(app, "#header")
        assert "no model loaded" in widget_text(app, "#kv")


@pytest.mark.anyio
async def test_a_wrong_key_shows_unauthorized() -> None:
    app = dashboard(FakeSource([DaemonError("the daemon answered 401: invalid API key", 401)]))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        assert "unauthorized: check LOCALSERVE_API_KEY" in widget_text(app, "#header")


@pytest.mark.anyio
async def test_an_older_daemon_without_the_new_fields() -> None:
    stats = snapshot()
    for key in ("started_at", "uptime_s", "host", "events"):
        del stats[key]
    for model in stats["models"]:
        for key in ("format", "quantization"):
            del model[key]
        for key in ("prompt_tokens_per_s", "generation_tokens_per_s"):
            del model["engine"][key]
        model["recent"] = {"requests": 1, "ttft_ms_median": 11.0, "ttft_ms_p90": 20.0,
                           "tpot_ms_median": None, "tpot_ms_p90": None}
    app = dashboard(FakeSource([stats]))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        assert "up -" in widget_text(app, "#header") and "host: -" in widget_text(app, "#header")
        assert "stories:latest" in widget_text(app, "#models")
        assert "11.0" in widget_text(app, "#latency")


@pytest.mark.anyio
async def test_screen_matches_the_golden_snapshot() -> None:
    """The whole screen at 120x40. LOCALSERVE_UPDATE_SNAPSHOTS=1 rewrites the golden file."""
    busier = with_engine(snapshot(), num_preemptions=2, swap_out_blocks=8)
    busier["events"].append({"seq": 3, "time": iso(0), "kind": "error", "model": "qwen:q4_k_m",
                             "message": "request failed: prompt too long"})
    app = dashboard(FakeSource([snapshot(), busier]))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await tick(app, pilot)
        assert_matches_golden(screen_text(app), SNAPSHOTS / "top_120x40.txt")


def assert_matches_golden(text: str, golden: Path) -> None:
    if os.environ.get("LOCALSERVE_UPDATE_SNAPSHOTS") == "1":
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text, encoding="utf-8")
        return
    expected = golden.read_text(encoding="utf-8") if golden.exists() else ""
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), text.splitlines(keepends=True),
                                            f"{golden.name} (golden)", f"{golden.name} (now)"))
        pytest.fail(f"the screen differs from {golden} (LOCALSERVE_UPDATE_SNAPSHOTS=1 rewrites it):\n{diff}",
                    pytrace=False)


# -- view.py -----------------------------------------------------------------------------


def test_preemptions_per_minute_counts_the_last_60_seconds() -> None:
    history = view.History()
    for t, preemptions in ((0, 0), (10, 2), (30, 5), (50, 5), (75, 9)):
        history.add(with_engine(snapshot(), num_preemptions=preemptions), NOW + t)
    # The window is (15, 75]: 5 -> 5 -> 9 over the samples at 30, 50, 75, plus 2 -> 5 at 30.
    assert history.preemptions_per_minute(NOW + 75) == 7
    assert history.preemptions_per_minute(NOW + 200) == 0


def test_preemptions_survive_a_reloaded_model() -> None:
    history = view.History()
    history.add(with_engine(snapshot(), num_preemptions=10), NOW)
    history.add(with_engine(snapshot(), num_preemptions=3), NOW + 5)  # reloaded: counts from 0 again
    assert history.preemptions_per_minute(NOW + 5) == 3


def test_sparkline_history_is_bounded() -> None:
    history = view.History(maxlen=5)
    for _ in range(20):
        history.add(snapshot(), NOW)  # a stalled clock: the minute's window never trims
    assert len(history.prompt_rates) == 5 and history.prompt_rate == pytest.approx(130.5)
    assert len(history.samples) == 5
    for t in range(100, 200, 10):
        history.add(snapshot(), NOW + t)
    assert [s.time - NOW for s in history.samples] == [130, 140, 150, 160, 170, 180, 190][-5:]


def test_rates_come_from_the_counters_when_the_daemon_has_none() -> None:
    history = view.History()
    old = copy.deepcopy(snapshot())
    for model in old["models"]:
        del model["engine"]["prompt_tokens_per_s"], model["engine"]["generation_tokens_per_s"]
    later = with_engine(with_engine(old, num_generated_tokens_total=600), 1, num_generated_tokens_total=540)
    history.add(old, NOW)
    history.add(later, NOW + 2)
    assert history.generation_rate == pytest.approx((100 + 40) / 2)
    assert history.prompt_rate == 0


@pytest.mark.parametrize(("model", "text"), [
    ({"expires_at": iso(252), "keep_alive_s": 300.0}, "in 4m 12s"),
    ({"expires_at": iso(-5), "keep_alive_s": 300.0}, "now"),
    ({"expires_at": None, "keep_alive_s": 300.0}, "in use"),
    ({"expires_at": None, "keep_alive_s": None}, "forever"),
    ({}, "-"),
])
def test_expiry_text(model: dict[str, Any], text: str) -> None:
    assert view.expiry_text(model, NOW) == text


def test_durations() -> None:
    assert [view.duration_text(s) for s in (5, 252, 3 * 3600 + 300, 2 * 86400 + 4 * 3600)] == \
        ["5s", "4m 12s", "3h 05m", "2d 04h"]


@pytest.mark.parametrize(("sort", "first"), [("age", "eeee5555ffff"), ("tokens/s", "cccc3333dddd"),
                                             ("generated", "eeee5555ffff"), ("prompt", "dddd4444eeee"),
                                             ("model", "eeee5555ffff")])
def test_sort_keys(sort: str, first: str) -> None:
    rows = view.request_rows(snapshot(), sort)
    assert rows[0].request_id == first and len(rows) == 5


def test_sort_cycles_through_every_key() -> None:
    seen, sort = [], "age"
    for _ in view.SORT_KEYS:
        seen.append(sort)
        sort = view.next_sort(sort)
    assert seen == list(view.SORT_KEYS) and sort == "age"


def test_daemon_events_are_shown_once_by_seq() -> None:
    log = view.EventLog()
    first = log.add_daemon(snapshot()["events"], NOW)
    assert [e.message for e in first] == ["loaded in 1.2 s", "loaded in 9.8 s"]
    assert log.add_daemon(snapshot()["events"], NOW) == []
    more = snapshot()["events"][1:] + [{"seq": 3, "time": iso(0), "kind": "unload", "model": "qwen:q4_k_m",
                                        "message": "unloaded"}]
    assert [e.kind for e in log.add_daemon(more, NOW)] == ["unload"]


def test_a_restarted_daemon_counts_seq_from_one_again() -> None:
    log = view.EventLog()
    log.add_daemon([{"seq": n, "time": iso(0), "kind": "load", "model": "m", "message": str(n)} for n in (5, 6)], NOW)
    fresh = log.add_daemon([{"seq": 1, "time": iso(9), "kind": "load", "model": "m", "message": "again"}], NOW)
    assert [e.message for e in fresh] == ["again"]


def test_preemptions_and_swaps_become_events() -> None:
    before = snapshot()
    after = with_engine(before, num_preemptions=2, swap_out_blocks=8, swap_in_blocks=1)
    events = view.counter_events(before, after, NOW)
    assert [(e.kind, e.model, e.message) for e in events] == [
        ("preempt", "stories:latest", "preempted 2 requests"),
        ("swap", "stories:latest", "swapped 8 KV blocks out to the CPU tier"),
        ("swap", "stories:latest", "swapped 1 KV block back in"),
    ]
    assert view.counter_events(None, after, NOW) == []


def test_monitor_logs_each_connection_change_once() -> None:
    monitor = view.Monitor()
    monitor.observe(snapshot(), NOW)
    lost = LocalserveError("connection refused")
    assert [e.kind for e in monitor.failed(lost, NOW)] == ["disconnect"]
    assert monitor.failed(lost, NOW + 1) == []
    assert monitor.status == view.DISCONNECTED
    assert [e.kind for e in monitor.observe(snapshot(), NOW + 2)] == ["reconnect"]
    monitor.failed(DaemonError("no", 401), NOW + 3)
    assert monitor.status == view.UNAUTHORIZED


def test_status_words() -> None:
    assert view.status_word(snapshot()) == "connected"
    assert view.status_word(snapshot(ready=False)) == "starting"
    assert view.status_word(snapshot(draining=True)) == "draining"


def test_hit_rate_and_where() -> None:
    stats = EngineStats.from_dict(engine(prefix_cache_queries=10, prefix_cache_hits=4))
    assert stats is not None and view.hit_rate_text(stats) == "40% (4/10)"
    assert view.hit_rate_text(replace(stats, prefix_cache_queries=0, prefix_cache_hits=0)) == "-"
    assert view.where_text({"device": "cuda", "host_weights_bytes": 0, "cpu_kv_cache_bytes": 1 << 30}) == \
        "cuda + 1.00 GiB host"
    assert view.where_text({"device": "cpu"}) == "cpu"


def test_kept_drafts_show_once_there_are_any() -> None:
    model = {"name": "m", "engine": engine()}
    assert not any(line.startswith("drafts") for line in view.kv_lines(model, 40))
    model["engine"] = engine(spec_decode_num_draft_tokens=40, spec_decode_num_accepted_tokens=30)
    assert "drafts kept 75% (30/40)" in view.kv_lines(model, 40)
    # A daemon of an older version reports no such counters: none shown, nothing breaks.
    old = {k: v for k, v in engine().items() if not k.startswith("spec_decode")}
    assert EngineStats.from_dict(old) is not None


def test_engine_stats_round_trip_and_another_version_shows_none() -> None:
    """The dashboard reads the daemon's EngineStats back by name: the same snapshot from
    the JSON; a missing or mistyped field (another version) gives no engine stats rather
    than wrong figures; rates, added later, may be absent."""
    data = engine()
    stats = EngineStats.from_dict(data)
    assert stats is not None and stats.as_dict() == data
    assert EngineStats.from_dict({**data, "a_future_field": 1}) == stats
    without_rates = {k: v for k, v in data.items() if not k.endswith("_per_s")}
    assert EngineStats.from_dict(without_rates) == replace(stats, prompt_tokens_per_s=None, generation_tokens_per_s=None)
    assert EngineStats.from_dict({k: v for k, v in data.items() if k != "kv_blocks_used"}) is None
    assert EngineStats.from_dict({**data, "kv_blocks_used": "40"}) is None
    assert EngineStats.from_dict({**data, "num_running": True}) is None
    model = {"name": "m", "engine": {"kv_blocks_total": 512}}
    assert view.engine_of(model) is None and view.kv_lines(model, 40) == ["no engine stats"]


def test_gauge() -> None:
    assert view.gauge(40, 512, 16) == "█" + "░" * 15
    assert view.gauge(0, 512, 4) == "░░░░" and view.gauge(512, 512, 4) == "████"
    assert view.gauge(3, 0, 4) == "░░░░"



def test_sparkline_draws_from_zero_with_the_newest_on_the_right() -> None:
    assert view.sparkline([], 5) == " " * 5
    assert view.sparkline([0, 4, 8], 5) == "  ▁▅█"
    assert view.sparkline([8, 8, 8], 3) == "███"  # steady is full height, not flat at the bottom
    assert view.sparkline([1, 1, 1], 3) == "███" and view.sparkline([0.001, 8], 2) == "▂█"


def test_sparkline_averages_when_there_are_more_values_than_columns() -> None:
    values = [0, 2, 4, 6, 8, 8]
    assert view.sparkline(values, 3) == view.sparkline([1, 5, 8], 3)
    # One value fell off the left: the columns keep their place in the stream, so the
    # first column now holds one value instead of straddling a new pair.
    assert view.sparkline(values[1:], 3, first_index=1) == view.sparkline([2, 5, 8], 3)


def test_cli_top_options() -> None:
    from click.testing import CliRunner

    from localserve.cli.main import main

    result = CliRunner().invoke(main, ["top", "--help"])
    assert result.exit_code == 0 and "--url" in result.output and "--interval" in result.output
    assert CliRunner().invoke(main, ["top", "--interval", "0.05"]).exit_code == 2


@pytest.mark.anyio
async def test_a_small_terminal_still_shows_the_essentials() -> None:
    app = dashboard(FakeSource([snapshot()]))
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot)
        assert app.query_one("#body").has_class("-narrow", "-short")
        assert "stories:latest" in widget_text(app, "#models") and "connected" in widget_text(app, "#header")
        assert "40/512" in widget_text(app, "#kv")
