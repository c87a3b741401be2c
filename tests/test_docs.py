"""The user's documents: a README read in five minutes that reaches every page of docs/, links that land,
and nothing that points outside the repository."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _links(path: Path) -> list[str]:
    return [link for link in LINK.findall(path.read_text(encoding="utf-8")) if not link.startswith("http")]


def test_the_readme_is_at_most_200_lines():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


def test_every_docs_page_is_reached_from_the_readme():
    linked = {(ROOT / link.split("#")[0]).resolve() for link in _links(ROOT / "README.md")}
    assert DOCS and [p.name for p in DOCS if p.resolve() not in linked] == []


def test_every_relative_link_lands_on_a_file_and_heading():
    for page in [ROOT / "README.md", *DOCS]:
        for link in _links(page):
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            assert path.is_file(), f"{page.name}: {link}"
            if anchor:
                assert anchor in _anchors(path), f"{page.name}: {link}"


def test_nothing_points_at_a_document_outside_the_repository():
    sources = [ROOT / "README.md", ROOT / "pyproject.toml", *DOCS, *ROOT.glob("tests/*.py")]
    sources += [p for folder in ("specplug", "verifier", "proposers", "plugins", "benchmarks", "examples")
                for p in (ROOT / folder).rglob("*.py")]
    for path in sources:
        text = path.read_text(encoding="utf-8")
        if path.name == "test_docs.py":
            continue
        assert not re.search(r"\bDESIGN\b|/work/|shared/DESIGN", text), path
