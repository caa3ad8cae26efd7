"""Application logs in the configured format: JSON lines (the access log's format) or plain text."""

from __future__ import annotations

import json
import logging
import sys
from typing import IO, Any, Mapping

from proxy.observability.config import LoggingConfig

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # what proxy/cli.py has always written
# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged as a field.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (Unix seconds, as in the access log), level, logger, message, the
    record's `extra=` fields, and the formatted exception when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": record.created, "level": record.levelname.lower(), "logger": record.name,
                               "message": record.getMessage()}
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


_OURS = "_affinity_proxy_handler"


class _Fields(logging.Filter):
    """Adds fixed fields to every record (a worker's index): JSON fields, or `[k v]` after the logger name."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        super().__init__()
        self.fields = dict(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def configure_logging(config: LoggingConfig, level: str = "info", stream: IO[str] | None = None,
                      fields: Mapping[str, Any] | None = None) -> logging.Handler:
    """Install on the root logger one handler writing `config.format` to `stream` (stderr), replacing the
    one an earlier call installed (a worker configures twice: before and after its config arrives); other
    handlers (pytest's caplog, an embedding application's) stay. `fields` (e.g. ``{"worker": 2}``) go on
    every line."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    text = TEXT_FORMAT
    if fields:
        handler.addFilter(_Fields(fields))
        text = TEXT_FORMAT.replace("%(name)s", "%(name)s[" + " ".join(f"{k} {v}" for k, v in fields.items()) + "]")
    handler.setFormatter(JsonFormatter() if config.format == "json" else logging.Formatter(text))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _OURS, False):
            root.removeHandler(old)
    setattr(handler, _OURS, True)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    return handler
