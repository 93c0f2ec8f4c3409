"""What every config check is made of: a value among its choices (with the nearest as a hint), a positive
number."""

from __future__ import annotations

import difflib
import math

from edgefed.errors import ConfigError


def choice(value, choices, key: str) -> None:
    if value not in choices:
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        fix = f"choose one of {', '.join(map(repr, choices))}"
        if hint and not other_number(str(value), hint[0]):  # (float16 is no typo of float64: there is no float16)
            fix = f"did you mean {hint[0]!r}? ({fix})"
        raise ConfigError(f"config: {key} = {value!r} is not known; {fix}")


def other_number(a: str, b: str) -> bool:
    """Whether two names differ in their numbers alone (float16 and float64, int4 and int8)."""
    letters = lambda text: "".join(ch for ch in text if not ch.isdigit())  # noqa: E731
    return a != b and letters(a) == letters(b)


def positive(value, key: str, example: str) -> None:
    if not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"config: {key} = {value!r} must be positive (e.g. {example})")
