"""`tandem worker-check WORKER_ID`: a battery of protocol checks against a live decode worker
(docs/protocol.md), each printed as PASS, FAIL or SKIP with its reason; exit 1 on any FAIL.

It reads what the worker sends before judging it, so that it can say exactly what was wrong: a chunk
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
import contextlib
import dataclasses
import json
import time
import uuid

HELP = "check that a live decode worker follows the wire protocol (docs/protocol.md)"


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
    from shared.bus import Bus
    from shared.cli.errors import CliError

    try:
        bus = await Bus.connect(nats_url, "tandem-worker-check", timeout_s=5)
    except ConnectionError as exc:  # one line naming the server (its password redacted)
        raise CliError(str(exc)) from None
    try:
        return await _Checker(bus, namespace, worker_id, prompt, timeout_s).run(drain)
    finally:
        await bus.close()


class _Checker:
    def __init__(self, bus, namespace: str, worker_id: str, prompt: list[int], timeout_s: float) -> None:
        from shared.protocol import Subjects

        self.bus = bus
        self.subjects = Subjects(namespace)
        self.bucket = self.subjects.workers_bucket
        self.worker_id, self.prompt, self.timeout_s = worker_id, prompt, timeout_s
        self.info = None  # WorkerInfo once the registry check passed

    async def run(self, drain: bool) -> list[Check]:
        from shared.bus import BusTimeout

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
            except (asyncio.TimeoutError, BusTimeout):
                results.append(Check(name, "FAIL", f"no answer within {self.timeout_s:g}s"))
        return results

    # -- registry ----------------------------------------------------------------------------------
    async def _kv(self):
        kv = await self.bus.find_key_value(self.bucket)
        if kv is None:
            raise Failed(f"no KV bucket {self.bucket!r}: is the namespace right?")
        return kv

    async def registry_entry(self) -> str:
        from pydantic import ValidationError

        from shared.kvcache.hashing import make_namespace
        from shared.protocol import WorkerInfo
        from shared.protocol.base import validation_message

        value = await (await self._kv()).get(self.worker_id)
        if value is None:
            raise Failed(f"no entry {self.worker_id!r} in {self.bucket!r} (not registered, or expired)")
        try:
            info = WorkerInfo.from_bytes(value)
        except ValidationError as exc:
            raise Failed(f"the entry is not a valid WorkerInfo (Tandem ignores it): "
                         f"{validation_message(exc)[0]}") from None
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
        kv = await self._kv()
        ttl_s = await kv.ttl_s() or 0
        started = time.monotonic()
        async with contextlib.aclosing(kv.watch(self.worker_id)) as values:
            try:
                current = await asyncio.wait_for(anext(values), self.timeout_s)
                if current is None:
                    raise Failed(f"no entry {self.worker_id!r} in {self.bucket!r} (not registered, or expired)")
                await asyncio.wait_for(anext(values), ttl_s or self.timeout_s)  # the next put (or delete)
            except asyncio.TimeoutError:
                raise Failed(f"no new put within the bucket's TTL ({ttl_s:g}s): the entry will expire") from None
        return f"put again within {time.monotonic() - started:.1f}s (TTL {ttl_s:g}s)"

    def _need_info(self):
        if self.info is None:
            raise _Skip("needs a valid registry entry")
        return self.info

    # -- generation --------------------------------------------------------------------------------
    def _stream(self, max_tokens: int):
        """(request, its stream of TokenChunks) on the subject the worker registered."""
        from shared.protocol import Endpoint, GenerateRequest, SamplingParams, TokenChunk

        request = GenerateRequest(request_id=f"check-{uuid.uuid4().hex[:12]}", model=self.info.model,
                                  prompt_token_ids=self.prompt,
                                  sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        endpoint = Endpoint(self.info.generate_subject, GenerateRequest, TokenChunk)
        return request, self.bus.stream(endpoint, request, first_timeout_s=self.timeout_s,
                                        idle_timeout_s=self.timeout_s)

    async def _read_stream(self, request, stream, on_first=None) -> list:
        """Chunks until the end marker; a problem found on the way fails at once."""
        from shared.bus import MalformedReply, NoResponders, RemoteError

        chunks: list = []
        try:
            async with contextlib.aclosing(stream) as replies:
                async for chunk in replies:
                    if chunk.request_id != request.request_id:
                        raise Failed(f"chunk {len(chunks)} names request {chunk.request_id!r}, "
                                     f"not {request.request_id!r}")
                    if chunk.index != len(chunks):
                        raise Failed(f"chunk index {chunk.index} where {len(chunks)} was due")
                    if chunks and chunks[-1].finish_reason is not None:
                        raise Failed(f"a chunk after the last one (finish_reason {chunks[-1].finish_reason!r})")
                    chunks.append(chunk)
                    if len(chunks) == 1 and on_first is not None:
                        await on_first()
        except MalformedReply as exc:
            raise Failed(f"chunk {len(chunks)} is not a valid TokenChunk: {exc.detail}") from None
        except RemoteError as exc:
            raise Failed(f"error reply {exc.code!r}: {exc.message[:200]}") from None
        except NoResponders:
            raise Failed(f"nobody serves {self.info.generate_subject}") from None
        return chunks

    async def generation(self) -> str:
        self._need_info()
        max_tokens = 8
        chunks = await self._read_stream(*self._stream(max_tokens))
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
        from shared.protocol import CancelRequest, Endpoint

        self._need_info()
        if not self.info.cancel_subject:
            raise Failed("the registry entry has no cancel_subject")
        max_tokens = min(512, max(64, self.info.max_model_len - len(self.prompt) - 1))
        request, stream = self._stream(max_tokens)

        async def cancel_now() -> None:
            await self.bus.publish(Endpoint(self.info.cancel_subject, CancelRequest), CancelRequest(
                request_id=request.request_id, reason="tandem worker-check: cancel test"))

        chunks = await self._read_stream(request, stream, on_first=cancel_now)
        num_tokens = sum(len(c.token_ids) for c in chunks)
        if num_tokens >= max_tokens:
            raise Failed(f"all {max_tokens} tokens came after a cancel sent on the first chunk")
        last = chunks[-1].finish_reason if chunks else None
        if last not in ("abort", None):
            raise Failed(f"the cancelled request ended with finish_reason {last!r} (want 'abort')")
        return f"stopped after {num_tokens} of {max_tokens} tokens" + (", finish_reason 'abort'" if last else "")

    async def error_reply(self) -> str:
        from shared.bus import BusTimeout, RemoteError

        self._need_info()
        replies = self.bus.stream_bytes(self.info.generate_subject, b'{"request_id": "check-malformed", "model": 7}',
                                        first_timeout_s=min(self.timeout_s, 10.0), idle_timeout_s=self.timeout_s)
        try:
            async with contextlib.aclosing(replies):
                data = await anext(replies, None)
        except BusTimeout:
            raise Failed("no reply to a malformed GenerateRequest (the caller waits out its timeout)") from None
        except RemoteError as exc:
            if exc.code != "bad_request":
                raise Failed(f"error code {exc.code!r}, want 'bad_request'") from None
            return "bad_request"
        raise Failed(f"the reply is not an error reply: {data[:120]!r}" if data is not None else
                     "the end marker, not an error reply")

    async def load_reports(self) -> str:
        from pydantic import ValidationError

        from shared.protocol import WorkerLoad
        from shared.protocol.base import validation_message

        info = self._need_info()
        reports = []
        async with self.bus.listening(self.subjects.load("decode", self.worker_id).subject) as received:
            deadline = time.monotonic() + 5.0
            while len(reports) < 2 and (left := deadline - time.monotonic()) > 0:
                try:
                    data = await asyncio.wait_for(received.get(), left)
                except asyncio.TimeoutError:
                    break
                try:
                    reports.append(WorkerLoad.from_bytes(data))
                except ValidationError as exc:
                    raise Failed(f"a report is not a valid WorkerLoad: {validation_message(exc)[0]}") from None
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
        from shared.bus import RemoteError
        from shared.protocol import ControlRequest, ControlResult, Endpoint

        info = self._need_info()
        if not info.control_subject:
            raise _Skip("no control_subject in the entry: drain it with SIGTERM")
        kv = await self._kv()
        states: list[str] = []
        async with contextlib.aclosing(kv.watch(self.worker_id)) as values:  # every put and the delete
            if (current := await asyncio.wait_for(anext(values), self.timeout_s)) is not None:
                states.append(json.loads(current).get("state"))  # the watch runs from here on
            try:
                await self.bus.request(Endpoint(info.control_subject, ControlRequest, ControlResult),
                                       ControlRequest(action="drain"), timeout_s=self.timeout_s)
            except RemoteError as exc:
                raise Failed(f"drain refused: {exc.message[:200]}") from None
            deadline = time.monotonic() + self.timeout_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    value = await asyncio.wait_for(anext(values), left)
                except asyncio.TimeoutError:
                    break
                if value is None:
                    return f"states {' → '.join(states)} → deleted"
                state = json.loads(value).get("state")
                if not states or states[-1] != state:
                    states.append(state)
        raise Failed(f"still registered {self.timeout_s:g}s after the drain (states {' → '.join(states)})")


class _Skip(Exception):
    pass
