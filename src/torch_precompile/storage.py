"""Artifact pairs on disk: ``path`` holds the source; its cache lies beside it.

The cache file is named after the code it belongs to (``model.<hash>.cache`` for
``model.py``), and the source is written last, by an atomic rename: that rename is the one
moment the new pair appears. A crash or kill at any point before it leaves the old pair (and
at most an unused file); after it, the new one. A reader never sees a new source with an old
cache, because it looks the cache up by the hash of the source it read: by that name first,
else (a source renamed or copied, a cache path of the caller's choosing) among the ``*.cache``
files beside it, taking one whose envelope names that hash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from torch_precompile.artifact import envelope, signature
from torch_precompile.errors import PrecompileError
from torch_precompile.spec import parse_spec

log = logging.getLogger("torch_precompile")
_HASH_CHARS = 16
_STALE_TEMP_SECONDS = 3600
_RACE_RETRIES = 10
_ZIP_MAGIC = b"PK\x03\x04"  # how a version-1 envelope (a torch.save archive) starts
_NAMED_OTHERS = 3  # caches of other sources a message names before "and N more"


def cache_path(path: str | os.PathLike[str], python_code: str) -> Path:
    """Where the cache of ``python_code`` saved at ``path`` lives."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{envelope.code_hash(python_code)[:_HASH_CHARS]}.cache")


def save(
    python_code: str,
    cache: bytes | None,
    path: str | os.PathLike[str],
    sign_key: bytes | None = None,
) -> Path:
    """Write the pair atomically; return the path of the source."""
    path = Path(path)
    parse_spec(python_code)  # refuse to write something that is not an artifact
    if cache is not None:
        cache = bytes(cache)
        if sign_key is not None:
            cache = signature.sign(sign_key, python_code, cache)
    elif sign_key is not None:
        raise PrecompileError("sign_key needs a cache: the signature is stored in it.")
    if not path.parent.is_dir():
        raise PrecompileError(f"cannot save to {path}: {path.parent} is not a directory.")
    previous = _previous_cache(path)
    new_cache = cache_path(path, python_code)
    if cache is not None:
        _write_atomically(new_cache, cache)
    _write_atomically(path, python_code.encode())  # the commit point
    _remove_stale(path, keep={new_cache, previous})
    return path


def save_pair(
    python_code: str,
    cache: bytes | None,
    path: str | os.PathLike[str],
    cache_file: str | os.PathLike[str] | None,
    sign_key: bytes | None = None,
) -> Path:
    """``save``, or with the cache at a path of the caller's choosing (``cache_file``).

    There the cache is replaced first and the source last, each by an atomic rename, and a
    reader (``read_pair``) that meets a new cache beside the old source reads both again.
    """
    if cache_file is None:
        return save(python_code, cache, path, sign_key=sign_key)
    path, cache_file = Path(path), Path(cache_file)
    parse_spec(python_code)
    if cache is None:
        raise PrecompileError("a cache path was given but there is no cache to write.")
    cache = bytes(cache) if sign_key is None else signature.sign(sign_key, python_code, cache)
    for target in (path, cache_file):
        if not target.parent.is_dir():
            raise PrecompileError(f"cannot save to {target}: {target.parent} is not a directory.")
    _write_atomically(cache_file, cache)
    _write_atomically(path, python_code.encode())
    return path


def read_pair(
    path: str | os.PathLike[str], cache_file: str | os.PathLike[str] | None
) -> tuple[str, bytes | None]:
    """The source at ``path`` and the cache at ``cache_file`` (None: the one beside it)."""
    if cache_file is None:
        return load_file(path)
    for attempt in range(_RACE_RETRIES):
        python_code = read_source(Path(path))
        cache = read_cache(Path(cache_file))
        # The envelope stores the source's hash as plain text: a cheap test for a pair read
        # halfway through a save. load() checks the pairing for real.
        if envelope.code_hash(python_code).encode() in cache:
            break
        time.sleep(0.01 * (attempt + 1))
    return python_code, cache


def load_file(path: str | os.PathLike[str]) -> tuple[str, bytes | None]:
    """Read a saved pair: the source, and the cache that belongs to it (None, with a warning,
    when none does)."""
    saved = read_saved(path)
    if saved.absence is not None:
        log.warning("%s; running from the source alone.", saved.absence)
    return saved.code, saved.cache


@dataclass(frozen=True)
class SavedPair:
    """A source read from a file, the cache found for it, and why there is none (if so)."""

    code: str
    cache: bytes | None
    absence: str | None  # None when a cache was found


def read_saved(path: str | os.PathLike[str]) -> SavedPair:
    """The source at ``path`` and the cache beside it that belongs to it (``find_cache``);
    without one, ``absence`` says what lies there instead, and nothing is logged."""
    path = Path(path)
    python_code = read_source(path)
    for _ in range(_RACE_RETRIES):
        search = find_cache(path, python_code)
        cache = _read_if_there(search.found)
        if cache is not None:
            return SavedPair(python_code, cache, None)
        # A save may have replaced the pair since the source was read: read it again, and
        # look again for the new source's cache.
        latest = read_source(path)
        if latest == python_code and search.found is None:
            break
        python_code = latest
    return SavedPair(python_code, None, search.absence())


def _read_if_there(found: Path | None) -> bytes | None:
    if found is None:
        return None
    try:
        return found.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PrecompileError(f"cannot read the cache at {found}: {e}") from e


@dataclass(frozen=True)
class CacheSearch:
    """Where ``find_cache`` found the cache of a source, or what it found instead."""

    source: Path
    code_hash: str  # the source's
    found: Path | None
    others: tuple[tuple[Path, str | None], ...]  # caches of other sources, and their hashes

    def absence(self) -> str:
        """Why there is no cache, in words (for a warning or an error)."""
        expected = f"{self.source.stem}.{self.code_hash[:_HASH_CHARS]}.cache"
        if not self.others:
            return f"no cache beside {self.source} (expected {expected})"
        mine = f"{self.code_hash[:12]}…"
        if len(self.others) == 1:
            other, digest = self.others[0]
            made_for = f"sha256 {digest[:12]}…" if digest else "another sha256"
            return (
                f"no cache for {self.source.name}: {other.name} beside it belongs to "
                f"another source (made for {made_for}; this source's is {mine})"
            )
        names = [other.name for other, _ in self.others[:_NAMED_OTHERS]]
        more = len(self.others) - len(names)
        listed = ", ".join(names) + (f" and {more} more" if more else "")
        return (
            f"no cache for {self.source.name}: the caches beside it ({listed}) belong to "
            f"other sources (none was made for this source, sha256 {mine})"
        )


def find_cache(path: str | os.PathLike[str], python_code: str) -> CacheSearch:
    """The cache beside ``path`` that belongs to ``python_code``: the one ``save`` names after
    its hash, else any ``*.cache`` there whose envelope was made for this source."""
    path = Path(path)
    expected = cache_path(path, python_code)
    digest = envelope.code_hash(python_code)
    if expected.is_file():
        return CacheSearch(path, digest, expected, ())
    others = []
    for candidate in _caches_beside(path, expected, digest[:_HASH_CHARS]):
        contents = _envelope_of(candidate, digest)
        if contents is None:
            continue  # not a cache of ours
        if contents.belongs_to(python_code):
            return CacheSearch(path, digest, candidate, ())
        made_for = contents.code_hash if isinstance(contents.code_hash, str) else None
        others.append((candidate, made_for))
    return CacheSearch(path, digest, None, tuple(others))


def _caches_beside(path: Path, expected: Path, short_hash: str) -> list[Path]:
    """The ``*.cache`` files in ``path``'s directory: first those ``save`` named after this
    hash (the source was renamed or copied), then those named after its stem."""
    try:
        found = sorted(
            entry
            for entry in path.parent.iterdir()
            if entry.name.endswith(".cache") and entry != expected
        )
    except OSError:
        return []
    return sorted(
        found,
        key=lambda entry: (
            not entry.name.endswith(f".{short_hash}.cache"),
            not entry.name.startswith(f"{path.stem}."),
        ),
    )


def _envelope_of(candidate: Path, digest: str) -> envelope.CacheContents | None:
    """The envelope of the cache at ``candidate``, blobs unread (None: not a readable cache).
    Of a version-2 envelope only the header is read."""
    try:
        with open(candidate, "rb") as file:
            head = file.read(envelope.HEADER_PROBE)
            end = envelope.header_end(head)
            if end is None:
                if not signature.split(head)[1].startswith(_ZIP_MAGIC):
                    return None  # neither envelope version: left unread
                return _version_1_envelope(head + file.read(), digest)
            head += file.read(max(0, end - len(head)))
    except OSError:
        return None
    return envelope.read_header(head)


def _version_1_envelope(body: bytes, digest: str) -> envelope.CacheContents | None:
    """A version-1 envelope (``torch.save`` of a dict), decoded only where the source's hash
    occurs in it: for any other, an envelope that names no hash."""
    if envelope.FORMAT.encode() not in body:
        return None  # an archive, but not one of ours
    if digest.encode() not in body:
        return envelope.CacheContents(
            backend=None, code_hash=None, acceleration=None, compiled=None
        )
    return envelope.read(body, problems=[])


def read_cache(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PrecompileError(
            f"no cache at {path}: pass None as the cache to run from the source alone."
        ) from None
    except OSError as e:
        raise PrecompileError(f"cannot read the cache at {path}: {e}") from e


def read_source(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise PrecompileError(f"no artifact at {path}.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PrecompileError(f"cannot read the artifact at {path}: {e}") from e


def _write_atomically(target: Path, data: bytes) -> None:
    temp = target.with_name(f".{target.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        with open(temp, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            temp.unlink()
        if isinstance(e, OSError):
            raise PrecompileError(
                f"cannot write {target}: {e}. Nothing there was replaced; "
                "pick a writable path that is not a directory."
            ) from e
        raise
    _sync_directory(target.parent)


def _sync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _previous_cache(path: Path) -> Path | None:
    try:
        return cache_path(path, path.read_text())
    except (OSError, UnicodeDecodeError):
        return None


def _remove_stale(path: Path, keep: set[Path | None]) -> None:
    """Drop caches of earlier sources (keeping the one just replaced, for readers still on
    it) and temporary files that a killed writer left behind."""
    caches = re.compile(rf"{re.escape(path.stem)}\.[0-9a-f]{{{_HASH_CHARS}}}\.cache")
    now = time.time()
    for entry in path.parent.iterdir():
        name = entry.name
        stale_cache = caches.fullmatch(name) and entry not in keep
        stale_temp = (
            name.startswith((f".{path.name}.", f".{path.stem}."))
            and name.endswith(".tmp")
            and now - _mtime(entry) > _STALE_TEMP_SECONDS
        )
        if stale_cache or stale_temp:
            with contextlib.suppress(OSError):
                entry.unlink()


def _mtime(entry: Path) -> float:
    try:
        return entry.stat().st_mtime
    except OSError:
        return time.time()
