"""What the test suite may not touch: the working tree and the directory it is run from (tests write
only under their temporary directories). Used by the session guard in conftest.py."""
from __future__ import annotations

import os
from pathlib import Path

# written by Python and pytest themselves, not by a test
IGNORED = {".git", ".venv", "__pycache__", ".pytest_cache"}


def snapshot(root: Path, recursive: bool = True) -> dict[str, tuple[int, int]]:
    """(size, mtime in ns) of every file under ``root``; with ``recursive=False`` of its own entries only."""
    if not recursive:
        return {e.name: _stamp(e.path) if e.is_file() else (0, 0) for e in os.scandir(root) if e.name not in IGNORED}
    found = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in IGNORED and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder) / name
            found[str(path.relative_to(root))] = _stamp(path)
    return found


def _stamp(path) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:  # removed while walking
        return (-1, -1)
    return st.st_size, st.st_mtime_ns


def changes(before: dict, after: dict) -> list[str]:
    """Files added, changed or removed between two snapshots."""
    return ([f"added {p}" for p in sorted(after.keys() - before.keys())]
            + [f"changed {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
            + [f"removed {p}" for p in sorted(before.keys() - after.keys())])
