"""The zoo's corpus: the running interpreter's standard-library Python sources.

Whole files are split deterministically into train (~95%) and held-out (~5%)
by a sha256 hash of their path relative to the stdlib root, so the split is the
same on every machine with the same Python version.
"""
from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from functools import lru_cache
from pathlib import Path

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
HELDOUT_PERCENT = 5  # out of 100 hash buckets


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_heldout(rel: str) -> bool:
    h = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") % 100 < HELDOUT_PERCENT


@lru_cache(maxsize=None)
def all_files(root: str | None = None) -> tuple[str, ...]:
    """Relative (posix) paths of all eligible .py files, sorted."""
    base = Path(root) if root else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = Path(dirpath).relative_to(base)
        if any(part in EXCLUDED_DIRS for part in rel_dir.parts):
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for fn in filenames:
            if fn.endswith(".py"):
                out.append((rel_dir / fn).as_posix())
    return tuple(sorted(out))


def train_files(root: str | None = None) -> list[str]:
    return [f for f in all_files(root) if not _is_heldout(f)]


def heldout_files(root: str | None = None) -> list[str]:
    return [f for f in all_files(root) if _is_heldout(f)]


def read_source(rel: str, root: str | None = None) -> str:
    """File text, exactly as on disk (bytes decoded as UTF-8; no newline translation)."""
    base = Path(root) if root else stdlib_root()
    data = (base / rel).read_bytes()
    return data.decode("utf-8", errors="replace")


def iter_texts(split: str = "train", root: str | None = None):
    files = train_files(root) if split == "train" else heldout_files(root)
    for f in files:
        text = read_source(f, root)
        if text.strip():
            yield text


def _function_headers(text: str) -> list[str]:
    """`def` line(s) (decorators excluded) + docstring for every documented function."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if not node.body:
            continue
        first = node.body[0]
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            continue
        if len(node.body) < 2:  # needs a body to continue into
            continue
        start = node.lineno - 1
        end = first.end_lineno  # inclusive line number -> slice end
        header = "".join(lines[start:end])
        if not header.endswith("\n"):
            header += "\n"
        # Dedent to column 0 for methods, keeping relative indentation.
        indent = len(lines[start]) - len(lines[start].lstrip())
        if indent:
            header = "".join(l[indent:] if l[:indent].strip() == "" else l
                             for l in header.splitlines(keepends=True))
        if 40 <= len(header) <= 1500:
            out.append(header)
    return out


def heldout_prompts(n: int | None = None, root: str | None = None) -> list[str]:
    """Deterministic held-out prompts: a function's def line + its docstring.

    Ordered by sha256 of the prompt text (stable across runs), de-duplicated;
    the first `n` are returned (all when n is None).
    """
    seen = {}
    for f in heldout_files(root):
        for h in _function_headers(read_source(f, root)):
            seen.setdefault(hashlib.sha256(h.encode("utf-8")).hexdigest(), h)
    ordered = [seen[k] for k in sorted(seen)]
    return ordered if n is None else ordered[:n]
