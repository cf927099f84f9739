"""The ``kvcore`` command: ``main`` dispatches ``run``, ``generate``, ``serve``, ``bench serve``,
``plan`` and ``eval-kv``; ``args`` holds the shared argument types (one-line errors, exit 2).

The top of the import order: may import anything in kvcore (tools, scale-out, the server);
nothing imports it.
"""
