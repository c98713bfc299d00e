"""A seeded fuzz of bad input through the real CLI entry point, in-process: hundreds of
bad ``--set`` values, preset files and sweep files. Each must end in exit code 2 with a
one-paragraph message naming what was wrong — never a traceback, never any work.

Values are drawn per key type from values no key of that type accepts, plus values
just outside each key's range (found by probing the key's own check, so that the
fuzz stays bad as ranges change); files mix those with structural damage.
"""

from __future__ import annotations

import json
import random
import signal

import pytest

import experiments.api
from experiments.cli import main as cli
from experiments.cli.keys import keys_reference
from tasks.config import KEYS as SCHEMA
from tasks.config.keys import INT_MAX, _interval

SEED = 20261122
CONTROL = ["a\nb", "tab\there", "esc\x1b[31m", "nul\x00", "del\x7f"]
NEVER = {  # values no key of the type accepts, as typed on a command line
    int: ["abc", "1.5", "nan", "inf", "-inf", str(2**64), str(-(2**63) - 5), "true", "[1, 2]",
          "{a = 1}", "1979-05-27", "'7'"],
    float: ["abc", "nan", "inf", "-inf", "1e999", "true", "[0.1]", "{a = 1}", "'0.5'",
            "1979-05-27T07:32:00"],
    bool: ["maybe", "2", "0.5", "'yes'", "[true]", "nan", "1979-05-27"],
    str: CONTROL,
}
PROBES = [-(2**62), -1e12, -1.0, -0.5, 0, 0.5, 1, 2, 1e12, float(INT_MAX)]


def _out_of_range(key) -> list[str]:
    """Numbers of the key's type that its own check refuses (its range's outside)."""
    out = []
    for p in PROBES:
        value = int(p) if key.type is int else float(p)
        if key.check is not None and key.check(value) is not None:
            out.append(repr(value))
    return out


def _bad_sets(rng: random.Random) -> list[tuple[list[str], str]]:
    """(--set arguments, the key the error must name)."""
    cases = []
    for key in SCHEMA.values():
        values = list(NEVER[key.type])
        if key.type in (int, float):
            values += _out_of_range(key)
        if key.choices:
            values += ["not-a-choice", "''", key.choices[0].upper() + "x"]
        for value in rng.sample(values, min(4, len(values))):
            cases.append(([f"{key.name}={value}"], key.name))
    names = list(SCHEMA)
    for _ in range(40):  # a bad key among good ones, in any order
        key = SCHEMA[rng.choice(names)]
        good = [f"{k}={_toml(SCHEMA[k].default)}" for k in rng.sample(names, 3) if k != key.name]
        bad = f"{key.name}={rng.choice(NEVER[key.type])}"
        args = good + [bad]
        rng.shuffle(args)
        cases.append((args, key.name))
    for name in rng.sample(names, 15):  # typos and unknown keys
        typo = name[:-1] if rng.random() < 0.5 else name + "s"
        if typo not in SCHEMA:
            cases.append(([f"{typo}=1"], typo))
    for text in ["num-clients", "=5", "num clients=5", " = ", "seed==3"]:
        cases.append(([text], text.split("=")[0].strip() or "key=value"))
    return cases


def _toml(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if value else "''"
    return repr(value)


@pytest.fixture
def guarded(monkeypatch):
    """Reaching a run means validation let a bad input through: fail loudly instead."""
    def reached(*a, **k):
        raise AssertionError("a bad input reached run_config: validation let it through")

    monkeypatch.setattr(experiments.api, "run_config", reached)
    monkeypatch.setattr(experiments.api, "resume", reached)
    saved = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, saved)


def _refused(capsys, argv: list[str], names: str) -> None:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    assert "Traceback" not in out + err, (argv, err)
    assert err.startswith("fedpriv: error: "), (argv, err)
    assert names.lower() in err.lower(), (argv, names, err)


def test_hundreds_of_bad_set_values_are_refused_with_the_key_named(capsys, guarded):
    cases = _bad_sets(random.Random(SEED))
    assert len(cases) > 300
    for args, name in cases:
        argv = ["run"]
        for a in args:
            argv += ["--set", a]
        _refused(capsys, argv, name)


def test_bad_preset_files_are_refused_with_the_key_or_file_named(tmp_path, capsys, guarded):
    rng = random.Random(SEED + 1)
    keys = list(SCHEMA.values())
    for i in range(60):
        path = tmp_path / f"preset{i}.toml"
        kind = i % 6
        key = rng.choice(keys)
        if kind == 0:  # a value of the wrong type, written as TOML
            path.write_text(f"{key.name} = {json.dumps(rng.choice(NEVER[key.type][:4]))}\n"
                            if key.type is not str else f"{key.name} = 7\n")
            name = key.name
        elif kind == 1:  # a table or an array of tables
            path.write_text(f"[{key.group}]\n{key.name} = 1\n" if rng.random() < 0.5
                            else f"[[{key.name}]]\nx = 1\n")
            name = str(path)
        elif kind == 2:  # not TOML
            path.write_text(rng.choice(["num-clients = ", "= 3", "[fixed", "a = 'b",
                                        "x = 1\nx = 2\n", "seed = 0x\n"]))
            name = str(path)
        elif kind == 3:  # not UTF-8, or binary
            path.write_bytes(bytes(rng.randrange(128, 256) for _ in range(rng.randint(1, 64))))
            name = str(path)
        elif kind == 4:  # a control character in a text key
            text = next(k for k in rng.sample(keys, len(keys)) if k.type is str)
            path.write_text(f"{text.name} = {json.dumps(rng.choice(CONTROL))}\n")
            name = text.name
        else:  # unknown key
            path.write_text(f"{key.name}-typo = 1\n")
            name = f"{key.name}-typo"
        _refused(capsys, ["run", "--config", str(path)], name)


def test_bad_sweep_files_are_refused_before_any_cell_runs(tmp_path, capsys, guarded):
    rng = random.Random(SEED + 2)
    keys = [k for k in SCHEMA.values() if k.type is not str]
    bodies = []
    for _ in range(50):
        key = rng.choice(keys)
        bad = rng.choice(NEVER[key.type][:4])
        bodies += [
            (f"[grid]\n{key.name} = [{SCHEMA[key.name].default!r}, {bad!r}]\n".replace(
                "True", "true").replace("False", "false"), key.name),
            (f"[fixed]\n{key.name} = {bad!r}\n[grid]\nseed = [1, 2]\n", key.name),
        ]
    bodies += [
        ("[grid]\nseed = 3\n", "non-empty lists"),
        ("[grid]\nseed = []\n", "non-empty lists"),
        ("fixed = 3\n[grid]\nseed = [1]\n", "fixed must be a table"),
        ("cells = 'x'\n", "cells must be a list"),
        ("[[cells]]\n", "[[cells]] entries"),
        ("name = 'x'\n", "give a [grid]"),
        ("[other]\nseed = 1\n", "unknown top-level"),
        ("seeds = 'abc'\n[grid]\nseed = [1]\n", "seeds"),
        ("[grid]\n" + "\n".join(f"seed{n} = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]" for n in range(7)),
         "cells"),
        ("\xff\xfe", "UTF-8"),
    ]
    for i, (body, name) in enumerate(bodies):
        path = tmp_path / f"sweep{i}.toml"
        path.write_bytes(body.encode("latin1") if body.startswith("\xff") else body.encode())
        _refused(capsys, ["sweep", str(path), "--dry-run"], name)


def test_open_ended_ranges_read_as_excluding_infinity():
    # `inf` itself is refused (values must be finite), so a range never ends in "inf]"
    assert _interval(0, None, True, False) == "(0, inf)"
    assert _interval(1, None, False, False) == "[1, inf)"
    assert _interval(0, 1, False, True) == "[0, 1)"
    assert "inf]" not in keys_reference()


def test_bad_deploy_inputs_are_refused_before_any_process_starts(capsys, guarded, tmp_path,
                                                                 monkeypatch):
    import experiments.deploy.supernode

    def started(*a, **k):
        raise AssertionError("a bad input reached a Flower process")

    monkeypatch.setattr(experiments.deploy.supernode, "serve_supernode", started)
    monkeypatch.setattr(experiments.api, "_submit", started)
    node = ["deploy", "supernode", "--superlink", "127.0.0.1:9092", "--insecure",
            "--partition-id", "0", "--num-partitions", "2"]
    _refused(capsys, [*node, "--data-path", str(tmp_path / "absent")], "does not exist")
    (tmp_path / "d" / "cats").mkdir(parents=True)
    _refused(capsys, [*node, "--data-path", str(tmp_path / "d")], "named by class index")
    _refused(capsys, ["deploy", "run", "--superlink", "127.0.0.1:9092", "--insecure",
                      "--resume", str(tmp_path), "--set", "num-clients=3"], "drop --set")
    _refused(capsys, ["deploy", "run", "--superlink", "127.0.0.1:9092", "--insecure",
                      "--resume", str(tmp_path)], "not a fedpriv run folder")


def test_damaged_deploy_files_and_flags_are_refused_in_one_paragraph(capsys, guarded, tmp_path,
                                                                     monkeypatch):
    """The cases a seeded fuzz from outside found as tracebacks or silent acceptances."""
    import numpy as np

    import experiments.deploy.superlink
    import experiments.deploy.supernode

    def started(*a, **k):
        raise AssertionError("a bad input reached a Flower process")

    monkeypatch.setattr(experiments.deploy.supernode, "serve_supernode", started)
    monkeypatch.setattr(experiments.deploy.superlink, "serve_superlink", started)
    afile = tmp_path / "afile"
    afile.write_text("x")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    certs = ["deploy", "certs", str(tmp_path / "certs")]
    for argv, why in (
            ([*certs, "--host", "server.lab", "--days", "10000000"], "--days 10000000"),
            ([*certs, "--host", "server.lab", "--days", "-5"], "--days -5"),
            ([*certs, "--host", "server.lab", "--days", "0"], "--days 0"),
            ([*certs, "--host", "999.1.1.1"], "looks like an IPv4 address"),
            (["deploy", "certs", str(afile), "--host", "server.lab"], "is a file"),
            (["deploy", "certs", "/proc/fedpriv-certs", "--host", "server.lab"], "/proc"),
            (["deploy", "keys", str(afile), "--nodes", "2"], "is a file"),
            (["deploy", "keys", "/proc/fedpriv-keys", "--nodes", "2"], "/proc")):
        _refused(capsys, argv, why)
    assert cli.main([*certs, "--host", "hôpital.lab"]) == 0  # an IDNA name, as its A-label
    capsys.readouterr()
    (tmp_path / "bad").mkdir()
    for name in ("ca.crt", "server.pem", "server.key"):
        (tmp_path / "bad" / name).write_text("garbage")
    _refused(capsys, ["deploy", "superlink", "--certs", str(tmp_path / "bad"), "--state",
                      str(tmp_path / "state")], "is not a PEM certificate")
    node = ["deploy", "supernode", "--superlink", "127.0.0.1:9092", "--partition-id", "0",
            "--num-partitions", "2"]
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 28, 28), np.uint8), y=np.zeros(0, int))
    np.savez(tmp_path / "mismatch.npz", x=np.zeros((5, 28, 28), np.uint8), y=np.zeros(3, int))
    np.savez(tmp_path / "labels.npz", x=np.zeros((3, 28, 28), np.uint8), y=np.array([-1, 0, 1]))
    good = (tmp_path / "empty.npz").read_bytes()
    (tmp_path / "truncated.npz").write_bytes(good[: len(good) // 2])
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    for extra, why in (
            (["--ca", str(garbage)], "is not a PEM certificate"),
            (["--insecure", "--state-dir", str(afile)], "is a file"),
            (["--insecure", "--rejoin-wait", "-1"], "--rejoin-wait -1"),
            (["--insecure", "--rejoin-wait", "nan"], "--rejoin-wait nan"),
            (["--insecure", "--poll", "0"], "--poll 0.0"),
            (["--insecure", "--poll", "inf"], "--poll inf"),
            (["--insecure", "--data-path", str(tmp_path / "empty.npz")], "N examples"),
            (["--insecure", "--data-path", str(tmp_path / "mismatch.npz")], "N examples"),
            (["--insecure", "--data-path", str(tmp_path / "labels.npz")], "class indices"),
            (["--insecure", "--data-path", str(tmp_path / "truncated.npz")], "not a readable"),
            (["--insecure", "--data-path", str(tmp_path / "junk.npz")], "not a readable")):
        _refused(capsys, [*node, *extra], why)
