"""systemd's readiness protocol (sd_notify(3)) without libsystemd: one datagram of
`KEY=VALUE` lines to the Unix socket named by $NOTIFY_SOCKET (a path, or `@name` for an
abstract socket). Without $NOTIFY_SOCKET (not started by systemd with Type=notify) every
call does nothing. Failures are logged, never raised: readiness reports must not stop a
daemon that is otherwise serving."""
from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        self.address = os.environ.get("NOTIFY_SOCKET", "") if address is None else address

    def notify(self, *lines: str) -> bool:
        """Send `lines` as one message; False when there is no socket or the send failed."""
        if not self.address:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        message = "\n".join(lines).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, target)
        except OSError as exc:
            log.warning("sd_notify failed", extra={"socket": self.address, "reason": str(exc)})
            return False
        return True

    def ready(self) -> bool:
        return self.notify("READY=1", f"MAINPID={os.getpid()}", "STATUS=serving")

    def reloading(self) -> bool:
        # MONOTONIC_USEC: systemd >= 253 requires it with RELOADING=1 for Type=notify-reload;
        # older ones ignore it.
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}",
                           "STATUS=reloading the tokens file")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1", "STATUS=draining")
