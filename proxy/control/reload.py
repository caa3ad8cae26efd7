"""Hot reload: SIGHUP or a change of the config file -> validate -> swap in, or keep serving the old one.

Validation is the full config parser (proxy/config.py), so a reload accepts exactly what `check-config`
accepts: in particular an empty file, or one with no backend (unless discovery is on), is invalid, so a
file caught between truncate and rewrite never empties the fleet. An invalid file changes nothing: the error is logged with every path and line, counted
(`affinity_proxy_config_reloads{result="invalid"}`), flagged (`affinity_proxy_config_last_reload_ok` 0,
alertable while the file on disk stays broken) and kept as `last_error` for the admin API. A valid file is
handed to `apply`, which swaps snapshots and settings in place: listeners stay bound, connections stay
open, and in-flight requests finish on the backend they started on.

The watch polls the file's identity (mtime, size, inode) instead of using inotify: it works the same on
every platform and for Kubernetes ConfigMaps, whose update is an atomic symlink swap that replaces the
inode. A half-written file simply fails validation and the next write triggers another attempt.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Callable

from proxy.config import Config, ConfigError, load_config
from proxy.control.resilience_metrics import ResilienceMetrics

log = logging.getLogger("affinity_proxy.reload")

Apply = Callable[[Config], int]  # applies a validated config; returns the snapshot version now current


@dataclass(frozen=True)
class ReloadResult:
    ok: bool
    version: int  # snapshot version after the attempt (unchanged when invalid)
    reason: str  # sighup | file_changed | admin | ...
    errors: tuple[str, ...] = field(default=())


class Reloader:
    def __init__(
        self,
        path: str,
        apply: Apply,
        current_version: Callable[[], int],
        *,
        loader: Callable[[str], Config] = load_config,
        metrics: ResilienceMetrics | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.path = path
        self.apply = apply
        self.current_version = current_version
        self.loader = loader
        self.metrics = metrics if metrics is not None else ResilienceMetrics()
        self.poll_s = poll_s
        self.last_result: ReloadResult | None = None
        self._lock = asyncio.Lock()
        self._identity = self._stat()
        self._signal_installed = False

    @property
    def last_error(self) -> tuple[str, ...]:
        r = self.last_result
        return r.errors if r is not None and not r.ok else ()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    async def reload(self, reason: str = "admin") -> ReloadResult:
        """Load, validate and apply the file. Serialised: two triggers never apply concurrently."""
        async with self._lock:
            self._identity = self._stat()
            try:
                config = self.loader(self.path)
            except ConfigError as exc:
                result = ReloadResult(False, self.current_version(), reason, tuple(exc.errors))
                self.metrics.reloads.labels("invalid").inc()
                log.error("config reload (%s) rejected, the previous configuration keeps serving:\n%s",
                          reason, "\n".join(f"  {e}" for e in exc.errors))
            except Exception as exc:  # noqa: BLE001 - whatever a file does to the loader, the old config serves on
                result = ReloadResult(False, self.current_version(), reason, (f"cannot load: {exc!r}",))
                self.metrics.reloads.labels("invalid").inc()
                log.exception("config reload (%s) failed to load, the previous configuration keeps serving", reason)
            else:
                try:
                    version = self.apply(config)
                except Exception as exc:  # a rule only the running proxy can check (e.g. a discovery name)
                    result = ReloadResult(False, self.current_version(), reason, (f"apply failed: {exc}",))
                    self.metrics.reloads.labels("invalid").inc()
                    log.exception("config reload (%s) could not be applied", reason)
                else:
                    result = ReloadResult(True, version, reason)
                    self.metrics.reloads.labels("ok").inc()
                    log.info("config reloaded (%s): snapshot version %d", reason, version)
            self.last_result = result
            self.metrics.reload_ok.set(1 if result.ok else 0)
            return result

    # ------------------------------------------------------------------------------------------ triggers

    def install_signal(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload("sighup")))
        self._signal_installed = True

    def remove_signal(self) -> None:
        if self._signal_installed:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._signal_installed = False

    async def watch(self) -> None:
        """Lifetime task: reload whenever the file's identity changes."""
        while True:
            await asyncio.sleep(self.poll_s)
            identity = self._stat()
            if identity is not None and identity != self._identity:
                await self.reload("file_changed")

    async def start(self) -> None:
        self.install_signal()

    async def stop(self) -> None:
        self.remove_signal()


__all__ = ["ReloadResult", "Reloader"]
