"""Tools beside the engine: the capacity planner, the KV quality gate (``eval_kv``,
``eval_retention``, ``mixed_precision``), the scheduler and cluster simulators, workloads,
baseline peers, reports and the ``kvcore bench serve`` load generator.

May import the engine and every layer below, and scale-out's router; the engine never imports
a tool.
"""
