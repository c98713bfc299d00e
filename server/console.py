"""Progress lines of the ServerApp.

They carry a prefix so `fedpriv run` can pick them out of Flower's log stream.
"""

from __future__ import annotations

import math

PREFIX = "[fedpriv] "


def say(text: str) -> None:
    """Print one progress line (each line of ``text`` gets the prefix)."""
    for line in str(text).splitlines() or [""]:
        print(PREFIX + line, flush=True)


def table_header(with_epsilon: bool = False) -> str:
    head = (f"{'round':>5} | {'test acc':>8} | {'test loss':>9} | {'train loss':>10} | "
            f"{'clients':>7} | {'time':>7}")
    return head + (f" | {'epsilon':>8}" if with_epsilon else "")


def table_row(rnd: int, test: dict, train: dict | None, clients: str, seconds: float | None,
              epsilon: float | None = None) -> str:
    """One progress line; ``epsilon`` (if not None) adds the privacy column."""
    train_loss = _num(train["loss"]) if train and "loss" in train else "-"
    secs = f"{seconds:.2f}s" if seconds is not None else "-"
    row = (f"{rnd:>5} | {test['accuracy']:>8.4f} | {_num(test['loss']):>9} | {train_loss:>10} | "
           f"{clients:>7} | {secs:>7}")
    if epsilon is not None:
        row += f" | {float(epsilon):>8.3f}"
    return row


def _num(value: float) -> str:
    """A loss for the table: 4 decimals, or 3 significant digits when it would not fit
    (an exploding or non-finite loss must not break the columns)."""
    v = float(value)
    return f"{v:.4f}" if math.isfinite(v) and abs(v) < 1e4 else f"{v:.3g}"
