"""A node's local tier of block values: plain files on its SSD, bounded in bytes, least recently used out.

Each value is the block codec's value exactly as Redis holds it (or its header and token
section, what a hybrid prefix reads of the blocks before its last), so it is checked the
same way when read: format, fingerprint, the key's digest, checksums. Files are named by a
hash of the block key, written to a temporary name and renamed into place (a reader sees
a whole value or none), and read straight into the fetch's arrays (``readinto``). Several
worker processes may share one directory: names are unique per writer, a rename is atomic,
and an eviction runs under a file lock; a file removed while another process reads it stays
readable until closed. Reading a file marks it used (its mtime, to the nearest 10 s); when the directory holds
more than ``max_bytes``, the least recently used files go until it holds 90 % of it.
Plain files, not ``diskcache``: ``bench/scale.py`` measures both for a warm fetch.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Sequence

from .wire import advanced

log = logging.getLogger(__name__)

_WHOLE, _PART = ".blk", ".part"  # a whole value; a value's header and token section
_STALE_TMP_S = 3600  # a temporary file this old was left by a writer that died
_RESCAN_SHARE = 0.05  # rescan the directory after writing this share of max_bytes
_RECENT_S = 10.0  # a file used this recently is not marked again (a metadata write per read saved)


class FileValue:
    """One stored file as a ``cache_store.wire.ValueSource`` (read in order, then closed)."""

    scatters = True  # a block's pieces are read in one preadv (cache_store.block_reader)

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pos = 0
        st = os.fstat(fd)
        self.length, self.mtime = st.st_size, st.st_mtime

    def readinto(self, view: memoryview) -> None:
        self.readinto_many([view])

    def readinto_many(self, views: Sequence[memoryview]) -> None:
        """Scatter the next bytes into ``views`` (``preadv``: one call for a whole block)."""
        pending = [v for v in views if len(v)]
        while pending:
            n = os.preadv(self._fd, pending[:512], self._pos)
            if not n:
                raise OSError("local tier: file ended early (removed or truncated while read)")
            self._pos += n
            pending = advanced(pending, n)

    def skip(self, n: int) -> None:
        self._pos += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalTier:
    """Block values in ``directory`` (created if missing), at most about ``max_bytes``."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes: {max_bytes!r}; allowed integers >= 1")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._root = str(self.directory)
        self.max_bytes = max_bytes
        self._written_since_scan = max_bytes  # scan (and bound) on the first write
        self._pid = os.getpid()
        self._serial = 0

    def _path(self, key: str, suffix: str) -> str:
        # Strings, not Path objects: a fetch looks up every block of a chain (Path parsing showed).
        return _stem(self._root, key) + suffix

    def has(self, key: str, whole: bool = False) -> bool:
        """Whether a value of ``key`` is here (``whole``: the whole value; else its token section will do)."""
        return os.path.exists(self._path(key, _WHOLE)) or (not whole and os.path.exists(self._path(key, _PART)))

    def open(self, key: str, whole: bool) -> FileValue | None:
        """The value of ``key`` to read (marked used), or None; ``whole=False`` also takes a
        file holding only its header and token section."""
        for suffix in (_WHOLE,) if whole else (_WHOLE, _PART):
            path = self._path(key, suffix)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("local tier: cannot read %s: %s", path, exc)
                return None
            value = FileValue(fd)
            if time.time() - value.mtime > _RECENT_S:  # least recently used goes first
                try:
                    os.utime(fd)
                except OSError:
                    pass
            return value
        return None

    def put(self, key: str, parts: Sequence[memoryview], whole: bool) -> bool:
        """Write a value of ``key`` from its bytes in order (``whole`` or its token section);
        False if the disk refused it (logged)."""
        path = Path(self._path(key, _WHOLE if whole else _PART))
        self._serial += 1
        tmp = path.with_name(f"{path.name}.tmp.{self._pid}.{self._serial}")
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                n_bytes = _write_all(fd, parts)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if whole:
                Path(self._path(key, _PART)).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("local tier: cannot write %s: %s", path, exc)
            tmp.unlink(missing_ok=True)
            return False
        self._written_since_scan += n_bytes
        if self._written_since_scan >= _RESCAN_SHARE * self.max_bytes:
            self.evict()
        return True

    def remove(self, key: str) -> None:
        """Delete every value of ``key`` (a bad one found by a fetch)."""
        for suffix in (_WHOLE, _PART):
            Path(self._path(key, suffix)).unlink(missing_ok=True)

    def evict(self) -> int:
        """Bring the directory under ``max_bytes`` (to 90 % of it), least recently used first,
        under a lock shared by every process on this directory; returns the bytes it holds."""
        self._written_since_scan = 0
        with open(self.directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            files, total = self._scan()
            if total <= self.max_bytes:
                return total
            for mtime, size, path in sorted(files):
                if total <= 0.9 * self.max_bytes:
                    break
                try:
                    path.unlink()
                    total -= size
                except FileNotFoundError:  # another reader's remove got there first
                    total -= size
        return total

    def _scan(self) -> tuple[list[tuple[float, int, Path]], int]:
        files, total, now = [], 0, time.time()
        for sub in os.scandir(self.directory):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if ".tmp." in entry.name:
                    if now - st.st_mtime > _STALE_TMP_S:
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                files.append((st.st_mtime, st.st_size, Path(entry.path)))
                total += st.st_size
        return files, total

    def usage(self) -> dict[str, int]:
        """Files and bytes held now (a scan)."""
        files, total = self._scan()
        return {"files": len(files), "bytes": total, "max_bytes": self.max_bytes}


@functools.lru_cache(maxsize=4096)  # a fetch looks each key up, then opens it: named once
def _stem(root: str, key: str) -> str:
    """The path of ``key``'s files in ``root`` without their suffix: ``<root>/<h[:2]>/<h>``, ``h``
    the key's SHA-256."""
    name = hashlib.sha256(key.encode()).hexdigest()
    return os.path.join(root, name[:2], name)


def _write_all(fd: int, parts: Sequence[memoryview]) -> int:
    """Write ``parts`` in order (``writev``, resumed after short writes); bytes written."""
    pending = [memoryview(p).cast("B") for p in parts if len(p)]
    total = 0
    while pending:
        n = os.writev(fd, pending[:512])  # IOV_MAX is at least 1024 on Linux and macOS
        total += n
        pending = advanced(pending, n)
    return total

