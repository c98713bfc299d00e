"""``fedpriv deploy``: its subcommands' arguments (certs, keys, register, superlink,
supernode, run) and what each does. The deployment itself is :mod:`experiments.deploy`,
imported only when a subcommand runs."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from tasks.config import ConfigError

from ..configs import PRESETS

EXAMPLE = """\
three hosts (server.lab, and hospitals a and b), the server holding the CA:
  server$ fedpriv deploy certs certs --host server.lab
  server$ fedpriv deploy keys keys --nodes 2 --certs certs
  server$ fedpriv deploy superlink --certs certs --state state --host 0.0.0.0 --nodes 2
          (SuperNodes connect to server.lab:9092, a gateway that serves only Flower's
          Fleet API; the SuperLink itself, with the Control API that registers nodes and
          runs apps, listens on 127.0.0.1:9093: operator commands run on the server)
  server$ fedpriv deploy register keys/supernode-0.pub keys/supernode-1.pub \\
              --superlink 127.0.0.1:9093 --ca certs/ca.crt
  (copy certs/ca.crt, keys/supernode-I and keys/supernode-I.crt to host I)
  a$      fedpriv deploy supernode --superlink server.lab:9092 --ca ca.crt \\
              --key supernode-0 --partition-id 0 --num-partitions 2
  b$      fedpriv deploy supernode --superlink server.lab:9092 --ca ca.crt \\
              --key supernode-1 --partition-id 1 --num-partitions 2
  server$ fedpriv deploy run --superlink 127.0.0.1:9093 --ca certs/ca.crt \\
              --set num-clients=2 --set num-server-rounds=3
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    deploy = sub.add_parser(
        "deploy", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run the same apps on a real SuperLink and SuperNodes across hosts (TLS, "
             "SuperNode authentication)",
        description="Deploy the federation on real hosts with Flower's deployment runtime: "
                    "TLS and SuperNode authentication on by default.", epilog=EXAMPLE)
    cmds = deploy.add_subparsers(dest="deploy_command", required=True)
    _add_files(cmds)
    _add_register(cmds)
    _add_superlink(cmds)
    _add_supernode(cmds)
    _add_run(cmds)
    cmds.add_parser("app-digest", help="print the digest (SHA-256 of the app bundle) of "
                                       "this installation's fedpriv app, which SuperNodes "
                                       "pin by default (compare it across hosts; --allow-app)")


def _add_connection(p: argparse.ArgumentParser, operator: bool = True) -> None:
    """--superlink and how to trust it (--ca or --insecure)."""
    p.add_argument("--superlink", required=True, metavar="HOST:PORT",
                   help=("the SuperLink's internal address, on the SuperLink's host: "
                         "127.0.0.1:INTERNAL_PORT (9093 by default); the public port "
                         "refuses operator commands" if operator else
                         "the SuperLink's public address (its fleet gateway), e.g. "
                         "server.lab:9092"))
    trust = p.add_mutually_exclusive_group(required=True)
    trust.add_argument("--ca", type=Path, help="the deployment's ca.crt")
    trust.add_argument("--insecure", action="store_true",
                       help="no TLS (loopback demos only)")


def _add_files(cmds: argparse._SubParsersAction) -> None:
    """certs and keys: the files a deployment needs."""
    certs = cmds.add_parser("certs", help="make a CA and the SuperLink's TLS certificate")
    certs.add_argument("folder", type=Path, help="where to write ca.crt, server.pem, server.key")
    certs.add_argument("--host", action="append", required=True, metavar="NAME_OR_IP",
                       help="a name or address SuperNodes use to reach the SuperLink "
                            "(repeatable); 127.0.0.1 and localhost are always added")
    certs.add_argument("--days", type=int, default=365, help="validity (default 365)")

    keys = cmds.add_parser("keys", help="make SuperNode key pairs (ECDSA P-384, OpenSSH)")
    keys.add_argument("folder", type=Path)
    keys.add_argument("--nodes", type=int, required=True, metavar="N")
    keys.add_argument("--certs", type=Path, metavar="FOLDER",
                      help="the folder `fedpriv deploy certs` made (with ca-private/ca.key): "
                           "also issue each node a TLS client certificate for its key "
                           "(supernode-I.crt), which the SuperLink's gateway demands")


def _add_register(cmds: argparse._SubParsersAction) -> None:
    reg = cmds.add_parser("register", help="register SuperNode public keys with the "
                                           "SuperLink (flwr supernode register; on the "
                                           "SuperLink's host)")
    reg.add_argument("keys", type=Path, nargs="*", metavar="KEY.pub")
    reg.add_argument("--ls", action="store_true", help="list the registered SuperNodes")
    reg.add_argument("--unregister", action="store_true",
                     help="unregister instead (give node ids, as `--ls` prints them)")
    _add_connection(reg)


def _add_superlink(cmds: argparse._SubParsersAction) -> None:
    link = cmds.add_parser("superlink", help="start a SuperLink (foreground; Ctrl-C stops it)")
    link.add_argument("--certs", type=Path, help="folder made by `fedpriv deploy certs`")
    link.add_argument("--state", type=Path, required=True,
                      help="folder for the SQLite state (registrations, runs)")
    link.add_argument("--host", default="127.0.0.1",
                      help="address to listen on (0.0.0.0: every interface; default loopback)")
    link.add_argument("--port", type=int, default=9092,
                      help="public port: the fleet gateway SuperNodes connect to, which "
                           "serves only Flower's Fleet API (default 9092)")
    link.add_argument("--internal-port", type=int, metavar="PORT",
                      help="the SuperLink's own port on 127.0.0.1, with the Control and "
                           "Runtime APIs: operator commands (register, run) on this host "
                           "use it (default: --port + 1)")
    link.add_argument("--nodes", type=int, default=0, help="for the printed commands")
    link.add_argument("--insecure", action="store_true",
                      help="no TLS and no authentication: loopback demos only")
    link.add_argument("--no-client-certs", action="store_true",
                      help="let SuperNodes without a TLS client certificate connect (e.g. "
                           "Flower's own flower-supernode); outsiders can then hold TLS "
                           "connections open on the public port")


def _add_supernode(cmds: argparse._SubParsersAction) -> None:
    node = cmds.add_parser("supernode", help="start a SuperNode for this host (foreground)")
    _add_connection(node, operator=False)
    node.add_argument("--key", type=Path, help="this host's private key (with authentication)")
    node.add_argument("--client-cert", type=Path, metavar="CRT",
                      help="this node's TLS client certificate for the SuperLink's gateway "
                           "(default: KEY.crt beside --key, made by `fedpriv deploy keys "
                           "--certs`)")
    node.add_argument("--partition-id", type=int, required=True)
    node.add_argument("--num-partitions", type=int, required=True)
    node.add_argument("--data-path", type=Path,
                      help="this host's own training data, which the server never sees: an "
                           ".npz file (arrays x, y) or an ImageFolder-layout folder "
                           "(<class index>/<images>); default: partition I of the shared "
                           "dataset")
    node.add_argument("--state-dir", type=Path,
                      help="where this client keeps its state (DP ledger, CVAE) so that "
                           "`fedpriv deploy run --resume` can go on without resetting it")
    node.add_argument("--data-dir", type=Path,
                      help="this host's folder of datasets in torchvision's layout (a run "
                           "config's data-dir is ignored on a SuperNode); default: only the "
                           "embedded or system copies")
    node.add_argument("--download", action="store_true",
                      help="allow downloading a missing dataset into --data-dir (the server "
                           "cannot turn this on)")
    node.add_argument("--backbone-weights", type=Path,
                      help="this host's copy of the run's backbone weights file (features = "
                           "embeddings with backbone-weights)")
    node.add_argument("--accept-trap-weights", action="store_true",
                      help="this host agrees to take part in a malicious-server study "
                           "(server = 'malicious' sends it trap weights that read its "
                           "records out of its update); without it such a run is refused "
                           "before any round")
    node.add_argument("--port", type=int, default=9094,
                      help="local port of this SuperNode's ClientApp API (default 9094)")
    node.add_argument("--rejoin-wait", type=float, default=90.0, metavar="SECONDS",
                      help="when the SuperLink refuses to activate this node (its previous "
                           "session still counts as online for up to 60 s after a crash, "
                           "or its key is not registered), keep retrying this long "
                           "(default 90; 0: give up at once)")
    node.add_argument("--clientapp-per-message", action="store_true",
                      help="Flower's stock SuperNode: a new flwr-clientapp process per "
                           "message and 3 s idle polls (default: one warm ClientApp worker "
                           "for all messages, 0.1 s polls while busy)")
    node.add_argument("--poll", type=float, default=0.1, metavar="SECONDS",
                      help="while busy (a message in the last minute), pull from the "
                           "SuperLink every SECONDS (default 0.1; idle: Flower's 3 s)")
    node.add_argument("--allow-app", action="append", default=[], metavar="SHA256",
                      help="also run the app whose bundle has this digest (repeatable; "
                           "`fedpriv deploy app-digest` prints one). By default this node "
                           "runs only this installation's own fedpriv app")
    node.add_argument("--allow-app-file", action="append", default=[], type=Path,
                      metavar="FILE", help="digests to allow, one per line (# comments)")
    node.add_argument("--allow-any-app", action="store_true",
                      help="run whatever app the SuperLink sends: the operator's code then "
                           "enforces every client-side defence")


def _add_run(cmds: argparse._SubParsersAction) -> None:
    run = cmds.add_parser("run", help="submit a run to the deployment and wait for it "
                                      "(run it on the SuperLink's host: the results folder "
                                      "is written there)")
    _add_connection(run)
    run.add_argument("--config", metavar="PRESET",
                     help=f"a preset TOML file, or the name of one in {PRESETS}")
    run.add_argument("--set", metavar="KEY=VALUE", action="append", default=[])
    run.add_argument("--name")
    run.add_argument("--resume", metavar="RUN_FOLDER", type=Path,
                     help="continue a crashed or failed deployed run (e.g. after a SuperLink "
                          "restart) from its last checkpointed round, with its own config; "
                          "its SuperNodes must have kept their state (--state-dir)")
    run.add_argument("--verbose", action="store_true")


def _connection(args: argparse.Namespace):
    from ..deploy.connection import Connection

    return Connection(args.superlink, None if args.insecure else args.ca)


def run(args: argparse.Namespace) -> int:
    """Dispatch ``fedpriv deploy <command>``; ConfigError for bad input, including a file
    or folder that cannot be read or written (named, with what to do)."""
    try:
        return COMMANDS[args.deploy_command](args)
    except OSError as exc:
        what = f" {exc.filename}" if exc.filename else ""
        raise ConfigError(f"fedpriv deploy {args.deploy_command}: cannot use{what} "
                          f"({exc.strerror or exc}); check that the path is a folder or file "
                          "you can read and write, not a file where a folder is expected "
                          "(or the reverse), and run the command again.") from None


def _certs(args: argparse.Namespace) -> int:
    from ..deploy.credentials import certificates_message, write_certificates

    made = write_certificates(args.folder, args.host, args.days)
    print(certificates_message(made, args.host))
    return 0


def _keys(args: argparse.Namespace) -> int:
    from ..deploy.credentials import write_node_keys

    paths = write_node_keys(args.folder, args.nodes, certs=args.certs)
    print(f"wrote {len(paths)} key pairs in {args.folder}: give supernode-I (private)"
          f"{' and supernode-I.crt' if args.certs else ''} to host I only; register the "
          ".pub files with `fedpriv deploy register`")
    if args.certs is None:
        print("note: no --certs, so no TLS client certificates: a SuperLink started with "
              "--certs admits only nodes that have one (mutual TLS). Run this again with "
              "--certs FOLDER where the CA's signing key is kept.")
    return 0


def _register(args: argparse.Namespace) -> int:
    from ..deploy import connection
    from ..deploy.credentials import read_node_key

    action = "ls" if args.ls else "unregister" if args.unregister else "register"
    if action != "ls" and not args.keys:
        raise ConfigError("fedpriv deploy register: give the .pub files to register (or "
                          "node ids with --unregister), or --ls to list.")
    if action == "register":
        for key in args.keys:
            read_node_key(key, "deploy register", private=False)
    return connection.register(_connection(args), args.keys, action)


def _superlink(args: argparse.Namespace) -> int:
    from ..deploy import superlink
    from ..deploy.credentials import Certificates

    if args.insecure == bool(args.certs):
        raise ConfigError("fedpriv deploy superlink: give --certs FOLDER (TLS and SuperNode "
                          "authentication), or --insecure for a loopback demo.")
    certs = Certificates.in_folder(args.certs).check() if args.certs else None
    for exposed in certs.exposed_signing_keys() if certs else []:
        print(f"note: the CA's signing key {exposed} is on the SuperLink's host; move it "
              "offline (it is needed only to issue a new server certificate, and whoever "
              "holds it can impersonate the SuperLink)")
    return superlink.serve_superlink(certs, args.state, args.host, args.port,
                                     auth=certs is not None, nodes=args.nodes,
                                     internal_port=args.internal_port,
                                     client_certs=not args.no_client_certs)


def _supernode(args: argparse.Namespace) -> int:
    from ..deploy import superlink, supernode
    from ..deploy.credentials import read_node_key

    if args.key is not None:
        read_node_key(args.key, "--key", private=True)
    if args.key is None and not args.insecure:
        print("note: no --key: the SuperLink admits this node only if it runs without "
              "SuperNode authentication")
    if not (math.isfinite(args.rejoin_wait) and args.rejoin_wait >= 0):
        raise ConfigError(f"--rejoin-wait {args.rejoin_wait}: give the seconds to keep "
                          "retrying, 0 or more (0: give up at once).")
    if not (math.isfinite(args.poll) and 0.01 <= args.poll <= 60):
        raise ConfigError(f"--poll {args.poll}: give the seconds between pulls while busy, "
                          "0.01 to 60.")
    if args.state_dir is not None and args.state_dir.exists() and \
            not args.state_dir.is_dir():
        raise ConfigError(f"--state-dir {str(args.state_dir)!r} is a file; give a folder "
                          "(it is made if missing).")
    allow = _allowed_apps(args)  # bad digests refused before anything starts
    cert = _client_cert(args)
    superlink.port_free("127.0.0.1", args.port, "--port")
    if not 0 <= args.partition_id < args.num_partitions:
        raise ConfigError(f"--partition-id {args.partition_id} must be in 0.."
                          f"{args.num_partitions - 1} (--num-partitions "
                          f"{args.num_partitions}).")
    config = _node_config(args)
    if allow is None:
        print("warning: --allow-any-app: this node runs whatever app the SuperLink sends, so "
              "the operator's code enforces every client-side defence (DP-SGD, the "
              "disclosure rule, the refusal of trap weights)")
    else:
        from ..deploy.app_pin import app_digest

        allow = list(dict.fromkeys([app_digest(), *allow]))
    return supernode.serve_supernode(_connection(args), config, args.key, args.port,
                                     rejoin_wait=args.rejoin_wait,
                                     warm=not args.clientapp_per_message, poll=args.poll,
                                     allow_apps=allow, client_cert=cert)


def _client_cert(args: argparse.Namespace) -> Path | None:
    """The node's TLS client certificate (``--client-cert``, else KEY.crt beside --key),
    checked against its key; None, with a note, when there is none."""
    from ..deploy.client_cert import context
    from ..deploy.credentials import client_certificate_path

    cert = args.client_cert
    if cert is None and args.key is not None and not args.insecure:
        beside = client_certificate_path(args.key)
        cert = beside if beside.is_file() else None
        if cert is None:
            print(f"note: no client certificate ({beside.name} beside --key): the "
                  "SuperLink's gateway refuses this node at the TLS handshake unless it runs "
                  "with --no-client-certs. Make one with `fedpriv deploy keys KEYS --nodes N "
                  "--certs CERTS`.")
    if cert is None:
        return None
    if args.insecure or args.key is None:
        raise ConfigError("--client-cert needs TLS (--ca) and the node's --key: the "
                          "certificate is issued for that key.")
    if not cert.is_file():
        raise ConfigError(f"--client-cert {str(cert)!r} is not a file; copy this node's "
                          "certificate (supernode-I.crt, made by `fedpriv deploy keys "
                          "--certs`) here.")
    context(cert, args.key, None)  # the certificate is this key's, or a clear error now
    return cert


def _allowed_apps(args: argparse.Namespace) -> list[str] | None:
    """The app digests given with --allow-app and --allow-app-file, checked (None:
    --allow-any-app); ConfigError for a bad one, or for pins the executor cannot keep."""
    from ..deploy.app_pin import check_digest, read_digest_file

    given = [check_digest(d, "--allow-app") for d in args.allow_app]
    for path in args.allow_app_file:
        given += read_digest_file(path)
    if args.allow_any_app:
        return None
    if args.clientapp_per_message:
        raise ConfigError(
            "--clientapp-per-message runs Flower's own flwr-clientapp, which cannot check "
            "which app it runs, so this node could not keep its pin (by default only this "
            "installation's fedpriv app"
            f"{', plus the --allow-app digests' if given else ''}). Drop "
            "--clientapp-per-message to run pinned apps in fedpriv's ClientApp worker, or "
            "add --allow-any-app to run whatever the SuperLink sends.")
    return given


def _node_config(args: argparse.Namespace) -> dict[str, str | int | bool]:
    """The SuperNode's node config: its partition, its own data and state, the host's
    datasets."""
    config: dict[str, str | int | bool] = {"partition-id": args.partition_id,
                                           "num-partitions": args.num_partitions}
    if args.data_path is not None:
        from tasks.local_data import describe

        print(f"own data: {describe(args.data_path)}")
        config["data-path"] = str(args.data_path.resolve())
    if args.state_dir is not None:  # the DP ledger and the CVAE: this user's only
        import os

        if args.state_dir.is_symlink():
            raise ConfigError(f"--state-dir {str(args.state_dir)!r} is a symbolic link; give "
                              "a real folder of your own (it is made if missing), so that no "
                              "one else controls where the DP ledger is kept.")
        args.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if args.state_dir.stat().st_uid != os.geteuid():
            raise ConfigError(f"--state-dir {str(args.state_dir)!r} belongs to another user, "
                              "who could read or replace the DP ledger kept there; give a "
                              "folder of your own (it is made if missing).")
        args.state_dir.chmod(0o700)
        config["state-dir"] = str(args.state_dir.resolve())
    if args.accept_trap_weights:
        config["accept-trap-weights"] = True
    config.update(_host_data(args))
    return config


def _run(args: argparse.Namespace) -> int:
    from server.checkpoint import resumable

    from ..api import resume_deployed, run_deployed
    from ..configs import resolve
    from ..deploy import connection

    t0 = time.perf_counter()
    link = _connection(args)
    if args.resume is not None:  # this host's inputs first, then the SuperLink
        given = [f for f, v in (("--config", args.config), ("--set", args.set),
                                ("--name", args.name)) if v]
        if given:
            raise ConfigError(f"fedpriv deploy run --resume continues a run with its own "
                              f"config; drop {', '.join(given)}.")
        resumable(args.resume)
        connection.refuse_public_port(link)  # before the pre-flight check
        result = resume_deployed(args.resume, link, verbose=args.verbose)
    else:
        cfg = resolve(args.config, args.set)
        connection.refuse_public_port(link)
        result = run_deployed(cfg, link, name=args.name, verbose=args.verbose)
    if result.ok:
        # the ServerApp named the folder (on the SuperLink's host) when the run started
        print(f"finished in {time.perf_counter() - t0:.1f} s")
        return 0
    print(f"run {result.status}: {result.error}\n  partial results and the full log "
          f"(flwr.log) are in {result.run_dir}")
    return 1


def _app_digest(args: argparse.Namespace) -> int:
    """Print this installation's app digest: what SuperNodes on this code pin."""
    from ..deploy.app_pin import app_digest

    print(app_digest())
    return 0


COMMANDS = {"certs": _certs, "keys": _keys, "register": _register, "superlink": _superlink,
            "supernode": _supernode, "run": _run, "app-digest": _app_digest}


def _host_data(args: argparse.Namespace) -> dict[str, str | int | bool]:
    """The node config keys for where this host's shared datasets live and whether it may
    download: the host's decision only (clients.host_config), checked here first."""
    out: dict[str, str | int | bool] = {}
    if args.download and args.data_dir is None:
        raise ConfigError("--download needs --data-dir: the folder a missing dataset is "
                          "downloaded into. Give e.g. --data-dir ~/data --download.")
    if args.data_dir is not None:
        folder = args.data_dir.expanduser()
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--data-dir {str(folder)!r} is a file; give the folder that "
                              "holds the datasets (torchvision's layout).")
        if not folder.exists() and not args.download:
            raise ConfigError(f"--data-dir {str(folder)!r} does not exist; create it with the "
                              "datasets in it, or add --download to let this node fetch them.")
        out["data-dir"] = str(folder.resolve())
    if args.download:
        out["download"] = True
    if args.backbone_weights is not None:
        weights = args.backbone_weights.expanduser()
        if not weights.is_file():
            raise ConfigError(f"--backbone-weights {str(weights)!r} is not a file; give this "
                              "host's copy of the run's weights file.")
        out["backbone-weights"] = str(weights.resolve())
    return out


