"""Progress lines of the ServerApp.

They carry a prefix so `fedpriv run` can pick them out of Flower's log stream. The
per-round table is laid out by ``rich`` (a Table of fixed-width columns, rendered one
row at a time as rounds end, as plain text: the lines travel through a pipe).
"""

from __future__ import annotations

import io
import math
import sys
import threading
from contextvars import ContextVar

PREFIX = "[fedpriv] "
# the sweep cell a line is about, when cells run side by side (server.cells): "cell 3: "
CELL_TAG: ContextVar[str] = ContextVar("cell_tag", default="")

# (header, width): every row of a run has the same columns, so the table stays aligned
# although it is printed one line at a time
COLUMNS = (("round", 5), ("test acc", 8), ("test loss", 10), ("train loss", 10),
           ("clients", 7), ("time", 8))
EPSILON = ("epsilon", 8)


def say(text: str) -> None:
    """Print one progress line (each line of ``text`` gets the prefix, and the cell's tag
    when a sweep's cells run side by side)."""
    tag = CELL_TAG.get()
    lines = "".join(f"{PREFIX}{tag}{line}\n" for line in str(text).splitlines() or [""])
    with _WRITING:  # whole lines: cells side by side print from two threads
        sys.stdout.write(lines)
        sys.stdout.flush()


_WRITING = threading.Lock()


def shown_by_cli(run_id: str, cell: object | None) -> bool:
    """True for a run fedpriv's CLI started on its own (run, resume, deploy run; it sets
    ``run-id``): the CLI's pre-flight line has described the data, so the ServerApp does
    not again. A sweep's cell, or a run submitted with `flwr run`, gets it from the
    ServerApp."""
    return cell is None and bool(run_id)


def _line(cells: list[str], with_epsilon: bool) -> str:
    """One line of the table: ``cells`` right-aligned in their columns, `` | `` between."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    columns = COLUMNS + ((EPSILON,) if with_epsilon else ())
    table = Table(box=box.ASCII, show_header=False, show_edge=False, pad_edge=False,
                  padding=(0, 1))
    for _, width in columns:
        table.add_column(justify="right", width=width, no_wrap=True, overflow="ellipsis")
    table.add_row(*cells)
    out = io.StringIO()
    Console(file=out, width=200, color_system=None, force_terminal=False,
            highlight=False).print(table)
    return out.getvalue().rstrip("\n").rstrip()


def table_header(with_epsilon: bool = False) -> str:
    """The table's header line (with the epsilon column when the run accounts privacy)."""
    return _line([name for name, _ in COLUMNS] + (["epsilon"] if with_epsilon else []),
                 with_epsilon)


def table_row(rnd: int, test: dict, train: dict | None, clients: str, seconds: float | None,
              epsilon: float | None = None) -> str:
    """One progress line; ``epsilon`` (if not None) adds the privacy column."""
    cells = [str(rnd), number(test["accuracy"]), number(test["loss"]),
             number(train["loss"]) if train and "loss" in train else "-",
             clients, "-" if seconds is None else
             f"{seconds:.2f}s" if seconds < 1e4 else f"{seconds:.0f}s"]
    if epsilon is not None:
        cells.append(number(epsilon, 3))
    return _line(cells, epsilon is not None)


def number(value: float, digits: int = 4) -> str:
    """A number for a table (this one, summary.md's): ``digits`` decimals, or 3
    significant digits when that would be too wide (an exploding loss: 5.05e+31; nan)."""
    v = float(value)
    return f"{v:.{digits}f}" if math.isfinite(v) and abs(v) < 1e4 else f"{v:.3g}"
