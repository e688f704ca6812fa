"""The `sao` command line: one subcommand per job.

    sao selftest                 the two arms differ only in the mask (no model, a second)

Every user mistake (bad option, missing file, band that does not bracket 1, ...) is one line on stderr
and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from sao.errors import SaoError


def _selftest(args: argparse.Namespace) -> int:
    from sao import selftest

    return 0 if selftest.run() else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sao", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("selftest", help="check that the two arms differ only in the mask")
    p.set_defaults(func=_selftest)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except SaoError as error:
        print(f"sao {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sao {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
