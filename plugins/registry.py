"""Plugin manager, entry-point loading, and the proposer registry built from the hooks."""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Callable

import pluggy

from . import hookspecs

ENTRY_POINT_GROUP = "specplug"
# Built-ins are plugins too: modules with a @hookimpl, loaded exactly like third-party ones.
BUILTIN_PLUGINS = ("specplug.proposers.draft_model", "specplug.proposers.ngram")


@dataclass(frozen=True)
class ProposerInfo:
    name: str
    factory: Callable
    description: str
    source: str  # the distribution (or module) that registered it


@dataclass(frozen=True)
class PluginFailure:
    plugin: str
    source: str
    error: str


class UnknownProposerError(KeyError):
    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


pm = pluggy.PluginManager(hookspecs.PROJECT)
pm.add_hookspecs(hookspecs)
_loaded = False
_sources: dict[str, str] = {}  # plugin name -> distribution or module
failures: list[PluginFailure] = []


def _register_plugin(module, name: str, source: str) -> None:
    pm.register(module, name=name)
    _sources[name] = source


def load_plugins() -> None:
    """Register the built-ins, then every entry point in group ``specplug``; a broken one is reported, not fatal."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module_name in BUILTIN_PLUGINS:
        try:
            _register_plugin(importlib.import_module(module_name), module_name, "specplug")
        except Exception as exc:  # a broken built-in must not take the others down either
            _fail(module_name, "specplug", exc)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        if pm.has_plugin(ep.name):
            continue
        try:
            _register_plugin(ep.load(), ep.name, dist)
        except Exception as exc:
            _fail(ep.name, dist, exc)


def _fail(plugin: str, source: str, exc: BaseException) -> None:
    failures.append(PluginFailure(plugin, source, f"{type(exc).__name__}: {exc}"))
    warnings.warn(f"specplug plugin {plugin!r} from {source!r} failed to load and was skipped: {exc!r}",
                  stacklevel=3)


def list_proposers() -> dict[str, ProposerInfo]:
    """Every registered proposer by name, each plugin's hook called with its own ``register``."""
    load_plugins()
    found: dict[str, ProposerInfo] = {}
    for impl in pm.hook.register_proposers.get_hookimpls():
        source = _sources.get(impl.plugin_name, impl.plugin_name)

        def register(name: str, factory: Callable, description: str = "", _source: str = source) -> None:
            if name in found:
                warnings.warn(f"proposer {name!r} from {_source!r} shadows the one from {found[name].source!r}")
            found[name] = ProposerInfo(name, factory, description, _source)

        try:
            impl.function(register=register)
        except Exception as exc:
            if not any(f.plugin == impl.plugin_name for f in failures):
                _fail(impl.plugin_name, source, exc)
    return dict(sorted(found.items()))


def get_proposer(name: str, **options):
    """Build the proposer registered as ``name`` with ``options`` (e.g. ``target=``, ``model=``)."""
    available = list_proposers()
    if name not in available:
        raise UnknownProposerError(f"unknown proposer {name!r}; available: {', '.join(available) or 'none'}")
    try:
        proposer = available[name].factory(**options)
    except TypeError as exc:
        raise TypeError(f"proposer {name!r}: bad options {sorted(options)}: {exc}") from exc
    if not getattr(proposer, "name", None) or proposer.name == "proposer":
        proposer.name = name
    return proposer
