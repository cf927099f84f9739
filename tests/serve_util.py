"""Helpers of the server tests: a small model directory with a tokenizer, a server subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
)


def make_model_dir(path: Path, **config: Any) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer (trained here, 400 tokens) and a chat
    template: the tiny model with text, so every endpoint can be tested in seconds. ``config``
    overrides fields of ``SMALL`` (a test that needs a slower step asks for a wider model)."""
    import pydoc_data.topics

    from kvcore.models.loader import tiny_llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "<|im_end|>", "<|im_start|>"],  # eos id 2, as tiny_llama
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:40], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    tiny_llama(seed=0, vocab_size=len(fast), **{**SMALL, **config}).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT / "kernels")])
    e.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return e


class ServerProcess:
    """``kvcore serve`` in a subprocess on a free port; stopped by its pid."""

    def __init__(self, *args: str, timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvcore", "serve", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, *args], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.timeout = timeout
        self.ready = False

    def wait_ready(self) -> ServerProcess:
        """Wait for /health (the model loads meanwhile; tests can prepare in parallel)."""
        deadline = time.monotonic() + self.timeout
        while not self.ready and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                self.ready = httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.3)
        if not self.ready:
            self.stop()
            raise RuntimeError("server did not start")
        return self

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM by pid; returns the exit code."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
