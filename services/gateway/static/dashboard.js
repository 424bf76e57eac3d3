// Tandem's live dashboard: polls /dashboard/data every second and draws the cluster map and the
// charts on canvas. No libraries and nothing fetched from elsewhere: it must work offline.
"use strict";

const POLL_MS = 1000;
const QUEUE_HISTORY = 300;  // seconds of prefill-queue depth kept here (the gateway keeps no history of it)
const COLORS = ["#88c0d0", "#ebcb8b", "#bf616a", "#a3be8c", "#b48ead", "#d08770"];

// chartPoints / chartLastT: per chart, the points drawn with a value and the newest one's time
const state = { updates: 0, errors: 0, queue: [], last: null, chartPoints: {}, chartLastT: {} };
window.tandemDashboard = state;  // read by the browser test and handy in the console

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function ms(seconds) { return seconds == null ? "–" : (seconds * 1000).toFixed(1); }

// --- cluster map --------------------------------------------------------------------------------
function renderWorkers(workers) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren(...workers.map(workerRow));
  document.getElementById("no-workers").hidden = workers.length > 0;
}

function workerRow(w) {
  const info = w.info, load = w.load || {};
  const total = load.num_blocks_total || info.num_blocks_total || 0;
  const used = load.num_blocks_used || 0;
  const pct = total ? (100 * used / total) : 0;
  const bar = el("span", { class: "bar" }, el("span", { style: `width:${pct.toFixed(1)}%` }));
  return el("tr", { class: "worker", "data-worker-id": info.worker_id },
    el("td", {}, info.worker_id),
    el("td", {}, el("span", { class: `role ${info.role}` }, info.role)),
    el("td", { class: `state ${info.state}` }, info.state),
    el("td", {}, bar, `${used}/${total} (${pct.toFixed(0)}%)`),
    el("td", {}, load.num_running ?? "–"),
    el("td", {}, load.num_waiting ?? "–"),
    el("td", {}, ms(load.ttft_recent_s)),
    el("td", {}, ms(load.itl_recent_s)),
    el("td", {}, load.num_requests_total ?? "–"),
    el("td", {}, info.num_restarts));
}

// --- charts -------------------------------------------------------------------------------------
// lines: [{label, values: [[t, v|null], ...]}]; draws axes, grid, lines and a legend.
function drawChart(id, lines, unit) {
  const canvas = document.getElementById(id);
  if (canvas.clientWidth && canvas.width !== canvas.clientWidth) canvas.width = canvas.clientWidth;  // fill the panel
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, L = 48, R = 8, T = 22, B = 22;
  ctx.clearRect(0, 0, W, H);
  const all = lines.flatMap(l => l.values).filter(p => p[1] != null);
  state.chartPoints[id] = all.length;
  state.chartLastT[id] = all.length ? Math.max(...all.map(p => p[0])) : null;
  canvas.dataset.points = String(all.length);
  const ts = lines.flatMap(l => l.values.map(p => p[0]));
  const t0 = ts.length ? Math.min(...ts) : 0, t1 = Math.max(...ts, t0 + 1);
  const vmax = niceMax(Math.max(0, ...all.map(p => p[1])));
  const x = t => L + (W - L - R) * (t - t0) / (t1 - t0);
  const y = v => H - B - (H - T - B) * v / vmax;
  ctx.font = "11px system-ui, sans-serif";
  ctx.strokeStyle = "#2b3440"; ctx.fillStyle = "#7b8794"; ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const v = vmax * i / 4;
    ctx.beginPath(); ctx.moveTo(L, y(v)); ctx.lineTo(W - R, y(v)); ctx.stroke();
    ctx.fillText(formatValue(v), 2, y(v) + 4);
  }
  ctx.fillText(`-${Math.round((t1 - t0) / 60)} min`, L, H - 6);
  ctx.fillText("now", W - R - 22, H - 6);
  lines.forEach((line, i) => {
    ctx.strokeStyle = ctx.fillStyle = COLORS[i % COLORS.length];
    ctx.lineWidth = 2;
    ctx.beginPath();
    let open = false;
    for (const [t, v] of line.values) {
      if (v == null) { open = false; continue; }
      if (open) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
      open = true;
    }
    ctx.stroke();
    for (const [t, v] of line.values) if (v != null) ctx.fillRect(x(t) - 1.5, y(v) - 1.5, 3, 3);
    ctx.fillText(line.label, L + 8 + i * 90, 12);
  });
  if (!all.length) { ctx.fillStyle = "#7b8794"; ctx.fillText(`no ${unit} data yet`, W / 2 - 40, H / 2); }
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  return [1, 2, 5, 10].map(m => m * p).find(m => m >= v);
}

function formatValue(v) { return v >= 100 ? v.toFixed(0) : v >= 1 ? v.toFixed(1) : v.toFixed(2); }

function series(points, key, scale = 1) {
  return points.map(p => [p.t, p[key] == null ? null : p[key] * scale]);
}

function renderCharts(data) {
  const pts = data.series;
  drawChart("chart-ttft", ["p50", "p90", "p99"].map(q => ({ label: q, values: series(pts, `ttft_${q}`, 1000) })), "TTFT");
  drawChart("chart-itl", ["p50", "p90", "p99"].map(q => ({ label: q, values: series(pts, `itl_${q}`, 1000) })), "ITL");
  drawChart("chart-throughput", [
    { label: "tokens/s", values: series(pts, "tokens_per_s") },
    { label: "requests/s", values: series(pts, "requests_per_s") }], "throughput");
  const tiers = [...new Set(pts.flatMap(p => Object.keys(p.rejected)))].sort();
  const perTier = tiers.map(tier => ({
    label: tier, values: pts.map(p => [p.t, (p.rejected[tier] || 0) / data.step_s]) }));
  drawChart("chart-rejections", perTier.length ? perTier : [{ label: "none (per s)", values: pts.map(p => [p.t, 0]) }],
    "rejection");
  drawChart("chart-queue", [{ label: "waiting", values: state.queue.map(q => [q.t, q.pending]) },
    { label: "being prefilled", values: state.queue.map(q => [q.t, q.inProgress]) }], "queue");
}

// --- panels -------------------------------------------------------------------------------------
function renderQueue(data) {
  const q = data.status.prefill_queue;
  state.queue.push({ t: data.now, pending: q ? q.num_pending : null, inProgress: q ? q.num_ack_pending : null });
  while (state.queue.length && state.queue[0].t < data.now - QUEUE_HISTORY) state.queue.shift();
  document.getElementById("queue-now").textContent = q
    ? `${q.num_pending} waiting (by level: ${q.num_pending_by_level.join(" / ") || "–"}), ` +
      `${q.num_ack_pending} being prefilled, ${q.num_redelivered} redelivered`
    : "no prefill queue (no prefill worker has started)";
}

function renderRejections(data) {
  const total = Object.entries(data.rejected_total);
  document.getElementById("rejections-total").textContent = total.length
    ? "since start: " + total.map(([tier, n]) => `${tier} ${n}`).join(", ") : "none since start";
}

function renderScaling(scaling) {
  const stateText = document.getElementById("scaling-state");
  const list = document.getElementById("scaling-decisions");
  if (!scaling) { stateText.textContent = "autoscaler not answering"; list.replaceChildren(); return; }
  stateText.textContent = scaling.enabled ? `on; last tick: ${scaling.last_reason || "–"}` : "autoscaling off";
  list.replaceChildren(...scaling.recent.slice(-8).reverse().map(r => el("li", {},
    `${new Date(r.timestamp * 1000).toLocaleTimeString()} prefill ${r.num_prefill}→${r.target_prefill}, ` +
    `decode ${r.num_decode}→${r.target_decode}: ${r.reason}; ` +
    (r.actions.map(a => `${a.kind} ${a.worker_id} to ${a.role} ${a.ok ? "ok" : "failed"}`).join("; ") || "nothing done"))));
}

function renderServices(services) {
  document.getElementById("services").replaceChildren(...services.map(s => el("li", {},
    `${s.service} (${s.instance_id}): `, el("a", { href: s.metrics_url }, s.metrics_url))));
}

function render(data) {
  const st = data.status;
  renderWorkers(st.workers);
  renderQueue(data);
  renderCharts(data);
  renderRejections(data);
  renderScaling(st.scaling);
  renderServices(st.services || []);
  const gw = st.gateway || {};
  document.getElementById("summary").textContent =
    `${st.workers.length} workers · ${gw.in_flight ?? 0} in flight · models: ${(gw.models || []).join(", ")} · source: ${st.source}`;
  document.getElementById("updated").textContent = `updated ${new Date(data.now * 1000).toLocaleTimeString()}`;
}

async function poll() {
  try {
    const resp = await fetch("/dashboard/data", { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const data = await resp.json();
    state.last = data;
    render(data);
    state.updates += 1;
  } catch (err) {
    state.errors += 1;
    document.getElementById("updated").textContent = `update failed: ${err.message}`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
