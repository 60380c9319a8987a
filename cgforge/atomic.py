"""Writing a file all at once: the one atomic writer of the package.

Every file cgforge writes goes under a unique temporary name beside its destination, is flushed to disk, given the
mode a plain ``open`` would give it and renamed into place; on any error the temporary file is removed, so a reader
sees the old file or the whole new one, and no user file is touched on failure.

    atomic_write("out.bin", lambda f: f.write(data))
    with atomic_path("run.png") as tmp:
        figure.savefig(tmp, format="png")      # writers that want a file name
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_path", "atomic_write", "atomic_save", "check_new_file"]


@contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = "") -> Iterator[Path]:
    """A unique temporary path beside ``path`` to write to; when the block ends without an error it is synced
    to disk and renamed to ``path``, otherwise removed. ``suffix`` ends the temporary name (writers such as
    ``numpy.savez`` append their own extension to a name without it)."""
    path = Path(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{suffix}", dir=path.parent)
    except OSError as err:  # the error would name the temporary file, which the caller never asked for
        raise _unwritable(err, path) from err
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        mask = os.umask(0)  # read by setting and restoring it
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600: give the file the usual mode
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()  # our own half-written file, never a user's


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """``write(file)`` into a temporary file beside ``path``, then rename it to ``path`` (see the module)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)
    return Path(path)


def _unwritable(err: OSError, path: Path, what: str | None = None) -> OSError:
    """``err`` (of its class and errno) with a message naming ``path`` and its directory."""
    reason = err.strerror or str(err)
    new = type(err)(f"{what + ': ' if what else ''}cannot write {path}: directory {path.parent} is not writable "
                    f"({reason})")
    new.errno = err.errno
    return new


def check_new_file(path: str | os.PathLike, *, force: bool = False, what: str = "output") -> Path:
    """``path`` as an output file name: not a directory, in a directory that exists and this process may
    create files in, and not an existing file unless ``force``; ``what`` names the path in errors (e.g. a
    command-line argument)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what}: {path} is a directory, expected a file name")
    if path.exists() and not force:
        raise FileExistsError(f"{what}: {path} exists; use force=True (--force) to overwrite it")
    if not path.parent.exists():
        raise FileNotFoundError(f"{what}: directory {path.parent} does not exist")
    if not path.parent.is_dir():
        raise NotADirectoryError(f"{what}: cannot write {path}: {path.parent} is a file, not a directory")
    if not os.access(path.parent, os.W_OK | os.X_OK):  # read-only mount or no permission: before any work
        raise _unwritable(PermissionError(errno.EACCES, "read-only or no write permission"), path, what)
    return path


def atomic_save(obj: Any, path: str | os.PathLike, *, force: bool = False, dump: Callable[[Any, IO[bytes]], Any]
                | None = None, what: str = "output") -> Path:
    """``dump(obj, file)`` (default ``torch.save``) written atomically to a new file ``path`` (``force``:
    replace an existing one); ``what`` names the path in errors."""
    if dump is None:
        import torch

        dump = torch.save
    path = check_new_file(path, force=force, what=what)
    return atomic_write(path, lambda f: dump(obj, f))
