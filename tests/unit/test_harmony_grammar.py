"""gpt-oss's (harmony's) tool grammars, run through llguidance over a byte-level vocabulary with
harmony's markers as special tokens: under ``auto`` with a ``strict`` function, reasoning then an
answer or calls of the declared functions with arguments that match; forced, calls only, as
harmony call messages. A token the grammar refuses is one the mask does not allow."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_tool_markers import byte_level_tokenizer

from shared.grammar import GrammarTable, TokenizerGrammars
from shared.openai_api import harmony
from shared.openai_api.tool_formats import HARMONY
from shared.openai_api.tools import NamedToolChoice, Tool, ToolUse

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}}})
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
SPECIAL = (*harmony.MARKERS, "<|endoftext|>")


# one token per byte, harmony's markers special tokens; as gpt-oss's generation config says,
# <|return|>, <|call|> and <|endoftext|> end a sequence
TOK = byte_level_tokenizer(list(SPECIAL), harmony.RETURN)
STOP_IDS = tuple(TOK.special_token_id(t) for t in (harmony.RETURN, harmony.CALL, "<|endoftext|>"))
VOCAB_SIZE = 256 + len(SPECIAL)


@pytest.fixture(scope="module")
def grammars() -> TokenizerGrammars:
    return TokenizerGrammars(TOK.to_json(), VOCAB_SIZE, STOP_IDS)


def accepts(grammars: TokenizerGrammars, use: ToolUse, text: str | list[int]) -> bool:
    """Whether each token of ``text`` (its markers the special tokens; or token ids) is one the
    mask allows, and the grammar may end after them."""
    table, spec = GrammarTable(grammars), use.grammar()
    ids = TOK.encode(text) if isinstance(text, str) else text
    for n, token in enumerate(ids):
        if not table.masks([table.sync("r", spec, ids[:n])])[0, token]:
            return False
    return table.sync("r", spec, ids).ll.is_accepting()


def call(name: str, arguments: str) -> str:
    return (f"{harmony.CHANNEL}commentary to=functions.{name} {harmony.CONSTRAIN}json{harmony.MESSAGE}"
            f"{arguments}{harmony.CALL}")


OSLO = call("get_weather", '{"city":"Oslo"}')
NOW = call("get_time", "{}")
REASONING = (f"{harmony.CHANNEL}analysis{harmony.MESSAGE}The user wants the weather.{harmony.END}"
             f"{harmony.START}assistant")
FINAL = f"{harmony.CHANNEL}final{harmony.MESSAGE}It is sunny in Oslo."


def names_and_args(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


def test_the_markers_are_special_tokens():
    assert all(len(TOK.encode(m)) == 1 and TOK.special_token_id(m) is not None for m in SPECIAL)


def test_auto_allows_text_or_calls_of_the_declared_functions(grammars):
    use = ToolUse([WEATHER, TIME], "auto", parallel=False, format=HARMONY)
    for text in ("It is sunny in Oslo.", "", FINAL, FINAL + harmony.RETURN, REASONING + FINAL, OSLO, NOW,
                 REASONING + OSLO, REASONING + REASONING + NOW):
        assert accepts(grammars, use, text), text
    assert names_and_args(use.calls(REASONING + OSLO, "stop")) == [("get_weather", {"city": "Oslo"})]
    assert names_and_args(use.calls(OSLO.removesuffix(harmony.CALL), "stop")) == [("get_weather", {"city": "Oslo"})]
    refused = [
        call("rm_rf", "{}"),  # never declared
        call("get_weather", '{"city":"Paris"}'),  # not in the enum
        call("get_weather", '{"city":"Oslo","days":3}'),  # a key the schema does not name
        call("get_weather", "{}"),  # a required key missing
        call("get_weather", '{"city": "Oslo"}'),  # compact JSON only
        OSLO + harmony.START + "assistant" + NOW,  # a second call without parallel_tool_calls
        "Sure! " + OSLO,  # text then a call
        "a <|call|> in text",  # a marker among the text
        TOK.encode("a <|ca") + TOK.encode("ll|> spelled out"),  # the gateway would read it as the marker
        FINAL + harmony.END,  # an answer ends with <|return|> (or the end of the sequence)
        f"{harmony.CHANNEL}analysis{harmony.MESSAGE}unended{harmony.CHANNEL}final{harmony.MESSAGE}x",
        f"{harmony.CHANNEL}commentary{harmony.MESSAGE}a preamble",  # not one of the grammar's messages
    ]
    assert accepts(grammars, use, TOK.encode("a <|ca") + TOK.encode("ll spelled out"))
    for text in refused:
        assert not accepts(grammars, use, text), text


def test_parallel_calls_follow_one_another_where_a_call_does_not_end_the_sequence(grammars):
    """gpt-oss's ``<|call|>`` ends its sequence (its generation config), and llguidance stops a
    matcher at an end of sequence: one call per output. An engine that goes on past it (no stop
    on ``<|call|>``) may write the next call message."""
    use = ToolUse([WEATHER, TIME], "auto", parallel=True, format=HARMONY)
    both = REASONING + OSLO + harmony.START + "assistant" + NOW
    assert accepts(grammars, use, OSLO) and not accepts(grammars, use, both)
    going_on = TokenizerGrammars(TOK.to_json(), VOCAB_SIZE, [TOK.special_token_id(harmony.RETURN)])
    assert accepts(going_on, use, both) and not accepts(going_on, use, OSLO + FINAL)
    assert not accepts(going_on, ToolUse([WEATHER, TIME], "auto", parallel=False, format=HARMONY), both)
    assert names_and_args(use.calls(both, "stop")) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    parallel = ToolUse([WEATHER, TIME], "required", parallel=True, format=HARMONY)
    assert accepts(going_on, parallel, OSLO + harmony.START + "assistant" + NOW)


def test_forced_calls_are_harmony_call_messages(grammars):
    required = ToolUse([WEATHER, TIME], "required", parallel=False, format=HARMONY)
    assert required.grammar().kind == "lark"
    assert accepts(grammars, required, OSLO) and accepts(grammars, required, NOW)
    for text in ("It is sunny.", FINAL, REASONING + OSLO, OSLO + harmony.START + "assistant" + NOW):
        assert not accepts(grammars, required, text), text
    assert names_and_args(required.calls(OSLO, "stop")) == [("get_weather", {"city": "Oslo"})]
    assert required.reply(OSLO, "stop")[0] is None  # no content before the call
    get_time = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    named = ToolUse([WEATHER, TIME], get_time, parallel=True, format=HARMONY)
    assert accepts(grammars, named, NOW) and not accepts(grammars, named, OSLO)


def check_output(use: ToolUse, ids: list[int], max_tokens: int) -> str:
    """Output the grammar allowed reads back as the grammar says: calls of the declared functions
    with valid arguments, or text without a call (cut off by the token limit: a prefix of either).
    Returns which: ``calls``, ``text`` or ``cut``."""
    text = TOK.decode(ids, skip_special_tokens=False)
    finish = "stop" if ids and ids[-1] in STOP_IDS else "length"
    assert finish == "stop" or len(ids) == max_tokens, text
    calls = use.calls(text, finish)
    for c in calls or []:
        assert c.function.name in ("get_weather", "get_time"), text
        assert json.loads(c.function.arguments) in ({"city": "Oslo"}, {"city": "Rome"}, {}), text
    if calls or finish == "length":
        return "calls" if calls else "cut"
    assert use.mode == "auto" and HARMONY.call_start(text) is None, text
    return "text"


def test_a_model_that_knows_nothing_ends_in_text_or_valid_calls(grammars):
    """Random logits (the markers that end no sequence made likely, so messages get written) under
    each grammar: whatever path they take parses, and they take both."""
    from shared.engine.request import Request, SamplingParams
    from shared.engine.sampler import Sampler

    sampler, gen = Sampler(torch.device("cpu"), grammars=grammars), torch.Generator().manual_seed(0)
    markers = [t for t in range(256, VOCAB_SIZE) if t not in STOP_IDS]
    seen = {"auto": set(), "required": set()}
    for i, choice in enumerate(["auto"] * 12 + ["required"] * 3):
        use = ToolUse([WEATHER, TIME], choice, parallel=i % 2 == 0, format=HARMONY)
        params = SamplingParams(grammar=use.grammar(), max_tokens=120, temperature=1.0, seed=i)
        request = Request(f"r{i}", [1], params, frozenset(STOP_IDS))
        while not request.status.is_finished:
            logits = torch.randn(1, VOCAB_SIZE, generator=gen) * 3
            logits[0, markers] += 5
            request.append_token(sampler.sample(logits, [request])[0].token_id, max_model_len=10_000)
        seen[choice].add(check_output(use, request.output_token_ids, 120))
    assert {"calls", "text"} <= seen["auto"] and seen["required"] == {"calls"}


def test_the_tiny_gpt_oss_model_through_the_engine(tmp_path):
    """A random-weight gpt-oss under the strict auto grammar and a forced one, through the engine."""
    from shared.engine import EngineConfig, LLMEngine, SamplingParams
    from shared.model.loader import load_model
    sys.path.insert(0, str(Path(__file__).parent / "engine"))
    from tiny_hf_models import save_tiny

    save_tiny("gpt_oss", tmp_path, vocab_size=VOCAB_SIZE)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=8), tokenizer=TOK,
                       eos_token_ids=frozenset(STOP_IDS))
    prompt = TOK.encode(f"{harmony.START}user{harmony.MESSAGE}Weather in Oslo?{harmony.END}{harmony.START}assistant")
    uses = [ToolUse([WEATHER, TIME], choice, parallel=False, format=HARMONY) for choice in ("auto", "required")]
    params = [SamplingParams(grammar=u.grammar(), max_tokens=80, temperature=1.0, seed=s) for u in uses for s in (0, 1)]
    outputs = engine.generate([prompt] * len(params), params)
    for n, ids in enumerate(outputs):
        check_output(uses[n // 2], ids, 80)
    assert any(uses[1].calls(TOK.decode(ids, skip_special_tokens=False), "stop") for ids in outputs[2:])
