"""The hooks a specplug plugin may implement. Import ``hookimpl`` (also ``specplug.hookimpl``) to mark them."""
import pluggy

PROJECT = "specplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_proposers(register):
    """Register draft proposers: ``register(name, factory, description)``; ``factory(**options)`` builds one."""


@hookspec
def register_policies(register):
    """Register γ policies: ``register(name, factory, description)``; ``factory(**options)`` builds one."""
