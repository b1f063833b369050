"""The control socket: a Unix socket (owner-only) that `radiancectl` talks to.

Wire format, one msgspec JSON object per line, many per connection:

    request  {"v": 1, "cmd": "status", "args": {...}}
    reply    {"v": 1, "ok": true, "result": {...}}
             {"v": 1, "ok": false, "error": "..."}

Every line gets exactly one reply, in order: an unknown command, a line that is
not JSON, a wrong version or a handler that raises gets an error reply and the
connection keeps answering. The daemon owns the handlers (`serve(path,
handlers)`); their result shapes are the Structs below, shared with the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import msgspec

log = logging.getLogger(__name__)

VERSION = 1
MAX_LINE = 1 << 20  # bytes; a longer request line is answered with an error and skipped
DEFAULT_TIMEOUT = 10.0  # seconds the client waits for a connection and a reply

Handler = Callable[[dict[str, Any]], Awaitable[Any] | Any]


# -- result shapes (what each handler returns; dicts of the same shape work too) --


class RequestSummary(msgspec.Struct, kw_only=True):
    id: str
    state: str  # "waiting" | "running"
    prompt_tokens: int
    generated: int
    age_s: float


class LayerExperts(msgspec.Struct, kw_only=True):
    """One MoE layer's routed-expert counts since start (SPEC §9): a lookup is one
    (step, layer, distinct expert), a hit found it in a VRAM slot; routed counts
    token-to-expert assignments."""

    layer: int
    lookups: int
    hits: int
    routed: int


class ExpertStatus(msgspec.Struct, kw_only=True):
    """The expert tiers of a MoE model: the slots now, the homes, and the counts per layer."""

    slots: int  # VRAM expert slots in use, pinned ones included
    pinned: int  # experts whose home is the card (a slot each, never evicted)
    host: int  # experts whose home is the host pool
    disk: int  # experts whose home is the model file (--weights-disk-tier)
    refills: int  # slots filled since start after the pre-fill
    evictions: int  # cached experts that gave up their slot since start
    layers: list[LayerExperts]  # MoE layers in order


class StatusResult(msgspec.Struct, kw_only=True):
    uptime_s: float
    state: Literal["loading", "ready", "draining"]
    model: str
    receipt: list[str]  # receipt.Receipt.lines()
    kv_util: float  # 0..1 of the KV pool in use
    running: int
    waiting: int
    requests: list[RequestSummary]
    steps: int
    experts: ExpertStatus | None = None  # None: a dense model, or still loading


class ReceiptResult(msgspec.Struct, kw_only=True):
    lines: list[str]


class DrainResult(msgspec.Struct, kw_only=True):
    draining: bool


class CancelArgs(msgspec.Struct, kw_only=True):
    id: str


class CancelResult(msgspec.Struct, kw_only=True):
    cancelled: bool  # False: no such request (finished already, or never existed)


class ProfileSaveArgs(msgspec.Struct, kw_only=True):
    out: str | None = None  # on the daemon's host, checked by its rules (profile_paths.py); None: the model's
    replace: bool = False  # drop the counts already in the file instead of adding to them


class ProfileSaveResult(msgspec.Struct, kw_only=True):
    path: str  # the profile written (absolute)
    pairs: int  # ranked (layer, expert) pairs in it
    added: int  # token-to-expert assignments this save added
    steps: int  # routing steps the file has counted, all saves together
    merged: bool  # the counts already in the file were kept and added to
    note: str | None = None  # why an existing file was replaced instead of merged (another model's, corrupt)


# -- messages --------------------------------------------------------------------


class ControlRequest(msgspec.Struct, kw_only=True):
    v: int
    cmd: str
    args: dict[str, Any] = {}


class ControlReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int  # no default: omit_defaults would drop it
    ok: bool
    result: Any = None
    error: str | None = None


class ControlError(Exception):
    """An expected refusal. A handler raises it to send its message as the error reply
    unchanged; the client raises it when the daemon replies with an error."""


class ControlSocketError(OSError):
    """The control socket cannot be served at this path; the message says why and what to do."""


class DaemonUnreachable(OSError):
    """The client could not reach a daemon at `path` (nothing listening, no permission, no answer)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"cannot reach radianced at {path}: {reason}")
        self.path = path
        self.reason = reason


def default_socket_path() -> str:
    """`$RUNTIME_DIRECTORY/control.sock` under systemd (RuntimeDirectory=), else `/tmp/radianced-$UID/control.sock`."""
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        # systemd joins several RuntimeDirectory= entries with ':'; the first is ours
        return os.path.join(runtime.split(":")[0], "control.sock")
    return os.path.join("/tmp", f"radianced-{os.getuid()}", "control.sock")


# -- server ----------------------------------------------------------------------


async def serve(path: str, handlers: Mapping[str, Handler]) -> asyncio.AbstractServer:
    """Listen on the Unix socket `path` and answer with `handlers` (cmd -> fn(args) -> result).

    The parent directory is created mode 0700 when missing; a stale socket file
    (nothing listening) is replaced. The socket file is mode 0600 before the
    socket listens, so no other user can ever connect. A handler may be sync or
    async and returns a Struct above or a dict; what it raises becomes an error
    reply (`ControlError`'s message as is, others as "cmd failed: Type: msg",
    logged with the traceback).

    Raises ControlSocketError when the path is unusable: another daemon listens
    there, it is not a socket, its directory belongs to another user, or it is
    longer than a Unix socket path may be. The caller closes the returned server;
    the socket file stays behind (the next `serve` replaces it as stale).
    """
    sock = _bind(path)
    try:
        return await asyncio.start_unix_server(lambda r, w: _connection(r, w, handlers), sock=sock, limit=MAX_LINE)
    except BaseException:
        sock.close()
        raise


def _bind(path: str) -> socket.socket:
    """A bound, not yet listening socket at `path`, mode 0600 (connect() is refused until listen())."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        try:
            os.makedirs(parent, mode=0o700)
            os.chmod(parent, 0o700)  # makedirs' mode is filtered through the umask
        except OSError as e:
            raise ControlSocketError(f"--control-socket {path}: cannot create {parent}: {e.strerror}") from e
    owner = os.stat(parent).st_uid
    if owner not in (os.geteuid(), 0):
        raise ControlSocketError(f"--control-socket {path}: {parent} belongs to uid {owner}, not to this user "
                                 f"(uid {os.geteuid()}); remove it or pass another --control-socket")
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
    except OSError as e:
        sock.close()
        reason = e.strerror or str(e)
        if len(os.fsencode(path)) > 107:
            reason = f"{len(os.fsencode(path))} bytes is longer than a Unix socket path may be (107)"
        raise ControlSocketError(f"--control-socket {path}: cannot bind: {reason}") from e
    return sock


def _remove_stale(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ControlSocketError(f"--control-socket {path}: exists and is not a socket; "
                                 "remove it or pass another --control-socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # stale: left by a daemon that did not exit cleanly
        except OSError as e:
            raise ControlSocketError(f"--control-socket {path}: a socket this user cannot probe ({e.strerror}); "
                                     "remove it or pass another --control-socket") from e
        else:
            raise ControlSocketError(f"--control-socket {path}: another radianced is listening there; "
                                     "stop it (radiancectl drain) or pass another --control-socket")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


async def _connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      handlers: Mapping[str, Handler]) -> None:
    try:
        while True:
            try:
                line = await _read_line(reader)
            except _LineTooLong:
                reply = _error(f"request line longer than {MAX_LINE} bytes")
            else:
                if line is None:
                    return
                if not line.strip():
                    continue
                reply = await _answer(line, handlers)
            writer.write(reply + b"\n")
            await writer.drain()
    except ConnectionError:
        pass  # the client went away mid-reply
    finally:
        writer.close()


class _LineTooLong(Exception):
    pass


async def _read_line(reader: asyncio.StreamReader) -> bytes | None:
    """The next line (a last line without newline counts); None at EOF.

    A line over MAX_LINE is discarded through its newline and raises _LineTooLong,
    so the request after it is read whole.
    """
    try:
        return await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as e:
        return e.partial or None
    except asyncio.LimitOverrunError:
        pass
    while True:
        try:
            await reader.readuntil(b"\n")
            raise _LineTooLong
        except asyncio.LimitOverrunError as e:
            await reader.readexactly(e.consumed)
        except asyncio.IncompleteReadError:
            raise _LineTooLong from None


async def _answer(line: bytes, handlers: Mapping[str, Handler]) -> bytes:
    """The encoded reply to one request line."""
    try:
        message = msgspec.json.decode(line)
    except msgspec.DecodeError as e:
        return _error(f"not a JSON request line: {e}")
    if not isinstance(message, dict):
        return _error('a request is a JSON object: {"v": 1, "cmd": ..., "args": {...}}')
    # the version first: a later version may shape the rest differently
    if message.get("v") != VERSION:
        return _error(f"protocol version {message.get('v')!r} not supported; this daemon speaks v{VERSION}")
    try:
        request = msgspec.convert(message, ControlRequest)
    except msgspec.ValidationError as e:
        return _error(f"bad request: {e}")
    handler = handlers.get(request.cmd)
    if handler is None:
        return _error(f"unknown command {request.cmd!r}; this daemon knows {', '.join(sorted(handlers))}")
    try:
        result = handler(request.args)
        if inspect.isawaitable(result):
            result = await result
        # encoded here: a result msgspec cannot encode is the handler's failure, not the connection's
        return msgspec.json.encode(ControlReply(v=VERSION, ok=True, result=result))
    except ControlError as e:
        return _error(str(e))
    except msgspec.ValidationError as e:  # msgspec.convert(args, CancelArgs) in a handler
        return _error(f"{request.cmd}: bad args: {e}")
    except Exception as e:
        log.exception("control command %r failed", request.cmd)
        return _error(f"{request.cmd} failed: {type(e).__name__}: {e}")


def _error(message: str) -> bytes:
    return msgspec.json.encode(ControlReply(v=VERSION, ok=False, error=message))


# -- client ----------------------------------------------------------------------


async def request(path: str, cmd: str, args: Mapping[str, Any] | None = None,
                  timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Send one command and return its result (decoded JSON: dicts, lists, numbers).

    Raises DaemonUnreachable when nothing listens at `path`, the socket refuses
    this user, or no reply comes within `timeout` seconds; ControlError with the
    daemon's message when it replies with an error.
    """
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path, limit=MAX_LINE), timeout)
    except FileNotFoundError:
        raise DaemonUnreachable(path, "no socket there") from None
    except ConnectionRefusedError:
        raise DaemonUnreachable(path, "nothing listening (a stale socket)") from None
    except PermissionError:
        raise DaemonUnreachable(path, "permission denied (the socket is owner-only: "
                                      "run as the daemon's user or root)") from None
    except TimeoutError:
        raise DaemonUnreachable(path, f"no connection within {timeout:g} s") from None
    except OSError as e:
        raise DaemonUnreachable(path, e.strerror or str(e)) from None
    try:
        line = msgspec.json.encode(ControlRequest(v=VERSION, cmd=cmd, args=dict(args or {}))) + b"\n"
        writer.write(line)
        await writer.drain()
        data = await asyncio.wait_for(reader.readline(), timeout)
    except TimeoutError:
        raise DaemonUnreachable(path, f"no reply to {cmd!r} within {timeout:g} s") from None
    except (ConnectionError, ValueError) as e:
        raise DaemonUnreachable(path, f"connection lost ({e})") from None
    finally:
        writer.close()
    if not data:
        raise DaemonUnreachable(path, f"the daemon closed the connection without answering {cmd!r}")
    try:
        reply = msgspec.json.decode(data, type=ControlReply)
    except msgspec.MsgspecError as e:
        raise ControlError(f"unreadable reply from {path}: {e}") from None
    if reply.v != VERSION:
        raise ControlError(f"the daemon speaks control protocol v{reply.v}; this radiancectl speaks v{VERSION}")
    if not reply.ok:
        raise ControlError(reply.error or "error without a message")
    return reply.result


def call(path: str, cmd: str, args: Mapping[str, Any] | None = None, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """`request` for synchronous callers (radiancectl); must not run inside an event loop's thread."""
    return asyncio.run(request(path, cmd, args, timeout))
