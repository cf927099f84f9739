"""The OpenAI-compatible HTTP server (FastAPI): protocol models, request handlers, SSE
streaming, Prometheus metrics.

Owns HTTP and text (chat templates, detokenized streams). Imports the engine layer (the async
engine) and the base; never the CLI, tools or scale-out.
"""
