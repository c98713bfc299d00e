import dataclasses
import tomllib

import pytest

from privacy.anonymize import ANONYMIZERS
from tasks.config import (
    KEYS,
    SCHEMA,
    AnonymizationConfig,
    ConfigError,
    RunConfig,
    defaults,
    parse_assignment,
    to_toml,
    validate,
    validate_partial,
)

from .conftest import REPO


def test_pyproject_run_config_matches_schema_defaults():
    with open(REPO / "pyproject.toml", "rb") as f:
        flwr_config = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    assert flwr_config == defaults(), \
        "paste `fedpriv keys --toml` into pyproject.toml's [tool.flwr.app.config]"


def test_defaults_validate_and_keep_types():
    cfg = validate({})
    assert isinstance(cfg, RunConfig) and cfg.flat() == defaults()
    flat = cfg.flat()
    for key in SCHEMA:
        assert type(flat[key.name]) is key.type
    assert validate(flat) == cfg and hash(validate(flat)) == hash(cfg)  # frozen, hashable


def test_override_is_typed_and_lands_in_its_section():
    cfg = validate({"num-clients": 20, "lr": 1, "download": "true", "dataset": "cifar10",
                    "secagg-num-shares": 5, "dp": "central"})
    assert cfg.federation.num_clients == 20
    assert isinstance(cfg.training.lr, float) and cfg.training.lr == 1.0
    assert cfg.data.download is True and cfg.data.dataset == "cifar10"
    assert cfg.secagg.num_shares == 5 and cfg.privacy.dp == "central"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.lr = 2.0  # type: ignore[misc]


def test_every_key_belongs_to_exactly_one_section():
    names = [k.name for k in SCHEMA]
    assert len(names) == len(set(names)) == len(defaults())
    groups = {k.group for k in SCHEMA}
    assert {"plugins", "data", "federation", "privacy", "secure aggregation", "embeddings",
            "anonymization", "leakage", "memorization", "training", "resources",
            "results"} == groups


def test_anonymizer_parameters_are_read_off_their_dataclass():
    # Each anonymizer's parameters are the keys its dataclass names: no second list.
    for name, spec in ANONYMIZERS.items():
        for f in dataclasses.fields(spec.params):
            assert f.name.replace("_", "-") in KEYS, (name, f.name)
            assert f.name in {g.name for g in dataclasses.fields(AnonymizationConfig)}
    cfg = validate({"features": "embeddings", "anonymizer": "density", "dbscan-eps": 2.5})
    params = cfg.anonymization.params()
    assert params.dbscan_eps == 2.5 and params.density_outliers == "merge"
    assert KEYS["anonymizer"].choices == tuple(ANONYMIZERS)


def test_integers_beyond_int64_are_refused():
    for key, value in (("seed", 10 ** 20), ("pca-components", 2 ** 63),
                       ("secagg-quantization-range", 1e30)):
        with pytest.raises(ConfigError, match=f"{key} = .* must be at most 2\\^63 - 1"):
            validate({key: value})


@pytest.mark.parametrize("values, fragment", [
    ({"dataset": "imagenet"}, "dataset = 'imagenet' must be one of mnist"),
    ({"model": "vgg"}, "model = 'vgg' must be one of"),
    ({"partitioner": "zipf"}, "partitioner = 'zipf' must be one of"),
    ({"dirichlet-alpha": 0.0}, "dirichlet-alpha = 0.0 must be > 0"),
    ({"dirichlet-alpha": -1}, "must be > 0"),
    ({"fraction-train": 0.0}, "fraction-train = 0.0 must be > 0"),
    ({"fraction-train": 1.5}, "fraction-train = 1.5 must be <= 1"),
    ({"fraction-evaluate": -0.1}, "must be >= 0"),
    ({"num-server-rounds": 0}, "num-server-rounds = 0 must be >= 1"),
    ({"num-clients": 0}, "num-clients = 0 must be >= 1"),
    ({"num-clients": "ten"}, "num-clients = 'ten' must be an integer"),
    ({"lr": float("nan")}, "must be a finite number"),
    ({"seed": 1.5}, "must be an integer"),
    ({"save-model": 1}, "must be true or false"),
    ({"data-dir": 3}, "must be text"),
    ({"trim-beta": 0.5}, "must be < 0.5"),
])
def test_bad_values_are_explained(values, fragment):
    with pytest.raises(ConfigError) as err:
        validate(values)
    assert fragment in str(err.value)
    assert "allowed:" in str(err.value)


def test_unknown_key_suggests_close_match():
    with pytest.raises(ConfigError, match="unknown key 'num-client'.*Did you mean num-clients"):
        validate({"num-client": 3})


def test_all_errors_reported_at_once():
    with pytest.raises(ConfigError) as err:
        validate({"num-server-rounds": 0, "dataset": "x", "bogus": 1})
    text = str(err.value)
    assert "num-server-rounds" in text and "dataset" in text and "bogus" in text


def test_cross_key_checks():
    with pytest.raises(ConfigError, match="min-train-clients = 5 is larger than num-clients = 3"):
        validate({"min-train-clients": 5, "num-clients": 3})
    with pytest.raises(ConfigError, match="mlp-hidden"):
        validate({"mlp-hidden": "200,x"})


def test_partial_validation_only_checks_given_keys():
    assert validate_partial({"num-clients": 4}) == {"num-clients": 4}


@pytest.mark.parametrize("text, expected", [
    ("num-clients=20", ("num-clients", 20)),
    ("lr=0.1", ("lr", 0.1)),
    ("download=true", ("download", True)),
    ("dataset=cifar10", ("dataset", "cifar10")),
    ("dataset='fashion-mnist'", ("dataset", "fashion-mnist")),
    ('data-dir="/tmp/a b"', ("data-dir", "/tmp/a b")),
    ("leakage-rounds=1", ("leakage-rounds", "1")),  # text keys keep number-like text
    ("leakage-clients=0,3", ("leakage-clients", "0,3")),
])
def test_parse_assignment(text, expected):
    assert parse_assignment(text) == expected


def test_parse_assignment_needs_equals():
    with pytest.raises(ConfigError, match="key=value"):
        parse_assignment("num-clients")


def test_to_toml_round_trips():
    cfg = validate({"data-dir": 'we"ird\\path', "lr": 0.125, "hash-salt": "a'b\"c#d é"})
    assert validate(tomllib.loads(to_toml(cfg))) == cfg


@pytest.mark.parametrize("text", ["a\nb", "tab\there", "bell\x07", "del\x7f"])
def test_control_characters_in_text_values_are_refused(text):
    with pytest.raises(ConfigError, match="must not contain control characters"):
        validate({"hash-salt": text})


def test_every_key_has_help_and_group():
    for key in SCHEMA:
        assert key.help and key.group
    assert len(KEYS) == len(SCHEMA)
