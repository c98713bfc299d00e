"""The Secret Sharer's exposure (Carlini et al. 2019) of canaries in next-character models:
windows, log-perplexities, exact and estimated exposure, each checked against an independent
computation, and a tiny CharRNN that memorises a canary."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import norm, skewnorm
from torch import nn

from privacy.attacks import exposure as ex
from tasks.models import CharRNN
from tasks.shakespeare import SEQ_LEN, VOCABULARY, Windows, encode

PREFIX = ex.DEFAULT_PREFIX


def tiny_model(seed: int = 0) -> CharRNN:
    torch.manual_seed(seed)
    return CharRNN(len(VOCABULARY), 8, 16, 1, "gru")


class Recorder(nn.Module):
    """The model, noting how many windows it read and in which mode."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.rows = 0
        self.modes: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows += len(x)
        self.modes.append((self.training, torch.is_grad_enabled()))
        return self.model(x)


def slice_windows(context: str, continuation: str, seq_len: int = SEQ_LEN):
    """The examples of ``context + continuation`` by string slicing, encoded by tasks'."""
    line = " " * seq_len + context + continuation
    starts = range(len(context), len(context) + len(continuation))
    x = np.array([encode(line[s:s + seq_len]) for s in starts]).reshape(-1, seq_len)
    y = np.array([VOCABULARY.index(line[s + seq_len]) for s in starts], dtype=np.int64)
    return x, y


# ------------------------------------------------------------------ canaries and windows


def test_canaries_are_distinct_seeded_and_validated():
    a = ex.make_canaries(50, 3, seed=4)
    assert a == ex.make_canaries(50, 3, seed=4) != ex.make_canaries(50, 3, seed=5)
    assert len({c.secret for c in a}) == 50
    assert all(len(c.secret) == 3 and c.secret.isdigit() and c.space == 1000 for c in a)
    assert a[0].text == PREFIX + a[0].secret
    big = ex.make_canaries(20, 12, seed=0, prefix="pin ", alphabet="ab")
    assert len({c.secret for c in big}) == 20 and big[0].space == 2**12
    assert set("".join(c.secret for c in big)) == {"a", "b"}
    assert len(ex.make_canaries(8, 3, seed=1, alphabet="ab")) == 8  # the whole space
    with pytest.raises(ValueError):
        ex.make_canaries(9, 3, seed=1, alphabet="ab")
    with pytest.raises(ValueError):
        ex.Canary("12a")
    with pytest.raises(ValueError):
        ex.Canary("12", prefix="two  spaces ")
    assert [ex.secret_of_index(i, "0123", 3) for i in range(64)] == \
        ["".join(p) for p in itertools.product("0123", repeat=3)]
    assert all(ex.index_of_secret(ex.secret_of_index(i, "xyz", 4), "xyz") == i
               for i in range(81))


def test_windows_for_equals_string_slicing_and_leafs_windows():
    cases = [(PREFIX, "0123456789"), ("", "hello, world"), ("x" * 100 + " say ", "42!"),
             ("Kent. ", "My lord?\n"), ("a", "")]
    for context, continuation in cases:
        x, y = ex.windows_for(context, continuation)
        want_x, want_y = slice_windows(context, continuation)
        assert x.dtype == np.uint8 and x.shape == (len(continuation), SEQ_LEN)
        np.testing.assert_array_equal(x, want_x)
        np.testing.assert_array_equal(y, want_y)
        if continuation:  # the same rows as tasks.shakespeare's Windows over the line
            buffer = encode(" " * SEQ_LEN + context + continuation + "\n")
            w = Windows(buffer, np.arange(len(context), len(context) + len(continuation)))
            np.testing.assert_array_equal(x, w[:])
            np.testing.assert_array_equal(y, w.targets())
    x, y = ex.windows_for("ab", "cde", seq_len=4, vocabulary="abcde ")
    assert x.tolist() == [[5, 5, 0, 1], [5, 0, 1, 2], [0, 1, 2, 3]] and y.tolist() == [2, 3, 4]
    with pytest.raises(ValueError, match="vocabulary"):
        ex.windows_for(PREFIX, "é1")
    np.testing.assert_array_equal(ex.encode_strict(VOCABULARY), encode(VOCABULARY))


# ------------------------------------------------------------------ log-perplexity


def test_log_perplexity_equals_per_position_log_softmax():
    model = tiny_model(1)
    secrets = ["0123", "9999", "01", "", "7", "x" * 70 + "!"]
    rec = Recorder(model).train()
    got = ex.log_perplexity(rec, PREFIX, secrets, batch=7)
    assert rec.training and model.training  # the mode is restored
    assert rec.modes and all(m == (False, False) for m in rec.modes)  # eval, no grad
    # windows are shared: the empty head once, "0" and "01"... once each across secrets
    heads = {s[:j] for s in secrets for j in range(len(s))}
    assert rec.rows == len(heads)
    model.eval()
    with torch.no_grad():
        for secret, value in zip(secrets, got, strict=True):
            want = 0.0
            for j, c in enumerate(secret):
                line = " " * SEQ_LEN + PREFIX + secret[:j]
                x = torch.as_tensor(encode(line[-SEQ_LEN:]), dtype=torch.long)[None]
                want -= torch.log_softmax(model(x), dim=-1)[0, VOCABULARY.index(c)].item()
            assert value == pytest.approx(want / math.log(2), rel=1e-5, abs=1e-5)
    assert got[3] == 0.0 and got.dtype == np.float64


def test_enumeration_equals_log_perplexity_of_every_candidate():
    rec = Recorder(tiny_model(2))
    got = ex.enumerate_log_perplexities(rec, PREFIX, "0123", 3, batch=5)
    assert rec.rows == 1 + 4 + 16  # one window per distinct head of the secret
    listed = ["".join(p) for p in itertools.product("0123", repeat=3)]
    want = ex.log_perplexity(rec.model, PREFIX, listed)
    assert got.shape == (64,)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.ptp(got) > 0.1  # candidates differ: a wrong order would show


# ------------------------------------------------------------------ exposure


def test_exposure_from_rank_on_hand_made_arrays():
    r = np.arange(16.0)
    assert ex.exposure_from_rank(0.0, r) == 4.0  # the most likely of 16: log2 |R|
    assert ex.exposure_from_rank(7.0, r) == 1.0  # rank 8 of 16: the middle, 1 bit
    assert ex.exposure_from_rank(15.0, r) == 0.0  # the least likely
    assert ex.exposure_from_rank(2.0, r[::-1].copy()) == 4.0 - math.log2(3)  # order-free
    ties = np.array([1.0, 3.0, 3.0, 3.0, 5.0, 0.5, 3.0, 9.0])
    # ties go to the canary: rank = 1 + 2 strictly lower
    assert ex.rank_of(3.0, ties) == 3
    assert ex.exposure_from_rank(3.0, ties) == 3.0 - math.log2(3)
    assert ex.exposure_from_rank(3.0, np.full(8, 3.0)) == 3.0  # all tied: the maximum
    with pytest.raises(ValueError, match="candidates"):
        ex.exposure_from_rank(2.5, r)  # the canary must be a member of R


def test_exposure_sampled_and_extrapolated_on_known_distributions():
    sample = np.arange(100.0)
    assert ex.exposure_sampled(50.0, sample, 1000) == pytest.approx(
        math.log2(1000) - math.log2(1 + 999 * 0.5))
    assert ex.exposure_sampled(-1.0, sample, 1000) == math.log2(1000)
    assert ex.exposure_sampled(1e9, sample, 1000) == pytest.approx(
        math.log2(1000) - math.log2(1000))
    # a large sample of a known skew-normal: the fit's -log2 CDF is the true one
    rng = np.random.default_rng(0)
    a, loc, scale = 3.0, 30.0, 6.0
    big = skewnorm.rvs(a, loc, scale, size=5000, random_state=rng)
    for x in (28.0, 30.0, 35.0):
        want = -math.log2(skewnorm.cdf(x, a, loc, scale))
        assert ex.exposure_extrapolated(x, big) == pytest.approx(want, abs=0.15)
    # a normal sample (a ~ 0): -log2 of the normal CDF
    normal = rng.normal(40.0, 5.0, size=5000)
    assert ex.exposure_extrapolated(25.0, normal) == pytest.approx(
        -math.log2(norm.cdf(-3.0)), abs=0.5)
    with pytest.raises(ValueError):
        ex.exposure_extrapolated(1.0, np.full(10, 3.0))


def test_skewnorm_tail_stays_finite_and_accurate():
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 40

    def log2_cdf(z, a):
        pdf = lambda t: 2 * mp.npdf(t) * mp.ncdf(a * t)  # noqa: E731
        return float(mp.log(mp.quad(pdf, [-mp.inf, z])) / mp.log(2))

    for a, z in [(-3.0, -3.0), (-3.0, -40.0), (0.0, -45.0), (0.5, -45.0), (4.0, -3.0),
                 (4.0, -12.0), (4.0, -30.0)]:
        got = ex.skewnorm_log2_cdf(10.0 + 2.0 * z, a, 10.0, 2.0)
        assert math.isfinite(got)
        assert got == pytest.approx(log2_cdf(z, a), rel=1e-4)


# ------------------------------------------------------------------ a memorising model


def training_data(canary: ex.Canary, seed: int, repeat: int = 8, lines: int = 10):
    """The canary line's windows ``repeat`` times, and ``lines`` random lines of letters."""
    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyz ,.")
    xs, ys = [], []
    for _ in range(repeat):
        x, y = ex.windows_for(canary.prefix, canary.secret)
        xs.append(x)
        ys.append(y)
    for _ in range(lines):
        x, y = ex.windows_for("", " ".join("".join(rng.choice(letters, size=30)).split()))
        xs.append(x)
        ys.append(y)
    return (torch.as_tensor(np.concatenate(xs), dtype=torch.long),
            torch.as_tensor(np.concatenate(ys)))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, seed: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(x), (32,), generator=g)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()


CANARY = ex.make_canaries(1, 4, seed=1)[0]  # a space of 10^4, log2 |R| = 13.29 bits


@pytest.fixture(scope="module")
def memorised():
    """(untrained model, the same model trained 30 steps on the canary line and random
    letters, the trained model's log-perplexities of all 10^4 candidates)."""
    before = tiny_model(0)
    after = tiny_model(0)
    train(after, *training_data(CANARY, 0), steps=30, seed=0)
    every = ex.enumerate_log_perplexities(after, CANARY.prefix, CANARY.alphabet, 4)
    return before, after, every


def test_a_memorised_canary_is_exposed_and_random_ones_are_not(memorised):
    before, after, every = memorised
    index = ex.index_of_secret(CANARY.secret, CANARY.alphabet)
    top = math.log2(CANARY.space)
    exposed = ex.exposure_from_rank(every[index], every)
    assert exposed >= top - 1.0, exposed  # rank <= 2 of 10^4
    untrained = ex.enumerate_log_perplexities(before, CANARY.prefix, CANARY.alphabet, 4)
    assert ex.exposure_from_rank(untrained[index], untrained) < 5.0
    # random canaries under the untrained model: a uniform rank, log2 e ~ 1.44 bits on average
    small = ex.enumerate_log_perplexities(before, PREFIX, ex.DIGITS, 3)
    chance = [ex.exposure_from_rank(small[ex.index_of_secret(c.secret, c.alphabet)], small)
              for c in ex.make_canaries(200, 3, seed=2)]
    assert 1.0 < np.mean(chance) < 2.0, np.mean(chance)
    # secrets the trained model never saw stay near chance (those sharing the canary's
    # first digits are somewhat exposed: their heads were trained)
    others = [ex.exposure_from_rank(every[ex.index_of_secret(c.secret, c.alphabet)], every)
              for c in ex.make_canaries(200, 4, seed=3) if c != CANARY]
    assert np.mean(others) < 3.0, np.mean(others)


def test_extrapolation_matches_exact_exposure_at_moderate_exposures(memorised):
    """A 500-candidate sample against the exact ranks of all 10^4. Every secret has an
    exposure under the model (a secret's rank does not depend on whether it was inserted), so
    the candidates at exposures 2..7 bits stand for canaries of moderate exposure.

    Tolerance 1 bit: beyond ~7 bits the sample holds fewer than ~4 candidates below the canary,
    and the fitted tail, not the data, decides; below it the skew-normal fits the
    log-perplexities closely (errors up to ~0.6 bits were seen over training from 10 to 60
    steps). The sampled rank estimate is held to the same bit only up to 5 bits (>= 15 of the
    sample below), as it cannot resolve more than ~log2 500 = 9 bits at all."""
    _, _, every = memorised
    rng = np.random.default_rng(3)
    sample = every[rng.choice(len(every), size=500, replace=False)]
    order = np.argsort(every, kind="stable")
    for bits in (2, 3, 4, 5, 6, 7):
        lp = every[order[int(len(every) / 2**bits)]]
        exact = ex.exposure_from_rank(lp, every)
        assert abs(exact - bits) < 0.1
        assert ex.exposure_extrapolated(lp, sample) == pytest.approx(exact, abs=1.0)
        if bits <= 5:
            assert ex.exposure_sampled(lp, sample, len(every)) == pytest.approx(exact, abs=1.0)


def test_measure_recomputed_independently(memorised):
    _, model, every = memorised
    canaries = [CANARY, *ex.make_canaries(2, 4, seed=5),
                ex.Canary("123456", prefix="call me at ")]
    got = ex.measure(model, canaries, samples=300, exact_up_to=10**4, seed=7)
    assert json.loads(json.dumps(got, allow_nan=False)) == got  # JSON-ready
    assert [d["secret"] for d in got] == [c.secret for c in canaries]
    for d in got[:3]:
        assert d["method"] == "exact" and d["space"] == 10**4
        lp = np.array(d["candidates_log_perplexity"])
        np.testing.assert_allclose(lp, every, rtol=1e-6, atol=1e-6)
        i = int(d["secret"])  # decimal digits: the enumeration order is numeric order
        assert d["canary_index"] == i and d["log_perplexity"] == lp[i]
        rank = 1 + int(np.sum(lp < lp[i]))
        assert d["rank"] == rank
        assert d["exposure"] == d["exposure_exact"] == pytest.approx(
            np.log2(len(lp)) - np.log2(rank))
        # the canary through the other path: windows of its own line, no enumeration
        alone = ex.log_perplexity(model, d["prefix"], [d["secret"]])[0]
        assert alone == pytest.approx(d["log_perplexity"], rel=1e-5)
        s = np.array(d["sample_log_perplexity"])
        assert len(s) == 300 == len(set(d["sample_secrets"]))
        np.testing.assert_array_equal(s, lp[[int(t) for t in d["sample_secrets"]]])
        below = int(np.sum(s < lp[i]))
        assert d["sample_below"] == below
        assert d["exposure_sampled"] == pytest.approx(
            np.log2(1e4) - np.log2(1 + (1e4 - 1) * below / 300))
        k = d["skewnorm"]
        assert d["exposure_extrapolated"] == pytest.approx(
            -np.log2(skewnorm.cdf(lp[i], k["a"], k["loc"], k["scale"])), rel=1e-6)
    assert got[0]["exposure"] >= math.log2(1e4) - 1.0  # the memorised one
    big = got[3]
    assert big["method"] == "sampled" and big["space"] == 10**6
    assert "candidates_log_perplexity" not in big and "rank" not in big
    s = np.array(big["sample_log_perplexity"])
    np.testing.assert_allclose(
        s, ex.log_perplexity(model, "call me at ", big["sample_secrets"]), rtol=1e-6)
    assert big["log_perplexity"] == pytest.approx(
        ex.log_perplexity(model, "call me at ", ["123456"])[0], rel=1e-6)
    assert big["exposure"] == big["exposure_extrapolated"]
    k = big["skewnorm"]
    assert big["exposure_extrapolated"] == pytest.approx(
        -np.log2(skewnorm.cdf(big["log_perplexity"], k["a"], k["loc"], k["scale"])), rel=1e-6)
    assert big["exposure_sampled"] == pytest.approx(
        np.log2(1e6) - np.log2(1 + (1e6 - 1) * np.mean(s < big["log_perplexity"])))
