"""Request body bytes -> a msgspec Struct; every way a body can fail to decode is a 400 naming the problem.

msgspec's own messages are kept where they are good ("max_tokens: Expected
`int`, got `str`", with `param` from their `$.path`) and replaced where they
mislead: a lone UTF-16 surrogate escape (`"\\ud800"`) reads as "Input data was
truncated", and nesting past msgspec's depth raises RecursionError (which
used to escape as a 500).
"""

from __future__ import annotations

import re

import msgspec

from radianced.server.api_errors import ProtocolError

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
# \uD800-\uDBFF not followed by \uDC00-\uDFFF, or \uDC00-\uDFFF alone; the backslash before it unescaped
_LONE_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2})")


def decode(data: bytes, kind: type[msgspec.Struct]):
    """`data` as `kind`, or ProtocolError(400) saying what is wrong and, where one field is, which."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        m = _AT.match(str(e))
        msg, path = m["msg"], (m["path"] or "").lstrip(".")
        missing = _MISSING.match(msg)
        if missing:
            param = f"{path}.{missing['field']}" if path else missing["field"]
            raise ProtocolError(400, f"{param} is required", param) from None
        where = f"{path}: " if path else "request body: "
        raise ProtocolError(400, f"{where}{msg}", path or None) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(400, f"the request body is not valid JSON ({_why(data, e)})") from None
    except RecursionError:
        raise ProtocolError(400, "the request body nests JSON arrays or objects too deeply to decode (the limit "
                            "is the interpreter's recursion depth, a thousand levels or more; a request needs a "
                            "handful)") from None


def _why(data: bytes, e: msgspec.DecodeError) -> str:
    m = _LONE_SURROGATE.search(data)
    if m is None:
        return str(e)
    escape = m[1].decode()
    return (f"a string holds the lone UTF-16 surrogate {escape} at byte {m.start(1)}, which is not a character; "
            f"write the character itself, or a high and low surrogate pair")
