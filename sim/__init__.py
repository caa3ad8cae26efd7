"""Simulated GPU inference servers: the fleet every other part of affinity-proxy is tested and measured on.

Public API (import from the modules; this package imports nothing heavy by itself):
- `sim.fleet.start_fleet(n, ...) -> Fleet` / `Fleet.stop()`: servers in this process.
- `sim.backend.SimBackend.generate(SimRequest) -> AsyncIterator[TokenChunk]`: the protocol-neutral
  generation API the HTTP (server.py) and gRPC (grpc.py) front ends share.
- `sim.engine.Engine`: the pure engine model, driven by a caller's clock (virtual-time replay).
- `sim.profiles.get_profile(name, **overrides)`: hardware/model profiles.
- `python -m sim ...`: the fleet as a process.
"""
