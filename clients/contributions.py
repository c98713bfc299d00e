"""A client's record of the models it has answered under secure aggregation, so that an
active server cannot difference two sums that hold the same update.

The adversary: a server that picks the cohorts (it samples them) and sends the same model
to overlapping cohorts, in one run or over restarts, then computes e.g.
(S01 + S12 - S02) / 2 = u1. Secure aggregation hides each update in its round's sum; it
says nothing about sums across rounds. The defence (the client's own, enforced before it
trains): **one model, one cohort**. A model is known by the SHA-256 of its weights and,
for a model within ``contribution-radius`` (relative L2) of one answered before, by a
secret sketch of it (a CountSketch with a hash only this client knows, so the server
cannot aim a perturbation at what the sketch ignores). A second request for the same
model is answered only for the same cohort, and then with the same update (its training
draws from the secret seed kept with the entry: batch order, dropout, DP noise and
SecAgg+'s rounding), so a redone round reveals nothing new; for any other cohort it is
refused.

The cohort is what the client can check: under HE the partitions the server declares,
bound into the signed update and checked by the decrypting client as exact (no subset is
decrypted); under SecAgg+ its masking neighbours (the whole cohort when
``secagg-num-shares`` >= the cohort), narrowed at the unmask stage to the clients the
server says survived (a second unmasking must name the same survivors).

Where it lives: on a real SuperNode in ``<state-dir>/contributions/partition-<id>.json``
(0600), for the host across runs and restarts; in simulation in the client's
``Context.state`` (kept with its DP ledger, so across the run and its resumes). A
SuperNode without ``--state-dir`` keeps it in memory only.

What remains (docs/PRIVACY.md): a server that moves the model by more than the radius
between requests gets two updates from nearby models, whose difference is close to the
update (distributed DP, :mod:`privacy.dp.distributed`, is the answer); under SecAgg+
without a signed roster the server can fabricate neighbours.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context

from tasks.config import validate
from tasks.messages import STATE_DIR

RECORD = "fedpriv.contributions"  # Context.state record (simulation, or no state-dir)
SKETCH = 256  # buckets of the secret sketch


class ContributionRefused(ValueError):
    """The client has answered this model (or one within the radius) for another cohort."""


@dataclass
class Entry:
    """One answered model: how to recognise it, for whom, and how to answer it again."""

    digest: str
    sketch: list[float]
    norm: float
    protocol: str
    cohort: list[int]
    seed: int
    revealed: list[int] | None = None  # SecAgg+: the survivors named at the unmask stage
    rounds: list[int] = field(default_factory=list)
    context: str = ""  # the digest of the training's other inputs (request_context)


def request_context(round_config: Mapping[str, Any], run_config: Mapping[str, Any]) -> str:
    """The digest of everything but the model a client's update depends on: the round's
    config (its round number, proximal term, clipping norm...) and the run's sections
    that shape training (not where results go)."""
    cfg = validate(dict(run_config))
    shaping = {name: asdict(getattr(cfg, name)) for name in
               ("data", "federation", "privacy", "secagg", "embeddings", "training",
                "anonymization", "leakage")}
    text = json.dumps({"round": {str(k): str(v) for k, v in round_config.items()},
                       "run": shaping}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def model_digest(arrays: Iterable[np.ndarray]) -> str:
    """SHA-256 over every array's dtype, shape and bytes, in order."""
    h = hashlib.sha256(b"fedpriv-model\0")
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _flat(arrays: Iterable[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


class ContributionRecord:
    """The record of one client (a partition on a host, or a simulated client)."""

    def __init__(self, secret: int, entries: list[Entry], radius: float) -> None:
        self.secret, self.entries, self.radius = secret, entries, radius

    # ---------------------------------------------------------------- recognising models

    def sketch(self, flat: np.ndarray) -> np.ndarray:
        """A CountSketch of the flat model under this client's secret hash and signs
        (Charikar, Chen & Farach-Colton 2002): ||sketch(x) - sketch(y)||^2 estimates
        ||x - y||^2 without bias, within about sqrt(2 / SKETCH) = 9% relative, for any
        difference chosen without the secret."""
        rng = np.random.default_rng(self.secret)
        bucket = rng.integers(0, SKETCH, flat.size)
        sign = rng.integers(0, 2, flat.size) * 2.0 - 1.0
        return np.bincount(bucket, weights=sign * flat, minlength=SKETCH)

    def find(self, arrays: list[np.ndarray]) -> tuple[Entry | None, str, np.ndarray, float]:
        """The entry for this model (same digest, or within the radius), its digest,
        sketch and norm."""
        digest = model_digest(arrays)
        flat = _flat(arrays)
        sk, norm = self.sketch(flat), float(np.linalg.norm(flat))
        for e in self.entries:
            if e.digest == digest:
                return e, digest, sk, norm
        for e in self.entries:
            scale = max(norm, e.norm, 1e-12)
            if np.linalg.norm(sk - np.asarray(e.sketch)) <= self.radius * scale:
                return e, digest, sk, norm
        return None, digest, sk, norm

    # ---------------------------------------------------------------- the rule

    def claim(self, arrays: list[np.ndarray], cohort: Iterable[int], protocol: str,
              server_round: int, context: str = "", new_seed: int | None = None) -> Entry:
        """The entry under which this client may answer ``arrays`` for ``cohort`` (its
        seed is the training's): a new one, or exactly the same request again (the same
        model, cohort, protocol and ``context``, the digest of every other input of the
        training: the round's config and the run's); refuse otherwise, and always for a
        model only within the radius of one answered (a near model is never replayed:
        its update would differ). A new entry's seed is ``new_seed`` (simulation: the
        run's public seed for the round, so a simulated run stays reproducible) or fresh
        secret randomness."""
        cohort = sorted({int(c) for c in cohort})
        entry, digest, sk, norm = self.find(arrays)
        if entry is None:
            entry = Entry(digest, [float(v) for v in sk], norm, protocol, cohort,
                          secrets.randbits(62) if new_seed is None else int(new_seed),
                          context=context)
            self.entries.append(entry)
        else:
            allowed = entry.revealed if entry.revealed is not None else entry.cohort
            why = None
            if entry.digest != digest:
                why = (f"a model within {self.radius:g} (relative L2) of this one, for the "
                       f"cohort {allowed}; a near model is never answered again")
            elif entry.protocol != protocol or cohort != allowed:
                why = f"this model for the cohort {allowed} under {entry.protocol}"
            elif entry.context != context:
                why = ("this model for this cohort, with other round or run settings (a "
                       "replay answers only the identical request, so that it sends the "
                       "identical update)")
            if why is not None:
                raise ContributionRefused(
                    f"this client already answered {why} (round(s) {entry.rounds}); it "
                    "answers a model once, for one cohort, so that no two sums differ by "
                    f"its update. Asked again for {cohort} in round {server_round} under "
                    f"{protocol}: refused, nothing trained.")
        entry.rounds.append(int(server_round))
        return entry

    @staticmethod
    def check_replay(entry: Entry, declined: bool) -> None:
        """A replay must send what the first answer sent: a client that trained then and
        would decline now (its DP budget spent since) refuses instead, or the two sums
        would differ by its update."""
        if declined and len(entry.rounds) > 1:
            raise ContributionRefused(
                "this client answered this request before with an update and would now "
                "decline (its budget or screen): it refuses, so that the two sums do not "
                "differ by its update")

    def reveal(self, entry_digest: str, survivors: Iterable[int]) -> None:
        """SecAgg+'s unmask stage: the server names the survivors whose masks it will
        remove. A first unmasking narrows the entry to them; a later one must name the
        same set."""
        survivors = sorted({int(s) for s in survivors})
        entry = next((e for e in self.entries if e.digest == entry_digest), None)
        if entry is None:
            raise ContributionRefused("an unmask request for a contribution this client has "
                                      "no record of")
        if not set(survivors) <= set(entry.cohort):
            raise ContributionRefused(f"the survivors named {survivors} are not all in the "
                                      f"cohort {entry.cohort} this update was masked for")
        if entry.revealed is not None and survivors != entry.revealed:
            raise ContributionRefused(
                f"this update was already unmasked in a sum of {entry.revealed}; refusing "
                f"to help unmask it in a sum of {survivors} (two different sums of one "
                "update differ by the others' updates alone)")
        entry.revealed = survivors

    # ---------------------------------------------------------------- storage

    def to_json(self) -> str:
        return json.dumps({"secret": self.secret, "entries": [asdict(e) for e in self.entries]})

    @classmethod
    def from_json(cls, text: str, radius: float) -> ContributionRecord:
        data = json.loads(text)
        return cls(int(data["secret"]), [Entry(**e) for e in data["entries"]], radius)

    @classmethod
    def new(cls, radius: float) -> ContributionRecord:
        return cls(secrets.randbits(62), [], radius)


DEFAULT_RADIUS = 1e-4
OFF = ("0", "false", "no", "off")


def settings(run_record: bool, run_radius: float, node_config: Mapping[str, Any],
             simulated: bool) -> tuple[bool, float]:
    """(record on?, radius) for this client. In simulation the run config decides. On a
    real SuperNode the host does: the record is on unless its node config says
    ``contribution-record=false``, and the radius is at least the host's
    ``contribution-radius`` (default 1e-4), whatever the operator's run config says (it is
    a defence against the operator)."""
    if simulated:
        return run_record, run_radius
    own = node_config.get("contribution-record")
    on = True if own is None else str(own).strip().lower() not in OFF
    try:
        floor = float(node_config.get("contribution-radius", DEFAULT_RADIUS))
    except (TypeError, ValueError):
        raise ValueError(f"node config contribution-radius = "
                         f"{node_config.get('contribution-radius')!r} is not a number; give "
                         "e.g. contribution-radius=1e-4") from None
    return on, max(run_radius, floor)


def record_path(node_config: Mapping[str, Any], simulated: bool) -> Path | None:
    """A real SuperNode's record file (None in simulation, or without a state-dir)."""
    folder = node_config.get(STATE_DIR)
    if simulated or not folder:
        return None
    return Path(str(folder)) / "contributions" / \
        f"partition-{int(node_config['partition-id'])}.json"


def load(context: Context, radius: float, simulated: bool) -> ContributionRecord:
    path = record_path(context.node_config, simulated)
    if path is not None:
        if path.exists():
            try:
                return ContributionRecord.from_json(path.read_text(), radius)
            except (ValueError, KeyError, TypeError) as exc:
                raise ContributionRefused(
                    f"this client's contribution record {path} is unreadable ({exc}); it "
                    "cannot tell which models it has answered, so it answers none. Restore "
                    "the file from a backup (deleting it forgets every past contribution, "
                    "which lets a server difference them).") from None
        return ContributionRecord.new(radius)
    record = context.state.config_records.get(RECORD)
    if record is None:
        return ContributionRecord.new(radius)
    return ContributionRecord.from_json(str(record["json"]), radius)


def save(context: Context, record: ContributionRecord, simulated: bool) -> None:
    """Write the record where :func:`load` reads it, before the update leaves the client."""
    path = record_path(context.node_config, simulated)
    text = record.to_json()
    if path is None:
        context.state[RECORD] = ConfigRecord({"json": text})
        return
    _private_folder(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # it holds a secret: a new file of this user's only, never through a planted link
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _private_folder(folder: Path) -> None:
    """The record's folder, made this user's only (0700)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.is_symlink():
        raise ContributionRefused(f"the contribution record's folder {folder} is a symbolic "
                                  "link; give the node a state-dir of its own")
    os.chmod(folder, 0o700)


@contextmanager
def held(context: Context, radius: float, simulated: bool) -> Iterator[ContributionRecord]:
    """The record, loaded under an exclusive lock (two runs on one SuperNode cannot both
    claim a model) and saved when the block ends without an error."""
    path = record_path(context.node_config, simulated)
    if path is None:
        record = load(context, radius, simulated)
        yield record
        save(context, record, simulated)
        return
    _private_folder(path.parent)
    fd = os.open(path.with_name(path.name + ".lock"),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        record = load(context, radius, simulated)
        yield record
        save(context, record, simulated)
    finally:
        os.close(fd)  # releases the lock
