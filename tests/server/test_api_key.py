"""load_api_key: one source of three (--api-key with a warning, --api-key-file, $RADIANCED_API_KEY),
each refusal naming its source and the fix (issue 19 finding 6)."""

from __future__ import annotations

import logging

import pytest

from radianced.config import Config
from radianced.server.api_key import ENV, ApiKeyError, load_api_key


def key_file(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "api-key"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_no_source_means_no_key():
    assert load_api_key(Config(), {}) is None
    assert load_api_key(Config(), {ENV: "  "}) is None  # an empty variable counts as unset


def test_the_file_holds_the_key_without_its_newline(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert load_api_key(Config(api_key_file=key_file(tmp_path, "s3cret\n")), {}) == "s3cret"
    assert caplog.records == []


def test_the_environment_variable_holds_the_key_and_is_not_inherited():
    environ = {ENV: "s3cret\n", "PATH": "/bin"}
    assert load_api_key(Config(), environ) == "s3cret"
    assert environ == {"PATH": "/bin"}  # processes the daemon starts do not see it


def test_a_key_on_the_command_line_works_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert load_api_key(Config(api_key="s3cret"), {}) == "s3cret"
    assert caplog.messages == ["--api-key on the command line is readable by every local user (ps, "
                               "/proc/PID/cmdline); put the key in a file only this user reads and pass "
                               "--api-key-file PATH, or set $RADIANCED_API_KEY"]


def test_a_key_file_others_may_read_works_with_a_warning(tmp_path, caplog):
    path = key_file(tmp_path, "s3cret", 0o644)
    with caplog.at_level(logging.WARNING):
        assert load_api_key(Config(api_key_file=path), {}) == "s3cret"
    assert caplog.messages == [f"--api-key-file {path}: other users may read it (mode 0644); chmod 600 it"]


@pytest.mark.parametrize("cfg, environ, message", [
    (Config(api_key="a"), {ENV: "b"}, "the API key is given by both --api-key and $RADIANCED_API_KEY: give it one way"),
    (Config(api_key_file="/k"), {ENV: "b"},
     "the API key is given by both --api-key-file and $RADIANCED_API_KEY: give it one way"),
    (Config(api_key_file="/nonexistent/api-key"), {},
     "--api-key-file /nonexistent/api-key: cannot read it: No such file or directory"),
])
def test_refusals_name_the_source(cfg, environ, message):
    with pytest.raises(ApiKeyError) as e:
        load_api_key(cfg, environ)
    assert str(e.value) == message


def test_an_empty_or_binary_key_file_is_refused(tmp_path):
    empty = key_file(tmp_path, "\n")
    with pytest.raises(ApiKeyError, match="empty; write the key in it"):
        load_api_key(Config(api_key_file=empty), {})
    (tmp_path / "bin").write_bytes(b"\xff\xfe")
    with pytest.raises(ApiKeyError, match="not UTF-8 text"):
        load_api_key(Config(api_key_file=str(tmp_path / "bin")), {})
