"""Layers shared by kvcore's own model code (``kvcore.models.llama``, ``qwen``, ``gemma``).

Every layer works on packed tokens ``[num_tokens, ...]`` (one step, every request's tokens in one
row, each with its own position). Owns the math of a decoder block and nothing of a step: the
attention layer calls the ``StepAttention`` the runner hands to the forward. Imports torch only.
"""
