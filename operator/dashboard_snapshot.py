"""The SLO panels of the dashboard rendered to PNG from Prometheus, for docs and bug reports.

The queries are the dashboard's own (`dashboards.PANELS`, variables filled by `substitute`),
asked over a time range with `/api/v1/query_range`; matplotlib draws them as Grafana would
(SLO series dashed red). matplotlib is imported only here, when a snapshot is drawn.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from .dashboards import PANELS, Panel, legend, substitute


class PrometheusQueryError(RuntimeError):
    """Prometheus did not answer a query, or refused it; the message names the query."""


class SnapshotUnavailable(RuntimeError):
    """matplotlib is not installed."""


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    points: list[tuple[float, float]]  # (unix time, value), NaN dropped


def _get(url: str, path: str, params: Mapping[str, str], timeout_s: float) -> list[dict]:
    endpoint = url.rstrip("/") + path
    try:
        body = httpx.get(endpoint, params=dict(params), timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise PrometheusQueryError(f"GET {endpoint} ({params.get('query')!r}): {exc}") from exc
    if body.get("status") != "success":
        raise PrometheusQueryError(f"Prometheus refused {params.get('query')!r}: "
                                   f"{body.get('errorType', '')}: {body.get('error', body)}")
    return body["data"]["result"]


def query(url: str, expr: str, at: float | None = None, timeout_s: float = 10.0) -> list[Series]:
    """An instant query (`/api/v1/query`)."""
    params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    out = []
    for item in _get(url, "/api/v1/query", params, timeout_s):
        t, v = item["value"]
        out.append(Series(item["metric"], [] if math.isnan(float(v)) else [(float(t), float(v))]))
    return out


def query_range(url: str, expr: str, start: float, end: float, step_s: float,
                timeout_s: float = 30.0) -> list[Series]:
    """A range query (`/api/v1/query_range`)."""
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"}
    return [Series(item["metric"], [(float(t), float(v)) for t, v in item["values"]
                                    if not math.isnan(float(v))])
            for item in _get(url, "/api/v1/query_range", params, timeout_s)]


def slo_panels() -> list[Panel]:
    return [p for p in PANELS if p.slo_panel]


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def fetch_panel(url: str, panel: Panel, values: Mapping[str, str], start: float, end: float,
                step_s: float) -> list[tuple[str, bool, Series]]:
    """(legend, is_slo, series) for every series of every query of the panel."""
    out = []
    for q in panel.queries:
        for s in query_range(url, substitute(q.expr, values), start, end, step_s):
            out.append((legend(q.legend, s.labels) or q.legend, q.slo, s))
    return out


_UNIT_LABEL = {"s": "seconds", "percentunit": "fraction", "reqps": "requests/s", "Bps": "bytes/s",
               "ops": "per second", "short": ""}


def _draw(ax, panel: Panel, lines: Sequence[tuple[str, bool, Series]], start: float) -> None:
    for name, is_slo, s in lines:
        if not s.points:
            continue
        xs = [(t - start) / 60.0 for t, _ in s.points]
        ys = [v for _, v in s.points]
        if is_slo:
            ax.plot(xs, ys, linestyle="--", color="red", linewidth=1.5, label=name)
        else:
            ax.plot(xs, ys, linewidth=1.2, label=name)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("minutes", fontsize=8)
    ax.set_ylabel(_UNIT_LABEL.get(panel.unit, panel.unit), fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    if any(s.points for _, _, s in lines):
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def render(url: str, values: Mapping[str, str], start: float, end: float, out: Path,
           step_s: float = 5.0, columns: int = 2) -> list[Path]:
    """One PNG per SLO panel plus `overview.png` with all of them; returns the paths written."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SnapshotUnavailable("drawing needs matplotlib: pip install 'kvmesh[snapshot]'") from exc
    matplotlib.use("Agg")  # no display in a pod or CI
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    panels = slo_panels()
    data = [fetch_panel(url, p, values, start, end, step_s) for p in panels]
    title = f"{values.get('namespace', '')}/{values.get('deployment', '')}"
    written = []
    for i, (panel, lines) in enumerate(zip(panels, data)):
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
        _draw(ax, panel, lines, start)
        fig.suptitle(title, fontsize=8, x=0.99, ha="right")
        fig.tight_layout()
        path = out / f"{i + 1:02d}-{slug(panel.title)}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(7 * columns, 3.4 * rows), dpi=90, squeeze=False)
    for ax, panel, lines in zip(axes.flat, panels, data):
        _draw(ax, panel, lines, start)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"kvmesh SLO: {title}", fontsize=12)
    fig.tight_layout()
    path = out / "overview.png"
    fig.savefig(path)
    plt.close(fig)
    return written + [path]
