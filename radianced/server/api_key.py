"""Where the API key comes from, kept off the command line.

Any local user reads a process's command line (`ps`, /proc/PID/cmdline), so
`--api-key KEY` shows the key to all of them; it still works, with a warning.
The key belongs in a file only the daemon's user reads (`--api-key-file PATH`;
under systemd a credential, `LoadCredential=` and `--api-key-file
%d/api-key`), or in `$RADIANCED_API_KEY` (a process's environment is readable
by its own user and root only). One source at a time: two are refused rather
than one silently winning.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import MutableMapping

from radianced.config import Config

log = logging.getLogger("radianced")

ENV = "RADIANCED_API_KEY"


class ApiKeyError(Exception):
    """The key cannot be read; the message names the source and what to do."""


def load_api_key(cfg: Config, environ: MutableMapping[str, str]) -> str | None:
    """The API key from --api-key, --api-key-file or $RADIANCED_API_KEY (an empty variable
    counts as unset); None when none is given. Removes the variable from `environ`, so the
    processes this one starts do not inherit it. Raises ApiKeyError."""
    from_env = environ.pop(ENV, "").strip() or None
    given = [name for name, v in (("--api-key", cfg.api_key), ("--api-key-file", cfg.api_key_file),
                                  (f"${ENV}", from_env)) if v is not None]
    if len(given) > 1:
        raise ApiKeyError(f"the API key is given by both {' and '.join(given)}: give it one way")
    if cfg.api_key is not None:
        log.warning("--api-key on the command line is readable by every local user (ps, /proc/PID/cmdline); "
                    "put the key in a file only this user reads and pass --api-key-file PATH, or set $%s", ENV)
        return cfg.api_key
    if cfg.api_key_file is not None:
        return _read_key_file(cfg.api_key_file)
    return from_env


def _read_key_file(path: str) -> str:
    """The key in `path`: its text without surrounding whitespace (a trailing newline is usual)."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            key = f.read().strip()
    except OSError as e:
        raise ApiKeyError(f"--api-key-file {path}: cannot read it: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ApiKeyError(f"--api-key-file {path}: not UTF-8 text; write the key as one line of text") from None
    if not key:
        raise ApiKeyError(f"--api-key-file {path}: empty; write the key in it (one line)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("--api-key-file %s: other users may read it (mode %04o); chmod 600 it", path,
                    stat.S_IMODE(mode))
    return key
