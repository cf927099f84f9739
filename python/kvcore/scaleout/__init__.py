"""Scale-out: routers for engine replicas, and the Ray Serve deployment (``deploy``).

Sits beside the tools, above the server: the Ray app wraps ``entrypoints.openai``; the engine
never imports scale-out.

``kvcore.scaleout.router`` needs nothing beyond kvcore; ``deploy`` imports Ray when called.
"""

from __future__ import annotations

from typing import Any

from kvcore.scaleout.policies import make_router
from kvcore.scaleout.router import (
    PowerOfTwoRouter,
    PrefixRouter,
    RandomRouter,
    ReplicaTree,
)


def deploy(*args: Any, **kwargs: Any) -> Any:
    """Deploy N engine replicas behind the OpenAI ingress on Ray Serve (see ``ray_app.deploy``)."""
    from kvcore.scaleout.ray_app import deploy as _deploy

    return _deploy(*args, **kwargs)


__all__ = [
    "PowerOfTwoRouter",
    "PrefixRouter",
    "RandomRouter",
    "ReplicaTree",
    "deploy",
    "make_router",
]
