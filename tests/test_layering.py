"""Who may import whom (docs/design.md, "The house"), checked by walking the source's import statements.

- the verifier imports only torch, numpy, the standard library and itself;
- a proposer never imports the decode loop (specplug.decode, specplug.batch, any engine module) or another
  proposer;
- the decode loop never imports a concrete proposer;
- no module takes another's private names, by import or as an attribute of the module (training reaches
  proposers through the registry or their public names; the engine's pieces share through public ones).
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the package-dir mapping of pyproject.toml: import name -> folder
PACKAGES = {"specplug": "specplug", "specplug.verifier": "verifier", "specplug.proposers": "proposers",
            "specplug.plugins": "plugins"}
LOOP = ("specplug.decode", "specplug.batch", "specplug.engine")
VERIFIER_MAY_IMPORT = ("torch", "numpy", "specplug.verifier")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module imported
    names: tuple[str, ...]  # names taken from it (empty for a plain ``import``)
    line: int


def modules(root: Path, packages: dict[str, str] = PACKAGES) -> dict[str, Path]:
    """Every source module under the mapped folders, by import name."""
    found = {}
    for package, folder in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            found.setdefault(name, path)  # a nested mapped package (specplug.verifier) wins over a namesake
    return found


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def _from_target(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    return _absolute(module, is_package, node.level, node.module) if node.level else node.module or ""


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """The imports of one module, anywhere in it (function-level ones too), as absolute module names.
    ``from pkg import sub`` where ``pkg.sub`` is a module counts as importing ``pkg.sub``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(name, alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(name, is_package, node)
            if target == "__future__":
                continue
            plain = []
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    out.append(Import(name, f"{target}.{alias.name}", (), node.lineno))
                else:
                    plain.append(alias.name)
            if plain:
                out.append(Import(name, target, tuple(plain), node.lineno))
    return out


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _reexports(package: str, known: dict[str, Path]) -> dict[str, str]:
    """Names a package's ``__init__`` takes from its modules: ``from specplug import generate`` is the loop."""
    path = known.get(package)
    if path is None or path.name != "__init__.py":
        return {}
    return {n: i.target for i in imports(package, path, known) for n in i.names}


def violations(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> list[str]:
    """Every import that breaks a layering rule, as 'module:line imports target: rule'."""
    known = modules(root, packages)
    found = []
    for name, path in known.items():
        for imp in imports(name, path, known):
            targets = [imp.target] + [_reexports(imp.target, known).get(n, imp.target) for n in imp.names]
            for rule in _broken(name, imp, targets):
                found.append(f"{name}:{imp.line} imports {imp.target}: {rule}")
        for line, module, attribute in private_attributes(name, path, known):
            found.append(f"{name}:{line} reads {module}.{attribute}: a module takes only another's public names")
    return found


def private_attributes(name: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str, str]]:
    """Private names read as attributes of another of the project's modules (``decode._emit()``), the
    module reached through whatever name an import bound to it: (line, module, name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    bound = {}  # local name -> the dotted name it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(name, is_package, node)
            bound.update({alias.asname or alias.name: f"{target}.{alias.name}" for alias in node.names})
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain = _dotted(node.value)
            if chain is None or chain[0] not in bound:
                continue
            module = ".".join([bound[chain[0]], *chain[1:]])
            if module in known and module != name:
                found.append((node.lineno, module, node.attr))
    return found


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything but names joined by dots."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else [*head, node.attr]
    return None


def _broken(name: str, imp: Import, targets: list[str]) -> list[str]:
    broken = []
    if _under(name, ["specplug.verifier"]):
        top = imp.target.split(".")[0]
        if not (_under(imp.target, VERIFIER_MAY_IMPORT) or top in sys.stdlib_module_names):
            broken.append("the verifier imports only torch and numpy")
    if _under(name, ["specplug.proposers"]) and name != "specplug.proposers":
        if any(_under(t, LOOP) for t in targets):
            broken.append("a proposer never imports the decode loop")
        others = [t for t in targets if _under(t, ["specplug.proposers"]) and t not in ("specplug.proposers", name)]
        if others:
            broken.append("a proposer never imports another proposer")
    if _under(name, LOOP) and any(_under(t, ["specplug.proposers"]) for t in targets):
        broken.append("the decode loop never imports a concrete proposer")
    if _under(imp.target, PACKAGES) and imp.target != name:
        private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
        if private:
            broken.append(f"a module takes only another's public names, not {', '.join(private)}")
    return broken


def test_the_source_keeps_every_layering_rule():
    assert violations() == []


def test_the_walk_sees_every_package():
    known = modules(ROOT)
    for module in ("specplug.verifier.rule", "specplug.proposers.ngram", "specplug.decode", "specplug.batch",
                   "specplug.training.eagle", "specplug.plugins.registry"):
        assert module in known


def _planted(tmp_path: Path, files: dict[str, str]) -> Path:
    """A miniature source tree laid out as the repository's, with ``files`` (path -> source) planted in it."""
    base = {"specplug/__init__.py": "from .decode import generate\n", "specplug/decode.py": "",
            "specplug/target.py": "", "specplug/training/__init__.py": "", "verifier/__init__.py": "",
            "verifier/rule.py": "import math\nimport torch\nfrom .proposal import Proposal\n",
            "verifier/proposal.py": "", "proposers/__init__.py": "", "proposers/ngram.py": "",
            "proposers/eagle.py": "from specplug.target import Target\n", "plugins/__init__.py": ""}
    for rel, text in {**base, **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_a_clean_planted_tree_passes(tmp_path):
    assert violations(_planted(tmp_path, {})) == []


def test_a_verifier_importing_the_target_is_caught(tmp_path):
    planted = "import torch\n\ndef f():\n    from specplug.target import Target\n"
    root = _planted(tmp_path, {"verifier/rule.py": planted})
    assert violations(root) == ["specplug.verifier.rule:4 imports specplug.target: "
                                "the verifier imports only torch and numpy"]


def test_a_verifier_reaching_up_by_a_relative_import_is_caught(tmp_path):
    root = _planted(tmp_path, {"verifier/rule.py": "from .. import target\n"})
    assert [v.split(": ")[1] for v in violations(root)] == ["the verifier imports only torch and numpy"]


def test_a_proposer_importing_the_loop_is_caught_also_through_the_package(tmp_path):
    root = _planted(tmp_path, {"proposers/ngram.py": "from specplug import generate\n",
                               "proposers/suffix.py": "import specplug.decode\n"})
    rules = sorted(v.split(": ")[1] for v in violations(root))
    assert rules == ["a proposer never imports the decode loop"] * 2


def test_a_proposer_importing_another_proposer_is_caught(tmp_path):
    root = _planted(tmp_path, {"proposers/mtp.py": "from .eagle import Head\n"})
    assert violations(root) == ["specplug.proposers.mtp:1 imports specplug.proposers.eagle: "
                                "a proposer never imports another proposer"]


def test_the_loop_importing_a_concrete_proposer_is_caught(tmp_path):
    root = _planted(tmp_path, {"specplug/batch.py": "from specplug.proposers.ngram import NgramProposer\n"})
    assert violations(root) == ["specplug.batch:1 imports specplug.proposers.ngram: "
                                "the decode loop never imports a concrete proposer"]


def test_a_module_taking_anothers_private_name_is_caught(tmp_path):
    root = _planted(tmp_path, {"specplug/training/eagle.py":
                               "def f():\n    from specplug.proposers.eagle import _rope\n",
                               "specplug/training/mtp.py": "from specplug.proposers.eagle import EagleHead\n",
                               "specplug/training/heads.py": "from .trainer import _Clock, lr_at\n",
                               "specplug/training/trainer.py": "from itertools import count as _count\n"})
    assert violations(root) == ["specplug.training.eagle:2 imports specplug.proposers.eagle: "
                                "a module takes only another's public names, not _rope",
                                "specplug.training.heads:1 imports specplug.training.trainer: "
                                "a module takes only another's public names, not _Clock"]


def test_a_module_reading_anothers_private_name_as_an_attribute_is_caught(tmp_path):
    root = _planted(tmp_path, {"specplug/native.py": "from . import target\nkey = target._hardware()\n",
                               "specplug/cli.py": "import specplug.target\nx = specplug.target._seen\n",
                               "specplug/zoo.py": "import specplug.target as t\nx = t.public, t.__name__\n",
                               "specplug/target.py": "import itertools\n_seen = itertools._grouper\n",
                               "specplug/training/trainer.py": "from .. import decode as d\nd._emit()\n"})
    assert sorted(violations(root)) == [
        "specplug.cli:2 reads specplug.target._seen: a module takes only another's public names",
        "specplug.native:2 reads specplug.target._hardware: a module takes only another's public names",
        "specplug.training.trainer:2 reads specplug.decode._emit: a module takes only another's public names"]
