"""The one registry style: registering, lazy built-ins, unknown names explained, and every
built-in entry resolving to what its registry says an entry is."""

from __future__ import annotations

import dataclasses

import pytest

from privacy.anonymize.registry import ANONYMIZERS
from privacy.attacks.registry import ATTACKS, AttackInfo
from privacy.registry import Registry
from strategies.registry import STRATEGIES
from tasks.config import ConfigError
from tasks.datasets import Dataset
from tasks.registry import BACKBONES, DATASETS, MODELS, PARTITIONERS

REGISTRIES = [DATASETS, PARTITIONERS, MODELS, BACKBONES, STRATEGIES, ANONYMIZERS, ATTACKS]


@dataclasses.dataclass(frozen=True)
class Info:
    colour: str
    size: int = 1


def _registry() -> Registry:
    return Registry("widget", where="tests.WIDGETS", signature="widget() -> int", info=Info,
                    error=ConfigError)


def test_register_as_decorator_as_call_and_lazily():
    widgets = _registry()

    @widgets.register("one", colour="red")
    def one() -> int:
        return 1

    assert one() == 1  # the decorator returns the function itself
    assert widgets.register("two", lambda: 2, colour="blue", size=2)() == 2
    widgets.register("dataclass", "dataclasses:dataclass", colour="green")  # imported on use
    assert widgets.names == ("one", "two", "dataclass") and "two" in widgets
    assert widgets.load("one") is one and widgets.load("dataclass") is dataclasses.dataclass
    assert widgets.info("two") == Info("blue", 2)
    assert dict(widgets.items())["one"] == Info("red")
    assert widgets.module("one") == __name__ and widgets.module("dataclass") == "dataclasses"


def test_an_unknown_name_is_one_paragraph_saying_what_is_allowed_and_how_to_add_one():
    widgets = _registry()
    widgets.register("one", lambda: 1, colour="red")
    with pytest.raises(ConfigError) as err:
        widgets.load("tow")
    text = str(err.value)
    assert text.startswith("unknown widget 'tow'; choose from one. A widget of your own must "
                           "be registered first: with tests.WIDGETS.register('tow') in a "
                           "module the run-config key plugins names (docs/EXTENDING.md).")
    assert "\n" not in text
    with pytest.raises(ConfigError, match="^gadget = 'tow' must be one of one. A widget"):
        widgets.check("tow", key="gadget")


def test_bad_registrations_are_refused_with_the_reason():
    widgets = _registry()
    widgets.register("one", lambda: 1, colour="red")
    with pytest.raises(ValueError, match="'one' is already registered.*replace=True"):
        widgets.register("one", lambda: 2, colour="red")
    widgets.register("one", lambda: 3, colour="red", replace=True)
    assert widgets.load("one")() == 3
    for bad in ("", "a,b", "my widget", "-x"):
        with pytest.raises(ValueError, match="cannot be registered"):
            widgets.register(bad, lambda: 1, colour="red")
    with pytest.raises(ValueError, match="must be 'module:attribute'"):
        widgets.register("lazy", "dataclasses.dataclass", colour="red")
    with pytest.raises(TypeError, match="widget 'x'.*takes colour, size"):
        widgets.register("x", lambda: 1, shape="round")
    with pytest.raises(ValueError, match="scored as one of labels, reconstruction"):
        AttackInfo("a description", "vibes")


def test_every_built_in_entry_resolves_to_what_its_registry_says_an_entry_is():
    for registry in REGISTRIES:
        assert registry.names and registry.signature
        for name in registry.names:
            target = registry.load(name)
            if registry is DATASETS:
                assert isinstance(target, Dataset), name
            else:
                assert callable(target), (registry.kind, name)
    for name, info in ANONYMIZERS.items():
        assert dataclasses.is_dataclass(info.params), name
    for name, info in ATTACKS.items():
        assert info.description and info.scored_as, name
