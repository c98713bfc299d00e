"""Progress lines of the ServerApp.

They carry a prefix so `fedpriv run` can pick them out of Flower's log stream.
"""

from __future__ import annotations

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
    train_loss = f"{train['loss']:.4f}" if train and "loss" in train else "-"
    secs = f"{seconds:.2f}s" if seconds is not None else "-"
    row = (f"{rnd:>5} | {test['accuracy']:>8.4f} | {test['loss']:>9.4f} | {train_loss:>10} | "
           f"{clients:>7} | {secs:>7}")
    if epsilon is not None:
        row += f" | {float(epsilon):>8.3f}"
    return row
