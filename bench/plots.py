"""PNG plots for the figures where a curve says more than a table (matplotlib, Agg backend). matplotlib (the
``bench`` extra) is imported when a plot is drawn, so the figure modules import without it (their pure logic
is unit-tested in ``make test``, whose environment has only the ``test`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def lines(path: Path, title: str, xlabel: str, ylabel: str,
          series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
          hlines: Sequence[tuple[float, str]] = (), ideal: tuple[Sequence[float], Sequence[float]] | None = None,
          bands: Sequence[tuple[Sequence[float], Sequence[float], Sequence[float]]] = ()) -> str:
    """One chart of named (x, y) series; optional horizontal reference lines, an 'ideal' dashed
    line and min-max bands (x, lo, hi) under the series of the same index."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for i, (label, xs, ys) in enumerate(series):
        (line,) = ax.plot(xs, ys, marker="o" if len(xs) <= 12 else None, label=label, lw=1.6)
        if i < len(bands):
            bx, lo, hi = bands[i]
            ax.fill_between(bx, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
    if ideal is not None:
        ax.plot(ideal[0], ideal[1], ls="--", color="grey", label="linear (ideal)")
    for y, label in hlines:
        ax.axhline(y, ls=":", color="black", lw=1)
        ax.text(ax.get_xlim()[0], y, f" {label}", va="bottom", fontsize=8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def panels(path: Path, title: str, panels: Sequence[tuple[str, str, Sequence[tuple[str, Sequence[float],
                                                                                     Sequence[float]]]]],
           hline: tuple[float, str] | None = None) -> str:
    """Side-by-side charts: each panel is (xlabel, ylabel, series)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), dpi=110, squeeze=False)
    for ax, (xlabel, ylabel, series) in zip(axes[0], panels, strict=True):
        for label, xs, ys in series:
            ax.plot(xs, ys, label=label, lw=1.4)
        if hline is not None:
            ax.axhline(hline[0], ls=":", color="black", lw=1)
            ax.text(ax.get_xlim()[0], hline[0], f" {hline[1]}", va="bottom", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)
