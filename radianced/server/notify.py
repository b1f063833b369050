"""sd_notify(3) without libsystemd: state changes to the service manager over `$NOTIFY_SOCKET`.

systemd (`Type=notify`) passes the path of an AF_UNIX datagram socket in
`NOTIFY_SOCKET` (a name starting with '@' is in the abstract namespace); each
message is newline-separated `KEY=VALUE` lines. Outside systemd the variable is
unset and every call here does nothing, so the daemon calls them unconditionally.

What radianced sends: `extend_timeout` while loading or pinning takes long,
`ready()` once the model is loaded and the sockets listen, `watchdog()` at half
of `watchdog_interval()` while the engine makes progress or is idle,
`stopping()` when SIGTERM starts the drain, `status(text)` along the way.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(**fields: object) -> bool:
    """Send `KEY=VALUE` lines (e.g. `notify(READY=1, STATUS="serving")`).

    Returns True when sent, False when there is no `NOTIFY_SOCKET` (not under
    systemd) or sending failed (logged: the daemon keeps serving either way).
    A newline inside a value would start a new field, so it is sent as a space.
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not fields:
        return False
    if address[0] == "@":
        address = "\0" + address[1:]
    elif address[0] != "/":
        log.warning("NOTIFY_SOCKET=%r: only Unix socket paths and @abstract names are supported", address)
        return False
    message = "\n".join(f"{key}={str(value).replace(chr(10), ' ')}" for key, value in fields.items())
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as e:
        log.warning("sd_notify to %s failed (%s): %s", os.environ["NOTIFY_SOCKET"], e, message)
        return False
    return True


def ready(status: str | None = None) -> bool:
    """Start-up is complete: systemd marks the unit active (and starts the watchdog clock)."""
    return notify(READY=1) if status is None else notify(READY=1, STATUS=status)


def watchdog() -> bool:
    """Still alive; send at least every `watchdog_interval()` (at half of it, to be safe)."""
    return notify(WATCHDOG=1)


def extend_timeout(usec: int) -> bool:
    """Ask for `usec` more microseconds for the current start-up or stop phase (from now)."""
    return notify(EXTEND_TIMEOUT_USEC=int(usec))


def stopping(status: str | None = None) -> bool:
    """Shutdown has begun (the drain)."""
    return notify(STOPPING=1) if status is None else notify(STOPPING=1, STATUS=status)


def status(text: str) -> bool:
    """A one-line state shown by `systemctl status`."""
    return notify(STATUS=text)


def watchdog_interval() -> float | None:
    """Seconds within which systemd expects `watchdog()`, or None when it expects none.

    From `WATCHDOG_USEC`, which applies to this process only if `WATCHDOG_PID` is
    unset or names it (a child that inherited the variables must not ping).
    """
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if pid is not None and pid != str(os.getpid()):
        return None
    try:
        value = int(usec) if usec is not None else 0
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None
