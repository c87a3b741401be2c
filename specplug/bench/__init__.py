"""specplug.bench — side-by-side comparison of proposers against target-only decoding."""
