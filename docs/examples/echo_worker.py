"""A custom decode worker in about 120 lines, using nothing of Tandem: only NATS and JSON.

It "generates" by echoing the prompt's token ids back, one per message, and stops at the model's
EOS ids (``sampling.eos_token_ids``). Any process that does what this one does (in any language) is
a decode worker the gateway and admission will use:

1. serve  <ns>.v1.decode.<id>.generate : one JSON TokenChunk per message to the request's reply
   subject, then an empty message with header ``Tandem-Stream: end``;
2. listen <ns>.v1.decode.<id>.cancel   : {"request_id": ...} → stop that request (none running: ignore it);
3. put its WorkerInfo into the KV bucket ``<ns>-workers`` under its id, again every TTL/3 seconds;
4. (optional) publish WorkerLoad on <ns>.v1.load.decode.<id> and KV events on <ns>.v1.kv.events.<id>;
5. on SIGTERM: put itself as ``draining``, finish what it runs, delete its entry, exit.

Against `tandem up --decode 0` (the URLs and namespace are in the connect.env it names):

    set -a; . ~/.cache/tandem/up/tandem/connect.env; set +a
    python docs/examples/echo_worker.py --model smollm2-135m
"""

import argparse
import asyncio
import json
import os
import signal
import ssl
import time

import nats


async def main(args: argparse.Namespace) -> None:
    # nats-py takes the user and password (or token) from the URL; TLS verifies against connect.env's CA
    ca = os.environ.get("TANDEM_NATS_CA")
    nc = await nats.connect(args.nats_url, tls=ssl.create_default_context(cafile=ca) if ca else None)
    js = nc.jetstream()
    root, wid = f"{args.namespace}.v1", args.worker_id
    generate, cancel = f"{root}.decode.{wid}.generate", f"{root}.decode.{wid}.cancel"
    cancelled: dict[str, bool] = {}  # the requests in flight: a cancel of any other id is ignored
    running: set[asyncio.Task] = set()

    async def serve(msg) -> None:
        try:
            req = json.loads(msg.data)
            rid, ids, sampling = req["request_id"], req["prompt_token_ids"], req.get("sampling", {})
            max_tokens = sampling.get("max_tokens", 16)
            stops = set(sampling.get("stop_token_ids", [])) | set(
                [] if sampling.get("ignore_eos") else sampling.get("eos_token_ids", []))
        except (ValueError, KeyError, TypeError) as exc:  # the error reply every service gives
            body = {"code": "bad_request", "message": f"bad GenerateRequest: {exc}"}
            await nc.publish(msg.reply, json.dumps(body).encode(), headers={"Tandem-Error-Code": "bad_request"})
            return
        out = (ids * max_tokens)[:max_tokens]
        cancelled[rid] = False
        for i, token in enumerate(out):
            finish = "abort" if cancelled[rid] else "stop" if token in stops else \
                "length" if i == len(out) - 1 else None
            chunk = {"request_id": rid, "index": i, "token_ids": [token], "finish_reason": finish,
                     "num_prompt_tokens": len(ids), "worker_id": wid}
            await nc.publish(msg.reply, json.dumps(chunk).encode())
            if finish:
                break
            await asyncio.sleep(0.01)
        cancelled.pop(rid, None)
        await nc.publish(msg.reply, b"", headers={"Tandem-Stream": "end"})

    async def on_generate(msg) -> None:  # one task per request: never block the subscription
        task = asyncio.create_task(serve(msg))
        running.add(task)
        task.add_done_callback(running.discard)

    async def on_cancel(msg) -> None:  # may come twice, or after the end: only a running request stops
        if (rid := json.loads(msg.data)["request_id"]) in cancelled:
            cancelled[rid] = True

    await nc.subscribe(generate, cb=on_generate)
    await nc.subscribe(cancel, cb=on_cancel)
    try:
        kv = await js.key_value(f"{args.namespace}-workers")
    except nats.js.errors.BucketNotFoundError:
        kv = await js.create_key_value(bucket=f"{args.namespace}-workers", ttl=args.ttl)
    info = {"worker_id": wid, "role": "decode", "state": "ready", "model": args.model,
            "block_size": 16, "max_model_len": 2048, "max_num_seqs": 64,
            "generate_subject": generate, "cancel_subject": cancel,
            # the engine's namespace: model id, LoRA and cache salt joined by \x1f (none here)
            "kv_namespace_hex": "\x1f".join([args.model, "", ""]).encode().hex(),
            "pid": os.getpid(), "started_at": time.time()}
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    print(f"echo worker {wid} serving {generate}", flush=True)
    seq = 0
    while not stop.is_set():  # heartbeat: the entry expires TTL seconds after the last put
        seq += 1
        await kv.put(wid, json.dumps({**info, "heartbeat_at": time.time()}).encode())
        load = {"worker_id": wid, "role": "decode", "seq": seq, "timestamp": time.time(),
                "num_running": len(running)}
        await nc.publish(f"{root}.load.decode.{wid}", json.dumps(load).encode())
        try:
            await asyncio.wait_for(stop.wait(), args.ttl / 3)
        except asyncio.TimeoutError:
            pass
    # drain: admission sends nothing new to a draining worker; finish, then leave the registry
    await kv.put(wid, json.dumps({**info, "state": "draining", "heartbeat_at": time.time()}).encode())
    if running:
        await asyncio.wait(running, timeout=30)
    await kv.purge(wid)
    await nc.drain()
    print(f"echo worker {wid} drained and deregistered", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="an echo decode worker speaking Tandem's protocol")
    # from the environment by default: a URL with a password on the command line shows in `ps`
    p.add_argument("--nats-url", default=os.environ.get("TANDEM_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--namespace", default=os.environ.get("TANDEM_NAMESPACE", "tandem"))
    p.add_argument("--worker-id", default=f"echo-{os.getpid()}")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ttl", type=float, default=6.0, help="must match the bucket's TTL")
    asyncio.run(main(p.parse_args()))
