"""Entry points over the engine: the OpenAI-compatible server (``kvcore serve``) and its load
generator (``kvcore bench serve``)."""
