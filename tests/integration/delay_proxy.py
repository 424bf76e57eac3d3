"""A TCP proxy that adds a one-way latency: every chunk is delivered ``delay`` after it arrived.

    python -m tests.integration.delay_proxy --listen 0.0.0.0:4223 --target 10.213.7.1:4222 --delay-ms 200

It forwards to the one ``--target`` only. Ready when it prints ``listening on HOST:PORT`` (port 0:
the one the OS picked). SIGTERM or SIGINT: it closes its listener and connections and exits 0.

Each direction of each connection has a queue of ``(due, bytes)``: a reader puts what it receives
with ``due = received + delay``, a writer sleeps until the head's due time and writes it. Order is
kept and throughput is not capped (many chunks can be in flight within one delay); the queue is
bounded, so a receiver that stops reading stalls the sender as TCP would. End of stream travels the
same way: after the last data, ``delay`` later, the other side's write half is shut down; once both
directions have ended, or on an error on either side, both sockets are closed.

Not emulated: the TCP handshake's round trip (the client's connect completes at the proxy at once;
the proxy connects to the target when a client arrives) and packet loss.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys

READY = re.compile(r"listening on ([^\s:]+):(\d+)")
CHUNK = 64 * 1024
QUEUE_CHUNKS = 256  # per direction: up to 16 MiB in flight


def _split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{hostport!r} is not HOST:PORT")
    return host, int(port)


def proxy_argv(listen: str, target: str, delay_ms: float, python: str = sys.executable) -> list[str]:
    """The command line that runs this proxy (cwd: the repository root)."""
    return [python, "-m", "tests.integration.delay_proxy", "--listen", listen, "--target", target,
            "--delay-ms", str(delay_ms)]


class DelayProxy:
    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        self.target, self.delay_s = target, delay_s
        self.server: asyncio.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._accepted, host, port)
        return self.server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _accepted(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        writers = [c_writer]
        try:
            upstream = asyncio.ensure_future(asyncio.open_connection(*self.target))
            up_writer_ready: asyncio.Future = asyncio.get_running_loop().create_future()

            async def client_to_target() -> None:
                await self._pipe(c_reader, up_writer_ready)

            async def target_to_client() -> None:
                u_reader, u_writer = await upstream
                writers.append(u_writer)
                up_writer_ready.set_result(u_writer)
                done = asyncio.get_running_loop().create_future()
                done.set_result(c_writer)
                await self._pipe(u_reader, done)

            a = asyncio.ensure_future(client_to_target())
            b = asyncio.ensure_future(target_to_client())
            try:
                # both directions end normally, or the first error ends the connection
                for fut in asyncio.as_completed([a, b]):
                    await fut
            finally:
                for t in (a, b, upstream):
                    t.cancel()
                await asyncio.gather(a, b, upstream, return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in writers:
                w.close()
            self._conns.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer_fut: asyncio.Future) -> None:
        """Read from ``reader``, deliver each chunk (then EOF) ``delay`` later to the writer."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(QUEUE_CHUNKS)

        async def deliver() -> None:
            writer: asyncio.StreamWriter = await writer_fut
            while True:
                due, data = await queue.get()
                while (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        async def receive() -> None:
            while True:
                data = await reader.read(CHUNK)
                await queue.put((loop.time() + self.delay_s, data or None))
                if not data:
                    return

        tasks = {asyncio.ensure_future(receive()), asyncio.ensure_future(deliver())}
        try:
            # both finish (the end of stream delivered), or the first error on either side ends it
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _main(args: argparse.Namespace) -> None:
    proxy = DelayProxy(args.target, args.delay_ms / 1000.0)
    host, port = await proxy.start(*args.listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening on {host}:{port}", flush=True)
    await stop.wait()
    await proxy.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=_split, required=True, help="HOST:PORT (port 0: any)")
    parser.add_argument("--target", type=_split, required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay per direction")
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
