"""The figure boilerplate every benchmark, report and the simulator share: a headless (Agg)
figure of subplots, laid out, saved and closed in one place."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def figure(path: str | Path, nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float], dpi: int = 100,
           **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """``(fig, axes)`` from ``plt.subplots(nrows, ncols, figsize=..., **subplots)``; when the
    block ends the figure is laid out tightly and saved to ``path`` at ``dpi``. It is closed
    either way (unsaved if the block raised), so a long benchmark does not keep its figures."""
    import matplotlib  # noqa: PLC0415 — only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def cdf(ax: Any, values: list[float], label: str) -> None:
    """The empirical CDF of ``values`` on ``ax`` (nothing when there are none)."""
    xs = sorted(values)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
