"""The options that set a stream's conversational turns (``server/core/turns.py``), as the APIs
that offer turns take them: Deepgram Flux's names and ranges, which protocol v1 takes too
(with ``turns=true``). ``query_numbers`` reads them from the text of a URL query,
``turn_config`` applies numbers (from a query or a decoded JSON message) to a ``TurnConfig``,
whose own checks say what is out of range."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from server.core.turns import TurnConfig

TURN_OPTIONS = ("eot_threshold", "eager_eot_threshold", "eot_timeout_ms")


def query_numbers(one: Callable[[str], str | None]) -> dict[str, float]:
    """The turn options a URL query gives (``one``: an option's last value, or None), as
    numbers. Raises ``ValueError`` naming one that is not a number."""
    given: dict[str, float] = {}
    for name in TURN_OPTIONS:
        raw = one(name)
        if raw is None:
            continue
        try:
            number = float(raw)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):  # float() takes "nan" and "inf"
            raise ValueError(f"{name} must be a number; got {raw[:20]!r}")
        given[name] = number
    return given


def turn_config(given: Mapping[str, float], current: TurnConfig | None = None) -> TurnConfig:
    """``current`` (Flux's defaults when None) with the options in ``given``; an option not
    given keeps its value. Raises ``ValueError`` saying which option is out of range."""
    for name, value in given.items():
        # A JSON parser may give NaN or infinity (Python's does), and round(inf) would raise
        # OverflowError, not a refusal the client can read.
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a number; got {value}")
    base = current or TurnConfig()
    eager = given.get("eager_eot_threshold")
    return TurnConfig(
        eot_threshold=float(given.get("eot_threshold", base.eot_threshold)),
        eager_eot_threshold=base.eager_eot_threshold if eager is None else float(eager),
        eot_timeout_ms=round(given.get("eot_timeout_ms", base.eot_timeout_ms)),
    )
