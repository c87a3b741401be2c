"""The bundled model zoo: ``zoo:NAME`` resolves to a model directory shipped inside the package."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

PREFIX = "zoo:"
# The draft (and later heads) that belong to each bundled target.
DEFAULT_DRAFT = {"pycode": "pycode-draft"}
# Feature heads (specplug.heads format) trained for each bundled target.
DEFAULT_EAGLE = {"pycode": "pycode-eagle"}
DEFAULT_MTP = {"pycode": "pycode-mtp"}


def models_dir() -> Path:
    return Path(str(resources.files("specplug") / "models"))


def available() -> list[str]:
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()
                  and "specplug_head" not in (p / "config.json").read_text())  # heads are not models


def is_zoo_name(name: object) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def resolve(name: str) -> Path:
    """``zoo:pycode`` -> the bundled directory; a clear error if it is not bundled in this install."""
    short = name[len(PREFIX):]
    path = models_dir() / short
    if not (path / "config.json").is_file():
        have = ", ".join(PREFIX + n for n in available()) or "none"
        raise FileNotFoundError(f"no bundled model {name!r} in this install (bundled: {have})")
    return path
