"""What `localserve top` shows, computed from the daemon's ``/api/localserve/stats`` snapshots.

Plain functions and small classes, no textual: the app only places these strings on
screen, so the logic (rates, windows, dedup, sorting, formatting) is tested here without
a terminal. Every field of a snapshot is optional, because an older daemon has fewer of
them; whatever is missing shows as "-".
"""

from __future__ import annotations

import datetime as dt
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..client import DaemonError
from ..engine.stats import EngineStats
from ..units import human_bytes

MISSING = "-"
HISTORY = 360  # samples kept: three minutes of throughput at the default 0.5 s refresh
WINDOW_S = 60.0  # preemptions are counted over the last minute of samples
MAX_EVENTS = 500

# Counters whose increase between two snapshots is worth a line in the event log.
COUNTER_EVENTS = (
    ("num_preemptions", "preempt", "preempted {n} request{s}"),
    ("swap_out_blocks", "swap", "swapped {n} KV block{s} out to the CPU tier"),
    ("swap_in_blocks", "swap", "swapped {n} KV block{s} back in"),
)

SORT_KEYS = ("age", "tokens/s", "generated", "prompt", "model")

Stats = Mapping[str, Any]


# -- small formatting helpers ---------------------------------------------------------


def number(value: object) -> float | None:
    """A JSON number, or None for anything else (missing, null, a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def count(value: object) -> int:
    """A counter: missing or malformed counts as 0 (so sums and deltas stay defined)."""
    n = number(value)
    return int(n) if n is not None else 0


def bytes_text(value: object) -> str:
    n = number(value)
    return human_bytes(int(n)) if n is not None else MISSING


def duration_text(seconds: float) -> str:
    """Coarse and fixed-width-ish, like top: 42s, 4m 12s, 3h 05m, 2d 04h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def age_text(seconds: object) -> str:
    s = number(seconds)
    if s is None:
        return MISSING
    return f"{s:.1f}s" if s < 10 else duration_text(s)


def rate_text(value: float | None) -> str:
    return MISSING if value is None else f"{value:,.1f}"


def ms_text(value: object) -> str:
    n = number(value)
    return MISSING if n is None else f"{n:.1f}"


def parse_time(text: object) -> float | None:
    """An ISO 8601 time from the daemon as epoch seconds (None when absent or unreadable)."""
    if not isinstance(text, str):
        return None
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:  # the daemon writes UTC; be lenient with a naive stamp
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return moment.timestamp()


def clock_text(timestamp: float, tz: dt.tzinfo | None = None) -> str:
    """HH:MM:SS in ``tz`` (None: the local zone)."""
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).astimezone(tz).strftime("%H:%M:%S")


def gauge(used: int, total: int, width: int) -> str:
    """A bar drawn with block characters (readable in a plain-text capture too)."""
    width = max(1, width)
    filled = 0 if total <= 0 else round(width * min(max(used, 0), total) / total)
    if used > 0 and total > 0 and filled == 0:
        filled = 1  # something is in use: never draw it as empty
    return "█" * filled + "░" * (width - filled)


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int, first_index: int = 0) -> str:
    """The newest value at the right edge, on a scale from 0 to the highest shown (so a
    steady rate reads as steady, not as zero). With more values than columns each column
    is the mean of a few; ``first_index`` (how many values came before ``values[0]``)
    anchors those groups to the stream, so they do not shift with every new sample."""
    if width <= 0:
        return ""
    per_column = max(1, -(-len(values) // width))
    groups: dict[int, list[float]] = {}
    for i, value in enumerate(values):
        groups.setdefault((first_index + i) // per_column, []).append(value)
    means = [sum(g) / len(g) for g in groups.values()][-width:]
    top = max(means, default=0.0)
    cells = []
    for mean in means:
        if mean <= 0 or top <= 0:
            cells.append(SPARK[0])
        else:  # anything above zero shows at least one step up
            cells.append(SPARK[max(1, min(len(SPARK) - 1, round(mean / top * (len(SPARK) - 1))))])
    return "".join(cells).rjust(width)


def short_id(request_id: str) -> str:
    """Enough of a request id to tell requests apart (they are uuid hex, maybe prefixed)."""
    for prefix in ("chatcmpl-", "cmpl-"):
        request_id = request_id.removeprefix(prefix)
    return request_id[:8]


# -- the header -----------------------------------------------------------------------


def status_word(stats: Stats) -> str:
    if stats.get("draining"):
        return "draining"
    if stats.get("ready") is False:
        return "starting"
    return "connected"


def host_text(stats: Stats) -> str:
    """Device, GPUs, CPU and RAM on one line."""
    host = stats.get("host")
    if not isinstance(host, Mapping):
        return "host: -"
    parts = [str(host.get("device_name") or host.get("device") or MISSING)]
    gpus = [g for g in host.get("gpus") or [] if isinstance(g, Mapping)]
    for gpu in gpus:
        util = number(gpu.get("utilization_percent"))
        memory = _used_of(gpu.get("memory_used_bytes"), gpu.get("memory_total_bytes"))
        parts.append(f"GPU{gpu.get('index', '?')} {MISSING if util is None else f'{util:.0f}%'} {memory}")
    if not gpus:
        parts.append("no GPU")
    cpu = number(host.get("cpu_percent"))
    parts.append(f"CPU {MISSING if cpu is None else f'{cpu:.0f}%'}")
    parts.append(f"RAM {_used_of(host.get('memory_used_bytes'), host.get('memory_total_bytes'))}")
    return "  ·  ".join(parts)


def _used_of(used: object, total: object) -> str:
    """"8.00/24.00 GiB": one unit for both, picked from the total."""
    u, t = number(used), number(total)
    if u is None or t is None:
        return f"{bytes_text(used)}/{bytes_text(total)}"
    unit, size = next(((name, s) for name, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)) if t >= s),
                      ("B", 1))
    return f"{u / size:.2f}/{t / size:.2f} {unit}" if size > 1 else f"{int(u)}/{int(t)} B"


def summary_text(stats: Stats | None, url: str) -> str:
    if stats is None:
        return f"localserve  {url}"
    version = stats.get("version")
    uptime = number(stats.get("uptime_s"))
    return (f"localserve {'v' + str(version) if version else MISSING}  {url}  "
            f"up {MISSING if uptime is None else duration_text(uptime)}")


# -- models ---------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ModelRow:
    name: str
    kind: str  # format and quantization
    size: str
    where: str
    expiry: str
    served: str
    in_flight: str


def models_of(stats: Stats | None) -> list[Mapping[str, Any]]:
    models = stats.get("models") if stats else None
    return [m for m in models or [] if isinstance(m, Mapping) and isinstance(m.get("name"), str)]


def engine_of(model: Mapping[str, Any]) -> EngineStats | None:
    """The model's engine statistics, or None when absent or of another version's schema."""
    engine = model.get("engine")
    return EngineStats.from_dict(engine) if isinstance(engine, Mapping) else None


def where_text(memory: object) -> str:
    """The device, plus what lives in host RAM when the model is partly offloaded."""
    if not isinstance(memory, Mapping):
        return MISSING
    device = str(memory.get("device") or MISSING)
    host = count(memory.get("host_weights_bytes")) + count(memory.get("cpu_kv_cache_bytes"))
    return f"{device} + {human_bytes(host)} host" if host > 0 else device


def expiry_text(model: Mapping[str, Any], now: float) -> str:
    """When the model unloads: "in 4m 12s", "in use" (the clock starts when it idles) or "forever"."""
    expires = parse_time(model.get("expires_at"))
    if expires is not None:
        return f"in {duration_text(expires - now)}" if expires > now else "now"
    if "keep_alive_s" not in model:
        return MISSING
    return "forever" if model["keep_alive_s"] is None else "in use"


def model_row(model: Mapping[str, Any], now: float) -> ModelRow:
    kind = " ".join(str(model[k]) for k in ("format", "quantization") if model.get(k)) or MISSING
    memory = model.get("memory")
    weights = memory.get("weights_bytes") if isinstance(memory, Mapping) else None
    engine = engine_of(model)
    finished = engine.num_finished_requests if engine is not None else None
    in_flight = model.get("requests_in_flight")
    return ModelRow(
        name=model["name"], kind=kind, size=bytes_text(weights), where=where_text(memory),
        expiry=expiry_text(model, now),
        served=MISSING if number(finished) is None else str(count(finished)),
        in_flight=MISSING if number(in_flight) is None else str(count(in_flight)),
    )


def loading_rows(stats: Stats | None) -> list[ModelRow]:
    """The models being loaded: their phase and progress, and the requests waiting for them."""
    entries = stats.get("loading") if stats else None
    rows = []
    for entry in entries or []:
        if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)):
            continue
        fraction = number(entry.get("fraction"))
        done = f" {fraction:.0%}" if fraction is not None else ""
        rows.append(ModelRow(name=entry["name"], kind=f"loading: {entry.get('phase') or MISSING}{done}",
                             size=MISSING, where=MISSING, expiry=f"for {duration_text(count(entry.get('elapsed_s')))}",
                             served=MISSING, in_flight=str(count(entry.get("requests_waiting")))))
    return rows


def busiest_model(stats: Stats | None) -> str | None:
    """The loaded model with the most requests in flight (the first on a tie; None with
    none loaded): the one the KV panel shows until the user picks another."""
    models = models_of(stats)
    if not models:
        return None
    return max(models, key=lambda m: count(m.get("requests_in_flight")))["name"]


# -- KV cache, scheduler, latency -------------------------------------------------------


def kv_lines(model: Mapping[str, Any] | None, width: int) -> list[str]:
    """The KV cache of one model, in lines of ``width``: device and CPU-tier gauges
    (blocks used/total), prefix-cache hits, speculative decoding's kept drafts (once there
    are any), dtype."""
    if model is None:
        return ["no model loaded"]
    engine = engine_of(model)
    if engine is None:
        return ["no engine stats"]

    def gauge_line(label: str, used: int, total: int) -> str:
        numbers = f" {used}/{total}"
        return f"{label:<7}{gauge(used, total, max(4, width - 7 - len(numbers)))}{numbers}"

    lines = [gauge_line("device", engine.kv_blocks_used, engine.kv_blocks_total)]
    if engine.cpu_blocks_total > 0:
        lines.append(gauge_line("cpu", engine.cpu_blocks_used, engine.cpu_blocks_total))
    else:
        lines.append(f"{'cpu':<7}no CPU tier")
    lines.append(f"prefix hits {hit_rate_text(engine)}")
    if engine.spec_decode_num_draft_tokens > 0:
        lines.append(f"drafts kept {draft_rate_text(engine)}")
    lines.append(f"{engine.kv_blocks_cached} cached · {engine.kv_block_size} tok/block")
    lines.append(f"dtype {engine.kv_cache_dtype or MISSING}")
    return lines


def draft_rate_text(engine: EngineStats) -> str:
    """Speculative decoding's acceptance: draft tokens kept of those verified."""
    drafted, kept = engine.spec_decode_num_draft_tokens, engine.spec_decode_num_accepted_tokens
    if drafted <= 0:
        return MISSING
    return f"{100 * kept / drafted:.0f}% ({kept}/{drafted})"


def hit_rate_text(engine: EngineStats) -> str:
    queries, hits = engine.prefix_cache_queries, engine.prefix_cache_hits
    if queries <= 0:
        return MISSING
    return f"{100 * hits / queries:.0f}% ({hits}/{queries})"


@dataclass(slots=True, frozen=True)
class SchedulerCounts:
    running: int
    waiting: int
    swapped: int
    finished: int


def scheduler_counts(stats: Stats | None) -> SchedulerCounts:
    """Summed over the loaded models (one scheduler each)."""
    engines = [e for e in map(engine_of, models_of(stats)) if e is not None]
    return SchedulerCounts(sum(e.num_running for e in engines), sum(e.num_waiting for e in engines),
                           sum(e.num_swapped for e in engines), sum(e.num_finished_requests for e in engines))


@dataclass(slots=True, frozen=True)
class LatencyRow:
    model: str
    requests: str
    ttft_p50: str
    ttft_p99: str
    tpot_p50: str
    tpot_p99: str


def latency_rows(stats: Stats | None) -> list[LatencyRow]:
    rows = []
    for model in models_of(stats):
        recent = model.get("recent")
        recent = recent if isinstance(recent, Mapping) else {}

        def pick(name: str, old: str | None = None) -> str:
            # An older daemon said "median" for p50; it had no p99 (its p90 is not one).
            return ms_text(recent.get(name) if name in recent or old is None else recent.get(old))

        n = recent.get("requests")
        rows.append(LatencyRow(model["name"], MISSING if number(n) is None else str(count(n)),
                               pick("ttft_ms_p50", "ttft_ms_median"), pick("ttft_ms_p99"),
                               pick("tpot_ms_p50", "tpot_ms_median"), pick("tpot_ms_p99")))
    return rows


# -- requests -------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class RequestRow:
    request_id: str
    model: str
    state: str
    prompt_tokens: int
    output_tokens: int
    tokens_per_s: float | None
    age_s: float | None

    def cells(self) -> tuple[str, ...]:
        return (short_id(self.request_id), self.model, self.state, str(self.prompt_tokens),
                str(self.output_tokens), rate_text(self.tokens_per_s), age_text(self.age_s))


def request_rows(stats: Stats | None, sort: str = "age") -> list[RequestRow]:
    rows = []
    for model in models_of(stats):
        for request in model.get("requests") or []:
            if not isinstance(request, Mapping):
                continue
            age = number(request.get("age_s"))
            output = count(request.get("output_tokens"))
            rows.append(RequestRow(
                request_id=str(request.get("request_id", MISSING)), model=model["name"],
                state=str(request.get("status", MISSING)), prompt_tokens=count(request.get("prompt_tokens")),
                output_tokens=output, tokens_per_s=output / age if age else None, age_s=age))
    return sorted(rows, key=lambda row: sort_key(row, sort))


def sort_key(row: RequestRow, sort: str) -> tuple[Any, ...]:
    """Biggest first for the numbers (the oldest, fastest, longest on top); names A-Z.
    The request id breaks ties, so rows do not jump between refreshes."""
    numeric = {"age": row.age_s, "tokens/s": row.tokens_per_s, "generated": row.output_tokens,
               "prompt": row.prompt_tokens}
    if sort == "model":
        return (row.model, -(row.age_s or 0.0), row.request_id)
    value = numeric.get(sort, row.age_s)
    return (value is None, -(value or 0.0), row.request_id)


def next_sort(sort: str) -> str:
    return SORT_KEYS[(SORT_KEYS.index(sort) + 1) % len(SORT_KEYS)] if sort in SORT_KEYS else SORT_KEYS[0]


# -- events ---------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Event:
    time: float  # epoch seconds
    kind: str
    model: str
    message: str


class EventLog:
    """The daemon's events, each shown once (by seq), and the ones this client derives."""

    def __init__(self, maxlen: int = MAX_EVENTS) -> None:
        self.events: deque[Event] = deque(maxlen=maxlen)
        self.last_seq = 0

    def add(self, event: Event) -> Event:
        self.events.append(event)
        return event

    def add_daemon(self, raw: object, now: float) -> list[Event]:
        """The events of a snapshot not seen before, oldest first."""
        items = [e for e in raw or [] if isinstance(e, Mapping) and number(e.get("seq")) is not None] \
            if isinstance(raw, list) else []
        if not items:
            return []
        newest = max(count(e["seq"]) for e in items)
        if newest < self.last_seq:
            # The daemon always lists its newest events, so a smaller newest seq means it
            # restarted and counts from 1 again: everything it lists now is new.
            self.last_seq = 0
        fresh = sorted((e for e in items if count(e["seq"]) > self.last_seq), key=lambda e: count(e["seq"]))
        self.last_seq = max(self.last_seq, newest)
        return [self.add(Event(parse_time(e.get("time")) or now, str(e.get("kind") or "event"),
                               str(e.get("model") or ""), str(e.get("message") or ""))) for e in fresh]


def counter_events(before: Stats | None, after: Stats, now: float) -> list[Event]:
    """Preemptions and swaps between two snapshots, per model (a reloaded model, whose
    counters start again from 0, is not a decrease worth reporting)."""
    previous = {m["name"]: engine_of(m) for m in models_of(before)}
    events = []
    for model in models_of(after):
        old, new = previous.get(model["name"]), engine_of(model)
        if old is None or new is None:
            continue
        for key, kind, text in COUNTER_EVENTS:
            n = getattr(new, key) - getattr(old, key)
            if n > 0:
                events.append(Event(now, kind, model["name"], text.format(n=n, s="s" * (n != 1))))
    return events


# -- history: throughput and preemptions over time ---------------------------------------


@dataclass(slots=True, frozen=True)
class Sample:
    time: float
    # per model: the counters rates and windows are computed from
    counters: Mapping[str, Mapping[str, int]]


_COUNTERS = ("num_preemptions", "num_prompt_tokens_total", "num_generated_tokens_total")


def sample_of(stats: Stats, now: float) -> Sample:
    engines = {m["name"]: engine_of(m) for m in models_of(stats)}
    return Sample(now, {name: {k: getattr(e, k) for k in _COUNTERS} for name, e in engines.items() if e is not None})


def increase(before: Mapping[str, Mapping[str, int]], after: Mapping[str, Mapping[str, int]], key: str) -> int:
    """How much ``key`` grew, summed over models; a counter that went down (the model was
    reloaded) grew by its new value, and a model that just appeared by all of it."""
    total = 0
    for name, counters in after.items():
        old = before.get(name, {}).get(key, 0)
        new = counters.get(key, 0)
        total += new - old if new >= old else new
    return total


@dataclass
class History:
    """Bounded series for the sparklines, and the samples of the last minute."""

    maxlen: int = HISTORY
    prompt_rates: deque[float] = field(init=False)
    generation_rates: deque[float] = field(init=False)
    samples: deque[Sample] = field(init=False)
    count: int = field(init=False, default=0)  # snapshots ever added

    def __post_init__(self) -> None:
        self.prompt_rates = deque(maxlen=self.maxlen)
        self.generation_rates = deque(maxlen=self.maxlen)
        # The window trims this; the bound holds even if the clock stalls (the CLI's
        # shortest interval, 0.2 s, needs 300 samples for a minute).
        self.samples = deque(maxlen=self.maxlen)

    def add(self, stats: Stats, now: float) -> None:
        self.count += 1
        sample = sample_of(stats, now)
        previous = self.samples[-1] if self.samples else None
        self.samples.append(sample)
        while len(self.samples) > 1 and self.samples[1].time <= now - WINDOW_S:
            self.samples.popleft()  # keep one sample at or before the window's start
        models = models_of(stats)
        for series, field_name, counter in ((self.prompt_rates, "prompt_tokens_per_s", "num_prompt_tokens_total"),
                                            (self.generation_rates, "generation_tokens_per_s",
                                             "num_generated_tokens_total")):
            rates = [getattr(e, field_name) if (e := engine_of(m)) is not None else None for m in models]
            if all(r is not None for r in rates):
                series.append(sum(r for r in rates if r is not None))
            elif previous is not None and now > previous.time:
                # An older daemon has no rates: derive them from the token counters.
                series.append(increase(previous.counters, sample.counters, counter) / (now - previous.time))

    def preemptions_per_minute(self, now: float) -> int:
        """Preemptions over the last 60 s of samples (fewer seconds just after start)."""
        samples = list(self.samples)
        total = 0
        for before, after in zip(samples, samples[1:]):
            if after.time > now - WINDOW_S:
                total += increase(before.counters, after.counters, "num_preemptions")
        return total

    def first_index(self, series: deque[float]) -> int:
        """How many values of ``series`` fell off its left end (see ``sparkline``)."""
        return self.count - len(series)

    @property
    def prompt_rate(self) -> float | None:
        return self.prompt_rates[-1] if self.prompt_rates else None

    @property
    def generation_rate(self) -> float | None:
        return self.generation_rates[-1] if self.generation_rates else None


# -- the whole picture ------------------------------------------------------------------

UNAUTHORIZED = "unauthorized: check LOCALSERVE_API_KEY"
DISCONNECTED = "disconnected (retrying)"
WAITING = "connecting"


@dataclass
class Monitor:
    """Everything the dashboard knows: the last snapshot, the connection's state, the
    history and the event log. ``observe`` and ``failed`` return the new log events."""

    history: History = field(default_factory=History)
    log: EventLog = field(default_factory=EventLog)
    stats: Stats | None = None
    status: str = WAITING

    def observe(self, stats: Stats, now: float) -> list[Event]:
        events: list[Event] = []
        if self.status in (DISCONNECTED, UNAUTHORIZED):
            events.append(self.log.add(Event(now, "reconnect", "", "the daemon answers again")))
        events += self.log.add_daemon(stats.get("events"), now)
        events += [self.log.add(e) for e in counter_events(self.stats, stats, now)]
        self.history.add(stats, now)
        self.stats = stats
        self.status = status_word(stats)
        return events

    def failed(self, error: Exception, now: float) -> list[Event]:
        status = UNAUTHORIZED if isinstance(error, DaemonError) and error.status in (401, 403) else DISCONNECTED
        events = []
        if status != self.status:  # one line per change, not one per retry
            kind = "disconnect" if self.status not in (WAITING, DISCONNECTED, UNAUTHORIZED) else "error"
            events.append(self.log.add(Event(now, kind, "", str(error))))
        self.status = status
        return events

    def model(self, name: str | None) -> Mapping[str, Any] | None:
        return next((m for m in models_of(self.stats) if m["name"] == name), None)

