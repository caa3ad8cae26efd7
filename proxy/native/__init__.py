"""The hot path compiled ahead of time with mypyc: `loader` (used on every import of proxy) and `build`."""
