"""From an endpoint's body to the ``GenerateRequest`` admission routes, with the request rules:
the model must be served, and the prompt plus ``max_tokens`` must fit the context window of the
model's ready decode workers (the smallest, as any of them may get the request).

Pure: the caller passes the ready workers, the tier and the clock.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Sequence

from shared.grammar import GrammarError, GrammarSpec, compile_grammar
from shared.kvcache.hashing import hash_blocks
from shared.openai_api.adapters import ApiAdapter
from shared.openai_api.errors import ApiError
from shared.openai_api.models import MAX_DEADLINE_MS, ApiRequest
from shared.protocol import GenerateRequest, SamplingParams, WorkerInfo

log = logging.getLogger(__name__)


def build_generate_request(api: ApiAdapter, prompt_ids: list[int], *, tier: str, priority: int = 0,
                           workers: Sequence[WorkerInfo], served_models: Sequence[str],
                           default_max_tokens: int, now: float) -> GenerateRequest:
    """``workers``: the ready decode workers of the request's model. Raises 404 for a model not in
    ``served_models`` and 400 for a request that cannot fit the context window."""
    body = api.body
    model = resolve_model(body.model, served_models)
    max_tokens = max_tokens_in_context(len(prompt_ids), body.requested_max_tokens(),
                                       min((w.max_model_len for w in workers), default=None),
                                       default_max_tokens, prompt_param=api.prompt_param)
    check_logit_bias(body, api.tokenizer.vocab_size)
    check_grammar(body)
    sampling = sampling_params(body, max_tokens).model_copy(
        update={"eos_token_ids": list(api.tokenizer.stop_token_ids)})  # the worker stops there, as the engine does
    return GenerateRequest(request_id=f"{api.id_prefix}-{uuid.uuid4().hex}", model=model,
                           prompt_token_ids=prompt_ids, sampling=sampling,
                           block_hashes=prompt_block_hashes(prompt_ids, workers), tier=tier,
                           priority=priority, created_at=now)


DEADLINE_HEADER = "x-tandem-deadline-ms"


def with_header_deadline(api: ApiAdapter, header: str | None) -> None:
    """Apply the ``x-tandem-deadline-ms`` header to the parsed body (the earlier of it and a
    ``deadline_ms`` in the body); a value that is not a positive number of ms up to a week is a 400."""
    if header is None:
        return
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_DEADLINE_MS:
        raise ApiError(400, f"{DEADLINE_HEADER} must be a number of milliseconds in (0, {MAX_DEADLINE_MS}], "
                       f"not {header!r}", param=DEADLINE_HEADER)
    if api.body.deadline_ms is None or value < api.body.deadline_ms:
        api.body = api.body.model_copy(update={"deadline_ms": value})


def deadline_at(api: ApiAdapter, now: float) -> float | None:
    """When the request should be finished (Unix seconds), from its ``deadline_ms``."""
    return None if api.body.deadline_ms is None else now + api.body.deadline_ms / 1000


def build_text_request(api: ApiAdapter, *, model: str, tier: str, priority: int = 0, default_max_tokens: int,
                       now: float) -> GenerateRequest:
    """A request for a text worker (``WorkerInfo.takes_text``): the prompt as text or chat messages,
    no token ids or block hashes. What needs the model's tokens here is a 400 naming it."""
    body = api.body
    token_bound = [("logprobs", body.num_logprobs() is not None), ("logit_bias", bool(body.token_biases())),
                   ("best_of", body.num_choices() > body.n)]
    if (grammar := body.grammar()) is not None:
        token_bound.append((grammar[1], True))
    if getattr(body, "tool_mode", lambda: "none")() != "none":
        token_bound.append(("tools", True))
    for param, used in token_bound:
        if used:
            raise ApiError(400, f"{param} is not supported for {model!r}: a text worker serves it (text in, "
                           f"text out; no token ids at the gateway)", param=param, code="unsupported_parameter")
    prompt_text, messages = api.text_prompt()
    return GenerateRequest(request_id=f"{api.id_prefix}-{uuid.uuid4().hex}", model=model, prompt_text=prompt_text,
                           messages=messages, sampling=sampling_params(body, body.requested_max_tokens()
                                                                       or default_max_tokens),
                           tier=tier, priority=priority, created_at=now)


def resolve_model(requested: str | None, served_models: Sequence[str]) -> str:
    """The model a request runs on: as named, or (omitted) the only one served."""
    if requested is None:
        if len(served_models) != 1:
            raise ApiError(400, f"model is required: several are served: {list(served_models)}",
                           param="model", code="missing_parameter")
        return served_models[0]
    if requested not in served_models:
        raise ApiError(404, f"model {requested!r} does not exist; served: {list(served_models)}",
                       param="model", code="model_not_found")
    return requested


def check_logit_bias(body: ApiRequest, vocab_size: int) -> None:
    bad = [t for t in (body.token_biases() or {}) if t >= vocab_size]
    if bad:
        raise ApiError(400, f"logit_bias: token ids must be in [0, {vocab_size}), got {bad[0]}",
                       param="logit_bias", code="invalid_value")


def check_grammar(body: ApiRequest) -> None:
    """A 400 naming the parameter for a schema or regex that does not compile, or uses a feature
    the grammar engine does not implement (the message names the feature)."""
    asked = body.grammar()
    if asked is None:
        return
    spec, param = asked
    try:
        compile_grammar(GrammarSpec(spec.kind, spec.value))
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="unsupported_schema") from None


def choice_requests(request: GenerateRequest, num_choices: int) -> list[GenerateRequest]:
    """One engine request per choice, all with the same prompt (so the prefix cache shares its
    blocks); a seeded request's choice ``i`` is seeded ``seed + i`` so that the choices differ."""
    if num_choices == 1:
        return [request]
    seed = request.sampling.seed
    return [request.model_copy(update={
        "request_id": f"{request.request_id}-{i}",
        "sampling": request.sampling.model_copy(update={"seed": None if seed is None else (seed + i) % 2**63})})
        for i in range(num_choices)]


def max_tokens_in_context(num_prompt_tokens: int, requested: int | None, max_model_len: int | None,
                          default_max_tokens: int, *, prompt_param: str) -> int:
    """The request's ``max_tokens``: as requested, else the default cut to what the context
    leaves. ``max_model_len`` None (no worker known yet) checks nothing: the worker will."""
    if max_model_len is None:
        return requested or default_max_tokens
    if num_prompt_tokens >= max_model_len:
        raise ApiError(400, f"prompt has {num_prompt_tokens} tokens; this model's maximum context length "
                       f"is {max_model_len}", code="context_length_exceeded", param=prompt_param)
    if requested is None:
        return min(default_max_tokens, max_model_len - num_prompt_tokens)
    if num_prompt_tokens + requested > max_model_len:
        raise ApiError(400, f"max_tokens {requested} + prompt {num_prompt_tokens} tokens exceeds the "
                       f"maximum context length {max_model_len}", param="max_tokens",
                       code="context_length_exceeded")
    return requested


def sampling_params(body: ApiRequest, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, seed=body.seed, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        ignore_eos=body.ignore_eos, logit_bias=body.token_biases(), logprobs=_engine_logprobs(body),
        grammar=(body.grammar() or (None,))[0])


def _engine_logprobs(body: ApiRequest) -> int | None:
    """``best_of`` ranks choices by their tokens' logprobs, so it needs them even when not asked."""
    asked = body.num_logprobs()
    if asked is None and body.num_choices() > body.n:
        return 0
    return asked


def prompt_block_hashes(prompt_ids: Sequence[int], workers: Sequence[WorkerInfo]) -> list[int]:
    """The prompt's chained block hashes as the model's workers compute them (admission looks
    them up in kv-index); none while no worker with a valid ``kv_namespace_hex`` is known (the
    request is then routed on load alone)."""
    for worker in workers:
        try:
            namespace = bytes.fromhex(worker.kv_namespace_hex)
        except ValueError:
            if worker.worker_id not in _WARNED_NAMESPACE:
                _WARNED_NAMESPACE.add(worker.worker_id)
                log.warning("worker %s registered kv_namespace_hex %r, which is not hex: its requests are "
                            "routed on load alone", worker.worker_id, worker.kv_namespace_hex[:80])
            continue
        return hash_blocks(prompt_ids, worker.block_size, namespace)
    return []


_WARNED_NAMESPACE: set[str] = set()
