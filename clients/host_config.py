"""What a real SuperNode takes from its own host, never from the server's run config.

The run config is the server's. Three of its keys name a place on the machine that runs
the client: ``data-dir`` (a folder to read datasets from), ``download`` (permission to
write a downloaded dataset into it) and ``backbone-weights`` (a file to read). Honoured
on a real SuperNode, they would let a server point a host at any path it can read, or
make it write into any folder it can write. So on a real SuperNode
(:func:`clients.app.in_simulation` is false) these keys come only from the node's own
configuration (``flower-supernode --node-config 'data-dir="/srv/data" download=true'``,
which ``fedpriv deploy supernode`` builds); absent there, the node reads only the
embedded or system copies and the cache (``FEDPRIV_CACHE``, the host's environment) and
downloads nothing. In Flower's simulation the nodes are the server's own workers and the
run config's keys apply as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.config import ConfigError, RunConfig
from tasks.messages import BACKBONE_WEIGHTS, DATA_DIR, DOWNLOAD

HOST_KEYS = (DATA_DIR, DOWNLOAD, BACKBONE_WEIGHTS)
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")


def _flag(value: Any) -> bool:
    """A node-config boolean: Flower parses ``download=true`` to True; text is accepted too."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ConfigError(f"node config {DOWNLOAD} = {value!r} is not true or false. Start the "
                      f"SuperNode with {DOWNLOAD}=true to let it download a missing dataset "
                      "into its data-dir, or leave it out (no download).")


def _text(node_config: Mapping[str, Any], key: str) -> str:
    value = node_config.get(key, "")
    if not isinstance(value, str):
        raise ConfigError(f"node config {key} = {value!r} must be a path in quotes, e.g. "
                          f"--node-config '{key}=\"/srv/fedpriv-data\"'.")
    return value


def flat_config(run_config: Mapping[str, Any] | RunConfig) -> dict[str, Any]:
    """A context's run config as a new flat dict (Flower gives a dict; in-process tests may
    give the typed :class:`RunConfig`, which ``validate`` accepts as well)."""
    return run_config.flat() if isinstance(run_config, RunConfig) else dict(run_config)


def host_run_config(run_config: Mapping[str, Any] | RunConfig, node_config: Mapping[str, Any]
                    ) -> dict[str, Any]:
    """The run config a real SuperNode works with: the server's, except ``data-dir``,
    ``download`` and ``backbone-weights``, which are the node's own (defaults: no folder,
    no download). A run that embeds with a weights file needs the host to name its copy."""
    config = flat_config(run_config)
    config[DATA_DIR] = _text(node_config, DATA_DIR)
    config[DOWNLOAD] = _flag(node_config.get(DOWNLOAD, False))
    config["plugins"] = _text(node_config, "plugins")  # modules to import: the host's own too
    if str(run_config.get(BACKBONE_WEIGHTS) or ""):
        own = _text(node_config, BACKBONE_WEIGHTS)
        if not own:
            raise ConfigError(
                "this run embeds with a backbone weights file (backbone-weights), and a "
                "SuperNode reads no file the server names: start this SuperNode with its "
                f"own copy of the same file, --node-config '{BACKBONE_WEIGHTS}="
                "\"/path/to/resnet18.pth\"'.")
        config[BACKBONE_WEIGHTS] = own
    return config
