"""`tandem protocol`: write the protocol's JSON Schemas and block-hash test vectors (docs/protocol/),
or check that the checked-in ones match the code."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "write (or --check) the wire protocol's JSON Schemas and block-hash test vectors"


def register(subparsers) -> None:
    parser = subparsers.add_parser("protocol", help=HELP, description=HELP + " (see docs/protocol.md)")
    parser.add_argument("--out", type=Path, default=Path("docs/protocol"),
                        help="folder for schemas/<Message>.json and hash_vectors.json (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming the files that differ from the code")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from shared.protocol import spec

    if args.check:
        stale = spec.drift(args.out)
        for relative in stale:
            print(f"differs from the code: {args.out / relative}")
        if stale:
            print("run `tandem protocol` to write them again")
        return 1 if stale else 0
    for path in spec.write(args.out):
        print(path)
    return 0
