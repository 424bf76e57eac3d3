"""``tandem decode``: a decode worker (the engine) serving its NATS subjects."""

import sys

from services.decode.config import DecodeSettings
from shared.runtime.command import register_service, run_as_main


def register(subparsers) -> None:
    register_service(subparsers, "decode", "run a decode worker (loads the model, warms up, registers, streams tokens)",
                     DecodeSettings, "services.decode.service:run")


if __name__ == "__main__":
    sys.exit(run_as_main("decode"))
