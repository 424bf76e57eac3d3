// A Tandem decode worker in Node.js, written from docs/protocol.md alone: it "generates" by echoing
// the prompt's token ids, one per chunk. npm's `nats` 2.x is its only dependency.
//
//   npm install --prefix docs/examples/node_worker
//   set -a; . ~/.cache/tandem/up/tandem/connect.env; set +a     # from `tandem up --decode 0`
//   node docs/examples/node_worker/worker.mjs --worker-id node-1 --model smollm2-135m
import { connect, headers, StringCodec } from "nats";
import { parseArgs } from "node:util";

const { values: args } = parseArgs({ options: {
  "nats-url": { type: "string", default: process.env.TANDEM_NATS_URL ?? "nats://127.0.0.1:4222" },
  namespace: { type: "string", default: process.env.TANDEM_NAMESPACE ?? "tandem" },
  "worker-id": { type: "string", default: `node-${process.pid}` },
  model: { type: "string", default: "smollm2-135m" },
  ttl: { type: "string", default: "6" },
} });
const url = new URL(args["nats-url"]);  // credentials in the URL become options
const nc = await connect({ servers: url.host, user: decodeURIComponent(url.username) || undefined,
                           pass: decodeURIComponent(url.password) || undefined });
const sc = StringCodec();
const send = (subject, obj, h) => nc.publish(subject, sc.encode(JSON.stringify(obj)), h ? { headers: h } : {});
const root = `${args.namespace}.v1`, wid = args["worker-id"], ttlS = Number(args.ttl);
const generate = `${root}.decode.${wid}.generate`, cancel = `${root}.decode.${wid}.cancel`;
const cancelled = new Set(), running = new Set();
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function serve(msg) {
  let req;
  try {
    req = JSON.parse(sc.decode(msg.data));
    if (!req.request_id || !Array.isArray(req.prompt_token_ids)) throw new Error("request_id and prompt_token_ids required");
  } catch (err) {  // the error reply every Tandem service gives
    const h = headers(); h.set("Tandem-Error-Code", "bad_request");
    send(msg.reply, { code: "bad_request", message: `bad GenerateRequest: ${err.message}` }, h);
    return;
  }
  const ids = req.prompt_token_ids, maxTokens = req.sampling?.max_tokens ?? 16;
  for (let i = 0; i < maxTokens; i++) {
    const isCancelled = cancelled.has(req.request_id), last = isCancelled || i === maxTokens - 1;
    send(msg.reply, { request_id: req.request_id, index: i, token_ids: [ids[i % ids.length]],
                      finish_reason: last ? (isCancelled ? "abort" : "length") : null,
                      num_prompt_tokens: ids.length, worker_id: wid });
    if (last) break;
    await sleep(10);
  }
  cancelled.delete(req.request_id);
  const h = headers(); h.set("Tandem-Stream", "end");
  nc.publish(msg.reply, new Uint8Array(0), { headers: h });
}

nc.subscribe(generate, { callback: (err, msg) => {  // one promise per request: never block the subscription
  if (err) return;
  const p = serve(msg).finally(() => running.delete(p));
  running.add(p);
} });
nc.subscribe(cancel, { callback: (err, msg) => { if (!err) cancelled.add(JSON.parse(sc.decode(msg.data)).request_id); } });
await nc.flush();  // subscribed before registering

const js = nc.jetstream();
const kv = await js.views.kv(`${args.namespace}-workers`, { ttl: ttlS * 1000, history: 1 });  // binds, or creates it
const namespaceHex = Buffer.from(`${args.model}\x1f\x1f`, "utf8").toString("hex");  // model, LoRA, salt
const info = { worker_id: wid, role: "decode", state: "ready", model: args.model, block_size: 16,
               max_model_len: 2048, max_num_seqs: 64, generate_subject: generate, cancel_subject: cancel,
               kv_namespace_hex: namespaceHex, pid: process.pid, started_at: Date.now() / 1000 };
const put = (state) => kv.put(wid, sc.encode(JSON.stringify({ ...info, state, heartbeat_at: Date.now() / 1000 })));

let stopping = false, seq = 0;
const stop = new Promise((resolve) => ["SIGTERM", "SIGINT"].forEach((s) => process.on(s, () => { stopping = true; resolve(); })));
console.log(`node worker ${wid} serving ${generate}`);
while (!stopping) {  // heartbeat: the entry expires TTL seconds after the last put
  await put("ready");
  send(`${root}.load.decode.${wid}`, { worker_id: wid, role: "decode", seq: ++seq, timestamp: Date.now() / 1000,
                                       num_running: running.size, max_num_seqs: 64 });
  await Promise.race([sleep((ttlS / 3) * 1000), stop]);
}
await put("draining");  // admission sends nothing new; finish, then leave the registry
await Promise.race([Promise.all(running), sleep(30000)]);
await kv.purge(wid);
await nc.drain();
console.log(`node worker ${wid} drained and deregistered`);
process.exit(0);  // without waiting for the timers still set
