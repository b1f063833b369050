"""`radianced` (alias `radiance`): the daemon. Flags -> Config -> `daemon.main`; no logic here.

With no --model it serves the bundled SmolLM2-135M-Instruct (prepared on first
run). `radianced --help` lists every flag; `radiancectl plan` prints the card
split the same flags would give.
"""

from __future__ import annotations

import argparse
import sys

from radianced.config import Config, ConfigError, add_flags, check_host


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radianced", description=__doc__.splitlines()[0])
    add_flags(parser)
    args = parser.parse_args(argv)
    try:
        cfg = Config.from_args(args)
        check_host(cfg)
    except ConfigError as e:
        parser.error(str(e))  # exits 2 with the usage line
    from radianced.daemon import main as run_daemon  # after parsing: --help needs no torch

    return run_daemon(cfg)


if __name__ == "__main__":
    sys.exit(main())
