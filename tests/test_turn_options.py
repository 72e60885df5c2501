"""The turn options the APIs with turns take (Deepgram Flux, v1's ``turns=true``): read from a
URL query or a JSON message, applied to a ``TurnConfig``, refused in words a client can act on."""

from __future__ import annotations

import math

import pytest

from server.apis.turn_options import query_numbers, turn_config
from server.core.turns import TurnConfig


def test_the_query_gives_numbers_for_the_options_it_names() -> None:
    query = {"eot_threshold": "0.8", "eot_timeout_ms": "3000.0", "keyterm": "x"}
    assert query_numbers(query.get) == {"eot_threshold": 0.8, "eot_timeout_ms": 3000.0}
    assert query_numbers({}.get) == {}


@pytest.mark.parametrize("raw", ["soon", "", "nan", "inf", "-Infinity"])
def test_a_query_value_that_is_not_a_finite_number_is_refused(raw: str) -> None:
    with pytest.raises(ValueError, match="eager_eot_threshold must be a number"):
        query_numbers({"eager_eot_threshold": raw}.get)


def test_options_not_given_keep_their_values() -> None:
    assert turn_config({}) == TurnConfig()
    current = TurnConfig(eot_threshold=0.8, eager_eot_threshold=0.4, eot_timeout_ms=2000)
    assert turn_config({"eot_timeout_ms": 2999.6}, current) == TurnConfig(0.8, 0.4, 3000)
    assert turn_config({"eot_threshold": 0.9}, current) == TurnConfig(0.9, 0.4, 2000)


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ({"eot_threshold": 2}, "eot_threshold must be 0.5 to 0.9; got 2.0"),
        ({"eager_eot_threshold": 0.8, "eot_threshold": 0.6}, "must be at most eot_threshold"),
        ({"eot_timeout_ms": 100}, "eot_timeout_ms must be 500 to 10000; got 100"),
        ({"eot_timeout_ms": math.inf}, "eot_timeout_ms must be a number; got inf"),
        ({"eot_threshold": math.nan}, "eot_threshold must be a number; got nan"),
    ],
)
def test_values_out_of_fluxs_ranges_are_refused(given: dict[str, float], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        turn_config(given)
