"""Forced tool calls from the real SmolLM2, read back as the gateway reads them: every call's
arguments are JSON and no call repeats another, whatever the token limit cut off."""

from __future__ import annotations

import itertools
import json

from services.decode.translate import engine_params
from shared.openai_api.adapters import ChatAdapter, Choice
from shared.openai_api.generate_request import sampling_params
from shared.openai_api.tools import MAX_FORCED_CALLS

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": {
    "type": "object", "properties": {}}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
    "required": ["query"]}}}
PROMPTS = ["Weather in Tokyo please", "What time is it in London?", "Find me recent news about the Mars rover."]
FORCED = [([WEATHER], "required"), ([WEATHER, TIME], "required"),  # greedy, both repeat a call until stopped
          ([WEATHER, SEARCH], {"type": "function", "function": {"name": "get_weather"}})]
MAX_TOKENS = [8, 30, 200]  # cut inside the first call, after a call or two, and a loop of repeats


def test_forced_calls_are_json_and_distinct_at_any_token_limit(make_engine, smol_tokenizer):
    engine, cases = make_engine(), []
    for i, (prompt, (tools, choice), parallel, max_tokens) in enumerate(
            itertools.product(PROMPTS, FORCED, [True, False], MAX_TOKENS)):
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "tools": tools,
                "tool_choice": choice, "parallel_tool_calls": parallel, "temperature": 0, "max_tokens": max_tokens}
        api = ChatAdapter.from_json(json.dumps(body).encode(), smol_tokenizer)
        engine.add_request(f"r{i}", api.prompt_ids(), engine_params(sampling_params(api.body, max_tokens)))
        cases.append((api, [], [None]))
    while engine.has_unfinished_requests():
        for out in engine.step():
            _, ids, finish = cases[int(out.request_id[1:])]
            ids.extend(out.new_token_ids)
            finish[0] = out.finish_reason
    num_calls = num_cut = num_repeats = 0
    for api, ids, [finish] in cases:
        text = smol_tokenizer.decode(ids)
        choice = api.choice(0, Choice(text, finish, []))
        calls = [c["function"] for c in choice["message"].get("tool_calls") or []]
        where = f"{api.body.tool_choice!r} parallel={api.body.parallel_tool_calls} {finish}: {text!r}"
        assert finish in ("stop", "length"), where
        if finish == "stop":  # the grammar ended the list: whole calls, at most MAX_FORCED_CALLS of them
            assert calls and choice["finish_reason"] == "tool_calls", where
        assert all(isinstance(json.loads(c["arguments"]), dict) for c in calls), where
        keys = [(c["name"], json.dumps(json.loads(c["arguments"]), sort_keys=True)) for c in calls]
        assert len(set(keys)) == len(keys), where
        assert len(calls) <= (MAX_FORCED_CALLS if api.body.parallel_tool_calls and api.body.tool_choice == "required"
                              else 1), where
        if finish == "stop" and api.body.parallel_tool_calls:
            num_repeats += len(json.loads(text)) > len(calls)
        num_calls += len(calls)
        num_cut += finish == "length"
    assert num_calls >= len(PROMPTS) * len(FORCED) * 2 and num_cut >= len(PROMPTS) * len(FORCED) * 2
    assert num_repeats >= 2  # the model did repeat calls: the sweep saw them dropped
