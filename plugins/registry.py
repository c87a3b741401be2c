"""Plugin manager, entry-point loading, and the proposer registry built from the hooks."""
from __future__ import annotations

import importlib
import inspect
import numbers
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Callable

import pluggy

from . import hookspecs

ENTRY_POINT_GROUP = "specplug"
# Built-ins are plugins too: modules with a @hookimpl, loaded exactly like third-party ones.
BUILTIN_PLUGINS = ("specplug.policies", "specplug.proposers.draft_model", "specplug.proposers.ngram",
                   "specplug.proposers.eagle", "specplug.proposers.eagle3", "specplug.proposers.mtp",
                   "specplug.proposers.suffix", "specplug.proposers.fallback")


@dataclass(frozen=True)
class PluginInfo:
    """A registered proposer or policy."""

    name: str
    factory: Callable
    description: str
    source: str  # the distribution (or module) that registered it


@dataclass(frozen=True)
class PluginFailure:
    plugin: str
    source: str
    error: str


ProposerInfo = PluginInfo


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


def _collect(hook_name: str) -> dict[str, PluginInfo]:
    """Call each plugin's ``hook_name`` with its own ``register``, so every entry knows its distribution."""
    load_plugins()
    found: dict[str, PluginInfo] = {}
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        source = _sources.get(impl.plugin_name, impl.plugin_name)

        def register(name: str, factory: Callable, description: str = "", _source: str = source) -> None:
            if name in found:
                warnings.warn(f"{name!r} from {_source!r} shadows the one from {found[name].source!r}")
            found[name] = PluginInfo(name, factory, description, _source)

        try:
            impl.function(register=register)
        except Exception as exc:
            if not any(f.plugin == impl.plugin_name for f in failures):
                _fail(impl.plugin_name, source, exc)
    return dict(sorted(found.items()))


def list_proposers() -> dict[str, PluginInfo]:
    """Every registered proposer by name."""
    return _collect("register_proposers")


def list_policies() -> dict[str, PluginInfo]:
    """Every registered γ policy by name."""
    return _collect("register_policies")


def get_proposer(name: str, **options):
    """Build the proposer registered as ``name`` with ``options`` (e.g. ``target=``, ``model=``)."""
    proposer = _build("proposer", list_proposers(), name, options)
    if not getattr(proposer, "name", None) or proposer.name == "proposer":
        proposer.name = name
    return proposer


def get_policy(name: str, **options):
    """Build the γ policy registered as ``name`` (``fixed``, ``heuristic``, ``cost-model``, plugins)."""
    return _build("policy", list_policies(), name, options)


def check_proposer_options(name: str, **options) -> None:
    """Raise what :func:`get_proposer` would raise for ``name`` and ``options`` before building anything: an
    unknown name, options the factory does not take, a value of the wrong scalar type. Nothing is built (the
    target need not be loaded yet)."""
    _factory("proposer", list_proposers(), name, options)


def _build(kind: str, available: dict[str, PluginInfo], name: str, options: dict):
    return _factory(kind, available, name, options)(**options)


def _factory(kind: str, available: dict[str, PluginInfo], name: str, options: dict) -> Callable:
    """The factory registered as ``name``, once ``options`` fit its signature."""
    if name not in available:
        raise UnknownProposerError(f"unknown {kind} {name!r}; available: {', '.join(available) or 'none'}")
    factory = available[name].factory
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to check (some builtins): the call itself will tell
        signature = None
    if signature is not None:
        try:  # only options the factory's signature does not take are bad options; a TypeError raised
            signature.bind(**options)  # inside the factory is its own error, and keeps its traceback
        except TypeError as exc:
            raise TypeError(f"{kind} {name!r}: {_unfit(signature, options, exc)}") from exc
        _check_scalar_options(f"{kind} {name!r}", signature, options)
    return factory


def _unfit(signature: inspect.Signature, options: dict, exc: TypeError) -> str:
    """What is wrong with ``options`` for a factory: the names it does not take, and those it does."""
    params = signature.parameters
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [o for o in options if o not in params]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return f"bad options {sorted(unknown)}; it takes {', '.join(named) or 'none'}"
    return f"bad options {sorted(options)}: {exc}"


# annotations naming one scalar type: a value of another type (``-o size=abc`` on the command line reads a
# string) is refused by name here, rather than failing later inside the factory on a comparison
_SCALARS = {"int": numbers.Integral, "float": numbers.Real, "bool": bool}


def _check_scalar_options(culprit: str, signature: inspect.Signature, options: dict) -> None:
    for key, value in options.items():
        param = signature.parameters.get(key)
        annotation = getattr(param, "annotation", None)
        wanted = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None)
        kind = _SCALARS.get(wanted)
        if kind is None:
            continue
        fits = isinstance(value, bool) if kind is bool else isinstance(value, kind) and not isinstance(value, bool)
        if not fits:
            raise TypeError(f"{culprit}: option {key} takes {'a' if wanted != 'int' else 'an'} {wanted}, "
                            f"got {value!r}")
