"""`radiancectl bench run`'s boundary: a daemon that is not there, flags in the wrong place."""

from __future__ import annotations

import pytest

from radianced.bench.command import _Progress, api_key
from radianced.config import Config
from radianced.ctl import main
from radianced.server.api_key import ApiKeyError


def test_a_daemon_that_is_not_there_is_one_message_and_exit_2(tmp_path, capsys):
    assert main(["bench", "run", "--url", "http://127.0.0.1:9", "--quick", "--out", str(tmp_path)]) == 2
    assert "cannot reach the daemon at http://127.0.0.1:9" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_daemon_flags_without_start_are_refused(capsys):
    assert main(["bench", "run", "--url", "http://127.0.0.1:9", "--", "--max-num-seqs", "4"]) == 1
    assert "go with --start only" in capsys.readouterr().err


def test_progress_draws_a_bar_per_workload_on_a_terminal_only(monkeypatch):
    with _Progress() as quiet:  # pytest's stdout is no terminal
        quiet.update("sweep c=1", 1, 1)
    assert quiet._bar is None
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    with _Progress() as bar:
        bar.update("sweep c=1", 0, 2)
        bar.update("sweep c=1", 2, 2)
        bar.update("overload", 1, 48)
    assert [t.description for t in bar._bar.tasks] == ["sweep c=1", "overload"]
    assert [t.completed for t in bar._bar.tasks] == [2, 1]


def test_the_api_key_comes_from_a_file_the_environment_or_the_started_daemon(tmp_path):
    path = tmp_path / "key"
    path.write_text("k-file\n")
    path.chmod(0o600)
    assert api_key(str(path), None, {}) == "k-file"
    assert api_key(None, None, {"RADIANCED_API_KEY": "k-env"}) == "k-env"
    assert api_key(None, Config(api_key_file=str(path)), {}) == "k-file"  # --start: the daemon's own key
    assert api_key(None, None, {}) is None
    with pytest.raises(ApiKeyError, match="both"):
        api_key(str(path), None, {"RADIANCED_API_KEY": "k-env"})


def test_workloads_are_named_or_refused(capsys):
    from radianced.bench.command import workload_names

    assert workload_names("sweep, decode") == {"decode", "sweep"}
    with pytest.raises(SystemExit):
        main(["bench", "run", "--url", "http://127.0.0.1:9", "--workloads", "decode,burst"])
    assert "unknown workload(s) burst; choose from decode, prefill, sweep, overload, multi-turn" in capsys.readouterr().err
