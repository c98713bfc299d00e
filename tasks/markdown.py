"""Markdown tables for fedpriv's pages (summary.md, sweep.md, leakage.md), by ``tabulate``.

Cells are written as given (``disable_numparse``: "0.8200" stays "0.8200"); a ``|`` in
a cell is escaped so it cannot split the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[Any]],
                   align: Sequence[str] | None = None) -> list[str]:
    """A Markdown (pipe) table, one line per item; ``align`` per column:
    ``left``, ``right`` or ``center`` (default left)."""
    from tabulate import tabulate  # lazy: only pages with a table need it

    def cell(x: Any) -> str:
        return "" if x is None else str(x).replace("|", "\\|").replace("\n", " ")

    text = tabulate([[cell(x) for x in row] for row in rows], headers=[cell(h) for h in head],
                    tablefmt="pipe", disable_numparse=True,
                    colalign=tuple(align) if align else None)
    return text.splitlines()


def drop_empty_columns(head: Sequence[str], rows: Sequence[Sequence[Any]],
                       keep: Sequence[str] = ()) -> tuple[list[str], list[list[Any]]]:
    """The columns with a value in at least one row (and those in ``keep``)."""
    used = [i for i, h in enumerate(head)
            if h in keep or any(row[i] not in (None, "") for row in rows)]
    return [head[i] for i in used], [[row[i] for i in used] for row in rows]
