"""Output paths a user names: why nothing could be written there, said before any work."""
from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["why_unwritable", "inside"]


def why_unwritable(path, folder: bool, example: str = "") -> str | None:
    """Why nothing can be written at ``path`` (a folder to make or fill when ``folder``, a
    file to write otherwise, ``example`` a file name to suggest inside a folder given for
    it), to follow the path in a message, or ``None`` where nothing stands in the way."""
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        return "is a file, not a folder; pass a folder (it is made if it does not exist)"
    if not folder and path.is_dir():
        return f"is a folder; pass a file name, e.g. {path / example}"
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return f"lies under {blocker}, a file, so nothing can be written there; pass another path"
    return _write_refused(path, folder)


def _write_refused(path: Path, folder: bool) -> str | None:
    """Why a write at ``path`` fails (a read-only file system, no permission, a folder that
    takes no new entries), tried with a scratch file where the first write would go: in
    the folder, or in the nearest folder above that exists; ``None`` where it succeeds."""
    if not folder and path.exists() and not path.is_file() and not path.is_dir():
        return None                 # a device or a pipe (/dev/null): its own to refuse
    where = path if not folder and path.is_file() else \
        next(p for p in (path, *path.parents) if p.is_dir())
    try:
        if where == path and not folder:
            with open(path, "ab"):          # appends nothing: the file is left as it was
                return None
        with tempfile.TemporaryFile(dir=where, prefix=".mpishard-write-test-"):
            return None
    except OSError as err:
        place = f"to {where}" if where == path and not folder else f"in {where}"
        return (f"cannot be written: writing {place} fails ({err.strerror or err}); pass "
                f"a path you can write to")


def inside(path, folder) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (links resolved), as an output
    that would write over what is read from ``folder``."""
    path, folder = Path(path).resolve(), Path(folder).resolve()
    return path == folder or folder in path.parents
