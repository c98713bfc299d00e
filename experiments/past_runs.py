"""Past runs at hand: every run folder under a results folder (sweep cells included) with
its headline numbers, read from run.json and config.toml (``fedpriv runs``,
``fedpriv.runs()``)."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.results.folder import RUN_INFO, read_run_info
from tasks.results.ledger import headline_epsilon

COLUMNS = ("run", "status", "dataset", "model", "clients", "rounds", "accuracy", "epsilon",
           "started", "wall s")


@dataclass(frozen=True)
class PastRun:
    """One run folder's headline: where it is, how it ended, what it reached."""

    path: Path
    status: str
    dataset: str | None
    model: str | None
    clients: int | None
    rounds: int | None
    accuracy: float | None
    epsilon: float | None
    started: str | None
    wall_s: float | None

    def row(self, root: Path) -> list[str]:
        def num(x: float | None, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        try:
            where = str(self.path.relative_to(root))
        except ValueError:
            where = str(self.path)
        return [where, self.status, self.dataset or "-", self.model or "-",
                num(self.clients, "d"), num(self.rounds, "d"), num(self.accuracy, ".4f"),
                num(self.epsilon, ".3g"), (self.started or "-")[:19].replace("T", " "),
                num(self.wall_s, ".1f")]


def _folders(root: Path) -> Iterator[Path]:
    """Every folder under ``root`` holding a run.json (runs and sweep cells), not below
    another run's folder."""
    for info in sorted(root.rglob(RUN_INFO)):
        if not any((p / RUN_INFO).is_file() for p in info.parent.parents if root in p.parents):
            yield info.parent


def _dataset(folder: Path) -> str | None:
    """The dataset's name from the run's config.toml (run.json describes it at length)."""
    try:
        with open(folder / "config.toml", "rb") as f:
            return str(tomllib.load(f).get("dataset"))
    except (OSError, tomllib.TOMLDecodeError):
        return None


def past_runs(results_dir: str | Path = "results") -> list[PastRun]:
    """The runs under ``results_dir``, oldest first; a folder whose run.json cannot be
    read is listed (last) as "unreadable" rather than skipped or raised."""
    root = Path(results_dir).expanduser()
    if not root.is_dir():
        return []
    out = []
    for folder in _folders(root):
        try:
            info = read_run_info(folder)
        except Exception:  # a damaged run.json: listed, so the user sees it
            out.append(PastRun(folder, "unreadable", *([None] * 8)))
            continue
        final = info.get("final") or {}
        out.append(PastRun(folder, info.get("status", "running"), _dataset(folder),
                           info.get("model"), info.get("num-clients"),
                           info.get("rounds-completed"), final.get("accuracy"),
                           headline_epsilon(info.get("privacy")), info.get("started"),
                           info.get("wall-s")))
    return sorted(out, key=lambda r: (r.started is None, r.started or "", str(r.path)))


def runs_table(runs: list[PastRun], root: Path) -> list[str]:
    """The runs as a Markdown table (what ``fedpriv runs`` prints)."""
    from tasks.markdown import markdown_table

    return markdown_table(COLUMNS, [r.row(root) for r in runs],
                          ["left", "left", "left", "left", *["right"] * 4, "left", "right"])


def runs_frame(runs: list[PastRun]) -> Any:
    """The runs as a pandas DataFrame, one row each (``fedpriv.runs()``)."""
    import pandas as pd

    rows = [{**asdict(r), "path": str(r.path)} for r in runs]
    return pd.DataFrame(rows, columns=[f.replace(" ", "_") if f != "run" else "path"
                                       for f in COLUMNS])
