"""The search space read from Hydra's sweep overrides (sweep/space.py)."""

from __future__ import annotations

import pytest
from optuna.distributions import (
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from ddpexp.errors import ConfigError
from ddpexp.sweep import space


def parse(*args, **params):
    return space.parse(list(args), {k.replace("__", "."): v for k, v in params.items()})


def test_fixed_and_swept():
    fixed, dists = parse("model=mlp", "optimizer.lr=interval(0.001, 0.1)", "a=x,y")
    assert fixed == ["model=mlp"]
    assert dists == {"optimizer.lr": FloatDistribution(0.001, 0.1),
                     "a": CategoricalDistribution(["x", "y"])}


def test_command_line_wins_over_params():
    fixed, dists = parse("seed=3", seed="1,2", trainer__max_epochs="2")
    assert fixed == ["trainer.max_epochs=2", "seed=3"] and dists == {}


@pytest.mark.parametrize("text, dist", [
    ("choice(1, 2, 4)", CategoricalDistribution([1, 2, 4])),
    ("range(1, 7, 2)", IntDistribution(1, 5, step=2)),
    ("range(0.0, 1.0, 0.25)", FloatDistribution(0.0, 0.75, step=0.25)),
    ("int(interval(2, 9))", IntDistribution(2, 9)),
    ("tag(log, interval(1e-4, 1e-1))", FloatDistribution(1e-4, 1e-1, log=True)),
])
def test_distributions(text, dist):
    assert parse(f"k={text}")[1] == {"k": dist}


def test_shuffled_range_is_categorical():
    d = parse("k=shuffle(range(3))")[1]["k"]
    assert isinstance(d, CategoricalDistribution) and sorted(d.choices) == [0, 1, 2]


def test_empty_range():
    with pytest.raises(ConfigError, match=r"k=range\(3, ?3\) holds no value \(range's stop is excluded\)"):
        parse("k=range(3, 3)")


@pytest.mark.parametrize("text, message", [
    ("tag(log, interval(0, 1))", r"k: tag\(log, interval\(0.0, 1.0\)\) needs a low end > 0"),
    ("interval(5, 1)", r"k: interval\(5.0, 1.0\) has its low end above its high end"),
])
def test_bad_spaces(text, message):
    with pytest.raises(ConfigError, match=message):
        parse(f"k={text}")


def test_unreadable_override():
    with pytest.raises(ConfigError, match=r"cannot read the override 'k=choice\(': "):
        parse("k=choice(")


def test_grid():
    _, dists = parse("a=choice(x, y)", "b=range(1, 4)", "c=range(0.0, 0.5, 0.25)")
    assert space.grid(dists) == {"a": ["x", "y"], "b": [1, 2, 3], "c": [0.0, 0.25]}


def test_grid_of_interval_is_refused():
    with pytest.raises(ConfigError, match="sampler.name=grid cannot enumerate the interval of lr"):
        space.grid({"lr": FloatDistribution(0.1, 1.0)})


def test_as_overrides_read_back_as_given():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = {"optimizer.lr": 0.0123, "model": "mlp", "n": 3, "on": True}
    words = space.as_overrides(params)
    assert words[:3] == ["optimizer.lr=0.0123", "model=mlp", "n=3"]
    parser = OverridesParser.create()
    assert {o.key_or_group: o.value() for o in parser.parse_overrides(words)} == params


def test_choice_of_lists_round_trips():
    d = parse("model.hidden=choice([8,8],[16])")[1]["model.hidden"]
    assert space.as_overrides({"model.hidden": d.choices[0]}) == ["model.hidden=[8,8]"]
