"""Routers by name (``--router``): kvcore's own, and the in-process model of Ray's
PrefixCacheAffinityRouter. Kept apart from ``router`` so that the Ray model (which builds on
``router``) is reached without a cycle."""

from __future__ import annotations

from kvcore.errors import InvalidArgumentError
from kvcore.scaleout.router import PowerOfTwoRouter, PrefixRouter, RandomRouter

ROUTERS = {"prefix": PrefixRouter, "p2c": PowerOfTwoRouter, "random": RandomRouter}
MODELS = ("ray-prefix",)  # Ray's router's policy, in-process (serve/ray_model.py; needs Ray)


def make_router(name: str, seed: int = 0, **kwargs):
    """A router by name: ``prefix`` (kwargs go to PrefixRouter), ``p2c``, ``random``, or
    ``ray-prefix`` (the model of Ray's PrefixCacheAffinityRouter; kwargs go to it)."""
    if name == "ray-prefix":
        from kvcore.scaleout.ray_model import RayPrefixModel

        return RayPrefixModel(seed=seed, **kwargs)
    if name not in ROUTERS:
        names = sorted([*ROUTERS, *MODELS])
        raise InvalidArgumentError(f"unknown router {name!r}: one of {names}")
    if name == "prefix":
        return PrefixRouter(seed=seed, **kwargs)
    return ROUTERS[name](seed=seed)
