"""Seeing every request: access log, heat-map windows and hot-spot rules, admin page, traces.

How the pieces attach (dependencies passed in, nothing wired after construction):

```python
observer = Observer(config.logging, config.hotspots, metrics.registry)          # clock: time.time
tracing = build_tracing(config.tracing)                                          # None when off
admin_app.add_routes(observability_routes(observer, lambda: snapshot_json(store.current, inflight)))
asyncio.create_task(observer.run())                                              # closes quiet windows

# in the lifecycle (dataplane), per request:
record = RequestRecord(request_id=..., client=..., protocol=HTTP1 | H2 | GRPC, method=..., path=...)
...after pick:    record.backend, .policy, .reason, .load_score, .inflight = ...; observer.on_pick(record)
...first byte:    record.ttft_s = now - arrival
...finish:        record.status, .attempts, .duration_s, .bytes_in/out, .prompt_tokens, ... ;
                  observer.on_finish(record)
```

The lifecycle does this through `lifecycle.Observability` (given to the OpenAI pipeline, hence to HTTP/1.1, the
HTTP/2 bridge and the gRPC relay) and one `lifecycle.RequestObservation` per request; `proxy/app.py` builds the
Observer (role single / worker / aggregator by process role), the tracing and the routes.

Modules: `lifecycle` (the lifecycle's hook), `demote` (optional: a hot spot's weight lowered), `record` (the one plain record), `config` (logging/access_log/tracing sections), `access_log`,
`logs` (JSON formatter), `observer`, `admin_routes` + `dashboard_page`, `tracing`. The windows and the
rules themselves are pure code in `proxy.core.hotspots`.
"""
