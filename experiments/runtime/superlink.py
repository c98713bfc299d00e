"""A private Flower SuperLink in simulation mode, owned and stopped by fedpriv.

Each :class:`LocalSuperLink` gets its own ``FLWR_HOME`` (a temporary folder that
also holds Ray's session files), a free local port, telemetry and update checks
off, and runtime dependency installation off (the app runs in this environment).
Whatever it starts — the SuperLink and, below it, SuperExec, the simulation
process, Ray's GCS, raylet and actors — is stopped by PID when the ``with`` block
ends, on success, on error and on Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import tomli_w

from tasks.config import plugin_roots, to_toml

from . import keeper, procs
from .owned_folders import owned_folder

# How real SuperNodes run their ClientApps: "warm" (one long-running worker per node,
# short polls: experiments.deploy.warm_node) or "per-message" (Flower's stock SuperNode:
# a new flwr-clientapp process per message, 3 s idle polls). Read when not passed.
CLIENTAPPS_ENV = "FEDPRIV_CLIENTAPPS"
CLIENTAPP_MODES = ("warm", "per-message")


def flower_config(default: str, connections: Mapping[str, Mapping[str, Any]]) -> str:
    """``$FLWR_HOME/config.toml`` (by tomli-w): the SuperLink ``connections`` by name,
    ``default`` the one Flower's commands use."""
    return tomli_w.dumps({"superlink": {"default": default, **connections}})


# A port is chosen free and bound by the Flower process a second or two later: another
# process can take it in between (its bind wins; the Flower process exits saying so). Such
# a port is chosen again, at most this many times in all.
PORT_TRIES = 3
PORT_TAKEN = "address already in use"


class SuperLinkError(RuntimeError):
    """The SuperLink or `flwr run` could not be started."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_executable(name: str) -> str:
    """A Flower console script from this interpreter's environment."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise SuperLinkError(f"`{name}` was not found next to {sys.executable} or on PATH; "
                             "install fedpriv's dependencies (pip install -e .).")
    return found


def flower_env(home: Path | None, ray: str = "") -> dict[str, str]:
    """The environment of the Flower processes fedpriv starts (``home``: a private
    FLWR_HOME; None keeps the user's; ``ray``: a Ray cluster's HOST:PORT to attach to)."""
    env = dict(os.environ)
    # Flower starts flower-superexec / flwr-simulation by name: make this environment's
    # scripts findable even when it was not activated (e.g. .venv/bin/fedpriv).
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # The run config's plugins, where this process found them (e.g. the current folder):
    # the ServerApp and the ClientApps (Ray workers) import them too.
    path = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), *plugin_roots()) if p)
    if path:
        env["PYTHONPATH"] = path
    if home is not None:
        env["FLWR_HOME"] = str(home)
        if not ray:  # a cluster keeps its session files where its head put them
            env["RAY_TMPDIR"] = str(home / "ray")
    env.update({
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        "PYTHONUNBUFFERED": "1",
    })

    # Ray's single-machine mode: its node address is 127.0.0.1, so the GCS, raylet,
    # workers and the simulation's driver listen on loopback only, not on every interface
    # (Flower passes no node address to ray.init). Also for a cluster whose head is on
    # loopback: otherwise Ray turns 127.0.0.1 into this host's network address.
    env.pop("RAY_ADDRESS", None)
    if ray:  # Flower's ray.init() without an address attaches to RAY_ADDRESS
        env["RAY_ADDRESS"] = ray
    if not ray or ray.rpartition(":")[0] in ("127.0.0.1", "localhost"):
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


class LocalSuperLink:
    """Start ``flower-superlink`` on a free port; stop its whole tree on exit.

    By default the SuperLink runs Flower's simulation runtime. With ``supernodes = N``
    it runs in deployment mode instead and N real Flower SuperNodes connect to it over
    loopback, node i with ``--node-config "partition-id=i num-partitions=N"``: the same
    apps, the way they run across hosts. ``clientapps`` (default: ``$FEDPRIV_CLIENTAPPS``,
    else "warm") says how a node runs its ClientApps: "warm", one long-running worker per
    node and short polls (:mod:`experiments.deploy.warm_node`); "per-message", Flower's
    stock ``flower-supernode`` with a new ``flwr-clientapp`` process per message.
    """

    CONNECTION = "fedpriv"

    def __init__(self, startup_timeout: float = 60.0, cwd: Path | None = None,
                 supernodes: int = 0, ray: str = "", plugins: str = "",
                 clientapps: str = "") -> None:
        self.startup_timeout = startup_timeout
        self.clientapps = clientapps or os.environ.get(CLIENTAPPS_ENV) or "warm"
        if self.clientapps not in CLIENTAPP_MODES:
            raise SuperLinkError(f"{CLIENTAPPS_ENV}={self.clientapps!r}: use one of "
                                 f"{', '.join(CLIENTAPP_MODES)}")
        self.cwd = cwd or Path.cwd()
        self.num_supernodes = supernodes
        self._digest: str | None = None  # the app the warm nodes are pinned to
        # a SuperNode imports only the plugins its own node config names (the host's
        # choice): these local ones are the user's, so they get the run's
        self.plugins = plugins
        self.simulation = supernodes == 0  # else real SuperNodes: no federation config
        self.ray = ray  # a Ray cluster to run the simulation on ("": a private Ray)
        self.nodes: list[subprocess.Popen] = []
        self.node_ports: dict[int, int] = {}  # node -> its Runtime API port
        self.home: Path | None = None
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.client: subprocess.Popen | None = None
        self.keeper: subprocess.Popen | None = None
        self.started_s = 0.0
        self._runs = 0

    @property
    def env(self) -> dict[str, str]:
        assert self.home is not None
        return flower_env(self.home, self.ray)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=0.5) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self) -> LocalSuperLink:
        t0 = time.perf_counter()
        # removed by close() or, if this process is killed, by the keeper or a later start
        self.home = owned_folder(remove_at_exit=False)
        (self.home / "ray").mkdir()
        for attempt in range(1, PORT_TRIES + 1):
            self.port = free_port()
            (self.home / "config.toml").write_text(flower_config(
                self.CONNECTION, {self.CONNECTION: {"address": f"127.0.0.1:{self.port}",
                                                    "insecure": True}}))
            mode = [] if self.num_supernodes else ["--simulation"]
            self.proc = self._spawn("superlink.log", [
                flower_executable("flower-superlink"), "--insecure", *mode,
                "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
                "--port", str(self.port)])
            self._keep(self.proc)
            # ready when it answers on a port it holds itself: an answer alone could come
            # from another SuperLink that took the port after free_port() let it go
            ready = procs.wait_until(lambda: self.proc.poll() is not None
                                     or (procs.listens_on(self.proc.pid, self.port)
                                         and self._healthy()), self.startup_timeout)
            if ready and self.proc.poll() is None:  # alive, holding the port, answering
                break
            tail = self.log_tail()
            if self.proc.poll() is not None and PORT_TAKEN in tail and attempt < PORT_TRIES:
                continue  # taken between choosing and binding: choose another
            self.stop()
            raise SuperLinkError(f"flower-superlink did not become ready on port {self.port}"
                                 f" (exit code {self.proc.poll()}). Its log ends with:\n{tail}")
        for i in range(self.num_supernodes):  # each listed as soon as it runs: stop() sees it
            self.nodes.append(self._start_node(i))
        self._await_nodes()
        self.started_s = time.perf_counter() - t0
        return self

    def _start_node(self, i: int) -> subprocess.Popen:
        """SuperNode ``i`` (partition i of N) on a free port for its Runtime API."""
        port = free_port()
        self.node_ports[i] = port
        node = self._spawn(f"supernode-{i}.log", [
            *self._supernode(), "--insecure",
            "--superlink", f"127.0.0.1:{self.port}", "--host", "127.0.0.1",
            "--port", str(port),
            "--node-config", f"partition-id={i} num-partitions={self.num_supernodes}"
            + (f' plugins="{self.plugins}"' if self.plugins else "")])
        self._keep(node)
        return node

    def _await_nodes(self) -> None:
        """Wait until every SuperNode holds its Runtime API port (its ClientApps' tasks
        go through it); restart on another port a node whose port was taken first."""
        def holds(i: int) -> bool:  # alive, with its port its own
            node = self.nodes[i]
            return node.poll() is None and procs.listens_on(node.pid, self.node_ports[i])

        for attempt in range(1, PORT_TRIES + 1):
            procs.wait_until(lambda: all(holds(i) or self.nodes[i].poll() is not None
                                         for i in range(len(self.nodes))),
                             self.startup_timeout)
            lost = [i for i in range(len(self.nodes)) if not holds(i)]
            if not lost:
                return
            for i in lost:
                tail = self.log_tail(f"supernode-{i}.log")
                if (self.nodes[i].poll() is None or PORT_TAKEN not in tail
                        or attempt == PORT_TRIES):
                    self.stop()
                    raise SuperLinkError(
                        f"SuperNode {i} did not start its Runtime API on port "
                        f"{self.node_ports[i]} (exit code {self.nodes[i].poll()}). Its log "
                        f"ends with:\n{tail}")
                self.nodes[i] = self._start_node(i)

    def _supernode(self) -> list[str]:
        """The command that starts a SuperNode, before Flower's arguments."""
        node = [sys.executable, "-m", "experiments.deploy.warm_node"]
        if self.clientapps == "warm":  # lives only as long as this SuperLink: always fast
            if self._digest is None:  # once here, not in every node (Flower's builder: ~1 s)
                from ..deploy.app_pin import app_digest

                self._digest = app_digest()
            return [*node, "--allow-app", self._digest, "--"]  # this installation's app
        # Flower's own executor (a flwr-clientapp per message, its 3 s polls), still with a
        # Runtime API secret per start; it cannot check an app's digest
        return [*node, "--executor", "superexec", "--allow-any-app", "--"]

    @property
    def record_path(self) -> Path:
        assert self.home is not None
        return self.home / "processes.json"

    def watch_run(self, run_dir: Path) -> None:
        """Have the keeper mark this run crashed if fedpriv dies before it ends."""
        with open(self.record_path.with_suffix(".runs"), "a") as f:
            f.write(f"{Path(run_dir).resolve()}\n")

    def _keep(self, *started: subprocess.Popen) -> None:
        """Have the keeper record these processes (and all they start); start it first."""
        with open(self.record_path.with_suffix(".roots"), "a") as f:
            f.writelines(f"{p.pid}\n" for p in started)
        if self.keeper is None:
            # Its own session: a Ctrl-C on the terminal is for fedpriv, not for it.
            self.keeper = subprocess.Popen(
                [sys.executable, "-m", "experiments.runtime.keeper", str(self.record_path),
                 str(os.getpid())], cwd=Path(__file__).resolve().parents[2],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True)

    def _spawn(self, log_name: str, cmd: list[str]) -> subprocess.Popen:
        assert self.home is not None
        with open(self.home / log_name, "w") as log:
            return subprocess.Popen(cmd, env=self.env, cwd=self.cwd, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

    def died(self) -> str | None:
        """Why the run cannot have ended well when a process fedpriv started has died."""
        if self.proc is not None and self.proc.poll() is not None:
            return (f"the Flower SuperLink (pid {self.proc.pid}) exited with code "
                    f"{self.proc.returncode} during the run")
        return None

    def log_tail(self, name: str = "superlink.log", lines: int = 20) -> str:
        path = (self.home or Path("/nonexistent")) / name
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc and self.proc.poll() is None else []

    def submit(self, app_dir: Path, run_config: Mapping[str, Any],
               federation: Mapping[str, Any], on_line: Callable[[str], None]) -> int:
        """Run ``flwr run APP fedpriv --stream`` with this config; pass each output line on."""
        assert self.home is not None
        if run_config.get("run-dir"):
            self.watch_run(Path(str(run_config["run-dir"])))
        self._runs += 1
        overrides = self.home / f"run-{self._runs}.toml"
        overrides.write_text(to_toml(run_config))
        cmd = [flower_executable("flwr"), "run", str(app_dir), self.CONNECTION, "--stream",
               "--run-config", str(overrides)]
        if self.simulation:  # the simulated federation's size and resources
            cmd += ["--federation-config",
                    " ".join(f"{k}={_toml_value(v)}" for k, v in federation.items())]
        client = subprocess.Popen(cmd, env=self.env, cwd=self.cwd, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                  bufsize=1, errors="replace")
        self.client = client
        self._keep(client)
        try:
            assert client.stdout is not None
            for line in client.stdout:
                on_line(line.rstrip("\n"))
            return client.wait()
        finally:
            if client.poll() is None:
                procs.stop_tree(client)
            self.client = None

    def stop(self) -> None:
        """Stop everything this SuperLink started, by PID, and remove its FLWR_HOME.

        The trees are walked from the processes fedpriv started; then everything the
        keeper recorded and is still alive is stopped too (a SuperLink that died leaves
        SuperExec, the simulation and Ray re-parented, out of reach of any walk).
        """
        with procs.signals_deferred():
            if self.client is not None and self.client.poll() is None:
                procs.stop_tree(self.client)
            for node in self.nodes:
                procs.stop_tree(node)
            if self.proc is not None:
                procs.stop_tree(self.proc)
            if self.home is not None:
                keeper.stop_recorded(keeper.read_record(self.record_path))
            if self.keeper is not None:
                procs.stop_tree(self.keeper)
                self.keeper = None
            if self.home is not None:
                shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> LocalSuperLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)
