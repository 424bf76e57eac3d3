"""`tandem worker-check WORKER_ID`: a battery of protocol checks against a live decode worker
(docs/protocol.md), each printed as PASS, FAIL or SKIP with its reason; exit 1 on any FAIL.

It reads what the worker sends before judging it, so that it can say exactly what was wrong: a chunk
that does not validate, a gap in ``index``, a missing end marker. Checks, in order: the registry
entry (valid, ready, heartbeat), a streamed generation (consecutive chunks, a last chunk with
``finish_reason: length``, the end marker, at most ``max_tokens``), cancel honoured, a malformed
request answered with a ``bad_request`` error reply, load reports (valid, ``seq`` increasing), and
with ``--drain`` (which takes the worker out of service) drain and deregistration over its control
subject.

A text worker (``takes_text`` in its entry) gets what the gateway sends it: a chat request
(``messages``) and a completion (``prompt_text``), no token ids; its output is ``text``, counted as
the gateway counts it (a chunk's token ids, else one token per chunk with text), and it may end
with ``stop`` before ``max_tokens``. A ``kv_namespace_hex`` that is not the engine's, or not hex at
all, passes with a note: the gateway serves such a worker and routes its requests on load alone.
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
DEFAULT_PROMPT_TEXT = "Count from 1 to 1000, one number per line."


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
    from services.commands.control_cmds import add_worker_args

    parser = subparsers.add_parser("worker-check", help=HELP, description=HELP)
    add_worker_args(parser)
    parser.add_argument("--prompt-token-ids", default="1,2,3,4,5,6,7,8",
                        help="the test prompt, comma-separated token ids (default: %(default)s)")
    parser.add_argument("--prompt-text", default=DEFAULT_PROMPT_TEXT,
                        help="the test prompt for a text worker (takes_text): sent as a user message and as "
                             "a completion prompt; the cancel check needs an answer longer than a few chunks "
                             "(default: %(default)r)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per check (default: %(default)s)")
    parser.add_argument("--drain", action="store_true",
                        help="also drain the worker over its control subject and check it deregisters "
                             "(takes it out of service)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    prompt = [int(t) for t in args.prompt_token_ids.split(",")]
    checks = asyncio.run(check_worker(args.nats_url, args.namespace, args.worker_id, prompt=prompt,
                                      prompt_text=args.prompt_text, timeout_s=args.timeout_s, drain=args.drain))
    for check in checks:
        print(check.line())
    failed = sum(c.outcome == "FAIL" for c in checks)
    print(f"{sum(c.outcome == 'PASS' for c in checks)} passed, {failed} failed, "
          f"{sum(c.outcome == 'SKIP' for c in checks)} skipped")
    return 1 if failed else 0


async def check_worker(nats_url: str, namespace: str, worker_id: str, *, prompt: list[int],
                       prompt_text: str = DEFAULT_PROMPT_TEXT, timeout_s: float = 60.0,
                       drain: bool = False) -> list[Check]:
    """``prompt``: token ids, for a token worker; ``prompt_text``: for a text worker (``takes_text``)."""
    from services.framework.errors import CliError
    from shared.bus import Bus

    try:
        bus = await Bus.connect(nats_url, "tandem-worker-check", timeout_s=5)
    except ConnectionError as exc:  # one line naming the server (its password redacted)
        raise CliError(str(exc)) from None
    try:
        return await _Checker(bus, namespace, worker_id, prompt, timeout_s, prompt_text).run(drain)
    finally:
        await bus.close()


class _Checker:
    def __init__(self, bus, namespace: str, worker_id: str, prompt: list[int], timeout_s: float,
                 prompt_text: str = DEFAULT_PROMPT_TEXT) -> None:
        from shared.protocol import Subjects

        self.bus = bus
        self.subjects = Subjects(namespace)
        self.bucket = self.subjects.workers_bucket
        self.worker_id, self.prompt, self.timeout_s = worker_id, prompt, timeout_s
        self.prompt_text = prompt_text
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
        self.info = info
        if info.takes_text:  # no token ids reach it: its KV namespace names nothing Tandem hashes
            return f"text worker, model {info.model!r}, max_model_len {info.max_model_len}, " \
                   f"max_num_seqs {info.max_num_seqs}"
        return f"model {info.model!r}, block size {info.block_size}, max_num_seqs {info.max_num_seqs}" + \
            namespace_note(info.kv_namespace_hex, make_namespace(info.model), info.model)

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
    def _stream(self, max_tokens: int, text_form: str = "chat"):
        """(request, its stream of TokenChunks) on the subject the worker registered: the token
        prompt, or for a text worker the text prompt as a user message (``chat``) or as
        ``prompt_text`` (``completion``), as the gateway sends them."""
        from shared.protocol import Endpoint, GenerateRequest, SamplingParams, TokenChunk

        prompt: dict = {"prompt_token_ids": self.prompt}
        if self.info.takes_text:
            prompt = {"messages": [{"role": "user", "content": self.prompt_text}]} if text_form == "chat" else \
                {"prompt_text": self.prompt_text}
        request = GenerateRequest(request_id=f"check-{uuid.uuid4().hex[:12]}", model=self.info.model, **prompt,
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
        info = self._need_info()
        if info.takes_text:
            return "; ".join([await self._text_generation("chat"), await self._text_generation("completion")])
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

    async def _text_generation(self, form: str) -> str:
        """A text worker's answer to a chat request or a completion: text, within ``max_tokens``."""
        max_tokens = 8
        try:
            chunks = await self._read_stream(*self._stream(max_tokens, form))
        except Failed as exc:
            raise Failed(f"{form} ({_TEXT_FIELD[form]}): {exc}") from None
        if not chunks:
            raise Failed(f"{form}: the end marker came before any chunk")
        last = chunks[-1].finish_reason
        if last is None:
            raise Failed(f"{form}: the end marker came before a chunk with a finish_reason")
        if last == "abort":
            raise Failed(f"{form}: finish_reason 'abort' for a request nobody cancelled")
        if not "".join(c.text or "" for c in chunks):
            raise Failed(f"{form} ({_TEXT_FIELD[form]}): no text in any chunk (a text worker answers in "
                         f"TokenChunk.text)")
        num_tokens = sum(text_chunk_tokens(c) for c in chunks)
        if num_tokens > max_tokens:
            raise Failed(f"{form}: {num_tokens} tokens (as usage counts them) for max_tokens {max_tokens}")
        return f"{form}: {len(chunks)} chunks of text, finish_reason {last!r}, end marker"

    async def cancel(self) -> str:
        from shared.protocol import CancelRequest, Endpoint

        self._need_info()
        if not self.info.cancel_subject:
            raise Failed("the registry entry has no cancel_subject")
        prompt_len = 0 if self.info.takes_text else len(self.prompt)
        max_tokens = min(512, max(64, self.info.max_model_len - prompt_len - 1))
        request, stream = self._stream(max_tokens)

        async def cancel_now() -> None:
            await self.bus.publish(Endpoint(self.info.cancel_subject, CancelRequest), CancelRequest(
                request_id=request.request_id, reason="tandem worker-check: cancel test"))

        chunks = await self._read_stream(request, stream, on_first=cancel_now)
        num_tokens = sum(text_chunk_tokens(c) if self.info.takes_text else len(c.token_ids) for c in chunks)
        last = chunks[-1].finish_reason if chunks else None
        if self.info.takes_text and last == "stop" and num_tokens < max_tokens:
            # ignore_eos may be more than a text worker's model can honour: a short answer ends first
            raise _Skip(f"the answer ended on its own (finish_reason 'stop' after {len(chunks)} chunks) before the "
                        f"cancel could show: give a --prompt-text with a longer answer")
        if num_tokens >= max_tokens:
            raise Failed(f"all {max_tokens} tokens came after a cancel sent on the first chunk")
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


_TEXT_FIELD = {"chat": "messages", "completion": "prompt_text"}


def text_chunk_tokens(chunk) -> int:
    """A text worker's chunk as the gateway's usage counts it: its token ids, else one token when
    it carries text."""
    return len(chunk.token_ids) if chunk.token_ids else int(chunk.text is not None)


def namespace_note(kv_namespace_hex: str, engine_namespace: bytes, model: str) -> str:
    """What ``kv_namespace_hex`` means for prefix-aware routing, as a note to the registry check
    ("" when it is the engine's namespace for ``model``). Never a failure: the gateway serves the
    worker either way, and without the engine's namespace routes its requests on load alone."""
    try:
        namespace = bytes.fromhex(kv_namespace_hex)
    except ValueError:
        return (f"; note: kv_namespace_hex {kv_namespace_hex[:40]!r} is not hex: the gateway computes no "
                f"block hashes with it and routes this worker's requests on load alone")
    if namespace == engine_namespace:
        return ""
    return f"; note: its KV namespace is not the engine's for model {model!r} (prefix hashes differ)"
