"""Structured logs: one JSON object per line (or plain text), with the `extra=` fields of
each call as keys, so operators can filter by session, namespace or reason."""
from __future__ import annotations

import json
import logging
import sys
import time

from kvtier.server.config import LogFormat

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD)
        line = f"{self.formatTime(record)} {record.levelname.lower():7} {record.name}: {record.getMessage()}"
        line = f"{line} {extra}" if extra else line
        return line + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def setup_logging(level: str, fmt: LogFormat) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt is LogFormat.JSON else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
