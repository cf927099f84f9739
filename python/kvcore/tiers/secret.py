"""The operator secret that authenticates tier values (and keys cache-salt namespaces).

Where it comes from, first found wins:

1. ``tier_secret_file`` (``--tier-secret-file``): a file of at least 16 bytes (whitespace
   stripped). Replicas that share a Redis must all be given the same one.
2. The environment variable ``KVCORE_TIER_SECRET`` (at least 16 characters).
3. Local tiers only: ``<disk_path>/tier-secret``, or ``$XDG_CACHE_HOME/kvcore/tier-secret``
   without a disk tier, created once (32 random bytes, hex) with owner-only permissions, so a
   restarted engine still reads its own disk tier. A file that others can read or write is
   refused: anyone who can read it can forge values.

Two keys are derived from the secret, one per use, so neither use can be turned into the other:
the MAC key of ``BlockCodec`` and the key of ``salt_namespace``.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from kvcore.errors import InvalidArgumentError

ENV = "KVCORE_TIER_SECRET"
FILE_NAME = "tier-secret"
MIN_BYTES = 16


def derive(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for one ``purpose`` ("mac", "salt") from the secret."""
    return hashlib.blake2b(secret, digest_size=32, person=f"kvcore-{purpose}".encode()).digest()


def _check(secret: bytes, where: str) -> bytes:
    secret = secret.strip()
    if len(secret) < MIN_BYTES:
        raise InvalidArgumentError(f"the tier secret in {where} is shorter than {MIN_BYTES} bytes")
    return secret


def _read_private(path: Path) -> bytes:
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgumentError(f"tier secret {path} is not a regular file")
        if st.st_mode & 0o077:
            raise InvalidArgumentError(
                f"tier secret {path} is readable or writable by others (mode "
                f"{stat.S_IMODE(st.st_mode):o}): chmod 600 it"
            )
        return _check(path.read_bytes(), str(path))
    except OSError as e:
        raise InvalidArgumentError(f"cannot read tier secret {path}: {e.strerror or e}") from None


def _local_file(directory: Path) -> Path:
    """``directory/tier-secret``, created once (atomically: written aside, then linked)."""
    path = directory / FILE_NAME
    if path.exists():
        return path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{FILE_NAME}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex())
        try:
            os.link(tmp, path)  # fails if another process won the race: read theirs
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise InvalidArgumentError(
            f"cannot create a tier secret in {directory}: {e.strerror or e} "
            f"(give --tier-secret-file or {ENV})"
        ) from None
    return path


def _cache_home() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcore"


def load_secret(secret_file: str | os.PathLike | None, disk_path: str | None) -> bytes:
    """The tier secret (see the module docstring); ``InvalidArgumentError`` when unusable."""
    if secret_file is not None:
        if not isinstance(secret_file, str | os.PathLike) or not str(secret_file):
            raise InvalidArgumentError(f"tier_secret_file must be a path, got {secret_file!r}")
        return _read_private(Path(secret_file))
    env = os.environ.get(ENV)
    if env:
        return _check(env.encode(), ENV)
    directory = Path(disk_path) if disk_path else _cache_home()
    return _read_private(_local_file(directory))
