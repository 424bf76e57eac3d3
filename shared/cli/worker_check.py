"""`tandem worker-check WORKER_ID`: a battery of protocol checks against a live decode worker
(docs/protocol.md), each printed as PASS, FAIL or SKIP with its reason; exit 1 on any FAIL.

It speaks raw NATS, not Tandem's bus, so that it can report exactly what the worker sent: a chunk
that does not validate, a gap in ``index``, a missing end marker. Checks, in order: the registry
entry (valid, ready, namespace, heartbeat), a streamed generation (consecutive chunks, a last chunk
with ``finish_reason: length``, the end marker, at most ``max_tokens``), cancel honoured, a
malformed request answered with a ``bad_request`` error reply, load reports (valid, ``seq``
increasing), and with ``--drain`` (which takes the worker out of service) drain and deregistration
over its control subject.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
import uuid

HELP = "check that a live decode worker follows the wire protocol (docs/protocol.md)"
STREAM_HEADER, ERROR_HEADER = "Tandem-Stream", "Tandem-Error-Code"


@dataclasses.dataclass
class Check:
    name: str
    outcome: str  # PASS, FAIL, SKIP
    reason: str = ""

    def line(self) -> str:
        return f"{self.outcome:<4}  {self.name}" + (f": {self.reason}" if self.reason else "")


class Failed(Exception):
    pass


def register(subparsers) -> None:
    from shared.cli.control_cmds import add_worker_args

    parser = subparsers.add_parser("worker-check", help=HELP, description=HELP)
    add_worker_args(parser)
    parser.add_argument("--prompt-token-ids", default="1,2,3,4,5,6,7,8",
                        help="the test prompt, comma-separated token ids (default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per check (default: %(default)s)")
    parser.add_argument("--drain", action="store_true",
                        help="also drain the worker over its control subject and check it deregisters "
                             "(takes it out of service)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    prompt = [int(t) for t in args.prompt_token_ids.split(",")]
    checks = asyncio.run(check_worker(args.nats_url, args.namespace, args.worker_id, prompt=prompt,
                                      timeout_s=args.timeout_s, drain=args.drain))
    for check in checks:
        print(check.line())
    failed = sum(c.outcome == "FAIL" for c in checks)
    print(f"{sum(c.outcome == 'PASS' for c in checks)} passed, {failed} failed, "
          f"{sum(c.outcome == 'SKIP' for c in checks)} skipped")
    return 1 if failed else 0


async def check_worker(nats_url: str, namespace: str, worker_id: str, *, prompt: list[int],
                       timeout_s: float = 60.0, drain: bool = False) -> list[Check]:
    import nats

    from shared.cli.errors import CliError
    from shared.telemetry.redact import redact_url

    try:
        nc = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=0)
    except Exception as exc:  # noqa: BLE001 — one line naming the server
        raise CliError(f"cannot connect to NATS at {redact_url(nats_url)}: {exc}") from None
    try:
        return await _Checker(nc, namespace, worker_id, prompt, timeout_s).run(drain)
    finally:
        await nc.close()


class _Checker:
    def __init__(self, nc, namespace: str, worker_id: str, prompt: list[int], timeout_s: float) -> None:
        from shared.protocol import Subjects

        self.nc, self.js = nc, nc.jetstream()
        self.subjects = Subjects(namespace)
        self.bucket = self.subjects.workers_bucket
        self.worker_id, self.prompt, self.timeout_s = worker_id, prompt, timeout_s
        self.info = None  # WorkerInfo once the registry check passed

    async def run(self, drain: bool) -> list[Check]:
        steps = [("registry entry", self.registry_entry), ("heartbeat", self.heartbeat),
                 ("streamed generation", self.generation), ("cancel honoured", self.cancel),
                 ("malformed request gets an error reply", self.error_reply), ("load reports", self.load_reports)]
        if drain:
            steps.append(("drain and deregistration", self.drain))
        results = []
        for name, step in steps:
            try:
                results.append(Check(name, "PASS", await step()))
            except Failed as exc:
                results.append(Check(name, "FAIL", str(exc)))
            except _Skip as exc:
                results.append(Check(name, "SKIP", str(exc)))
            except asyncio.TimeoutError:
                results.append(Check(name, "FAIL", f"no answer within {self.timeout_s:g}s"))
        return results

    # -- registry ----------------------------------------------------------------------------------
    async def _entry(self):
        from nats.js.errors import BucketNotFoundError, KeyNotFoundError

        try:
            kv = await self.js.key_value(self.bucket)
        except BucketNotFoundError:
            raise Failed(f"no KV bucket {self.bucket!r}: is the namespace right?") from None
        try:
            return kv, await kv.get(self.worker_id)
        except KeyNotFoundError:
            raise Failed(f"no entry {self.worker_id!r} in {self.bucket!r} (not registered, or expired)") from None

    async def registry_entry(self) -> str:
        from pydantic import ValidationError

        from shared.kvcache.hashing import make_namespace
        from shared.protocol import WorkerInfo

        kv, entry = await self._entry()
        try:
            info = WorkerInfo.from_bytes(entry.value)
        except ValidationError as exc:
            raise Failed(f"the entry is not a valid WorkerInfo (Tandem ignores it): {_first(exc)}") from None
        if info.worker_id != self.worker_id:
            raise Failed(f"worker_id {info.worker_id!r} in the entry, but its key is {self.worker_id!r}")
        if info.role != "decode":
            raise _Skip(f"role {info.role!r}: these checks are for decode workers")
        if info.state != "ready":
            raise Failed(f"state {info.state!r}, not 'ready'")
        try:
            namespace = bytes.fromhex(info.kv_namespace_hex)
        except ValueError:
            raise Failed(f"kv_namespace_hex {info.kv_namespace_hex[:40]!r} is not hex") from None
        self.info = info
        note = "" if namespace == make_namespace(info.model) else \
            f"; note: its KV namespace is not the engine's for model {info.model!r} (prefix hashes differ)"
        return f"model {info.model!r}, block size {info.block_size}, max_num_seqs {info.max_num_seqs}{note}"

    async def heartbeat(self) -> str:
        kv, first = await self._entry()
        ttl_s = (await self.js.stream_info(f"KV_{self.bucket}")).config.max_age or 0
        started = time.monotonic()
        deadline = started + (ttl_s or self.timeout_s)
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            _, entry = await self._entry()
            if entry.revision != first.revision:
                return f"put again within {time.monotonic() - started:.1f}s (TTL {ttl_s:g}s)"
        raise Failed(f"no new put within the bucket's TTL ({ttl_s:g}s): the entry will expire")

    def _need_info(self):
        if self.info is None:
            raise _Skip("needs a valid registry entry")
        return self.info

    # -- generation --------------------------------------------------------------------------------
    def _request(self, max_tokens: int) -> dict:
        return {"request_id": f"check-{uuid.uuid4().hex[:12]}", "model": self.info.model,
                "prompt_token_ids": self.prompt, "sampling": {"max_tokens": max_tokens, "temperature": 0.0,
                                                              "ignore_eos": True}}

    async def _open(self, body: bytes):
        inbox = self.nc.new_inbox()
        queue: asyncio.Queue = asyncio.Queue()

        async def on_msg(msg) -> None:
            queue.put_nowait(msg)

        sub = await self.nc.subscribe(inbox, cb=on_msg)
        await self.nc.publish(self.info.generate_subject, body, reply=inbox)
        return sub, queue

    async def _read_stream(self, queue, request_id: str, max_tokens: int, on_first=None) -> tuple[list, list[str]]:
        """Chunks until the end marker; problems found on the way (a failure is raised at once)."""
        from pydantic import ValidationError

        from shared.protocol import TokenChunk

        chunks: list = []
        while True:
            msg = await asyncio.wait_for(queue.get(), self.timeout_s)
            headers = msg.headers or {}
            if headers.get(STREAM_HEADER) == "end":
                return chunks, []
            if ERROR_HEADER in headers:
                raise Failed(f"error reply {headers[ERROR_HEADER]!r}: {msg.data[:200].decode(errors='replace')}")
            try:
                chunk = TokenChunk.from_bytes(msg.data)
            except ValidationError as exc:
                raise Failed(f"chunk {len(chunks)} is not a valid TokenChunk: {_first(exc)}") from None
            if chunk.request_id != request_id:
                raise Failed(f"chunk {len(chunks)} names request {chunk.request_id!r}, not {request_id!r}")
            if chunk.index != len(chunks):
                raise Failed(f"chunk index {chunk.index} where {len(chunks)} was due")
            if chunks and chunks[-1].finish_reason is not None:
                raise Failed(f"a chunk after the last one (finish_reason {chunks[-1].finish_reason!r})")
            chunks.append(chunk)
            if len(chunks) == 1 and on_first is not None:
                await on_first()

    async def generation(self) -> str:
        self._need_info()
        max_tokens = 8
        request = self._request(max_tokens)
        sub, queue = await self._open(json.dumps(request).encode())
        try:
            chunks, _ = await self._read_stream(queue, request["request_id"], max_tokens)
        finally:
            await sub.unsubscribe()
        if not chunks:
            raise Failed("the end marker came before any chunk")
        if chunks[-1].finish_reason is None:
            raise Failed("the end marker came before a chunk with a finish_reason")
        num_tokens = sum(len(c.token_ids) for c in chunks)
        if num_tokens > max_tokens:
            raise Failed(f"{num_tokens} tokens for max_tokens {max_tokens}")
        if chunks[-1].finish_reason != "length" or num_tokens != max_tokens:
            raise Failed(f"ignore_eos with max_tokens {max_tokens} gave {num_tokens} tokens, finish_reason "
                         f"{chunks[-1].finish_reason!r} (want {max_tokens}, 'length')")
        return f"{len(chunks)} chunks, {num_tokens} tokens, finish_reason 'length', end marker"

    async def cancel(self) -> str:
        self._need_info()
        if not self.info.cancel_subject:
            raise Failed("the registry entry has no cancel_subject")
        max_tokens = min(512, max(64, self.info.max_model_len - len(self.prompt) - 1))
        request = self._request(max_tokens)

        async def cancel_now() -> None:
            await self.nc.publish(self.info.cancel_subject, json.dumps(
                {"request_id": request["request_id"], "reason": "tandem worker-check: cancel test"}).encode())

        sub, queue = await self._open(json.dumps(request).encode())
        try:
            chunks, _ = await self._read_stream(queue, request["request_id"], max_tokens, on_first=cancel_now)
        finally:
            await sub.unsubscribe()
        num_tokens = sum(len(c.token_ids) for c in chunks)
        if num_tokens >= max_tokens:
            raise Failed(f"all {max_tokens} tokens came after a cancel sent on the first chunk")
        last = chunks[-1].finish_reason if chunks else None
        if last not in ("abort", None):
            raise Failed(f"the cancelled request ended with finish_reason {last!r} (want 'abort')")
        return f"stopped after {num_tokens} of {max_tokens} tokens" + (", finish_reason 'abort'" if last else "")

    async def error_reply(self) -> str:
        self._need_info()
        sub, queue = await self._open(b'{"request_id": "check-malformed", "model": 7}')
        try:
            msg = await asyncio.wait_for(queue.get(), min(self.timeout_s, 10.0))
        except asyncio.TimeoutError:
            raise Failed("no reply to a malformed GenerateRequest (the caller waits out its timeout)") from None
        finally:
            await sub.unsubscribe()
        code = (msg.headers or {}).get(ERROR_HEADER)
        if code is None:
            raise Failed(f"the reply has no {ERROR_HEADER} header: {msg.data[:120]!r}")
        if code != "bad_request":
            raise Failed(f"error code {code!r}, want 'bad_request'")
        return "bad_request"

    async def load_reports(self) -> str:
        from pydantic import ValidationError

        from shared.protocol import WorkerLoad

        info = self._need_info()
        queue: asyncio.Queue = asyncio.Queue()

        async def on_msg(msg) -> None:
            queue.put_nowait(msg)

        sub = await self.nc.subscribe(self.subjects.load("decode", self.worker_id).subject, cb=on_msg)
        reports = []
        try:
            deadline = time.monotonic() + 5.0
            while len(reports) < 2 and time.monotonic() < deadline:
                try:
                    msg = await asyncio.wait_for(queue.get(), max(0.1, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    break
                try:
                    reports.append(WorkerLoad.from_bytes(msg.data))
                except ValidationError as exc:
                    raise Failed(f"a report is not a valid WorkerLoad: {_first(exc)}") from None
        finally:
            await sub.unsubscribe()
        if not reports:
            raise _Skip("no load report in 5 s (optional: admission then routes it as idle)")
        if len(reports) == 2 and reports[1].seq <= reports[0].seq:
            raise Failed(f"seq went from {reports[0].seq} to {reports[1].seq}: reports are taken out of order")
        bad = [f"{r.worker_id!r}" for r in reports if r.worker_id != info.worker_id]
        if bad:
            raise Failed(f"reports name worker {bad[0]}")
        last = reports[-1]
        if last.num_blocks_total and last.num_blocks_used > last.num_blocks_total:
            raise Failed(f"{last.num_blocks_used} blocks used of {last.num_blocks_total}")
        return f"{len(reports)} in 5 s, seq {reports[-1].seq}, {last.num_running} running, {last.num_waiting} waiting"

    async def drain(self) -> str:
        from shared.protocol import ControlRequest

        info = self._need_info()
        if not info.control_subject:
            raise _Skip("no control_subject in the entry: drain it with SIGTERM")
        import nats.errors
        from nats.js.kv import KV_DEL, KV_PURGE

        kv = await self.js.key_value(self.bucket)
        watcher = await kv.watch(self.worker_id)  # every put and the delete, however quick
        states: list[str] = []
        try:
            reply = await self.nc.request(info.control_subject, ControlRequest(action="drain").to_bytes(),
                                          timeout=self.timeout_s)
            if ERROR_HEADER in (reply.headers or {}):
                raise Failed(f"drain refused: {reply.data[:200].decode(errors='replace')}")
            deadline = time.monotonic() + self.timeout_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    entry = await watcher.updates(timeout=left)
                except nats.errors.TimeoutError:
                    break
                if entry is None:  # the end of the current values
                    continue
                if entry.operation in (KV_DEL, KV_PURGE):
                    return f"states {' → '.join(states)} → deleted"
                state = json.loads(entry.value).get("state")
                if not states or states[-1] != state:
                    states.append(state)
        finally:
            await watcher.stop()
        raise Failed(f"still registered {self.timeout_s:g}s after the drain (states {' → '.join(states)})")


class _Skip(Exception):
    pass


def _first(exc) -> str:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error.get("loc", ()))
    return f"{error['msg']}" + (f" (field {where})" if where else "")
