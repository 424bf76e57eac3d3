"""`tandem complete`, `tandem chat` and `tandem model fetch`: the engine in-process."""

from __future__ import annotations

import argparse
import os
import sys

from services.framework.command import add_settings_arguments, settings_from_args
from shared.engine_settings import engine_settings

# the engine's settings at the engine's defaults (shared/engine_settings.py), TANDEM_* or a flag each;
# ``--seed`` here is the request's (sampling), and the engine's own generator is seeded 0, so that a
# run without --seed repeats
EngineCommandSettings = engine_settings("EngineCommandSettings", exclude=("seed",))
# ``tandem model fetch --compile``: the settings that pick the compiled step a worker would load
FetchSettings = engine_settings("FetchSettings", only=("model", "dtype", "quantization", "block_size", "num_threads"))


def register(subparsers) -> None:
    p = subparsers.add_parser("complete", help="complete one prompt in-process; prints only the completion",
                              description="Run the engine in this process and print the completion of PROMPT "
                                          "on stdout (logs go to stderr). PROMPT '-' reads stdin.")
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument("--chat", action="store_true", help="wrap PROMPT as a user message in the chat template")
    p.add_argument("--system", help="system message (with --chat)")
    _add_sampling_args(p)
    _add_engine_args(p)
    p.set_defaults(func=run_complete, settings_class=EngineCommandSettings)

    c = subparsers.add_parser("chat", help="interactive chat with the model in-process",
                              description="Chat in the terminal; /reset clears the history, /exit or Ctrl-D quits.")
    c.add_argument("--system", help="system message")
    _add_sampling_args(c)
    _add_engine_args(c)
    c.set_defaults(func=run_chat, settings_class=EngineCommandSettings)

    m = subparsers.add_parser("model", help="manage models", description="Manage the model cache.")
    msub = m.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    f = msub.add_parser("fetch", help="download a model alias into the cache ahead of time",
                        description="Resolve an alias (downloading it into TANDEM_CACHE_DIR) or check a path. "
                                    "With --compile, also compile the decode step for this machine (CPU) as a "
                                    "worker with the same precision, block size and threads would, so that "
                                    "workers here load it in seconds; with --nats, take it from the cluster if "
                                    "it has it and publish it there if not. Prints a JSON summary last.")
    f.add_argument("model", nargs="?", default=None,
                   help=f"alias or path (env TANDEM_MODEL; default: {FetchSettings.model_fields['model'].default})")
    c = f.add_argument_group("compiled decode step (env: TANDEM_<FLAG>)")
    c.add_argument("--compile", action="store_true",
                   help="compile the decode step into TANDEM_COMPILE_CACHE_DIR (default: TANDEM_CACHE_DIR/compile): "
                        "minutes the first time on a machine, seconds to load afterwards")
    c.add_argument("--nats", default=None, metavar="URL",
                   help="with --compile: fetch the artifacts from this cluster's NATS Object Store, or publish "
                        "them there once built (credentials in the URL; env TANDEM_NATS_URL is not read here)")
    c.add_argument("--namespace", default=os.environ.get("TANDEM_NAMESPACE", "tandem"),
                   help="the cluster's subject namespace (default: %(default)s)")
    add_settings_arguments(c, FetchSettings, exclude=("model",))  # as the workers' flags of the same names
    f.set_defaults(func=run_fetch)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (env: TANDEM_<FLAG>, e.g. TANDEM_MODEL)")
    add_settings_arguments(g, EngineCommandSettings)


def engine_config_from_args(args: argparse.Namespace):
    """The engine config of ``tandem complete`` / ``chat``: flags, then TANDEM_* variables, then defaults."""
    from shared.engine.config import engine_config  # noqa: PLC0415 — torch

    return engine_config(settings_from_args(args.settings_class, args), seed=0)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="default: %(default)s")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def _sampling_params(args):
    from shared.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, ignore_eos=args.ignore_eos)


def _checked_sampling_params(args):
    """Validate sampling flags before the (slow) model load."""
    from services.framework.errors import CliError
    from shared.engine import InvalidRequestError

    params = _sampling_params(args)
    try:
        params.validate(vocab_size=2**31)
    except InvalidRequestError as exc:
        raise CliError(str(exc)) from None
    return params


def _load_engine(args):
    from services.framework.errors import CliError
    from shared.engine import LLMEngine
    from shared.telemetry.logs import configure_logging

    configure_logging("tandem")
    try:
        return LLMEngine.from_config(engine_config_from_args(args))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise CliError(str(exc)) from None


def _stream(engine, prompt_ids: list[int], params, out=sys.stdout) -> list[int]:
    """Generate and print text as it completes; returns the generated ids."""
    from services.framework.errors import CliError
    from shared.engine import InvalidRequestError
    from shared.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(engine.tokenizer, prompt_ids)
    request_id = f"cli-{id(prompt_ids)}"
    try:
        engine.add_request(request_id, prompt_ids, params)
    except InvalidRequestError as exc:
        raise CliError(str(exc)) from None
    generated: list[int] = []
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                generated.extend(o.new_token_ids)
                out.write(detok.push(o.new_token_ids))
                out.flush()
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        raise
    out.write(detok.flush())
    return generated


def run_complete(args) -> int:
    from services.framework.errors import CliError

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = _checked_sampling_params(args)
    engine = _load_engine(args)
    tok = engine.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": text})
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    ids = tok.encode(text)
    try:
        _stream(engine, ids, params)
    finally:
        engine.close()  # a disk KV tier keeps this prompt's blocks for the next run
    sys.stdout.write("\n")
    return 0


def run_chat(args) -> int:
    params = _checked_sampling_params(args)
    engine = _load_engine(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    print("Chatting with %s. /reset clears the history, /exit quits." % engine.model_id, file=sys.stderr)
    try:
        return _chat_loop(engine, params, base)
    finally:
        engine.close()  # a disk KV tier keeps the conversation's blocks for the next session


def _chat_loop(engine, params, base: list[dict]) -> int:
    from services.framework.errors import CliError

    history = list(base)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = list(base)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(history, add_generation_prompt=True))
        try:
            reply_ids = _stream(engine, ids, params)
        except CliError as exc:
            print(f"error: {exc} (try /reset)", file=sys.stderr)
            history.pop()
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": engine.tokenizer.decode(reply_ids)})


def run_fetch(args) -> int:
    from services.framework.errors import CliError
    from shared.model.registry import resolve_model
    from shared.telemetry.logs import configure_logging

    configure_logging("tandem")
    settings = settings_from_args(FetchSettings, args)
    try:
        source = resolve_model(settings.model)
    except (ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from None
    print(source.path)
    if args.compile:
        import asyncio

        print(asyncio.run(_compile_artifacts(args, settings)))
    elif args.nats:
        raise CliError("--nats goes with --compile")
    return 0


async def _compile_artifacts(args, settings) -> str:
    """Load or compile the decode step as a worker with these settings would on this machine (and,
    with ``--nats``, take it from the cluster or offer it there). Returns a one-line JSON summary."""
    import asyncio
    import json

    from services.framework.errors import CliError
    from shared.engine import LLMEngine
    from shared.engine.config import engine_config

    try:
        config = engine_config(settings, device="cpu", kv_cache_memory=64 << 20, compile="on")
    except ValueError as exc:
        raise CliError(str(exc)) from None
    bus = store = None
    try:
        if args.nats:
            from services.worker.compile_share import NatsArtifactStore
            from shared.bus import Bus
            from shared.protocol import Subjects

            bus = await Bus.connect(args.nats, "tandem-model-fetch")
            store = await NatsArtifactStore.open(bus, Subjects(args.namespace))
        engine = await asyncio.to_thread(LLMEngine.from_config, config, store)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:  # inductor's errors are RuntimeErrors
        raise CliError(f"the decode step could not be compiled: {type(exc).__name__}: "
                       f"{str(exc).strip().splitlines()[0]}") from None
    finally:
        if bus is not None:
            await bus.close()
    compiled = engine.runner.compiled
    return json.dumps({"key": compiled.artifacts.key, "dir": str(compiled.artifacts.dir), "step": compiled.source,
                       "fetched": bool(store and store.fetched), "published": bool(store and store.published),
                       "seconds": round(compiled.warm_s, 2)})
