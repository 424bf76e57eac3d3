// A Tandem decode worker in Node.js, written from docs/protocol.md alone: it "generates" by echoing
// the prompt's token ids, one per chunk, and stops at the model's EOS ids (GenerateRequest
// sampling.eos_token_ids) as a real model would. npm's `nats` 2.x is its only dependency.
//
//   npm install --prefix docs/examples/node_worker
//   set -a; . ~/.cache/tandem/up/tandem/connect.env; set +a     # from `tandem up --decode 0`
//   node docs/examples/node_worker/worker.mjs --worker-id node-1 --model smollm2-135m
import { connect, headers, StringCodec } from "nats";
import { parseArgs } from "node:util";
import { connectOptions } from "./connect_options.mjs";

const { values: args } = parseArgs({ options: {
  // from the environment by default: a URL with a password on the command line shows in `ps`
  "nats-url": { type: "string", default: process.env.TANDEM_NATS_URL ?? "nats://127.0.0.1:4222" },
  namespace: { type: "string", default: process.env.TANDEM_NAMESPACE ?? "tandem" },
  "worker-id": { type: "string", default: `node-${process.pid}` },
  model: { type: "string", default: "smollm2-135m" },
  ttl: { type: "string", default: "6" },
} });
// nats.js ignores credentials and tls:// in the URL: user/pass, token and tls go in as options
const nc = await connect({ ...connectOptions(args["nats-url"]), name: args["worker-id"] });
const sc = StringCodec();
const send = (subject, obj, h) => nc.publish(subject, sc.encode(JSON.stringify(obj)), h ? { headers: h } : {});
const root = `${args.namespace}.v1`, wid = args["worker-id"], ttlS = Number(args.ttl);
const generate = `${root}.decode.${wid}.generate`, cancel = `${root}.decode.${wid}.cancel`;
const running = new Map();  // request_id → { cancelled }: only requests in flight, so cancels never pile up
const finishing = new Set();  // promises of the requests in flight, for the drain
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
let seq = 0;
const reportLoad = () => send(`${root}.load.decode.${wid}`, { worker_id: wid, role: "decode", seq: ++seq,
  timestamp: Date.now() / 1000, num_running: running.size, max_num_seqs: 64 });

async function serve(msg) {
  let req;
  try {
    req = JSON.parse(sc.decode(msg.data));
    if (!req.request_id || !Array.isArray(req.prompt_token_ids) || !req.prompt_token_ids.length)
      throw new Error("request_id and prompt_token_ids required");
  } catch (err) {  // the error reply every Tandem service gives
    const h = headers(); h.set("Tandem-Error-Code", "bad_request");
    send(msg.reply, { code: "bad_request", message: `bad GenerateRequest: ${err.message}` }, h);
    return;
  }
  // a moved request comes with a new id (<id>-m1, ...) and its tokens so far at the prompt's end: a new request here
  const state = { cancelled: false };
  running.set(req.request_id, state);
  const ids = req.prompt_token_ids, s = req.sampling ?? {}, maxTokens = s.max_tokens ?? 16;
  const stops = new Set([...(s.stop_token_ids ?? []), ...(s.ignore_eos ? [] : s.eos_token_ids ?? [])]);
  for (let i = 0; i < maxTokens; i++) {
    const token = ids[i % ids.length];
    const finish = state.cancelled ? "abort" : stops.has(token) ? "stop" : i === maxTokens - 1 ? "length" : null;
    if (finish) {  // gone from the load before its last chunk: admission may send the next request at once
      running.delete(req.request_id);
      reportLoad();
    }
    send(msg.reply, { request_id: req.request_id, index: i, token_ids: state.cancelled ? [] : [token],
                      finish_reason: finish, num_prompt_tokens: i === 0 ? ids.length : 0, worker_id: wid });
    if (finish) break;
    await sleep(10);
  }
  const h = headers(); h.set("Tandem-Stream", "end");
  nc.publish(msg.reply, new Uint8Array(0), { headers: h });
}

nc.subscribe(generate, { callback: (err, msg) => {  // one promise per request: never block the subscription
  if (err) return;
  const p = serve(msg).finally(() => finishing.delete(p));
  finishing.add(p);
} });
nc.subscribe(cancel, { callback: (err, msg) => {
  if (err) return;
  try {  // a cancel may come twice, or after the request finished: one for an id not running is ignored
    const state = running.get(JSON.parse(sc.decode(msg.data)).request_id);
    if (state) state.cancelled = true;
  } catch { /* not a CancelRequest */ }
} });
await nc.flush();  // subscribed before registering

const js = nc.jetstream();
const kv = await js.views.kv(`${args.namespace}-workers`, { ttl: ttlS * 1000, history: 1 });  // binds, or creates it
const namespaceHex = Buffer.from(`${args.model}\x1f\x1f`, "utf8").toString("hex");  // model, LoRA, salt
const info = { worker_id: wid, role: "decode", state: "ready", model: args.model, block_size: 16,
               max_model_len: 2048, max_num_seqs: 64, generate_subject: generate, cancel_subject: cancel,
               kv_namespace_hex: namespaceHex, pid: process.pid, started_at: Date.now() / 1000 };
const put = (state) => kv.put(wid, sc.encode(JSON.stringify({ ...info, state, heartbeat_at: Date.now() / 1000 })));

let stopping = false;
const stop = new Promise((resolve) => ["SIGTERM", "SIGINT"].forEach((s) => process.on(s, () => { stopping = true; resolve(); })));
const loadTimer = setInterval(reportLoad, 1000);  // about every second, and before each request's last chunk
console.log(`node worker ${wid} serving ${generate}`);
while (!stopping) {  // heartbeat: the entry expires TTL seconds after the last put
  await put("ready");
  await Promise.race([sleep((ttlS / 3) * 1000), stop]);
}
await put("draining");  // admission sends nothing new; finish, then leave the registry
await Promise.race([Promise.all(finishing), sleep(30000)]);
clearInterval(loadTimer);
await kv.purge(wid);
await nc.drain();
console.log(`node worker ${wid} drained and deregistered`);
process.exit(0);  // without waiting for the timers still set
