"""The search space: Hydra's sweep overrides read as optuna distributions.

The grammar is Hydra's override grammar, read the way users of hydra-optuna-sweeper know it:

- ``choice(a, b, c)`` or ``a,b,c``: categorical;
- ``range(start, stop[, step])``: the integers (or floats) of Hydra's ``range``, ``stop``
  excluded, as an ordered discrete distribution; ``shuffle(range(...))``: categorical;
- ``interval(low, high)``: floats in [low, high]; ``int(interval(low, high))``: integers;
- ``tag(log, interval(...))``: sampled on a log scale.

Any other override is fixed: every trial gets it as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import (
    ChoiceSweep,
    IntervalSweep,
    Override,
    RangeSweep,
    Transformer,
)

from ddpexp.errors import ConfigError


def parse(arguments: Sequence[str], params: Mapping[str, str]) -> tuple[list[str], dict[str, Any]]:
    """``hydra.sweeper.params`` and the command line's task overrides (which win for the same
    key) as (fixed overrides, {key: optuna distribution})."""
    lines = [f"{key}={value}" for key, value in params.items()] + list(arguments)
    parser = OverridesParser.create()
    by_key: dict[str, Override] = {}
    for line in lines:
        try:
            (override,) = parser.parse_overrides([line])
        except Exception as exc:
            raise ConfigError(f"cannot read the override {line!r}: {exc}") from None
        by_key.pop(override.get_key_element(), None)  # a later one replaces it, in order
        by_key[override.get_key_element()] = override
    fixed: list[str] = []
    space: dict[str, Any] = {}
    for key, override in by_key.items():
        if override.is_sweep_override():
            space[key] = distribution(override)
        else:
            fixed.append(str(override.input_line))
    return fixed, space


def distribution(override: Override) -> Any:
    """The optuna distribution of one sweep override (see the module docstring)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    key = override.get_key_element()
    if isinstance(value, ChoiceSweep) or (isinstance(value, RangeSweep) and value.shuffle):
        choices = list(override.sweep_iterator(transformer=Transformer.encode))
        if not choices:
            raise ConfigError(f"{key}: the choice is empty; give at least one value")
        return CategoricalDistribution(cast(list[Any], choices))  # encoded: str, int, float, bool
    if isinstance(value, RangeSweep):
        values: list[Any] = list(override.sweep_iterator(transformer=Transformer.identity))  # numbers
        if not values:
            # Hydra cannot turn a sweep back into its text: the range is written from its parts.
            step = "" if value.step in (None, 1) else f", {value.step}"
            raise ConfigError(f"{key}=range({value.start}, {value.stop}{step}) holds no value "
                              "(range's stop is excluded)")
        step = value.step if value.step is not None else 1
        if all(isinstance(v, int) for v in values) and isinstance(step, int):
            return IntDistribution(values[0], values[-1], step=step)
        return FloatDistribution(float(values[0]), float(values[-1]), step=float(step))
    if isinstance(value, IntervalSweep):
        # An interval's ends are both given (the grammar has no open interval).
        low, high = cast(float, value.start), cast(float, value.end)
        log = "log" in value.tags
        if log and low <= 0:
            raise ConfigError(f"{key}: tag(log, interval({low}, {high})) needs a low end > 0")
        if low > high:
            raise ConfigError(f"{key}: interval({low}, {high}) has its low end above its high end")
        if isinstance(low, int) and isinstance(high, int):
            return IntDistribution(low, high, log=log)
        return FloatDistribution(float(low), float(high), log=log)
    raise ConfigError(f"{key}: {override.input_line} is not a search space this sweeper reads: "
                      "use choice(...), range(...), interval(...), int(interval(...)) or "
                      "tag(log, interval(...))")


def grid(space: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Every value of each parameter, for optuna's grid sampler; intervals of floats have no
    grid."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    out: dict[str, list[Any]] = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            out[key] = list(dist.choices)
        elif isinstance(dist, IntDistribution) and not dist.log:
            out[key] = list(range(dist.low, dist.high + 1, dist.step))
        elif getattr(dist, "step", None) is not None and not dist.log:
            count = int(round((dist.high - dist.low) / dist.step)) + 1
            out[key] = [dist.low + i * dist.step for i in range(count)]
        else:
            raise ConfigError(f"hydra.sweeper.sampler.name=grid cannot enumerate the interval of "
                              f"{key}: give it as choice(...) or range(...), or use the tpe or "
                              "random sampler")
    return out


def as_overrides(params: Mapping[str, Any]) -> list[str]:
    """A trial's parameters as overrides, e.g. ``["optimizer.lr=0.0123", "model=mlp"]``.
    A string is a choice as the override grammar wrote it (a list or quoted string was
    encoded by :func:`distribution`), so it goes back verbatim."""
    return [f"{key}={value if isinstance(value, str) else Transformer.str(value)}"
            for key, value in params.items()]
