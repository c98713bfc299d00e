"""``fedpriv deploy supernode``: one host's SuperNode, retried while the SuperLink still
counts its previous session as online."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tasks.config import ConfigError
from tasks.progress import Relay

from ..runtime.procs import stream_child
from ..runtime.superlink import (
    flower_env,
    flower_executable,  # noqa: F401 (tests guard starts with it)
)
from .app_pin import describe
from .connection import Connection

Echo = Callable[[str], None]

# What flower-supernode prints (Flower 1.41): exit code 305 (SUPERNODE_CONNECTION_ERROR);
# 2004 (FLEET_NODE_ACTIVATION_FAILED, "Failed to activate SuperNode."), which it reports
# alike for an unregistered key and for a registered node whose previous session still
# counts as online; and its node id, logged once the SuperLink has activated it.
REFUSED = "Exit Code: 305"
NOT_ACTIVATED = "[code: 2004]"
JOINED = "SuperNode ID:"
ONLINE_AFTER_HEARTBEAT = 60  # Flower's HEARTBEAT_PATIENCE (2) x the 30 s heartbeat
BUSY_FOR = 60.0  # s after its last message that a warm node keeps polling fast
# Test hook: False starts the node without a Runtime API secret (the attack it stops).
PROTECT_RUNTIME_API = True


def supernode_command(link: Connection, node_config: dict[str, str | int | bool],
                      key: Path | None, host: str = "127.0.0.1", port: int = 9094,
                      warm: bool = True, poll: float = 0.1,
                      allow_apps: Sequence[str] | None = (),
                      client_cert: Path | None = None) -> list[str]:
    """The SuperNode for one host: the partition it serves, its key, always through
    :mod:`experiments.deploy.warm_node` (a fresh Runtime API secret per start). ``warm``:
    one ClientApp worker and short polls while busy; else Flower's stock executor (a
    ``flwr-clientapp`` process per message). ``allow_apps``: the app digests it runs
    (default: this installation's app; None: any app, needed when not ``warm``).
    ``client_cert``: the TLS client certificate the node shows the SuperLink's gateway
    (its key is ``key``)."""
    config = " ".join(f"{k}={node_config_value(k, v)}" for k, v in node_config.items())
    start = [sys.executable, "-m", "experiments.deploy.warm_node"]
    start += ["--poll", str(poll), "--idle-after", str(BUSY_FOR)] if warm else \
        ["--executor", "superexec"]
    start += ["--allow-any-app"] if allow_apps is None else \
        [a for d in allow_apps for a in ("--allow-app", d)]
    if not PROTECT_RUNTIME_API:
        start.append("--unprotected-runtime-api")
    if client_cert is not None:
        start += ["--client-cert", str(client_cert)]
    cmd = [*start, "--", "--superlink", link.address, *link.flags(),
           "--node-config", config, "--host", host, "--port", str(port)]
    if key is not None:
        if not key.is_file():
            raise ConfigError(f"--key {str(key)!r} does not exist. Copy this host's private "
                              "key (made by `fedpriv deploy keys`) here.")
        cmd += ["--auth-supernode-private-key", str(key)]
    return cmd


def node_config_value(key: str, value: str | int | bool) -> str:
    """``value`` as Flower's ``--node-config`` reads it back unchanged (a TOML value inside
    its ``key=value`` list): text in double quotes, or in single quotes (TOML's literal
    string) when it holds a double quote or a backslash; ConfigError for text it cannot
    carry (both kinds of quote, a control character)."""
    if isinstance(value, bool):
        return str(value).lower()
    if not isinstance(value, str):
        return str(value)
    if any(ord(c) < 32 or ord(c) == 127 for c in value) or ("'" in value and (
            '"' in value or "\\" in value)):
        raise ConfigError(
            f"{key} {value!r}: Flower's --node-config cannot carry this path (it holds a "
            "control character, or a single quote together with a double quote or a "
            "backslash). Rename the file or folder, or give it through a symlink whose "
            "path has none of these, and start the SuperNode again.")
    return f"'{value}'" if ('"' in value or "\\" in value) else f'"{value}"'


class _Attempt:
    """The output of one start of flower-supernode. A retry's lines are held back until
    the SuperLink admits the node, so that refused retries print nothing."""

    def __init__(self, echo: Echo, on_join: Callable[[], str] | None = None) -> None:
        self.echo = echo
        self.on_join = on_join
        self.held: list[str] | None = [] if on_join else None
        self.refused = self.not_activated = False
        self.progress = Relay()  # the ClientApps' progress bars, drawn on this terminal

    def line(self, text: str) -> None:
        if self.progress.feed(text):
            return
        self.refused = self.refused or REFUSED in text
        self.not_activated = self.not_activated or NOT_ACTIVATED in text
        if self.held is None:
            self.echo(text)
            return
        self.held.append(text)
        if JOINED in text and self.on_join:
            self.echo(self.on_join())
            self.release()
        elif len(self.held) > 100:  # not Flower's usual start-up: stop holding back
            self.release()

    def release(self) -> None:
        held, self.held = self.held or [], None
        for text in held:
            self.echo(text)


def serve_supernode(link: Connection, node_config: dict[str, str | int | bool], key: Path | None,
                    port: int, echo: Echo = print, *, rejoin_wait: float = 90.0,
                    retry_every: float = 3.0, warm: bool = True, poll: float = 0.1,
                    allow_apps: Sequence[str] | None = (),
                    client_cert: Path | None = None) -> int:
    """Run one SuperNode in the foreground until it exits or is interrupted.

    A SuperNode restarted after a crash or ``kill -9`` is refused while the SuperLink still
    counts its previous session as online (up to 60 s after its last heartbeat); Flower
    reports that exactly as it reports an unregistered key. So a refused activation is
    retried every ``retry_every`` s for up to ``rejoin_wait`` s, then ends with the
    register advice.
    """
    cmd = supernode_command(link, node_config, key, port=port, warm=warm, poll=poll,
                            allow_apps=allow_apps, client_cert=client_cert)
    pinned = ("any app the SuperLink sends (not pinned)" if allow_apps is None else
              f"pinned to app {describe(allow_apps)}" if allow_apps else
              "pinned to this installation's fedpriv app")
    echo(f"SuperNode for {link.address} ({'TLS' if link.ca else 'insecure'}"
         f"{', authenticated' if key else ''}"
         f"{', client certificate ' + client_cert.name if client_cert else ''}), "
         f"node config: {cmd[cmd.index('--node-config') + 1]}"
         f", ClientApps {'in one warm worker' if warm else 'in a process per message'}, "
         f"{pinned}; Runtime API on 127.0.0.1:{port} "
         f"{'authenticated (a fresh secret per start)' if PROTECT_RUNTIME_API else 'OPEN'}")
    env = flower_env(None)
    attempt = _Attempt(echo)
    code = stream_child(cmd, attempt.line, env)
    attempt.progress.close()
    if not attempt.refused:
        return code
    if key is None or not attempt.not_activated or rejoin_wait <= 0:
        echo("the SuperLink refused this SuperNode (Flower's exit code 305): register its key "
             "on the SuperLink's host with `fedpriv deploy register KEY.pub --superlink "
             "127.0.0.1:INTERNAL_PORT --ca ...`, or, if it has just restarted, wait about a "
             "minute for its old session to time out.")
        return code
    echo(f"the SuperLink refused to activate this SuperNode: it still counts this node's "
         f"previous session as online for up to {ONLINE_AFTER_HEARTBEAT} s after its last "
         f"heartbeat (after a crash or kill -9), or its key is not registered; retrying every "
         f"{retry_every:g} s for up to {rejoin_wait:g} s")
    start = time.monotonic()
    tries = 1
    while time.monotonic() + retry_every < start + rejoin_wait:
        time.sleep(retry_every)  # Ctrl-C and SIGTERM end it at once
        tries += 1
        attempt = _Attempt(echo, lambda n=tries: f"the SuperLink admitted this SuperNode "
                                                 f"after {time.monotonic() - start:.0f} s "
                                                 f"(attempt {n})")
        code = stream_child(cmd, attempt.line, env)
        attempt.progress.close()
        if not (attempt.refused and attempt.not_activated):
            attempt.release()  # it joined and has ended, or failed in another way
            return code
    echo(f"the SuperLink refused this SuperNode for {time.monotonic() - start:.0f} s, longer "
         "than a previous session stays online: register its key on the SuperLink's "
         "host with `fedpriv deploy register KEY.pub --superlink 127.0.0.1:INTERNAL_PORT "
         "--ca ...` (`--ls` lists the registered nodes).")
    return code


