"""The ``fedpriv deploy`` subcommands: certs, keys, register, superlink, supernode, run."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tasks.config import ConfigError

from .configs import PRESETS

EXAMPLE = """\
three hosts (server.lab, and hospitals a and b), the server holding the CA:
  server$ fedpriv deploy certs certs --host server.lab
  server$ fedpriv deploy keys keys --nodes 2
  server$ fedpriv deploy superlink --certs certs --state state --host 0.0.0.0 --nodes 2
  server$ fedpriv deploy register keys/supernode-0.pub keys/supernode-1.pub \\
              --superlink 127.0.0.1:9092 --ca certs/ca.crt
  (copy certs/ca.crt and keys/supernode-I to host I)
  a$      fedpriv deploy supernode --superlink server.lab:9092 --ca ca.crt \\
              --key supernode-0 --partition-id 0 --num-partitions 2
  b$      fedpriv deploy supernode --superlink server.lab:9092 --ca ca.crt \\
              --key supernode-1 --partition-id 1 --num-partitions 2
  server$ fedpriv deploy run --superlink 127.0.0.1:9092 --ca certs/ca.crt \\
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

    certs = cmds.add_parser("certs", help="make a CA and the SuperLink's TLS certificate")
    certs.add_argument("folder", type=Path, help="where to write ca.crt, server.pem, server.key")
    certs.add_argument("--host", action="append", required=True, metavar="NAME_OR_IP",
                       help="a name or address SuperNodes use to reach the SuperLink "
                            "(repeatable); 127.0.0.1 and localhost are always added")
    certs.add_argument("--days", type=int, default=365, help="validity (default 365)")

    keys = cmds.add_parser("keys", help="make SuperNode key pairs (ECDSA P-384, OpenSSH)")
    keys.add_argument("folder", type=Path)
    keys.add_argument("--nodes", type=int, required=True, metavar="N")

    def connection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--superlink", required=True, metavar="HOST:PORT",
                       help="the SuperLink's address")
        trust = p.add_mutually_exclusive_group(required=True)
        trust.add_argument("--ca", type=Path, help="the deployment's ca.crt")
        trust.add_argument("--insecure", action="store_true",
                           help="no TLS (loopback demos only)")

    reg = cmds.add_parser("register", help="register SuperNode public keys with the "
                                           "SuperLink (flwr supernode register)")
    reg.add_argument("keys", type=Path, nargs="*", metavar="KEY.pub")
    reg.add_argument("--ls", action="store_true", help="list the registered SuperNodes")
    reg.add_argument("--unregister", action="store_true",
                     help="unregister instead (give node ids, as `--ls` prints them)")
    connection(reg)

    link = cmds.add_parser("superlink", help="start a SuperLink (foreground; Ctrl-C stops it)")
    link.add_argument("--certs", type=Path, help="folder made by `fedpriv deploy certs`")
    link.add_argument("--state", type=Path, required=True,
                      help="folder for the SQLite state (registrations, runs)")
    link.add_argument("--host", default="127.0.0.1",
                      help="address to listen on (0.0.0.0: every interface; default loopback)")
    link.add_argument("--port", type=int, default=9092)
    link.add_argument("--nodes", type=int, default=0, help="for the printed commands")
    link.add_argument("--insecure", action="store_true",
                      help="no TLS and no authentication: loopback demos only")

    node = cmds.add_parser("supernode", help="start a SuperNode for this host (foreground)")
    connection(node)
    node.add_argument("--key", type=Path, help="this host's private key (with authentication)")
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
    node.add_argument("--port", type=int, default=9094,
                      help="local port of this SuperNode's ClientApp API (default 9094)")
    node.add_argument("--rejoin-wait", type=float, default=90.0, metavar="SECONDS",
                      help="when the SuperLink refuses to activate this node (its previous "
                           "session still counts as online for up to 60 s after a crash, "
                           "or its key is not registered), keep retrying this long "
                           "(default 90; 0: give up at once)")

    run = cmds.add_parser("run", help="submit a run to the deployment and wait for it "
                                      "(run it on the SuperLink's host: the results folder "
                                      "is written there)")
    connection(run)
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
    from .deploy import Connection

    return Connection(args.superlink, None if args.insecure else args.ca)


def run(args: argparse.Namespace) -> int:
    """Dispatch ``fedpriv deploy <command>``; ConfigError for bad input."""
    from . import deploy
    from .credentials import Certificates, write_certificates, write_node_keys

    cmd = args.deploy_command
    if cmd == "certs":
        made = write_certificates(args.folder, args.host, args.days)
        print(f"wrote {made.ca} (give it to every SuperNode host), {made.cert} and {made.key} "
              f"(keep them on the SuperLink's host); valid for {', '.join(args.host)}, "
              "127.0.0.1 and localhost")
        return 0
    if cmd == "keys":
        paths = write_node_keys(args.folder, args.nodes)
        print(f"wrote {len(paths)} key pairs in {args.folder}: give supernode-I (private) to "
              "host I only; register the .pub files with `fedpriv deploy register`")
        return 0
    if cmd == "register":
        action = "ls" if args.ls else "unregister" if args.unregister else "register"
        if action != "ls" and not args.keys:
            raise ConfigError("fedpriv deploy register: give the .pub files to register (or "
                              "node ids with --unregister), or --ls to list.")
        return deploy.register(_connection(args), args.keys, action)
    if cmd == "superlink":
        if args.insecure == bool(args.certs):
            raise ConfigError("fedpriv deploy superlink: give --certs FOLDER (TLS and SuperNode "
                              "authentication), or --insecure for a loopback demo.")
        certs = Certificates.in_folder(args.certs) if args.certs else None
        return deploy.serve_superlink(certs, args.state, args.host, args.port,
                                      auth=certs is not None, nodes=args.nodes)
    if cmd == "supernode":
        if args.key is None and not args.insecure:
            print("note: no --key: the SuperLink admits this node only if it runs without "
                  "SuperNode authentication")
        if not 0 <= args.partition_id < args.num_partitions:
            raise ConfigError(f"--partition-id {args.partition_id} must be in 0.."
                              f"{args.num_partitions - 1} (--num-partitions "
                              f"{args.num_partitions}).")
        config: dict[str, str | int] = {"partition-id": args.partition_id,
                                        "num-partitions": args.num_partitions}
        if args.data_path is not None:
            from tasks.local_data import describe

            print(f"own data: {describe(args.data_path)}")
            config["data-path"] = str(args.data_path.resolve())
        if args.state_dir is not None:
            args.state_dir.mkdir(parents=True, exist_ok=True)
            config["state-dir"] = str(args.state_dir.resolve())
        return deploy.serve_supernode(_connection(args), config, args.key, args.port,
                                      rejoin_wait=args.rejoin_wait)
    if cmd == "run":
        from .api import resume_deployed, run_deployed
        from .configs import resolve

        t0 = time.perf_counter()
        if args.resume is not None:
            given = [f for f, v in (("--config", args.config), ("--set", args.set),
                                    ("--name", args.name)) if v]
            if given:
                raise ConfigError(f"fedpriv deploy run --resume continues a run with its own "
                                  f"config; drop {', '.join(given)}.")
            result = resume_deployed(args.resume, _connection(args), verbose=args.verbose)
        else:
            result = run_deployed(resolve(args.config, args.set), _connection(args),
                                  name=args.name, verbose=args.verbose)
        if result.ok:
            print(f"finished in {time.perf_counter() - t0:.1f} s · results: {result.run_dir}")
            return 0
        print(f"run {result.status}: {result.error}\n  partial results and the full log "
              f"(flwr.log) are in {result.run_dir}")
        return 1
    raise AssertionError(cmd)
