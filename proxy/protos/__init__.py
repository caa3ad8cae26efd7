"""Protocol definitions (.proto) and their generated modules; regenerate with `python -m proxy.protos.regenerate`."""
