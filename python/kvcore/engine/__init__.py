"""The engine: ``LLMEngine`` (the step loop: schedule in Rust, run the model, sample, update),
its construction, requests, the sampler, the detokenizer, the async engine of the server, the
engine-core process of the server and its client (``core_proc``, ``core_client``,
``core_messages``, ``output_processor``) and the engine's statistics.

Owns request state and the step loop. Imports the runner, models, retention, tiers and the
base; never an entry point, a tool or scale-out.
"""
