"""The gateway's ``Generation`` when its decode worker is lost mid-stream, over a real nats-server:
a stand-in admission and a stand-in decode worker (``Bus.serve``/``serve_stream``) whose stream
goes silent, as a SIGKILLed worker's does, while the test plays the registry view.

- A worker that died and came back under the same id (a new ``started_at``) is lost: the request
  continues on the new incarnation without waiting for the token idle timeout.
- When no worker is ready, the request waits for one (admission's "unavailable" while its view
  lags is asked again), then continues with the tokens generated so far.
- That wait is bounded by ``request_timeout_s``: then a 503 with code ``unavailable``.
- The same wait when the worker is lost before its first token (e.g. during a long prefill).
"""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from services.gateway.config import GatewaySettings
from services.gateway.generation import Generation
from services.gateway.metrics import GatewayMetrics
from shared.openai_api.errors import ApiError
from shared.protocol import AdmissionDecision, GenerateRequest, SamplingParams, Subjects, TokenChunk
from shared.tokenizer import Tokenizer

WORKER = "w-1"
PROMPT = [1, 2, 3]


def tokenizer() -> Tokenizer:
    backend = BackendTokenizer(WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, bos_token=None, eos_token=None, chat_template="")


class Cluster:
    """Admission, one decode worker and the gateway's registry view, driven by the test."""

    def __init__(self) -> None:
        self.started_at_s: float | None = 1.0   # the registered worker's start time; None: not listed
        self.is_ready = True
        self.num_unavailable = 0              # admissions to answer "unavailable" before admitting
        self.num_first_tokens = 3             # what the first incarnation streams before it goes silent
        self.requests: list[GenerateRequest] = []
        self.gone_silent = asyncio.Event()    # the first incarnation stopped streaming
        self.waiting = asyncio.Event()        # the gateway asked for a ready worker and got none
        self.released = asyncio.Event()       # end of test: the silent stream may end (bus drains)

    async def admit(self, request: GenerateRequest) -> AdmissionDecision:
        if not self.is_ready or self.num_unavailable:
            self.num_unavailable -= 1 if self.is_ready else 0
            return AdmissionDecision(request_id=request.request_id, is_admitted=False,
                                     reject_reason="unavailable", message="no decode worker")
        return AdmissionDecision(request_id=request.request_id, is_admitted=True, worker_id=WORKER)

    async def generate(self, request: GenerateRequest):
        """Three tokens then silence (the first request); the rest of max_tokens (a migration)."""
        self.requests.append(request)
        n = request.sampling.max_tokens if len(self.requests) > 1 else self.num_first_tokens
        for i in range(n):
            last = i == n - 1 and len(self.requests) > 1
            yield TokenChunk(request_id=request.request_id, index=i, token_ids=[10 + len(request.prompt_token_ids) + i],
                             finish_reason="length" if last else None)
        if len(self.requests) == 1:
            self.gone_silent.set()
            await self.released.wait()

    # the gateway's worker directory, as a Generation asks it
    def has_ready_worker(self, model: str) -> bool:
        if not self.is_ready:
            self.waiting.set()
        return self.is_ready

    def started_at(self, worker_id: str) -> float | None:
        return self.started_at_s if worker_id == WORKER else None

    def block_hashes(self, prompt_token_ids: list[int], model: str) -> list[int]:
        return []


@pytest.fixture
async def setup(bus, namespace, nats_url):
    cluster = Cluster()
    subjects = Subjects(namespace)
    await bus.serve(subjects.admission_submit(), cluster.admit)
    await bus.serve_stream(subjects.decode_generate(WORKER), cluster.generate)
    await bus.subscribe(subjects.decode_cancel(WORKER), lambda _: asyncio.sleep(0))

    def generation(**settings) -> Generation:
        s = GatewaySettings(nats_url=nats_url, namespace=namespace, refresh_interval_s=0.05,
                            token_idle_timeout_s=600, **settings)
        request = GenerateRequest(request_id="r-1", model="m", prompt_token_ids=PROMPT,
                                  sampling=SamplingParams(max_tokens=8, temperature=0.0))
        return Generation(bus, subjects, s, tokenizer(), GatewayMetrics.create(), request, [], workers=cluster)

    yield cluster, generation
    cluster.released.set()


async def finish(gen: Generation) -> str:
    text = ""
    async for delta in gen.deltas():
        text += delta.text
    return text


def expected_text() -> str:
    # first incarnation: tokens 13,14,15 after the 3-token prompt; the migration's prompt has 6 tokens
    ids = [13, 14, 15] + [16 + i for i in range(5)]
    tok = tokenizer()
    return tok.decode(PROMPT + ids)[len(tok.decode(PROMPT)):]


async def test_a_worker_restarted_under_its_id_is_lost_and_the_request_continues_on_the_new_one(setup):
    cluster, generation = setup
    gen = generation()
    await gen.start()
    consumer = asyncio.create_task(finish(gen))
    await asyncio.wait_for(cluster.gone_silent.wait(), 10)
    cluster.started_at_s = 2.0  # the same id, listed again by a new incarnation
    # bounded far below the 600 s idle timeout, which is what ends the stream without the check
    text = await asyncio.wait_for(consumer, 20)
    assert text == expected_text()
    assert cluster.requests[1].prompt_token_ids == PROMPT + [13, 14, 15]
    assert cluster.requests[1].sampling.max_tokens == 5
    await gen.close()


async def test_with_no_ready_worker_the_request_waits_for_one_then_continues(setup):
    cluster, generation = setup
    gen = generation()
    await gen.start()
    consumer = asyncio.create_task(finish(gen))
    await asyncio.wait_for(cluster.gone_silent.wait(), 10)
    cluster.started_at_s, cluster.is_ready = None, False  # died: left the registry, none other ready
    waiting = asyncio.create_task(cluster.waiting.wait())
    await asyncio.wait({waiting, consumer}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert not consumer.done(), f"the request ended instead of waiting: {consumer.exception()!r}"
    assert waiting.done() and len(cluster.requests) == 1
    cluster.num_unavailable = 2  # admission has not seen the replacement yet
    cluster.started_at_s, cluster.is_ready = 2.0, True
    assert await asyncio.wait_for(consumer, 20) == expected_text()
    assert cluster.num_unavailable == 0 and len(cluster.requests) == 2
    await gen.close()


async def test_the_wait_for_a_worker_ends_at_the_request_timeout(setup):
    cluster, generation = setup
    gen = generation(request_timeout_s=0.5)
    await gen.start()
    consumer = asyncio.create_task(finish(gen))
    await asyncio.wait_for(cluster.gone_silent.wait(), 10)
    cluster.started_at_s, cluster.is_ready = None, False
    with pytest.raises(ApiError) as err:
        await asyncio.wait_for(consumer, 20)
    assert (err.value.status, err.value.code) == (503, "unavailable")
    assert len(cluster.requests) == 1
    await gen.close()


async def test_a_worker_lost_before_the_first_token_is_waited_for_too(setup):
    cluster, generation = setup
    cluster.num_first_tokens = 0  # dies during the prefill: nothing streamed yet
    gen = generation()
    starting = asyncio.create_task(gen.start())
    await asyncio.wait_for(cluster.gone_silent.wait(), 10)
    cluster.started_at_s, cluster.is_ready = None, False
    waiting = asyncio.create_task(cluster.waiting.wait())
    await asyncio.wait({waiting, starting}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert not starting.done(), f"the request ended instead of waiting: {starting.exception()!r}"
    cluster.started_at_s, cluster.is_ready = 2.0, True
    await asyncio.wait_for(starting, 20)
    tok = tokenizer()
    expected = tok.decode(PROMPT + [13 + i for i in range(8)])[len(tok.decode(PROMPT)):]
    assert await asyncio.wait_for(finish(gen), 20) == expected
    assert len(cluster.requests) == 2 and cluster.requests[1].prompt_token_ids == PROMPT
    await gen.close()
