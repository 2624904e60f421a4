"""The report's figures (matplotlib, no pyplot state): curves per step and bars per case.

Each ``*_figure`` function returns a ``Figure`` (testable without a file) and
:func:`save` writes it as PNG plus a JSON sidecar holding the plotted series,
one per case, so the data behind every picture can be re-plotted or checked.

The exact cases lie on top of each other by design; to keep every one of them
visible each case gets its own marker, drawn smaller than the previous one, and
a second panel shows each case's relative difference from the reference on a
log scale.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from matplotlib.figure import Figure

from torchtune_ext.tools.parity_report.cases import Case

# A relative difference of exactly 0 has no place on a log axis; it is drawn here.
ZERO_FLOOR = 1e-10
_MARKERS = ["o", "s", "^", "v", "D", "P", "X", "<", ">", "h"]
_STYLES = ["-", "--", "-.", ":"]
_CONTROL_COLOR = "tab:red"
# matplotlib's tab10 without its red, which marks the control
_COLORS = ["black", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan", "tab:gray"]


def _color(index: int, case: Case) -> str:
    return _CONTROL_COLOR if case.control else _COLORS[index % len(_COLORS)]


def _style(index: int, case: Case, count: int) -> Dict[str, Any]:
    if case.control:
        return dict(color=_CONTROL_COLOR, linewidth=2.5, marker="x", markersize=9, linestyle="-", zorder=5)
    # first (reference) biggest and hollow, later ones smaller and filled: all stay visible
    size = 13 - 8 * index / max(count - 1, 1)
    return dict(
        color=_color(index, case),
        linewidth=3.0 if index == 0 else 1.4,
        linestyle=_STYLES[index % len(_STYLES)],
        marker=_MARKERS[index % len(_MARKERS)],
        markersize=size,
        markerfacecolor="none" if index == 0 else None,
        zorder=2 + index * 0.1,
    )


def _series(rows: Sequence[Dict[str, Any]], key: str):
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def curve_figure(
    cases: Sequence[Case],
    metrics: Dict[str, Sequence[Dict[str, Any]]],
    key: str,
    *,
    title: str,
    ylabel: str,
    tolerance: Optional[float] = None,
) -> Figure:
    """Per-step curves of ``key``, one line per case, and their difference from the reference.

    Args:
        cases: the cases, reference first.
        metrics: case name -> metrics rows (dicts with ``step`` and ``key``).
        key: the metric to plot, e.g. ``loss``.
        title, ylabel: labels of the top panel (say the unit in ``ylabel``).
        tolerance: drawn as a dashed line in the difference panel.

    Returns:
        Figure with two axes: ``axes[0]`` has exactly one line per case (with
        data); ``axes[1]`` one line per non-reference case plus the tolerance line.
    """
    fig = Figure(figsize=(9, 7.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    ref_x, ref_y = _series(metrics.get(cases[0].name, []), key)
    reference = dict(zip(ref_x, ref_y))
    for i, case in enumerate(cases):
        x, y = _series(metrics.get(case.name, []), key)
        if not x:
            continue
        style = _style(i, case, len(cases))
        top.plot(x, y, label=case.name, **style)
        if i == 0:
            continue
        diffs = [
            (s, max(abs(v - reference[s]) / abs(reference[s]) if reference[s] else abs(v - reference[s]), ZERO_FLOOR))
            for s, v in zip(x, y) if s in reference
        ]
        if diffs:
            bottom.plot([d[0] for d in diffs], [d[1] for d in diffs], label=case.name, **style)
    top.set_title(title)
    top.set_ylabel(ylabel)
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8, ncols=2, loc="best")
    bottom.set_yscale("log")
    if tolerance is not None:
        bottom.axhline(tolerance, color="grey", linestyle="--", linewidth=1, label=f"tolerance {tolerance:g}")
        bottom.legend(handles=[h for h in bottom.get_lines() if h.get_label().startswith("tolerance")],
                      fontsize=8, loc="best")
    bottom.set_title(f"relative difference from {cases[0].name} (0 drawn at {ZERO_FLOOR:g})", fontsize=10)
    bottom.set_ylabel("|case − ref| / |ref|")
    bottom.set_xlabel("optimizer step")
    bottom.grid(True, alpha=0.3, which="both")
    if ref_x:
        bottom.set_xticks(ref_x)
    return fig


def bar_figure(
    cases: Sequence[Case], values: Dict[str, Optional[float]], *, title: str, xlabel: str, fmt: str = ".2f"
) -> Figure:
    """Horizontal bars, one per case (missing values drawn as 0 and labelled n/a).

    Returns:
        Figure with one axis holding one bar per case (``len(ax.patches)``).
    """
    fig = Figure(figsize=(9, 1.2 + 0.45 * len(cases)), layout="constrained")
    ax = fig.subplots()
    names = [c.name for c in cases]
    heights = [values.get(n) or 0.0 for n in names]
    bars = ax.barh(names, heights, color=[_color(i, c) for i, c in enumerate(cases)])
    ax.bar_label(bars, labels=["n/a" if values.get(n) is None else format(values[n], fmt) for n in names],
                 padding=3, fontsize=8)
    ax.invert_yaxis()  # reference on top, as in report.md
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.margins(x=0.15)
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def curve_series(cases: Sequence[Case], metrics: Dict[str, Sequence[Dict[str, Any]]], key: str) -> List[Dict[str, Any]]:
    """The plotted data of :func:`curve_figure`'s top panel: one series per case with data."""
    out = []
    for case in cases:
        x, y = _series(metrics.get(case.name, []), key)
        if x:
            out.append({"label": case.name, "x": x, "y": y})
    return out


def save(fig: Figure, path: Path, *, title: str, unit: str, series: List[Dict[str, Any]], dpi: int = 100) -> None:
    """Write ``fig`` as PNG at ``path`` and its data as ``path.with_suffix('.json')``.

    The sidecar is ``{"title", "unit", "series": [{"label", "x", "y"}]}`` with
    one series per case drawn (for bars ``x`` is omitted and ``y`` is the value).
    """
    fig.savefig(path, dpi=dpi)
    path.with_suffix(".json").write_text(json.dumps({"title": title, "unit": unit, "series": series}, indent=1))
