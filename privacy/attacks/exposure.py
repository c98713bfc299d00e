"""The Secret Sharer's exposure of canaries in fedpriv's next-character models.

Carlini, Liu, Erlingsson, Kos & Song, "The Secret Sharer: Evaluating and Testing Unintended
Memorization in Neural Networks", USENIX Security 2019. A *canary* ``s[r] = prefix + r`` is a
line whose secret ``r`` is drawn at random from a randomness space ``R`` (here every string of
``length`` characters over ``alphabet``, ``|R| = |alphabet| ** length``) and inserted into the
training text. After training:

- the **log-perplexity** of a candidate (§3, Definition 1) is, in bits,
  ``Px(r) = -sum_j log2 Pr(r_j | prefix, r_1 .. r_{j-1})``, the model's probability of each
  secret character being its softmax over the whole vocabulary (not renormalised to the
  alphabet). Only the secret's positions are summed: the prefix's own terms are the same for
  every candidate and cancel out of every rank;
- the **rank** of the canary (Definition 3) is its position among all of ``R`` sorted by
  log-perplexity, and its **exposure** (Definition 4) is ``log2 |R| - log2 rank``: from
  ``log2 |R|`` bits (the most likely candidate of all) down to 0 (the least likely). A secret
  the model has not memorised has a uniformly random rank, so an expected exposure of about
  ``log2 e ~ 1.44`` bits;
- when ``R`` is too large to enumerate, §4.3 estimates it from a random sample of candidates:
  by the fraction of the sample below the canary (:func:`exposure_sampled`), or by fitting a
  skew-normal to the sample's log-perplexities and taking ``-log2 CDF(Px(canary))``
  (:func:`exposure_extrapolated`), which reaches beyond what the sample itself resolves.

The windows a model reads are formed exactly as :mod:`tasks.shakespeare` forms LEAF's
examples (:func:`windows_for`): 80 spaces in front of the line, one example per character,
the 80 characters before it. Nothing here imports :mod:`tasks` at import time; the vocabulary
defaults to LEAF's (``tasks.shakespeare.VOCABULARY``, imported when first needed).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import numpy as np
import torch
from scipy import special, stats
from torch import nn

# LEAF's character vocabulary (models/utils/language_utils.py: ALL_LETTERS), in its order;
# tasks.shakespeare encodes its text with it
LEAF_VOCABULARY = ("\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrs"
                   "tuvwxyz}")
DEFAULT_PREFIX = "my secret number is "
DIGITS = "0123456789"
SEQ_LEN = 80  # tasks.shakespeare.SEQ_LEN (LEAF's window), repeated to keep tasks unimported
BATCH = 1024  # windows per forward pass: a char-gru batch of 1024 holds ~40 MB of activations
_LN2 = math.log(2.0)


# --------------------------------------------------------------------------- canaries


@dataclass(frozen=True)
class Canary:
    """A canary line ``prefix + secret`` (Carlini et al. 2019, §3: the format ``s[r]`` with
    the randomness ``r = secret`` drawn from ``alphabet ** len(secret)``).

    ``prefix`` and ``alphabet`` are keyword-only (``Canary("1234", prefix="my pin is ")``), so
    that a prefix passed where the secret goes fails loudly. The line must have no run of two
    spaces: LEAF's corpus builder collapses them, and the windows measured would then not be
    the ones the model was trained on."""

    secret: str
    _: KW_ONLY
    prefix: str = DEFAULT_PREFIX
    alphabet: str = DIGITS

    def __post_init__(self) -> None:
        if not self.secret:
            raise ValueError("a canary needs a non-empty secret")
        if len(set(self.alphabet)) != len(self.alphabet) or not self.alphabet:
            raise ValueError(f"canary alphabet {self.alphabet!r} must be distinct characters")
        if not set(self.secret) <= set(self.alphabet):
            raise ValueError(f"canary secret {self.secret!r} has characters outside its "
                             f"alphabet {self.alphabet!r}")
        if "  " in self.text:
            raise ValueError(f"canary {self.text!r} has a run of spaces, which LEAF's corpus "
                             f"builder collapses: its measured windows would not be trained")

    @property
    def text(self) -> str:
        """The line inserted into a client's text (its corpus builder adds the line end)."""
        return self.prefix + self.secret

    @property
    def space(self) -> int:
        """``|R|``: how many secrets of this length the alphabet spells."""
        return len(self.alphabet) ** len(self.secret)


def secret_of_index(index: int, alphabet: str, length: int) -> str:
    """The ``index``-th secret in :func:`itertools.product` order (``alphabet`` as the digits
    of a base-``len(alphabet)`` number, most significant first)."""
    base = len(alphabet)
    chars = []
    for _ in range(length):
        index, d = divmod(index, base)
        chars.append(alphabet[d])
    if index:
        raise ValueError(f"index beyond the {base ** length} secrets of length {length}")
    return "".join(reversed(chars))


def index_of_secret(secret: str, alphabet: str) -> int:
    """Inverse of :func:`secret_of_index`: the secret's position in the enumeration order of
    :func:`enumerate_log_perplexities`."""
    index = 0
    for c in secret:
        index = index * len(alphabet) + alphabet.index(c)
    return index


def make_canaries(count: int, length: int, seed: int, prefix: str = DEFAULT_PREFIX,
                  alphabet: str = DIGITS) -> list[Canary]:
    """``count`` canaries with distinct secrets of ``length`` characters, drawn uniformly from
    ``alphabet ** length`` by ``numpy.random.default_rng(seed)``."""
    space = len(alphabet) ** length
    if count > space:
        raise ValueError(f"{count} distinct canaries asked of a space of {space} secrets")
    rng = np.random.default_rng(seed)
    if space <= 10**6:
        picks = rng.choice(space, size=count, replace=False)
        return [Canary(secret_of_index(int(i), alphabet, length), prefix=prefix,
                       alphabet=alphabet)
                for i in picks]
    seen: dict[str, None] = {}  # insertion-ordered: the draw order is the canaries' order
    while len(seen) < count:
        digits = rng.integers(0, len(alphabet), size=length)
        seen.setdefault("".join(alphabet[d] for d in digits), None)
    return [Canary(s, prefix=prefix, alphabet=alphabet) for s in seen]


# --------------------------------------------------------------------------- windows


def _vocabulary(vocabulary: str | None) -> str:
    return LEAF_VOCABULARY if vocabulary is None else vocabulary


def _encoder(vocabulary: str) -> np.ndarray:
    """A lookup table: Latin-1 character code -> vocabulary id (255 for none)."""
    table = np.full(256, 255, dtype=np.uint8)
    for i, c in enumerate(vocabulary):
        if ord(c) >= 256 or i >= 255:
            raise ValueError("the vocabulary must be at most 255 Latin-1 characters")
        table[ord(c)] = i
    return table


def encode_strict(text: str, vocabulary: str | None = None) -> np.ndarray:
    """``text`` as uint8 vocabulary ids; unlike :func:`tasks.shakespeare.encode` (which spells
    unknown characters as near ones), a character outside the vocabulary is an error: the model
    could not have been trained on the canary as written."""
    vocab = _vocabulary(vocabulary)
    bad = sorted(set(text) - set(vocab))
    if bad:
        raise ValueError(f"characters {bad!r} of {text!r} are not in the model's vocabulary")
    return _encoder(vocab)[np.frombuffer(text.encode("latin-1"), dtype=np.uint8)]


def windows_for(context: str, continuation: str, seq_len: int = SEQ_LEN,
                vocabulary: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The training examples of the line ``context + continuation`` that predict the
    continuation's characters, as :func:`tasks.shakespeare.build_corpus` forms them: the line
    with ``seq_len`` spaces in front, example ``j`` = the ``seq_len`` characters before
    ``continuation[j]``. Returns (windows ``(len(continuation), seq_len)`` uint8 ids, targets
    ``(len(continuation),)`` int64 ids)."""
    vocab = _vocabulary(vocabulary)
    ids = encode_strict(" " * seq_len + context + continuation, vocab)
    start = len(context)
    n = len(continuation)
    view = np.lib.stride_tricks.sliding_window_view(ids, seq_len)
    return view[start:start + n].copy(), ids[seq_len + start:].astype(np.int64)


# --------------------------------------------------------------------------- log-perplexity


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[torch.device]:
    """The model in eval mode without gradients; its mode restored after. Yields its device."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            param = next(model.parameters(), None)
            yield param.device if param is not None else torch.device("cpu")
    finally:
        model.train(was_training)


def next_log2_probs(model: nn.Module, windows: np.ndarray, columns: np.ndarray | None = None,
                    batch: int = BATCH) -> np.ndarray:
    """``log2 Pr(next character | window)`` for each row of ``windows`` ``(n, seq_len)``: the
    model's log-softmax over its whole vocabulary (float32, as the model computes it),
    returned as float64 ``(n, V)`` or only the ``columns`` asked for ``(n, len(columns))``."""
    cols = None if columns is None else torch.as_tensor(np.asarray(columns, dtype=np.int64))
    out = []
    with _evaluating(model) as device:
        for i in range(0, len(windows), batch):
            x = torch.as_tensor(np.asarray(windows[i:i + batch], dtype=np.int64), device=device)
            logp = torch.log_softmax(model(x).float(), dim=-1).cpu()
            out.append(logp if cols is None else logp[:, cols])
    if not out:
        return np.zeros((0, 0 if cols is None else len(cols)))
    return torch.cat(out).double().numpy() / _LN2


def _context_ids(prefix: str, seq_len: int, vocabulary: str) -> np.ndarray:
    return encode_strict(" " * seq_len + prefix, vocabulary)


def _windows_after(context: np.ndarray, heads: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows ``(n, seq_len)``: the last ``seq_len`` ids of ``context`` followed by each row
    of ``heads`` ``(n, k)`` (the secret characters already written)."""
    n, k = heads.shape
    tail = context[len(context) - max(seq_len - k, 0):]
    full = np.concatenate([np.broadcast_to(tail, (n, len(tail))), heads], axis=1)
    return np.ascontiguousarray(full[:, full.shape[1] - seq_len:], dtype=np.uint8)


def log_perplexity(model: nn.Module, prefix: str, secrets: Sequence[str],
                   seq_len: int = SEQ_LEN, vocabulary: str | None = None,
                   batch: int = BATCH) -> np.ndarray:
    """Carlini et al.'s log-perplexity (§3, Definition 1) of ``prefix + secret`` for each
    secret, restricted to the secret's characters: ``-sum_j log2 Pr(secret[j] | the window
    before it)``, float64 bits, in the order of ``secrets``.

    Each distinct window is computed once: a window depends only on ``secret[:j]``, and the
    candidates share their heads (all of them the first, empty one), so a batch of thousands
    of candidates costs one forward per distinct head, batched by ``batch``."""
    vocab = _vocabulary(vocabulary)
    context = _context_ids(prefix, seq_len, vocab)
    table = _encoder(vocab)
    heads: dict[str, int] = {}
    rows, cols, owner = [], [], []
    for i, secret in enumerate(secrets):
        encode_strict(secret, vocab)  # a clear error for characters outside the vocabulary
        for j, c in enumerate(secret):
            rows.append(heads.setdefault(secret[:j], len(heads)))
            cols.append(table[ord(c)])
            owner.append(i)
    windows = np.empty((len(heads), seq_len), dtype=np.uint8)
    for head, r in heads.items():
        ids = np.concatenate([context, table[np.frombuffer(head.encode("latin-1"), np.uint8)]])
        windows[r] = ids[len(ids) - seq_len:]
    logp = next_log2_probs(model, windows, batch=batch)
    if not rows:
        return np.zeros(len(secrets))
    terms = -logp[np.asarray(rows), np.asarray(cols)]
    return np.bincount(np.asarray(owner), weights=terms, minlength=len(secrets))


def enumerate_log_perplexities(model: nn.Module, prefix: str, alphabet: str, length: int,
                               seq_len: int = SEQ_LEN, vocabulary: str | None = None,
                               batch: int = BATCH) -> np.ndarray:
    """:func:`log_perplexity` of every one of the ``|alphabet| ** length`` secrets, in
    :func:`itertools.product` order (:func:`secret_of_index`), by expanding the trie of secrets
    level by level: level ``k`` runs one forward per head of ``k`` characters (``|A| ** k``
    of them) and extends every head's log-perplexity by each alphabet character's, so the whole
    space costs ``(|A| ** length - 1) / (|A| - 1)`` windows instead of
    ``length * |A| ** length``."""
    vocab = _vocabulary(vocabulary)
    context = _context_ids(prefix, seq_len, vocab)
    ids = encode_strict(alphabet, vocab).astype(np.int64)
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet {alphabet!r} repeats characters")
    heads = np.zeros((1, 0), dtype=np.uint8)
    lp = np.zeros(1)
    for _ in range(length):
        step = next_log2_probs(model, _windows_after(context, heads, seq_len), ids, batch)
        lp = (lp[:, None] - step).reshape(-1)
        heads = np.concatenate([np.repeat(heads, len(ids), axis=0),
                                np.tile(ids.astype(np.uint8), len(heads))[:, None]], axis=1)
    return lp


# --------------------------------------------------------------------------- exposure


def rank_of(canary_lp: float, candidates_lp: np.ndarray) -> int:
    """The canary's rank in ``R`` (Definition 3): ``1 + #{candidates with strictly lower
    log-perplexity}``. Ties go to the canary (it comes first among equals), so the exposure
    is the largest any tie-break gives: the conservative side for a privacy measurement."""
    return 1 + int(np.count_nonzero(np.asarray(candidates_lp, dtype=np.float64) < canary_lp))


def exposure_from_rank(canary_lp: float, candidates_lp: np.ndarray) -> float:
    """Exact exposure (Definition 4): ``log2 |R| - log2 rank``, where ``candidates_lp`` holds
    the log-perplexity of every member of ``R``, the canary's own included (so ``|R| =
    len(candidates_lp)``); the rank as :func:`rank_of`. From ``log2 |R|`` (the canary is the
    most likely candidate) to 0. A ``canary_lp`` found nowhere in ``candidates_lp`` is an
    error: the canary must be a member of the space it is ranked in."""
    lp = np.asarray(candidates_lp, dtype=np.float64)
    if not np.isclose(lp, canary_lp, rtol=1e-9, atol=1e-9).any():
        raise ValueError("the canary's log-perplexity is not among the candidates': pass all "
                         "of R, the canary included")
    return math.log2(len(lp)) - math.log2(rank_of(canary_lp, lp))


def exposure_sampled(canary_lp: float, sample_lp: np.ndarray, space: int) -> float:
    """Exposure estimated from a uniform sample of ``R`` (§4.3, by sampling): with ``k`` of the
    ``n`` sampled candidates strictly below the canary, the rank is estimated as ``1 +
    (|R| - 1) k / n`` (the other candidates below, as :func:`rank_of` counts them) and the
    exposure as ``log2 |R| - log2`` of that. It resolves exposures up to about ``log2 n``
    bits: with ``k = 0`` it gives ``log2 |R|``, the most the canary could have."""
    lp = np.asarray(sample_lp, dtype=np.float64)
    if len(lp) == 0:
        raise ValueError("an empty sample")
    below = np.count_nonzero(lp < canary_lp)
    return math.log2(space) - math.log2(1 + (space - 1) * below / len(lp))


def fit_skewnorm(sample_lp: np.ndarray) -> tuple[float, float, float]:
    """Maximum-likelihood skew-normal ``(a, loc, scale)`` of sampled log-perplexities (the
    distribution Carlini et al. found to fit them, §4.3)."""
    lp = np.asarray(sample_lp, dtype=np.float64)
    if len(lp) < 3 or np.ptp(lp) == 0:
        raise ValueError("a skew-normal needs at least 3 sampled log-perplexities, not all "
                         "equal")
    a, loc, scale = stats.skewnorm.fit(lp)
    return float(a), float(loc), float(scale)


def skewnorm_log2_cdf(x: float, a: float, loc: float, scale: float) -> float:
    """``log2`` of the skew-normal CDF at ``x``, finite far into the left tail: where scipy's
    CDF underflows (exposures beyond ~1000 bits) the tail's asymptotic form is used, ``2 Phi(z)``
    for ``a < 0`` and ``phi(z) phi(az) / (pi a (1 + a^2) z^2)`` for ``a > 0``."""
    z = (x - loc) / scale
    v = float(stats.skewnorm.logcdf(z, a))
    if math.isfinite(v) and v > -700:
        return v / _LN2
    if a == 0:
        v = float(special.log_ndtr(z))
    elif a < 0:
        v = _LN2 + float(special.log_ndtr(z))
    else:
        v = (-math.log(math.pi * a * (1 + a * a)) - 2 * math.log(abs(z))
             - (1 + a * a) * z * z / 2)
    return v / _LN2


def exposure_extrapolated(canary_lp: float, sample_lp: np.ndarray) -> float:
    """Exposure by distribution modelling (§4.3): fit a skew-normal to the log-perplexities of
    a uniform random sample of candidates and take ``-log2 CDF(canary_lp)``. Unlike
    :func:`exposure_sampled` it extrapolates beyond the sample's resolution, and unlike the
    exact exposure it is not bounded by ``log2 |R|``: a memorised canary far out in the
    tail gets the fit's tail, not a rank."""
    return -skewnorm_log2_cdf(canary_lp, *fit_skewnorm(sample_lp))


# --------------------------------------------------------------------------- measurement


def _sample_secrets(rng: np.random.Generator, alphabet: str, length: int, n: int) -> list[str]:
    digits = rng.integers(0, len(alphabet), size=(n, length))
    return ["".join(alphabet[d] for d in row) for row in digits]


def _estimates(lp: float, sample_lp: np.ndarray, space: int) -> dict[str, Any]:
    try:
        a, loc, scale = fit_skewnorm(sample_lp)
        fitted: dict[str, float] | None = {"a": a, "loc": loc, "scale": scale}
        extrapolated: float | None = -skewnorm_log2_cdf(lp, a, loc, scale)
    except ValueError:  # a degenerate sample (every candidate equally likely)
        fitted, extrapolated = None, None
    return {"exposure_extrapolated": extrapolated,
            "exposure_sampled": exposure_sampled(lp, sample_lp, space),
            "sample_below": int(np.count_nonzero(sample_lp < lp)),
            "skewnorm": fitted}


def measure(model: nn.Module, canaries: Sequence[Canary], samples: int = 500,
            exact_up_to: int = 10**4, seed: int = 0, seq_len: int = SEQ_LEN,
            vocabulary: str | None = None, batch: int = BATCH) -> list[dict[str, Any]]:
    """Each canary's exposure under ``model``, one JSON-ready dict per canary, in order.

    Canaries whose space is at most ``exact_up_to`` are ranked exactly against all of ``R``
    (one enumeration per distinct (prefix, alphabet, length), shared by the canaries of that
    format); the others against ``samples`` secrets drawn uniformly (with replacement) from
    ``R`` by ``numpy.random.default_rng(seed)``, the same sample for every canary of a format.
    Exact canaries get the §4.3 estimates too, from ``samples`` of their enumerated candidates
    drawn without replacement, so extrapolation can be checked against the exact value.

    Keys (log-perplexities in bits, as :func:`log_perplexity`):

    - ``prefix``, ``secret``, ``alphabet``, ``length``, ``space`` (``|R|``, an int);
    - ``log_perplexity``: the canary's;
    - ``method``: ``"exact"`` or ``"sampled"``; ``exposure``: the exact exposure when there is
      one, else the extrapolated one, else (a degenerate sample) the sampled one;
    - exact only: ``exposure_exact``, ``rank`` (:func:`rank_of`; ties to the canary),
      ``canary_index`` (its position in the enumeration, :func:`index_of_secret`) and
      ``candidates_log_perplexity`` (all ``|R|`` of them, in :func:`secret_of_index` order,
      the canary's own at ``canary_index`` is ``log_perplexity``);
    - always: ``sample_secrets`` and ``sample_log_perplexity`` (the sample, aligned),
      ``sample_below`` (how many of the sample are strictly below the canary),
      ``exposure_sampled`` (:func:`exposure_sampled`), ``exposure_extrapolated``
      (:func:`exposure_extrapolated`, ``None`` if the sample is degenerate) and ``skewnorm``
      (the fit's ``{"a", "loc", "scale"}``, for ``scipy.stats.skewnorm``, or ``None``).
    """
    vocab = _vocabulary(vocabulary)
    rng = np.random.default_rng(seed)
    formats: dict[tuple[str, str, int], dict[str, Any]] = {}
    results = []
    for canary in canaries:
        key = (canary.prefix, canary.alphabet, len(canary.secret))
        space = canary.space
        exact = space <= exact_up_to
        if key not in formats:
            fmt: dict[str, Any] = {}
            if exact:
                fmt["all"] = enumerate_log_perplexities(model, *key, seq_len, vocab, batch)
                pick = np.sort(rng.choice(space, size=min(samples, space), replace=False))
                fmt["secrets"] = [secret_of_index(int(i), *key[1:]) for i in pick]
                fmt["sample"] = fmt["all"][pick]
            else:
                fmt["secrets"] = _sample_secrets(rng, *key[1:], samples)
                fmt["sample"] = log_perplexity(model, canary.prefix, fmt["secrets"], seq_len,
                                               vocab, batch)
            formats[key] = fmt
        fmt = formats[key]
        out: dict[str, Any] = {"prefix": canary.prefix, "secret": canary.secret,
                               "alphabet": canary.alphabet, "length": len(canary.secret),
                               "space": space, "method": "exact" if exact else "sampled"}
        if exact:
            index = index_of_secret(canary.secret, canary.alphabet)
            lp = float(fmt["all"][index])
            out.update(log_perplexity=lp, canary_index=index, rank=rank_of(lp, fmt["all"]),
                       exposure_exact=exposure_from_rank(lp, fmt["all"]))
        else:
            lp = float(log_perplexity(model, canary.prefix, [canary.secret], seq_len, vocab,
                                      batch)[0])
            out.update(log_perplexity=lp)
        out.update(_estimates(lp, fmt["sample"], space))
        out["exposure"] = (out["exposure_exact"] if exact else
                           out["exposure_extrapolated"] if out["exposure_extrapolated"]
                           is not None else out["exposure_sampled"])
        out["sample_secrets"] = list(fmt["secrets"])
        out["sample_log_perplexity"] = [float(v) for v in fmt["sample"]]
        if exact:
            out["candidates_log_perplexity"] = [float(v) for v in fmt["all"]]
        results.append(out)
    return results
