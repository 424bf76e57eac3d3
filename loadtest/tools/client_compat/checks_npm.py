"""The openai npm package, run by the machine's ``node`` when ``require("openai")`` resolves there
(``NODE_PATH``; the CLI's ``--node-modules`` adds to it). One ``node`` process per check."""

from __future__ import annotations

import shutil
import subprocess

from loadtest.tools.client_compat.base import TIMEOUT_S, Check, Client, Target, expect


NODE_SCRIPT = r"""
const OpenAI = require("openai");
const [url, model, feature] = process.argv.slice(1);
const client = new OpenAI({baseURL: url, apiKey: "unused", maxRetries: 0, timeout: 120000});
const weather = {type: "function", function: {name: "get_weather", description: "Current weather of a city",
  parameters: {type: "object", properties: {city: {type: "string", maxLength: 30}}, required: ["city"]}}};
const chat = (prompt, extra) => ({model, messages: [{role: "user", content: prompt}], max_tokens: 60,
                                  temperature: 0, ...extra});
const checks = {
  async chat() {
    const r = await client.chat.completions.create(chat("Say hello.")); return r.choices[0].message.content; },
  async stream() {
    let text = ""; const s = await client.chat.completions.create(chat("Say hello.", {stream: true}));
    for await (const c of s) text += c.choices[0]?.delta?.content || ""; return text; },
  async tools_forced() {
    const r = await client.chat.completions.create(chat("What is the weather in Paris?",
      {tools: [weather], tool_choice: "required", parallel_tool_calls: false}));
    const calls = r.choices[0].message.tool_calls;
    JSON.parse(calls[0].function.arguments); return calls.length === 1; },
  async tools_auto() {
    const r = await client.chat.completions.create(chat("What is the weather in Paris?", {tools: [weather]}));
    const m = r.choices[0].message;
    for (const c of m.tool_calls || []) JSON.parse(c.function.arguments); return m.content || m.tool_calls; },
  async structured() {
    const schema = {type: "object", properties: {city: {type: "string"}, country: {type: "string"}},
                    required: ["city", "country"], additionalProperties: false};
    const r = await client.chat.completions.create(chat("Name a city and its country.",
      {response_format: {type: "json_schema", json_schema: {name: "City", schema, strict: true}}}));
    const city = JSON.parse(r.choices[0].message.content);
    return city.city !== undefined && city.country !== undefined; },
  async responses() { const r = await client.responses.create({model, input: "Say hello.", max_output_tokens: 16});
    return r.output_text; },
  async stored() {
    const first = await client.responses.create({model, input: "Hi! I'm Ada.", max_output_tokens: 16});
    const again = await client.responses.retrieve(first.id);
    const second = await client.responses.create({model, input: "Say hello.", previous_response_id: first.id,
                                                  max_output_tokens: 16});
    return again.output_text === first.output_text && second.previous_response_id === first.id; },
  async conversations() {
    const conv = await client.conversations.create({items: [{role: "user", content: "Hi! I'm Ada."}]});
    await client.responses.create({model, input: "Say hello.", conversation: conv.id, max_output_tokens: 16});
    const items = []; for await (const i of client.conversations.items.list(conv.id)) items.push(i);
    return items.length === 3 && (await client.conversations.delete(conv.id)).deleted; },
};
checks[feature]().then(ok => { if (!ok) throw new Error(`${feature}: not the reply expected`); })
  .then(() => process.exit(0), e => { console.error(String(e)); process.exit(1); });
"""


def node_openai_version() -> str | None:
    if shutil.which("node") is None:
        return None
    out = subprocess.run(["node", "-e", 'const p = require("path"); console.log(require(p.join(p.dirname('
                          'require.resolve("openai")), "package.json")).version)'],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip() if out.returncode == 0 else None


def node_check(feature: str) -> Check:
    def check(t: Target) -> None:
        out = subprocess.run(["node", "-e", NODE_SCRIPT, t.v1, t.model, feature], capture_output=True, text=True,
                             timeout=TIMEOUT_S + 10)
        expect(out.returncode == 0, out.stderr.strip()[-400:])
    return check


CLIENT = Client("openai (npm)", node_openai_version,
                {f: node_check(f) for f in ("chat", "stream", "tools_forced", "tools_auto", "structured",
                                              "responses", "stored", "conversations")})
