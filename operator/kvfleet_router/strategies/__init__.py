"""Routing strategies, one module each behind `base.Strategy`."""

from __future__ import annotations

from kvfleet_router.settings import RouterSettings
from kvfleet_router.strategies.base import Ranking, RoutedRequest, Strategy
from kvfleet_router.strategies.least_load import LeastLoad
from kvfleet_router.strategies.prefix import PrefixAffinity
from kvfleet_router.strategies.round_robin import RoundRobin

__all__ = ["Ranking", "RoutedRequest", "Strategy", "make_strategy"]


def make_strategy(settings: RouterSettings) -> Strategy:
    if settings.strategy == "prefix":
        return PrefixAffinity(settings.block_chars, settings.load_factor)
    if settings.strategy == "least-load":
        return LeastLoad()
    return RoundRobin()
