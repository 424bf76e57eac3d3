"""``/tokenize`` and ``/detokenize`` as vLLM serves them: a prompt (or chat messages, rendered
through the chat template) to token ids, and token ids back to text."""

from __future__ import annotations

from pydantic import Field, JsonValue, StrictBool, StrictInt, StrictStr

from shared.openai_api.errors import ApiError
from shared.openai_api.models import MAX_TEMPLATE_KWARGS, ChatMessage, _Body, check_template_kwargs
from shared.tokenizer import Tokenizer


class TokenizeRequest(_Body):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    # as on /v1/chat/completions: extra variables of the chat template (messages only)
    chat_template_kwargs: dict[str, JsonValue] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(min_length=0)




def tokenize(body: TokenizeRequest, tokenizer: Tokenizer, max_model_len: int | None, *, max_chars: int) -> dict:
    """Blocking (the tokenizer runs here): the gateway calls it off its event loop. A text longer
    than ``max_chars`` characters (the prompt, or the messages as the chat template renders them)
    is a 413."""
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    if body.chat_template_kwargs is not None and body.messages is None:
        raise ApiError(400, "chat_template_kwargs applies to messages only", param="chat_template_kwargs")
    if body.messages is not None:
        check_template_kwargs(body.chat_template_kwargs)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                 extra_variables=body.chat_template_kwargs)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        _check_size(len(text), max_chars, "characters", "messages")
    else:
        text = body.prompt
        _check_size(len(text), max_chars, "characters", "prompt")
    tokens = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}


def detokenize(body: DetokenizeRequest, tokenizer: Tokenizer, *, max_tokens: int) -> dict:
    """Blocking, as ``tokenize``; more than ``max_tokens`` tokens is a 413."""
    _check_size(len(body.tokens), max_tokens, "tokens", "tokens")
    vocab = tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise ApiError(400, f"tokens must be in [0, {vocab})", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


def _check_size(size: int, limit: int, unit: str, param: str) -> None:
    if size > limit:
        raise ApiError(413, f"{param}: {size} {unit}, more than this server's limit of {limit}",
                       param=param, code="input_too_large")
