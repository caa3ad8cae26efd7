"""Application logs in the configured format: JSON lines (the access log's format) or plain text."""

from __future__ import annotations

import json
import logging
import sys
from typing import IO, Any

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


def configure_logging(config: LoggingConfig, level: str = "info", stream: IO[str] | None = None) -> logging.Handler:
    """Replace the root logger's handlers with one writing `config.format` to `stream` (stderr)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if config.format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    return handler
