"""Where `radiancectl profile --save` may write: the daemon's rules for a path sent over the control socket.

The daemon may run as root, or as a service user who can write where its
caller cannot, and the path comes from the caller. So the daemon resolves it
by its own rules, never the caller's working directory, and writes only

- the model's own profile (`<model>.expert-profile.bin`; no `out` means it), or
- a file under --profile-dir (a relative `out` is taken from there; symbolic
  links and `..` in its folder are resolved before the check),

and only a new file or one that already is an expert profile: never over a
file of another kind, never through a symbolic link. The write itself is atomic
(tiers/profile.py: a temp file beside it, renamed over it).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from radianced.tiers.profile import MAGIC, profile_path


class ProfilePathError(ValueError):
    """A save path the daemon refuses; the message says why and what would work."""


def resolve_profile_out(out: str | None, model_path: str, profile_dir: str | None) -> Path:
    """The absolute path a save of `out` writes (None: the model's own profile).
    Raises ProfilePathError."""
    own = _resolved(profile_path(model_path), "")
    if out is None:
        target = own
    else:
        given = out
        if not os.path.isabs(out):
            if profile_dir is None:
                raise ProfilePathError(f"out {given!r}: a relative path is taken from the daemon's --profile-dir, "
                                       f"and this daemon has none; leave --out out to write the model's own "
                                       f"profile ({own})")
            out = os.path.join(profile_dir, out)
        target = _resolved(Path(out), given)
        allowed = profile_dir is not None and _under(target.parent, Path(os.path.realpath(profile_dir)))
        if target != own and not allowed:
            where = f"under --profile-dir {profile_dir}" if profile_dir else "(this daemon has no --profile-dir)"
            raise ProfilePathError(f"out {given!r}: the daemon writes an expert profile only to the model's own "
                                   f"({own}) or {where}")
    _check_existing(target)
    return target


def _resolved(path: Path, given: str) -> Path:
    """`path` with its folder's symbolic links and `..` resolved; its last name kept as it is."""
    if path.name in ("", ".", ".."):
        raise ProfilePathError(f"out {given!r}: name a file, not a folder")
    return Path(os.path.realpath(path.parent)) / path.name


def _under(folder: Path, root: Path) -> bool:
    return folder == root or root in folder.parents


def _check_existing(target: Path) -> None:
    """Refuse a target that exists and is not a regular file holding an expert profile."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ProfilePathError(f"{target}: cannot check it: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise ProfilePathError(f"{target}: is a symbolic link; the daemon writes a profile only as a file of its "
                               f"own: give the link's target, or another path")
    if not stat.S_ISREG(st.st_mode):
        raise ProfilePathError(f"{target}: exists and is not a file; choose another path")
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as e:
        raise ProfilePathError(f"{target}: cannot check it: {e.strerror}") from None
    if head != MAGIC:
        raise ProfilePathError(f"{target}: exists and is not an expert profile; the daemon writes only a new file "
                               f"or over a profile: choose another path")
