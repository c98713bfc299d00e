"""How a sweep's lines tell its factors apart: with two or more keys varying (a 2x2x2
factorial), colour shows the first, the line style the second and the marker the third,
so a reader sees the design instead of eight unrelated colours."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from matplotlib import colormaps

DASHES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3)))
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def varying(params: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The keys that take two or more values across the labelled settings, in order."""
    seen: dict[str, set[str]] = {}
    for p in params.values():
        for k, v in p.items():
            seen.setdefault(k, set()).add(repr(v))
    return [k for k, values in seen.items() if len(values) > 1]


def factor_styles(params: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per label: colour by the first varying key's value, dashes by the second's, marker
    by the third's; {} when one key or none varies (matplotlib's own cycle says it)."""
    keys = varying(params)
    if len(keys) < 2:
        return {}
    values = [list(dict.fromkeys(repr(p.get(k)) for p in params.values())) for k in keys[:3]]
    colours = colormaps["tab10"]
    out = {}
    for label, p in params.items():
        at = [vals.index(repr(p.get(k))) for k, vals in zip(keys, values, strict=False)]
        style: dict[str, Any] = {"color": colours(at[0] % 10), "ls": DASHES[at[1] % len(DASHES)]}
        if len(at) > 2:
            style["marker"] = MARKERS[at[2] % len(MARKERS)]
        out[label] = style
    return out
