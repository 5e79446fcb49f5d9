"""How a run is shown: a progress bar on stderr while it runs, tables at the end, a JSON
file, and a PNG of the distributions (matplotlib, only when asked for)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .client import RequestRecord
from .config import BenchError
from .metrics import LATENCIES, LATENCY_NAMES, output_tokens_per_bucket, percentile_label
from .runner import BenchResult
from .runner import Progress as ProgressHooks


@contextmanager
def progress_bar(console: Console | None = None) -> Iterator[ProgressHooks]:
    """A rich progress bar (on stderr) per phase, with a running count of failures."""
    console = console or Console(stderr=True)
    bar = Progress(TextColumn("{task.description:<9}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[failed]}"), TimeElapsedColumn(), console=console, transient=False)
    tasks: dict[str, Any] = {}
    failures: dict[str, int] = {}

    def started(phase: str, total: int) -> None:
        tasks[phase] = bar.add_task(phase, total=total, failed="")
        failures[phase] = 0

    def done(phase: str, record: RequestRecord) -> None:
        if not record.success:
            failures[phase] += 1
        bar.update(tasks[phase], advance=1, failed=f"{failures[phase]} failed" if failures[phase] else "")

    with bar:
        yield ProgressHooks(started=started, done=done)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _arrivals(burstiness: float) -> str:
    if math.isinf(burstiness):
        return "even gaps"
    return "Poisson" if burstiness == 1 else "gamma"


def summary_table(result: BenchResult) -> Table:
    m, c = result.metrics, result.config
    table = Table(title=f"localserve bench · {result.model} · {result.url}", show_header=False, title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("Successful requests", str(m.completed)),
        ("Failed requests", str(m.failed)),
        ("Request rate configured (req/s)", "inf" if math.isinf(c.request_rate) else f"{c.request_rate:g}"),
        ("Burstiness", f"{c.burstiness:g} ({_arrivals(c.burstiness)})"),
        ("Maximum request concurrency", str(c.max_concurrency) if c.max_concurrency else "unlimited"),
        ("Peak concurrent requests", str(m.max_concurrent_requests)),
        ("Benchmark duration (s)", f"{m.duration:.2f}"),
        ("Total input tokens", str(m.total_input_tokens)),
        ("Total generated tokens", str(m.total_output_tokens)),
        ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
    ]
    if m.request_goodput is not None:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in c.goodput.items())
        rows.append((f"Request goodput (req/s; {slos})", f"{m.request_goodput:.2f}"))
    rows += [
        ("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
        ("Peak output token throughput (tok/s)", f"{m.max_output_tokens_per_s:.2f}"),
        ("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}"),
    ]
    spec = result.spec_decode
    if spec is not None and spec.acceptance_rate is not None and spec.acceptance_length is not None:
        rows += [
            ("Draft tokens verified (speculative decoding)", f"{spec.draft_tokens:.0f}"),
            ("Draft acceptance rate (%)", f"{100 * spec.acceptance_rate:.1f}"),
            ("Mean acceptance length (tokens per verification)", f"{spec.acceptance_length:.2f}"),
        ]
    for row in rows:
        table.add_row(*row)
    return table


def latency_table(result: BenchResult) -> Table:
    percentiles = list(result.config.metric_percentiles)
    table = Table(title="Latencies (ms)", title_justify="left", caption_justify="left",
                  caption="  ".join(f"{name.upper()}: {LATENCY_NAMES[name]}." for name in LATENCIES))
    table.add_column("metric")
    for heading in ["mean", "median", "std", *(f"P{percentile_label(p)}" for p in percentiles), "n"]:
        table.add_column(heading, justify="right")
    for name in LATENCIES:
        dist = result.metrics.latencies[name]
        table.add_row(name.upper(), _ms(dist.mean), _ms(dist.median),
                      _ms(dist.std), *(_ms(dist.percentiles[p]) for p in percentiles), str(dist.count))
    return table


def print_tables(result: BenchResult, console: Console | None = None) -> None:
    console = console or Console()
    console.print(summary_table(result))
    console.print(latency_table(result))
    if result.metrics.failed:
        console.print(f"[yellow]{result.metrics.failed} request(s) failed; the first: {result.first_error}[/yellow]")
    if result.warmup_failures:
        console.print(f"[yellow]{result.warmup_failures} warm-up request(s) failed[/yellow]")


def save_result(result: BenchResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")


def plot(result: BenchResult, path: Path) -> None:
    """Histograms of TTFT, TPOT, ITL and E2EL, and output tokens/s over the run, in one PNG."""
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install localserve[plot]") from None
    matplotlib.use("Agg")  # files only: no display, and safe off the main thread
    import matplotlib.pyplot as plt

    from .metrics import request_tpot

    done = [r for r in result.records if r.success]
    samples = {
        "ttft": [r.ttft * 1000 for r in done],
        "tpot": [t * 1000 for r in done if (t := request_tpot(r)) is not None],
        "itl": [g * 1000 for r in done for g in r.itl],
        "e2el": [r.e2el * 1000 for r in done],
    }
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, name in zip(axes.flat, LATENCIES):
        values = samples[name]
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
            ax.axvline(float(sum(values) / len(values)), color="tab:red", linestyle="--", label="mean")
            ax.legend()
        ax.set_title(f"{name.upper()}: {LATENCY_NAMES[name]}")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    duration = result.metrics.duration
    width = 1.0 if duration >= 20 else max(duration / 20, 0.01)  # ~20+ points on short runs
    starts, rates = output_tokens_per_bucket(done, width)
    ax = axes.flat[4]
    ax.step(starts, rates, where="post", color="tab:green")
    ax.set_title(f"Output throughput ({width:.2g} s buckets)")
    ax.set_xlabel("s since start")
    ax.set_ylabel("tokens/s")
    axes.flat[5].axis("off")
    m = result.metrics
    axes.flat[5].text(0.0, 0.5, "\n".join([
        f"model {result.model}", f"requests {m.completed} ok, {m.failed} failed",
        f"duration {m.duration:.2f} s", f"{m.request_throughput:.2f} req/s",
        f"{m.output_throughput:.2f} output tok/s", f"peak concurrency {m.max_concurrent_requests}",
    ]), family="monospace", va="center")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
