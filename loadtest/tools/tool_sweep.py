"""A sweep of forced tool calls against a running gateway, counting what a client could not parse.

    python -m loadtest.tools.tool_sweep --base-url http://127.0.0.1:8000 --requests 100 \\
        --out loadtest/results/tools/sweep.json

Each request asks ``/v1/chat/completions`` (through the official ``openai`` client, as an agent
framework would) for a forced call of one of two tools, varying what clients vary: ``tool_choice``
(``required`` or the tool by name), ``parallel_tool_calls`` (on, off), ``max_tokens`` (from a
cut-off inside the first call to room for several), temperature (greedy, or 1.0 with a seed),
streamed or not (the stream's tool-call deltas joined as a client joins them). Counted: calls whose
arguments are not a JSON object, calls repeating an earlier call of the same reply (same name, same
arguments), and the finish reasons. A reply cut off by ``max_tokens`` before any call was written
whole carries no call (docs/api.md, Tool calls), which is counted as ``cut_off`` and is fine.
Prints the counts and writes them (and every bad reply) as JSON. Exit status 1 if any call could not
be parsed or repeated one before it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
UNITS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
         "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_forecast", "description": "Tomorrow's forecast",
                                           "parameters": UNITS}}]
PROMPTS = ["What is the weather in Paris?", "Weather in Paris and in Rome, please.",
           "Is it going to rain in Oslo tomorrow? Use celsius.", "Check the weather for Lima, Quito and Bogota."]
MAX_TOKENS = (6, 16, 40, 120)


@dataclass(frozen=True)
class Case:
    prompt: str
    tool_choice: str  # "required" or a tool's name
    parallel: bool
    max_tokens: int
    temperature: float
    stream: bool
    seed: int

    def request(self, model: str) -> dict:
        choice = self.tool_choice if self.tool_choice == "required" else \
            {"type": "function", "function": {"name": self.tool_choice}}
        return {"model": model, "messages": [{"role": "user", "content": self.prompt}], "tools": TOOLS,
                "tool_choice": choice, "parallel_tool_calls": self.parallel, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "seed": self.seed}


@dataclass
class Tally:
    requests: int = 0
    calls: int = 0
    unparsable: int = 0
    repeated: int = 0
    cut_off: int = 0
    errors: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    bad: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self) | {"finish_reasons": dict(self.finish_reasons)}


def cases(num: int) -> list[Case]:
    """``num`` cases drawn from every combination (each once before any twice), the same each run."""
    grid = list(itertools.product(PROMPTS, ("required", "get_weather"), (True, False), MAX_TOKENS,
                                  (0.0, 1.0), (False, True)))
    order = random.Random(0).sample(grid, len(grid))
    return [Case(*order[i % len(order)], seed=i) for i in range(num)]


def run_case(client, model: str, case: Case) -> tuple[str | None, list[tuple[str, str]]]:
    """(finish_reason, [(name, arguments)]) of one reply, as a client reads it."""
    body = case.request(model)
    if not case.stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = choice.message.tool_calls or []
        return choice.finish_reason, [(c.function.name, c.function.arguments) for c in calls]
    finish, calls = None, {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:  # joined by index, as clients join them
                name, args = calls.get(delta.index, ("", ""))
                fn = delta.function
                if fn is not None:
                    calls[delta.index] = (name + (fn.name or ""), args + (fn.arguments or ""))
    return finish, [calls[i] for i in sorted(calls)]


def check(tally: Tally, case: Case, finish: str | None, calls: list[tuple[str, str]]) -> None:
    tally.requests += 1
    tally.finish_reasons[finish] += 1
    if not calls:
        tally.cut_off += finish == "length"
        if finish != "length":
            tally.bad.append({"case": asdict(case), "why": "no call and not cut off", "finish": finish})
        return
    seen = set()
    for name, arguments in calls:
        tally.calls += 1
        try:
            ok = isinstance(json.loads(arguments), dict)
        except ValueError:
            ok = False
        if not ok:
            tally.unparsable += 1
            tally.bad.append({"case": asdict(case), "why": "arguments not a JSON object", "call": [name, arguments]})
        if (name, arguments) in seen:
            tally.repeated += 1
            tally.bad.append({"case": asdict(case), "why": "a call repeated", "call": [name, arguments]})
        seen.add((name, arguments))


def sweep(base_url: str, model: str, num: int, concurrency: int = 4, api_key: str = "unused") -> Tally:
    import openai

    client = openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=300)
    tally = Tally()
    todo = cases(num)

    def one(case: Case):
        try:
            return case, run_case(client, model, case), None
        except openai.APIError as exc:
            return case, None, exc

    with ThreadPoolExecutor(concurrency) as pool:
        for case, result, error in pool.map(one, todo):
            if error is not None:
                tally.requests += 1
                tally.errors += 1
                tally.bad.append({"case": asdict(case), "why": f"error: {error}"})
            else:
                check(tally, case, *result)
    return tally


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m loadtest.tools.tool_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the gateway (default: %(default)s)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--api-key", default="unused")
    p.add_argument("--out", type=Path, default=None, help="write the counts and the bad replies here (JSON)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    tally = sweep(args.base_url, args.model, args.requests, args.concurrency, args.api_key)
    print(f"{tally.requests} requests, {tally.calls} calls: {tally.unparsable} with arguments that are not a JSON "
          f"object, {tally.repeated} repeating an earlier call, {tally.cut_off} cut off before a whole call, "
          f"{tally.errors} errors; finish reasons {dict(tally.finish_reasons)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"base_url": args.base_url, "model": args.model, **tally.to_dict()}, indent=1))
    return 1 if tally.unparsable or tally.repeated or tally.errors else 0


if __name__ == "__main__":
    sys.exit(main())
