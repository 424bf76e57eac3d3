"""Structured outputs on the real SmolLM2 tokenizer, without the model: random logits stand in
for it, so every token is chosen by the grammar's mask alone. The output must parse and match its
schema; the grammar state survives being lost (rebuilt from the tokens) and a move to another
worker (replayed over the prompt's tail); a schema feature that is not implemented is named."""

from __future__ import annotations

import json
import re

import pytest
import torch

from schema_check import violation
from shared.engine.request import Request, SamplingParams
from shared.engine.sampler import Sampler
from shared.grammar import GrammarError, GrammarSpec, GrammarTable, TokenizerGrammars, compile_grammar
from shared.openai_api.adapters import ChatAdapter
from shared.openai_api.errors import ApiError
from shared.openai_api.generate_request import check_grammar
from shared.tokenizer import Tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}},
                         "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}


@pytest.fixture(scope="module")
def tok(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def grammars(tok) -> TokenizerGrammars:
    return TokenizerGrammars(tok.to_json(), tok.vocab_size, tok.stop_token_ids)


def run(sampler: Sampler, requests: list[Request], tok: Tokenizer, max_steps: int, seed: int = 0) -> None:
    """Sample every request to its end with random logits (a model that knows nothing)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_steps):
        live = [r for r in requests if not r.status.is_finished]
        if not live:
            return
        logits = torch.randn(len(live), tok.vocab_size, generator=gen) * 3
        for r, token in zip(live, sampler.sample(logits, live)):
            r.append_token(token.token_id, max_model_len=10_000)
    raise AssertionError(f"not finished within {max_steps} steps")


def request(rid: str, tok: Tokenizer, spec: GrammarSpec, **params) -> Request:
    params = {"max_tokens": 400, "seed": sum(map(ord, rid)), **params}
    return Request(rid, [1], SamplingParams(grammar=spec, **params), frozenset(tok.stop_token_ids))


def test_json_schema_output_parses_and_matches_under_random_logits(tok, grammars):
    sampler = Sampler(torch.device("cpu"), grammars=grammars)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    reqs = [request(f"r{i}", tok, spec, temperature=t) for i, t in enumerate((0.0, 0.7, 1.0, 1.5))]
    run(sampler, reqs, tok, 400)
    assert sampler.grammars.num_prefetch_hits > 0  # masks computed while the next "forward" ran
    for r in reqs:
        assert r.output_token_ids[-1] in tok.stop_token_ids, "ended by the grammar, not max_tokens"
        value = json.loads(tok.decode(r.output_token_ids))
        assert violation(value, SCHEMA) is None, (value, violation(value, SCHEMA))


def test_json_object_and_regex(tok, grammars):
    sampler = Sampler(torch.device("cpu"), grammars=grammars)
    obj = request("o", tok, GrammarSpec("json_object"), temperature=1.0, max_tokens=60)
    rx = request("x", tok, GrammarSpec("regex", r"[A-Z]{2}-\d{3}"), temperature=1.0)
    run(sampler, [obj, rx], tok, 400)
    text = tok.decode(obj.output_token_ids)
    if obj.status.value == "stop":  # a random object may run past 60 tokens: then it is a prefix
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", tok.decode(rx.output_token_ids))


def test_state_is_rebuilt_from_the_tokens_after_being_lost_or_moved(tok, grammars):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    sampler = Sampler(torch.device("cpu"), grammars=grammars)
    first = request("a", tok, spec, temperature=1.0)
    run(sampler, [first], tok, 400, seed=3)
    out = first.output_token_ids
    for cut in (1, len(out) // 2, len(out) - 2):
        # lost (preempted, forgotten): the same tokens so far give the same mask
        lost = request("a-lost", tok, spec)
        lost.output_token_ids = list(out[:cut])
        # moved: the tokens so far are the prompt's tail, replayed
        moved = Request("a-moved", [1, *out[:cut]], SamplingParams(grammar=spec, num_output_in_prompt=cut))
        fresh = Sampler(torch.device("cpu"), grammars=grammars)
        masks = [fresh.grammars.masks([fresh.grammars.sync(r.request_id, spec, r.grammar_token_ids)])
                 for r in (lost, moved)]
        assert torch.equal(masks[0], masks[1]) and bool(masks[0][0, out[cut]]), cut
        assert masks[0].sum() < tok.vocab_size  # the grammar constrains here


@pytest.mark.parametrize("schema,feature", [({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
                                            ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}},
                                             "$defs")])
def test_unsupported_schema_features_are_named(schema, feature):
    with pytest.raises(GrammarError, match=re.escape(feature)):
        compile_grammar(GrammarSpec("json_schema", json.dumps(schema)))


def test_the_gateway_refuses_a_bad_schema_naming_parameter_and_feature(tok):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"not": {"type": "string"}}}}}
    api = ChatAdapter.from_json(json.dumps(body).encode(), tok)
    with pytest.raises(ApiError) as info:
        check_grammar(api.body)
    assert info.value.param == "response_format" and "not" in info.value.message, info.value.body()
    body["response_format"] = {"type": "json_object"}
    check_grammar(ChatAdapter.from_json(json.dumps(body).encode(), tok).body)


def test_the_strict_auto_tool_grammar_allows_text_or_declared_calls_only(tok, grammars):
    from shared.openai_api.tools import Tool, ToolUse
    weather = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    spec = ToolUse([weather], "auto", parallel=True).grammar()

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(spec).ll
        return all(matcher.consume_token(t) for t in tok.encode(text)) and matcher.is_accepting()

    assert accepts("It is sunny in Oslo.") and accepts("a < b, <tool is not a call")
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>'
    assert accepts(call) and accepts("\n" + call + "\n" + call)
    assert not accepts('<tool_call>{"name":"rm_rf","arguments":{}}</tool_call>')  # never declared
    assert not accepts('<tool_call>{"name":"get_weather","arguments":{"city":"Oslo","type":"x"}}</tool_call>')
    assert not accepts("Sure! " + call)  # text with a call in it: neither
    # a model that knows nothing still ends, in text that holds no call or in valid calls
    sampler = Sampler(torch.device("cpu"), grammars=grammars)
    reqs = [request(f"t{i}", tok, spec, temperature=1.0, max_tokens=40) for i in range(3)]
    run(sampler, reqs, tok, 100)
    for r in reqs:
        text = tok.decode(r.output_token_ids)
        assert "<tool_call>" not in text or ToolUse([weather], "auto", True).calls(text, r.status.value), text


def test_json_object_never_repeats_a_key(tok, grammars):
    spec = GrammarSpec("json_object")
    matcher = grammars.matcher(spec)
    matcher.advance_to(tok.encode('{"a":1,"b":{"a":2,"a'))
    allowed = GrammarTable(grammars).masks([matcher])[0]
    closing = grammars.tokens_starting_with(b'"')
    assert closing and not allowed[closing].any()  # "a" is already a key of the inner object
    assert allowed[tok.encode("b")].any()  # "ab" is not
    matcher = grammars.matcher(spec)
    matcher.advance_to(tok.encode('{"a":1,"b":{"c":2,"a'))
    assert GrammarTable(grammars).masks([matcher])[0][closing].any()  # "a" is a key of the outer one only
    # a model that knows nothing, steered toward repeating keys: still none twice
    sampler = Sampler(torch.device("cpu"), grammars=grammars)
    reqs = [request(f"k{i}", tok, spec, temperature=1.0, max_tokens=80) for i in range(6)]
    a_key = tok.encode('"a"')
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        live = [r for r in reqs if not r.status.is_finished]
        if not live:
            break
        logits = torch.randn(len(live), tok.vocab_size, generator=gen) * 3
        logits[:, a_key] += 12  # every key would be "a" if it could
        for r, token in zip(live, sampler.sample(logits, live)):
            r.append_token(token.token_id, max_model_len=10_000)

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), keys
        return dict(pairs)

    for r in reqs:
        text = tok.decode(r.output_token_ids)
        if r.status.value == "stop":
            json.loads(text, object_pairs_hook=no_duplicates)
