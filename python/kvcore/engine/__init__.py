"""The engine: ``LLMEngine`` (the step loop: schedule in Rust, run the model, sample, update),
its construction, requests, the sampler, the detokenizer, the async engine of the server and
the engine's statistics.

Owns request state and the step loop. Imports the runner, models, retention, tiers and the
base; never an entry point, a tool or scale-out.
"""
