"""The `localserve top` screen: textual widgets that show what view.py computes.

Fetching runs in a thread (``asyncio.to_thread``) from a timer's own task, so a slow or
absent daemon never blocks the keys; one fetch at a time, and a tick that finds one in
flight is skipped.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable, Iterable

from rich.table import Table
from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Footer, Label, RichLog, Static

from ..errors import LocalserveError
from . import view
from .source import StatsSource

EVENT_STYLES = {"error": "bold red", "load_failed": "bold red", "disconnect": "bold red",
                "reconnect": "green", "preempt": "yellow", "swap": "yellow"}
UNAUTHORIZED_RETRY_S = 5.0  # the key cannot change while we run; ask now and then anyway
NARROW = 110  # columns below which the requests table and the event log do not fit side by side
MODEL_COLUMNS = ("model", "format", "size", "where", "unloads", "served", "in flight")
REQUEST_COLUMNS = ("id", "model", "state", "prompt", "generated", "tok/s", "age")
KEYS = (
    ("q", "quit"),
    ("p", "pause or resume refreshing"),
    ("s", "sort the requests by the next column: age, tokens/s, generated, prompt, model"),
    ("u", "unload the selected model (asks first)"),
    ("up/down", "select a model (the KV cache panel follows it)"),
    ("tab", "move between the models table and the event log (to scroll it)"),
    ("?", "this help"),
)


class RequestsTable(DataTable, can_focus=False):
    """Read-only: the arrow keys stay with the models table."""


class ConfirmUnload(ModalScreen[bool]):
    AUTO_FOCUS = "#no"  # Enter on the default button must not unload
    BINDINGS = [Binding("y", "answer(True)", "yes"), Binding("n", "answer(False)", "no"),
                Binding("escape", "answer(False)", "no", show=False)]

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(Text.assemble("Unload ", (self.model, "bold"), "?"))  # a name is not markup
            yield Label("Requests still running on it end with an error.")
            with Horizontal(classes="buttons"):
                yield Button("Unload (y)", variant="error", id="yes")
                yield Button("Cancel (n)", variant="primary", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "close", "close")]

    def compose(self) -> ComposeResult:
        keys = Table.grid(padding=(0, 2))
        for key, what in KEYS:
            keys.add_row(Text(key, style="bold"), what)
        with Vertical(classes="dialog"):
            yield Label("[b]localserve top[/b]: keys")
            yield Static(keys)
            yield Label("escape, ? or q closes this", classes="hint")

    def action_close(self) -> None:
        self.dismiss()


class Dashboard(App[None]):
    TITLE = "localserve top"
    # Inline rather than a .tcss file beside the module, so a wheel needs no package data.
    # Fixed-height panels on top; the live tables take what is left.
    CSS = """
#header { height: 2; background: $boost; }
#summary { width: 1fr; padding: 0 1; }
#status { width: auto; min-width: 14; height: 2; padding: 0 2; content-align: center middle; text-style: bold; }
#status.-ok { background: $success 35%; }
#status.-warn { background: $warning 45%; }
#status.-bad { background: $error; }

.panel { border: round $primary 50%; border-title-color: $text; padding: 0 1; }

#models { height: auto; max-height: 9; }
#middle { height: 7; }
#middle > .panel { height: 1fr; }
#kv { width: 1fr; }
#scheduler { width: 28; }
#latency { width: 1fr; }

#throughput { height: 4; }
.rate { height: 1; }
.rate-label { width: 23; }
.spark { width: 1fr; color: $success; }

#bottom { height: 1fr; min-height: 8; }
#bottom > .panel { height: 1fr; }
#requests { width: 3fr; }
#events { width: 2fr; padding: 0 0 0 1; scrollbar-size-vertical: 1; }

/* Narrow: the requests and the log one above the other. Short: no sparklines. */
#body.-narrow #bottom { layout: vertical; min-height: 14; }
#body.-narrow #requests, #body.-narrow #events { width: 1fr; height: 1fr; }
#body.-narrow #scheduler { width: 22; }
#body.-short #throughput { display: none; }

ConfirmUnload, HelpScreen { align: center middle; }
.dialog { width: 80; max-width: 95%; height: auto; padding: 1 2; border: thick $primary; background: $surface; }
ConfirmUnload .dialog { width: 60; }
.dialog .buttons { height: auto; margin-top: 1; }
.dialog Button { margin-right: 2; }
.dialog .hint { color: $text-muted; margin-top: 1; }
"""
    ENABLE_COMMAND_PALETTE = False
    AUTO_FOCUS = "#models"
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("p", "pause", "pause"),
        Binding("s", "sort", "sort"),
        Binding("u", "unload", "unload"),
        Binding("question_mark", "help", "help", key_display="?"),
    ]

    def __init__(self, source: StatsSource, interval: float = 0.5, url: str = "", *,
                 clock: Callable[[], float] = time.time, tz: dt.tzinfo | None = None) -> None:
        """``clock`` (epoch seconds) and ``tz`` (None: local) make tests deterministic."""
        super().__init__()
        self.source = source
        self.interval = interval
        self.url = url
        self.clock = clock
        self.tz = tz
        self.monitor = view.Monitor()
        self.paused = False
        self.sort = view.SORT_KEYS[0]
        self._fetching = False
        self._retry_at = 0.0  # time.monotonic() when an unauthorized dashboard asks again
        self._model_names: list[str] = []
        self._picked = False  # the user chose a model: the KV panel stops following the busiest

    # -- layout ---------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Vertical(id="body"):
            with Horizontal(id="header"):
                yield Static(id="summary")
                yield Static(id="status")
            yield DataTable(id="models", classes="panel", cursor_type="row", zebra_stripes=True)
            with Horizontal(id="middle"):
                yield Static(id="kv", classes="panel")
                yield Static(id="scheduler", classes="panel")
                yield Static(id="latency", classes="panel")
            with Vertical(id="throughput", classes="panel"):
                for name in ("prompt", "generation"):
                    with Horizontal(classes="rate"):
                        yield Static(id=f"{name}-rate", classes="rate-label")
                        yield Static(id=f"{name}-spark", classes="spark")
            with Horizontal(id="bottom"):
                yield RequestsTable(id="requests", classes="panel", cursor_type="none", zebra_stripes=True)
                yield RichLog(id="events", classes="panel", max_lines=view.MAX_EVENTS, wrap=True,
                              min_width=20, markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#models", DataTable).add_columns(*MODEL_COLUMNS)
        self.query_one("#requests", DataTable).add_columns(*REQUEST_COLUMNS)
        self.query_one("#models").border_title = "Models"
        self.query_one("#scheduler").border_title = "Scheduler · all models"
        self.query_one("#throughput").border_title = "Throughput · all models · tokens/s"
        self.query_one("#events").border_title = "Events"
        self.show()
        self.set_interval(self.interval, self.tick)
        self.run_worker(self.poll(), group="poll")  # the first look, without waiting a tick

    def on_resize(self, event: events.Resize) -> None:
        # Narrow terminals stack the bottom panels; gauges follow their panel's width.
        self.query_one("#body").set_class(event.size.width < NARROW, "-narrow")
        self.query_one("#body").set_class(event.size.height < 30, "-short")
        self.call_after_refresh(self.show)

    # -- fetching -------------------------------------------------------------------

    async def tick(self) -> None:
        """The timer: fetch unless paused (or unauthorized and not yet due again)."""
        if self.paused:
            return
        if self.monitor.status == view.UNAUTHORIZED and time.monotonic() < self._retry_at:
            return
        await self.poll()

    async def poll(self) -> None:
        """Fetch one snapshot and show it (or the error)."""
        if self._fetching:
            return
        self._fetching = True
        try:
            stats = await asyncio.to_thread(self.source.stats)
        except (LocalserveError, ValueError) as exc:  # DaemonError is a LocalserveError
            new = self.monitor.failed(exc, self.clock())
            self._retry_at = time.monotonic() + UNAUTHORIZED_RETRY_S
        else:
            new = self.monitor.observe(stats, self.clock())
        finally:
            self._fetching = False
        self.log_events(new)
        self.show()

    async def unload(self, name: str) -> None:
        # The daemon logs the unload itself; this line says who asked, and what went wrong.
        new = [self.monitor.log.add(view.Event(self.clock(), "unload", name, "asked from top"))]
        try:
            answer = await asyncio.to_thread(self.source.unload, name)
        except (LocalserveError, ValueError) as exc:
            new.append(self.monitor.log.add(view.Event(self.clock(), "error", name, f"unload failed: {exc}")))
        else:
            if not (isinstance(answer, dict) and answer.get("unloaded")):
                new.append(self.monitor.log.add(view.Event(self.clock(), "unload", name, "was not loaded")))
        self.log_events(new)
        await self.poll()

    # -- showing --------------------------------------------------------------------

    def log_events(self, new: Iterable[view.Event]) -> None:
        log = self.query_one("#events", RichLog)
        for event in new:
            body = Text.assemble((event.kind, EVENT_STYLES.get(event.kind, "cyan")), " ")
            if event.model:
                body.append(event.model, "bold").append(" ")
            # Two columns, so a long message wraps under itself, not under the time.
            line = Table.grid(padding=(0, 1))
            line.add_column(no_wrap=True)
            line.add_column(ratio=1)
            line.add_row(Text(view.clock_text(event.time, self.tz), "dim"), body.append(event.message))
            log.write(line)

    @property
    def selected_model(self) -> str | None:
        row = self.query_one("#models", DataTable).cursor_row
        return self._model_names[row] if 0 <= row < len(self._model_names) else None

    def show(self) -> None:
        stats = self.monitor.stats
        now = self.clock()
        self.query_one("#summary", Static).update(
            f"{view.summary_text(stats, self.url)}\n{view.host_text(stats) if stats else ''}")
        self._show_status()
        self._show_models(now)
        self._show_kv()
        counts = view.scheduler_counts(stats)
        self.query_one("#scheduler", Static).update(
            f"running   {counts.running}\nwaiting   {counts.waiting}\nswapped   {counts.swapped}\n"
            f"preempted {self.monitor.history.preemptions_per_minute(now)}/min\nfinished  {counts.finished}")
        self._show_latency()
        history = self.monitor.history
        for name, rate, series in (("prompt", history.prompt_rate, history.prompt_rates),
                                   ("generation", history.generation_rate, history.generation_rates)):
            self.query_one(f"#{name}-rate", Static).update(f"{name:<11}{view.rate_text(rate):>10}")
            spark = self.query_one(f"#{name}-spark", Static)
            spark.update(view.sparkline(series, spark.content_size.width, history.first_index(series)))
        self._show_requests()

    def _show_status(self) -> None:
        status = self.monitor.status
        word = f"{status} · paused" if self.paused else status
        widget = self.query_one("#status", Static)
        widget.update(word)
        widget.set_class(status == "connected" and not self.paused, "-ok")
        widget.set_class(status in ("draining", "starting", view.WAITING) or self.paused, "-warn")
        widget.set_class(status in (view.DISCONNECTED, view.UNAUTHORIZED), "-bad")

    def _show_models(self, now: float) -> None:
        table = self.query_one("#models", DataTable)
        selected = self.selected_model if self._picked else view.busiest_model(self.monitor.stats)
        stats = self.monitor.stats
        rows = [view.model_row(m, now) for m in view.models_of(stats)] + view.loading_rows(stats)
        table.clear()
        for row in rows:
            table.add_row(row.name, row.kind, row.size, row.where, row.expiry, row.served, row.in_flight,
                          key=f"{row.name}/{row.kind}")
        self._model_names = [row.name for row in rows]
        if selected in self._model_names:  # a refresh keeps the selection
            table.move_cursor(row=self._model_names.index(selected), animate=False)

    def on_key(self, event: events.Key) -> None:
        if event.key in ("up", "down", "pageup", "pagedown", "home", "end") and self.focused is self.query_one("#models"):
            self._picked = True

    def _show_kv(self) -> None:
        panel = self.query_one("#kv", Static)
        name = self.selected_model
        panel.border_title = f"KV cache · {name}" if name else "KV cache"
        lines = view.kv_lines(self.monitor.model(name), panel.content_size.width)
        panel.update("\n".join(lines))

    def _show_latency(self) -> None:
        panel = self.query_one("#latency", Static)
        rows = view.latency_rows(self.monitor.stats)
        if not rows:
            panel.border_title = "Latency"
            panel.update("no model loaded")
            return
        # A narrow panel keeps the model names readable and drops the count and the p99s.
        wide = panel.content_size.width >= 40
        panel.border_title = "Latency ms · p50/p99 · recent" if wide else "Latency ms · p50"
        table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, expand=True)
        table.add_column("model", no_wrap=True, overflow="ellipsis", ratio=1)
        for header in ("n", "TTFT", "TPOT") if wide else ("TTFT", "TPOT"):
            table.add_column(header, justify="right", no_wrap=True)
        for row in rows:
            if wide:
                table.add_row(row.model, row.requests, f"{row.ttft_p50}/{row.ttft_p99}",
                              f"{row.tpot_p50}/{row.tpot_p99}")
            else:
                table.add_row(row.model, row.ttft_p50, row.tpot_p50)
        panel.update(table)

    def _show_requests(self) -> None:
        table = self.query_one("#requests", DataTable)
        rows = view.request_rows(self.monitor.stats, self.sort)
        table.border_title = f"Requests ({len(rows)}) · sort: {self.sort} (s)"
        table.clear()
        for row in rows:
            table.add_row(*row.cells())

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "models":
            self._show_kv()

    # -- keys -----------------------------------------------------------------------

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._show_status()

    def action_sort(self) -> None:
        self.sort = view.next_sort(self.sort)
        self._show_requests()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_unload(self) -> None:
        name = self.selected_model
        if name is None:
            self.notify("no model selected", severity="warning")
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self.unload(name), group="unload")

        self.push_screen(ConfirmUnload(name), answered)
