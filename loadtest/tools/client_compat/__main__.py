"""``python -m loadtest.tools.client_compat``: run the checks against a gateway (given, or started
here), write ``clients.json``, print the table, and with ``--readme`` put it into README.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

from loadtest.tools.client_compat import CLIENTS, README, Target, __doc__ as DOC, failures, run, table, with_table


@contextlib.contextmanager
def started_tandem(model: str, timeout_s: float):
    """``tandem up`` here, its decode step left eager (nothing to wait for: these are no timings)."""
    from loadtest.tools.tandem_server import tandem_up

    with tandem_up(["--model", model, "--compile", "off"], timeout_s, name="client-compat") as url:
        yield url


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.tools.client_compat", description=DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running gateway's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--start-tandem", action="store_true", help="start `tandem up` here and check against it")
    p.add_argument("--model", default="smollm2-135m", help="the model named in requests (and served, started)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a started tandem may take")
    p.add_argument("--clients", default="", help="comma-separated client names to run (default: all)")
    p.add_argument("--node-modules", type=Path, help="a folder holding the openai npm package (added to NODE_PATH)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/clients"), help="writes clients.json here")
    p.add_argument("--readme", action="store_true", help=f"rewrite the table between the markers of {README}")
    p.add_argument("--render", type=Path, metavar="RESULT",
                   help="print the table of a saved result (with --readme: put it there too); run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.render:
        rendered = table(json.loads(args.render.read_text()))
        print(rendered)
        if args.readme:
            README.write_text(with_table(README.read_text(), rendered))
        return 0
    if bool(args.url) == args.start_tandem:
        p.error("give --url or --start-tandem")
    if args.node_modules:  # the node processes of checks_npm inherit it
        os.environ["NODE_PATH"] = os.pathsep.join(filter(None, [str(args.node_modules.resolve()),
                                                              os.environ.get("NODE_PATH")]))
    wanted = {n.strip() for n in args.clients.split(",") if n.strip()}
    clients = [c for c in CLIENTS if not wanted or c.name in wanted]
    with (started_tandem(args.model, args.ready_timeout) if args.start_tandem
          else contextlib.nullcontext(args.url)) as url:
        result = run(Target(url, args.model), clients)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "clients.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    if args.readme:
        README.write_text(with_table(README.read_text(), table(result)))
    return 1 if failures(result) else 0


if __name__ == "__main__":
    raise SystemExit(main())
