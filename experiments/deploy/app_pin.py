"""Which client code a SuperNode runs: apps pinned by the digest of their bundle.

A SuperNode runs whatever Flower App Bundle (FAB) the SuperLink sends, so without a pin
every client-side defence (DP-SGD, the disclosure rule, the trap-weights refusal) is
enforced by code the operator ships. The digest here is the SHA-256 of the FAB bytes,
exactly as Flower computes a FAB's hash: ``flwr run`` builds the FAB from
:func:`experiments.runtime.app_bundle.stage_app` with Flower's own builder
(``flwr.cli.build.build_fab_from_disk``: files sorted, every zip entry dated
``FAB_DATE``), so the same fedpriv code gives the same digest on every host. The ClientApp
worker (:mod:`experiments.deploy.clientapp_worker`) refuses a FAB whose digest is not
pinned before installing or importing anything from it.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

# Nothing from the app packages at import time: the ClientApp worker imports this module,
# and the app's own modules must come from the FAB it runs.
DIGEST = re.compile(r"^[0-9a-f]{64}$")
SHORT = 12  # hex digits shown in start lines


def fab_digest(content: bytes) -> str:
    """The SHA-256 of a FAB's bytes (Flower's ``Fab.hash_str`` for an honest FAB)."""
    return hashlib.sha256(content).hexdigest()


def app_digest() -> str:
    """The digest of the FAB ``flwr run`` builds from this installation's fedpriv app:
    what an operator on the same code submits, so what a host pins by default."""
    from flwr.cli.build import build_fab_from_disk

    from ..runtime.app_bundle import stage_app

    stage = stage_app()
    try:
        return fab_digest(build_fab_from_disk(stage))
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def check_digest(text: str, where: str) -> str:
    """``text`` as a digest (64 hex digits, lower case); ConfigError naming ``where``."""
    from tasks.config import ConfigError

    digest = text.strip().lower()
    if not DIGEST.match(digest):
        raise ConfigError(
            f"{where}: {text.strip()!r} is not an app digest (64 hexadecimal digits, the "
            "SHA-256 of the app bundle). Get the digest of the code you reviewed with "
            "`fedpriv deploy app-digest` on a checkout of it, or copy it from the refusal "
            "line a SuperNode logs, and give it again.")
    return digest


def read_digest_file(path: Path) -> list[str]:
    """The digests in ``path``: one per line; blank lines and ``#`` comments ignored."""
    from tasks.config import ConfigError

    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--allow-app-file {str(path)!r} cannot be read ({exc}); give a "
                          "text file with one app digest per line (# starts a comment).") \
            from None
    out = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if text:
            out.append(check_digest(text, f"--allow-app-file {path}, line {number}"))
    return out


def describe(digests: Iterable[str]) -> str:
    """Short digests for a start line: ``16ec85cc0fc4, 0123456789ab``."""
    return ", ".join(d[:SHORT] for d in digests)


def refusal(fab_id: str, version: str, digest: str) -> str:
    """The one line a host logs when it refuses an app: which, its digest, how to pin it."""
    return (f"[fedpriv clientapp-worker] refused app {fab_id or '?'} {version or '?'} (FAB "
            f"sha256 {digest}): this SuperNode runs only pinned client code, and this app "
            f"is not pinned. After reviewing that code, allow it with `fedpriv deploy "
            f"supernode ... --allow-app {digest}` (`fedpriv deploy app-digest` on a "
            "checkout of it prints the same digest).")
