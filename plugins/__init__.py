"""specplug.plugins — hookspecs, the plugin manager, entry-point loading and the proposer registry."""
from .hookspecs import hookimpl, hookspec
from .registry import (ENTRY_POINT_GROUP, PluginFailure, PluginInfo, ProposerInfo, UnknownProposerError,
                       check_proposer_options, failures, get_policy, get_proposer, list_policies, list_proposers,
                       load_plugins, pm)

__all__ = ["hookimpl", "hookspec", "ENTRY_POINT_GROUP", "PluginFailure", "ProposerInfo", "UnknownProposerError",
           "check_proposer_options", "failures", "get_policy", "get_proposer", "list_policies", "list_proposers",
           "load_plugins", "pm", "PluginInfo"]
