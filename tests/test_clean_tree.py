"""The guard that keeps the suite from writing into the working tree or the current directory (conftest.py
runs it around the whole session) notices what a careless test leaves behind."""
import os

from clean_tree import changes, snapshot


def _tree(root):
    (root / "pkg").mkdir()
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "README.md").write_text("# r\n")
    return root


def test_a_file_written_into_the_tree_is_reported(tmp_path):
    root = _tree(tmp_path)
    before = snapshot(root)
    (root / "report.html").write_text("<html>")
    assert changes(before, snapshot(root)) == ["added report.html"]


def test_a_file_rewritten_or_removed_is_reported(tmp_path):
    root = _tree(tmp_path)
    before = snapshot(root)
    (root / "pkg" / "mod.py").write_text("x = 22\n")
    (root / "README.md").unlink()
    assert changes(before, snapshot(root)) == [f"changed pkg{os.sep}mod.py", "removed README.md"]


def test_bytecode_caches_are_not_the_suites_writing(tmp_path):
    root = _tree(tmp_path)
    before = snapshot(root)
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    assert changes(before, snapshot(root)) == []


def test_the_current_directory_is_watched_at_its_top_level(tmp_path):
    root = _tree(tmp_path)
    before = snapshot(root, recursive=False)
    (root / "report.html").write_text("<html>")
    (root / "pkg" / "deep.txt").write_text("not watched: the cwd may be a home directory")
    assert changes(before, snapshot(root, recursive=False)) == ["added report.html"]
