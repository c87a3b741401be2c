"""specplug.proposers — the built-in draft proposers, one module each, registered through the plugin hook."""
