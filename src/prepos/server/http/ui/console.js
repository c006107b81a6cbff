// prepos console: sessions, a session's live view, a chat playground and metrics, drawn
// from the server's own API with the key the user enters (kept in session storage and sent
// in an Authorization header). No framework, no build step; every text goes in as text.
"use strict";

const KEY = "prepos.key";
const PATHS = ["fast", "fall-through", "cold"];
const TIERS = ["resident", "ram", "disk"];
const $ = (id) => document.getElementById(id);
const HISTORY = 60;  // metrics samples kept: the paths chart's intervals
const ui = { view: null, timer: null, refresh: null, stream: null, sid: null, metrics: [], chat: [] };

// -- the API ---------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, body) {
    super(body && body.error ? body.error.message : `HTTP ${status}`);
    this.status = status;
    this.code = body && body.error ? body.error.code : null;
  }
}

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function api(method, path, body) {
  const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const r = await fetch(path, init);
  const text = await r.text();
  let data = text;
  if ((r.headers.get("content-type") || "").startsWith("application/json")) data = JSON.parse(text);
  if (!r.ok) throw new ApiError(r.status, typeof data === "object" ? data : null);
  return { data, headers: r.headers };
}

// A session's server-sent events, read from a fetch body (EventSource sends no header).
async function subscribe(sid, onEvent, signal) {
  const r = await fetch(`/sessions/${encodeURIComponent(sid)}/events`,
                        { headers: headers({ Accept: "text/event-stream" }), signal });
  if (!r.ok) throw new ApiError(r.status, await r.json().catch(() => null));
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) onEvent(name, JSON.parse(data.join("\n")));
    }
  }
}

// -- small helpers ---------------------------------------------------------------------
function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null) continue;
    if (k === "class") e.className = v;
    else if (k.startsWith("data-") || k === "title" || k === "href") e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) e.append(kid);
  return e;
}

const ms = (x) => (x === null || x === undefined ? "-" : x < 1 ? `${x.toFixed(3)} ms` : `${x.toFixed(1)} ms`);
const clock = () => new Date().toLocaleTimeString([], { hour12: false }) + "." +
  String(new Date().getMilliseconds()).padStart(3, "0");
const badge = (text, cls) => el("span", { class: `badge ${cls || ""}` }, text);
const pathBadge = (path) => el("span", { class: `badge path-${path}`, "data-path": path }, path);

function fact(dl, name, value) {
  dl.append(el("div", {}, el("dt", {}, name), el("dd", {}, value)));
}

function status(text) {
  $("status").hidden = !text;
  $("status").textContent = text || "";
}

function stop() {
  clearTimeout(ui.refresh);
  clearTimeout(ui.timer);
  ui.timer = null;
  if (ui.stream) ui.stream.abort();
  ui.stream = null;
}

function every(ms_, fn) {  // fn now, then ms_ after each run ends (never overlapping)
  const view = ui.view;
  const run = async () => {
    try { await fn(); } catch (e) { status(e.message); }
    if (ui.view === view) ui.timer = setTimeout(run, ms_);
  };
  run();
}

// -- the key and the views -------------------------------------------------------------
async function start() {
  stop();
  try {
    await api("GET", "/sessions");  // the key's test: 401 without a valid one
  } catch (e) {
    if (e.status === 401) return askKey(sessionStorage.getItem(KEY) ? `Refused: ${e.message}` : "");
    if (e.status === 503) { status("The model is loading..."); ui.timer = setTimeout(start, 1000); return; }
    status(e.message);
    return;
  }
  status("");
  $("nav").hidden = false;
  $("forget").hidden = !sessionStorage.getItem(KEY);
  api("GET", "/v1/models").then(({ data }) => {
    $("model-name").textContent = data.data.map((m) => m.id).join(", ");
  }).catch((e) => status(e.message));
  route();
}

function askKey(error) {
  sessionStorage.removeItem(KEY);
  show("key");
  $("nav").hidden = true;
  $("key-error").textContent = error;
  $("key-input").focus();
}

function show(name) {
  for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== `view-${name}`;
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("active", a.dataset.view === name || (name === "session" && a.dataset.view === "sessions"));
  }
  ui.view = name;
}

function route() {
  if ($("nav").hidden) return;
  stop();
  const hash = location.hash.slice(1);
  if (hash.startsWith("session/")) return openSession(decodeURIComponent(hash.slice(8)));
  if (hash === "chat") return openChat();
  if (hash === "metrics") return openMetrics();
  show("sessions");
  every(500, listSessions);
}

// -- sessions ----------------------------------------------------------------------------
async function listSessions() {
  const { data } = await api("GET", "/sessions");
  const words = $("filter").value.trim().toLowerCase().split(/\s+/).filter(Boolean);
  const kind = $("kind-filter").value;
  const rows = data.data.filter((s) => (!kind || s.kind === kind) &&
    words.every((w) => `${s.id} ${s.kind} ${s.kv}`.toLowerCase().includes(w)));
  const body = $("sessions-table").tBodies[0];
  body.replaceChildren(...rows.map((s) => el("tr", { "data-sid": s.id },
    el("td", {}, el("a", { href: `#session/${encodeURIComponent(s.id)}` }, s.id)),
    el("td", {}, s.kind),
    el("td", { class: "num" }, String(s.version)),
    el("td", { class: "num" }, String(s.tokens)),
    el("td", { "data-col": "kv" }, badge(s.kv, `tier-${s.kv}`)),
    el("td", { "data-col": "prepared", class: s.prepared ? "yes" : "" }, s.prepared ? "ready" : "pending"),
    el("td", { class: "num" }, String(s.predecoded_tokens)),
    el("td", { class: "num" }, s.hit.toFixed(2)))));
  $("no-sessions").hidden = rows.length > 0;
  $("session-count").textContent = `${rows.length} of ${data.data.length} sessions`;
}

async function createSession(ev) {
  ev.preventDefault();
  const body = { kind: $("create-kind").value };
  if ($("create-system").value) body.system = $("create-system").value;
  if (body.kind === "streaming" && $("create-query").value) body.standing_queries = [$("create-query").value];
  try {
    const { data } = await api("POST", "/sessions", body);
    $("create-error").textContent = "";
    location.hash = `session/${encodeURIComponent(data.id)}`;
  } catch (e) { $("create-error").textContent = e.message; }
}

// -- one session, live --------------------------------------------------------------------
async function openSession(sid) {
  show("session");
  ui.sid = sid;
  $("s-id").textContent = sid;
  for (const id of ["s-events", "s-answers", "s-messages"]) $(id).replaceChildren();
  $("s-error").textContent = "";
  setLive("connecting", "");
  const info = await refreshSession().catch((e) => { $("s-error").textContent = e.message; });
  if (!info) return;
  $("s-streaming").hidden = info.kind !== "streaming";
  $("s-agentic").hidden = info.kind !== "agentic";
  const ctl = new AbortController();
  ui.stream = ctl;
  subscribe(sid, onSessionEvent, ctl.signal)
    .then(() => { if (ui.stream === ctl) setLive("ended", "closed"); })
    .catch((e) => { if (e.name !== "AbortError") { setLive("disconnected", "closed"); $("s-error").textContent = e.message; } });
}

function setLive(text, cls) {
  const b = $("s-live");
  b.textContent = text;
  b.className = `badge ${cls}`;
}

async function refreshSession() {
  const sid = ui.sid;
  const { data: s } = await api("GET", `/sessions/${encodeURIComponent(sid)}?include=messages`);
  if (sid !== ui.sid) return s;
  const dl = $("s-facts");
  dl.replaceChildren();
  fact(dl, "kind", s.kind);
  fact(dl, "version", String(s.version));
  fact(dl, "tokens", String(s.tokens));
  fact(dl, "KV tier", badge(s.kv, `tier-${s.kv}`));
  fact(dl, "prepared", s.prepared ? "ready" : "pending");
  fact(dl, "pre-decoded", `${s.predecoded_tokens} tokens`);
  fact(dl, "h(rho)", s.hit.toFixed(2));
  fact(dl, "fast path", s.fast_path);
  for (const [key, r] of Object.entries(s.ready.records)) {
    fact(dl, `ready ${key}`, `p=${r.p} gap=${r.gap === null ? "-" : r.gap.toFixed(2)} "${r.token}"`);
  }
  const standing = $("s-standing");
  if (s.standing_queries.length && !standing.querySelector(".answer")) {
    standing.replaceChildren(...s.standing_queries.map((q) => el("div", { class: "answer", "data-query": q },
      el("span", { class: "meta" }, `${q} `), el("span", { class: "muted" }, "waiting for a push"))));
  }
  $("s-messages").replaceChildren(...(s.message_list || []).map((m) =>
    el("li", {}, el("span", { class: "role" }, m.role), m.content || JSON.stringify(m.tool_calls || ""))));
  return s;
}

function onSessionEvent(name, d) {
  let text;
  if (name === "hello") { setLive("live", "live"); text = `version ${d.version}, ${d.tokens} tokens`; }
  else if (name === "commit") text = `version ${d.version}: ${d.tokens} tokens, ${d.messages} messages`;
  else if (name === "ready") text = `${d.key} at p=${d.p}, gap ${d.gap === null ? "-" : d.gap.toFixed(2)} (version ${d.version})`;
  else if (name === "answer") { text = `"${d.text}" for ${d.query}: ${d.path}/${d.match}, ${ms(d.ttft_ms)} (version ${d.version})`; standingAnswer(d); }
  else if (name === "correction") text = `answer ${d.answer_id}: served ${JSON.stringify(d.served)}, full path ${JSON.stringify(d.full)}`;
  else if (name === "close") { setLive("closed", "closed"); text = "the session closed"; }
  else text = JSON.stringify(d);
  if (name !== "hello" && name !== "close") refreshSoon();
  const list = $("s-events");
  list.prepend(el("li", { class: `ev-${name}`, "data-event": name },
    el("time", {}, clock()), el("span", { class: "name" }, name), text));
  while (list.children.length > 300) list.lastChild.remove();
}

function refreshSoon() {  // the facts again after a burst of events, once
  clearTimeout(ui.refresh);
  ui.refresh = setTimeout(() => refreshSession().catch((e) => { $("s-error").textContent = e.message; }), 150);
}

function standingAnswer(d) {
  const card = el("div", { class: "answer", "data-query": d.query, "data-version": String(d.version) },
    el("span", { class: "meta" }, `${d.query} `), el("span", { class: "text" }, d.text), pathBadge(d.path), " ",
    el("span", { class: "meta" }, `${d.match} · ${ms(d.ttft_ms)} · version ${d.version} · ` +
      `${d.predecoded} pre-decoded · pushed ${clock()}`));
  const old = [...$("s-standing").children].find((c) => c.dataset.query === d.query);
  if (old) old.replaceWith(card); else $("s-standing").append(card);
}

function answerCard(what, r, agentic) {
  const t = r.timing || {};
  const text = agentic && r.tool_calls && r.tool_calls.length ? JSON.stringify(r.tool_calls) : (agentic ? r.content : r.text);
  const card = el("div", { class: "answer", "data-answer": what },
    el("span", { class: "meta" }, `${what} `), el("span", { class: "text" }, text || "(empty)"), pathBadge(r.path), " ",
    el("span", { class: "meta" }, `${r.match} · first token ${ms(t.ttft_ms)} · total ${ms(t.total_ms)} · ` +
      `${t.cached_tokens} cached · ${r.predecoded} pre-decoded · version ${r.version ?? r.committed_version}`));
  $("s-answers").prepend(card);
}

async function sessionCall(ev, path, body, what, agentic) {
  ev.preventDefault();
  const form = ev.target;
  form.querySelector("button").disabled = true;
  try {
    const { data } = await api("POST", `/sessions/${encodeURIComponent(ui.sid)}/${path}`, body);
    $("s-error").textContent = "";
    if (what) answerCard(what, data, agentic);
    for (const input of form.querySelectorAll("input:not([type=number])")) input.value = "";
  } catch (e) { $("s-error").textContent = e.message; }
  form.querySelector("button").disabled = false;
}

// -- chat playground ---------------------------------------------------------------------
async function openChat() {
  show("chat");
  const [{ data: models }, { data: sessions }] = await Promise.all([api("GET", "/v1/models"), api("GET", "/sessions")]);
  const keep = (sel, options) => {
    const was = sel.value;
    sel.replaceChildren(...options.map(([value, label]) => el("option", { value }, label)));
    if (options.some(([v]) => v === was)) sel.value = was;
  };
  keep($("chat-model"), models.data.map((m) => [m.id, m.id]));
  keep($("chat-session"), [["", "implicit (the server keeps the conversation)"],
    ...sessions.data.filter((s) => s.kind === "agentic").map((s) => [s.id, `named: ${s.id}`])]);
  renderChat();
}

async function pickChatSession() {
  ui.chat = [];
  const sid = $("chat-session").value;
  if (sid) {  // a named session: the conversation so far is its own
    const { data } = await api("GET", `/sessions/${encodeURIComponent(sid)}?include=messages`);
    ui.chat = data.message_list.filter((m) => m.role !== "system");
    const sys = data.message_list.find((m) => m.role === "system");
    $("chat-system").value = sys ? sys.content : "";
  }
  renderChat();
}

function renderChat() {
  $("chat-log").replaceChildren(...ui.chat.map((m) => {
    const li = el("li", { class: `msg-${m.role}` }, el("span", { class: "role" }, m.role),
      m.content || "", m.tool_calls ? el("code", {}, JSON.stringify(m.tool_calls.map((c) => c.function))) : null);
    if (m.label) {
      const p = m.label;
      li.append(el("span", { class: "label", "data-label": "answer" }, pathBadge(p.path),
        ` ${p.match} · ${p.cached} cached tokens · first token ${ms(p.ttft)} · total ${ms(p.total)}` +
        ` · ${p.predecoded} pre-decoded`));
    }
    return li;
  }));
}

async function sendChat(ev) {
  ev.preventDefault();
  $("chat-error").textContent = "";
  let tools;
  try {
    tools = $("chat-tools").value.trim() ? JSON.parse($("chat-tools").value) : undefined;
  } catch (e) { $("chat-error").textContent = `tools: ${e.message}`; return; }
  const role = $("chat-role").value;
  const msg = { role, content: $("chat-input").value };
  if (role === "tool") {
    const call = [...ui.chat].reverse().find((m) => m.tool_calls);
    if (call) msg.tool_call_id = call.tool_calls[0].id;
  }
  const history = ui.chat.map(({ label, ...m }) => m);
  const system = $("chat-system").value.trim();
  const body = { model: $("chat-model").value, messages: [...(system ? [{ role: "system", content: system }] : []), ...history, msg],
                 max_tokens: Number($("chat-max").value), temperature: Number($("chat-temp").value) };
  if (tools) body.tools = tools;
  if ($("chat-session").value) body.session_id = $("chat-session").value;
  const button = ev.target.querySelector("button");
  button.disabled = true;
  try {
    const { data } = await api("POST", "/v1/chat/completions", body);
    const m = data.choices[0].message;
    const p = data.prepos;
    ui.chat.push(msg, { role: "assistant", content: m.content || "", ...(m.tool_calls ? { tool_calls: m.tool_calls } : {}),
      label: { path: p.path, match: p.match, cached: data.usage.prompt_tokens_details.cached_tokens,
               ttft: p.timing.ttft_ms, total: p.timing.total_ms, predecoded: p.predecoded } });
    $("chat-input").value = "";
    renderChat();
  } catch (e) { $("chat-error").textContent = e.message; }
  button.disabled = false;
}

// -- metrics -----------------------------------------------------------------------------
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$/);
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[k] = v;
    (out[m[1]] = out[m[1]] || []).push({ labels, value: Number(m[3]) });
  }
  return out;
}

const total = (M, name, where = {}) => (M[name] || [])
  .filter((s) => Object.entries(where).every(([k, v]) => s.labels[k] === v))
  .reduce((a, s) => a + s.value, 0);

function openMetrics() {
  show("metrics");
  every(2000, async () => {
    let text;
    try {
      ({ data: text } = await api("GET", "/metrics"));
    } catch (e) {
      $("metrics-error").textContent = e.status === 401 ? `GET /metrics: ${e.message} (the server was started with --metrics-key)` : e.message;
      return;
    }
    $("metrics-error").textContent = "";
    const M = parseMetrics(text);
    const sample = { paths: Object.fromEntries(PATHS.map((p) => [p, total(M, "prepos:requests_total", { path: p })])) };
    ui.metrics.push(sample);
    if (ui.metrics.length > HISTORY + 1) ui.metrics.shift();
    drawMetrics(M);
  });
}

function drawMetrics(M) {
  const h = ui.metrics;
  const deltas = h.slice(1).map((s, i) => Object.fromEntries(PATHS.map((p) => [p, Math.max(0, s.paths[p] - h[i].paths[p])])));
  while (deltas.length < HISTORY) deltas.unshift(Object.fromEntries(PATHS.map((p) => [p, 0])));
  const ago = deltas.map((_, i) => (i % 10 ? "" : `-${(HISTORY - i) * 2} s`));
  chart($("m-paths"), ago, PATHS.map((p) => ({ name: p, cls: `s-${p}`, values: deltas.map((d) => d[p]) })), true);
  const buckets = (M["prepos:time_to_first_token_seconds_bucket"] || []).filter((s) => s.labels.path === "fast").map((s) => s.labels.le);
  const counts = PATHS.map((p) => {
    const cum = buckets.map((le) => total(M, "prepos:time_to_first_token_seconds_bucket", { path: p, le }));
    return cum.map((c, i) => c - (i ? cum[i - 1] : 0));
  });
  let last = buckets.length - 1;
  while (last > 6 && counts.every((c) => !c[last])) last--;
  chart($("m-ttft"), buckets.slice(0, last + 1).map((le) => (le === "+Inf" ? "more" : `≤${fmtSeconds(Number(le))}`)),
    PATHS.map((p, i) => ({ name: p, cls: `s-${p}`, values: counts[i].slice(0, last + 1) })), false);
  chart($("m-tiers"), TIERS, [{ name: "sessions", cls: "", values: TIERS.map((t) => total(M, "prepos:kv_tier_sessions", { tier: t })) }],
    false, TIERS.map((t) => `s-${t}`));
  const pre = ["predecoded_tokens", "predecode_served", "predecode_wasted"].map((n) => total(M, `prepos:prepositions_${n}_total`));
  chart($("m-predecode"), ["decoded", "served", "wasted"], [{ name: "tokens", cls: "", values: pre }], false,
    ["s-decoded", "s-served", "s-wasted"]);
  const dl = $("m-facts");
  dl.replaceChildren();
  fact(dl, "pre-position hit rate", total(M, "prepos:preposition_hit_rate").toFixed(2));
  fact(dl, "standing answers pushed", String(total(M, "prepos:standing_query_pushes_total")));
  fact(dl, "SSE subscribers", String(total(M, "prepos:sse_subscribers")));
  fact(dl, "sessions", String(total(M, "prepos:sessions")));
  fact(dl, "KV cells", `${total(M, "prepos:kv_cells_used")} of ${total(M, "prepos:kv_cells_budget")}`);
  fact(dl, "gate fires / misses", `${total(M, "prepos:gate_fires_total")} / ${total(M, "prepos:gate_misses_total")}`);
  fact(dl, "relaxed corrections", String(total(M, "prepos:relaxed_corrections_total")));
  for (const p of PATHS) fact(dl, `answers ${p}`, String(total(M, "prepos:requests_total", { path: p })));
}

function fmtSeconds(s) {
  return s < 1e-3 ? `${+(s * 1e6).toPrecision(3)}µs` : s < 1 ? `${+(s * 1e3).toPrecision(3)}ms` : `${s}s`;
}

// A bar chart in an SVG: one group per label, the series side by side (or stacked).
function chart(svg, labels, series, stacked, barClasses) {
  const NS = "http://www.w3.org/2000/svg";
  const W = 600, H = 220, L = 36, B = 34, T = 22;
  const node = (tag, attrs, text) => {
    const n = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    return n;
  };
  const sums = labels.map((_, i) => series.reduce((a, s) => a + s.values[i], 0));
  const max = Math.max(1, ...(stacked ? sums : series.flatMap((s) => s.values)));
  const kids = [node("line", { x1: L, y1: H - B, x2: W, y2: H - B, class: "axis" }),
                node("text", { x: 2, y: T + 4 }, String(+max.toPrecision(3))), node("text", { x: 2, y: H - B }, "0")];
  const gw = (W - L) / Math.max(1, labels.length);
  const bw = stacked ? gw * 0.8 : (gw * 0.8) / series.length;
  const every_ = labels.length > 30 ? 1 : Math.ceil(labels.length / 12);  // long: labels say when
  labels.forEach((label, i) => {
    let y0 = H - B;
    series.forEach((s, j) => {
      const v = s.values[i];
      const hgt = (v / max) * (H - B - T);
      const x = L + i * gw + gw * 0.1 + (stacked ? 0 : j * bw);
      if (v > 0) {
        const y = stacked ? y0 - hgt : H - B - hgt;
        kids.push(node("rect", { x, y, width: Math.max(1, bw - 1), height: hgt,
                                 class: barClasses ? barClasses[i] : s.cls, "data-value": v }, undefined));
        kids[kids.length - 1].append(node("title", {}, `${s.name} ${label}: ${v}`));
        if (!stacked && labels.length <= 6) kids.push(node("text", { x, y: y - 3 }, String(v)));
        y0 -= hgt;
      }
    });
    if (label && i % every_ === 0) kids.push(node("text", { x: L + i * gw + 2, y: H - B + 14 }, label));
  });
  if (!barClasses) {
    series.forEach((s, j) => {
      kids.push(node("rect", { x: L + j * 110, y: H - 12, width: 10, height: 10, class: s.cls }));
      kids.push(node("text", { x: L + j * 110 + 14, y: H - 3 }, s.name));
    });
  }
  svg.replaceChildren(...kids);
}

// -- wiring --------------------------------------------------------------------------------
window.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("key-input").value.trim());
    $("key-input").value = "";
    start();
  });
  $("forget").addEventListener("click", () => { stop(); askKey(""); });
  $("create-form").addEventListener("submit", createSession);
  $("filter").addEventListener("input", () => listSessions().catch((e) => status(e.message)));
  $("kind-filter").addEventListener("change", () => listSessions().catch((e) => status(e.message)));
  $("append-form").addEventListener("submit", (ev) => sessionCall(ev, "append", { data: $("append-input").value }));
  $("ask-form").addEventListener("submit", (ev) => sessionCall(ev, "query",
    { question: $("ask-input").value, max_tokens: Number($("ask-tokens").value) }, $("ask-input").value, false));
  $("turn-form").addEventListener("submit", (ev) => sessionCall(ev, "turn",
    $("turn-input").value ? { user: $("turn-input").value } : {}, $("turn-input").value || "(turn)", true));
  $("tool-form").addEventListener("submit", (ev) => sessionCall(ev, "tool_result",
    { content: $("tool-input").value }, "tool result", true));
  $("chat-form").addEventListener("submit", sendChat);
  $("chat-session").addEventListener("change", () => pickChatSession().catch((e) => { $("chat-error").textContent = e.message; }));
  $("chat-clear").addEventListener("click", () => pickChatSession().catch((e) => { $("chat-error").textContent = e.message; }));
  window.addEventListener("hashchange", route);
  start();
});
