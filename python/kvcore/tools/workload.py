"""Built-in workloads: the end-to-end benchmark's token workloads and ``kvcore run``'s chat job.

* ``bench_workload("random" | "shared", vocab_size, seed)``: 64 requests arriving at once, prompt
  lengths uniform in 32-512 tokens, ``max_tokens`` uniform in 16-256. In ``shared`` every prompt
  starts with the same 256 tokens, followed by 32-256 tokens of its own (so 288-512 in all).
* ``chat_workload(num_conversations, seed)``: conversations sharing one system prompt, each with
  one to three user turns (a turn is submitted when the previous answer is back, its prompt is
  the whole conversation so far: a prefix-cache hit), and mixed lengths: short questions next to
  questions about a page of the Python reference manual (``pydoc_data.topics``, shipped with
  every Python installation).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYSTEM_PROMPT = (
    "You are a helpful assistant running inside kvcore, a key-value cache engine for language "
    "model inference. Answer the user's question clearly and briefly. Prefer short paragraphs "
    "and plain words. When the question is about Python, give a small example when it helps. "
    "When you do not know something, say so instead of guessing. Never repeat the question."
)

QUESTIONS = [
    "What is a key-value cache in a transformer model?",
    "Explain what a hash table is.",
    "Why is the sky blue?",
    "Give three tips for writing readable code.",
    "What does a compiler do?",
    "How do plants make food from sunlight?",
    "What is the difference between a list and a tuple in Python?",
    "Describe how a bicycle stays upright.",
    "What is recursion? Give an example.",
    "Why do we sleep?",
    "How does a binary search work?",
    "What are prime numbers used for?",
    "Explain the water cycle in a few sentences.",
    "What is the purpose of unit tests?",
    "How do vaccines work?",
    "Write a short poem about the sea.",
]

FOLLOW_UPS = [
    "Can you give a concrete example?",
    "Summarize that in one sentence.",
    "What is a common mistake people make about this?",
    "Explain it to a ten-year-old.",
]

DOC_TOPICS = ["for", "while", "if", "try", "with", "class", "function", "import", "lambda"]


@dataclass
class Conversation:
    """User turns of one conversation and the answer length of each turn."""

    turns: list[str]
    max_tokens: list[int]

    def messages(self, turn: int, answers: list[str]) -> list[dict[str, str]]:
        """Chat messages for ``turn`` given the answers to the earlier turns."""
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
        for i in range(turn):
            msgs.append({"role": "user", "content": self.turns[i]})
            msgs.append({"role": "assistant", "content": answers[i]})
        msgs.append({"role": "user", "content": self.turns[turn]})
        return msgs


def _doc_question(rng: random.Random) -> str:
    import pydoc_data.topics

    topic = rng.choice(DOC_TOPICS)
    text = pydoc_data.topics.topics[topic]
    size = rng.choice((600, 1200, 2000))
    return f"Here is part of the Python manual:\n\n{text[:size]}\n\nWhat does this section explain?"


def chat_workload(num_conversations: int = 24, seed: int = 0) -> list[Conversation]:
    """Conversations with a shared system prompt, follow-up turns and mixed prompt lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(num_conversations):
        first = _doc_question(rng) if i % 4 == 3 else QUESTIONS[i % len(QUESTIONS)]
        turns = [first] + rng.sample(FOLLOW_UPS, rng.choice((0, 1, 1, 2)))
        out.append(Conversation(turns, [rng.choice((32, 48, 64, 96)) for _ in turns]))
    return out


@dataclass
class TokenWorkload:
    """Prompts as token ids and each request's max_tokens."""

    prompts: list[list[int]]
    max_tokens: list[int]


def bench_workload(
    variant: str, vocab_size: int, seed: int = 0, num_requests: int = 64, low_token: int = 3
) -> TokenWorkload:
    """The end-to-end benchmark's workload (see the module docstring)."""
    if variant not in ("random", "shared"):
        raise ValueError(f"variant must be random or shared, not {variant!r}")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low_token, vocab_size) for _ in range(n)]

    shared = tokens(256) if variant == "shared" else []
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        if variant == "shared":
            prompts.append(shared + tokens(rng.randint(32, 256)))
        else:
            prompts.append(tokens(rng.randint(32, 512)))
        max_tokens.append(rng.randint(16, 256))
    return TokenWorkload(prompts, max_tokens)
