// The llmgw dashboard: list, then watch (/api/events), and draw. No build step.
//
// `live` is the view as the stream keeps it: listed once, then patched with the
// entities each change carries. `shown` is what is drawn: `live`, or a past view from
// /api/view?seq=N while the slider is away from the head. Drawing is coalesced to one
// per animation frame, whatever the event rate.
//
// The page draws first from /api/view, then opens the stream. Ages ("40s ago", "in 17s")
// are counted from the page's clock (`Date.now()`), live, and tick without events; at a
// past moment, from that moment.

const token = new URLSearchParams(location.search).get("token");
const withToken = (url) => (token ? url + (url.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(token) : url);
const $ = (sel) => document.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

const HOLDING = new Set(["pending", "starting", "loading", "ready", "draining"]);
const FEED_MAX = 300;

let traffic = {}; // model -> {rps, inflight, held, hit (each null: unknown), source: gateway | log}
let live = null; // {seq, time, nodes: Map, models: Map, replicas: Map, quota, ...}
let past = null; // a past view document, while the slider is away from live
let feed = [];
let source = null;
let drawQueued = false;
let painted = false;
let health = {};
let streamed = false; // the stream's listing has come (before it: /api/view's)
const colours = new Map();

function colour(model) {
  if (!colours.has(model)) {
    let h = 0;
    for (const c of model) h = (h * 31 + c.charCodeAt(0)) >>> 0;
    colours.set(model, `hsl(${h % 360} 65% 72%)`);
  }
  return colours.get(model);
}

function fromDoc(doc) {
  return {
    seq: doc.seq,
    time: doc.time,
    nodes: new Map(doc.nodes.map((n) => [n.name, n])),
    models: new Map(doc.models.map((m) => [m.name, m])),
    replicas: new Map(doc.replicas.map((r) => [r.id, r])),
    quota: doc.quota || [],
    rejected: doc.rejected || 0,
    decisions: doc.decisions || [],
  };
}

// ------------------------------------------------------------------ the stream

function connect() {
  if (source) source.close();
  source = new EventSource(withToken("api/events"));
  setConn("connecting", "");
  source.addEventListener("list", (m) => {
    const doc = JSON.parse(m.data);
    live = fromDoc(doc);
    feed = doc.recent || [];
    streamed = true;
    setConn("live", "ok");
    queueDraw();
  });
  source.addEventListener("change", (m) => {
    if (!live) return;
    const c = JSON.parse(m.data);
    apply(c);
    feed.push(c);
    if (feed.length > FEED_MAX) feed.splice(0, feed.length - FEED_MAX);
    queueDraw();
  });
  // Requests a second and in flight per model: live only (not in the log's past).
  source.addEventListener("traffic", (m) => {
    traffic = JSON.parse(m.data);
    queueDraw();
  });
  source.addEventListener("summary", (m) => {
    if (!live) return;
    const s = JSON.parse(m.data);
    Object.assign(live, { quota: s.quota, rejected: s.rejected, decisions: s.decisions });
    queueDraw();
  });
  // Told to re-list (behind past what the server keeps, or the log was listed again):
  // start again without a position, and take the listing as the new truth.
  source.addEventListener("relist", () => {
    live = null;
    connect();
  });
  source.onerror = () => setConn("reconnecting", "bad");
}

function apply(c) {
  live.seq = c.seq;
  if (c.time) live.time = c.time;
  for (const [key, e] of Object.entries(c.entities)) {
    const slash = key.indexOf("/");
    const kind = key.slice(0, slash);
    const name = key.slice(slash + 1);
    const map = kind === "replica" ? live.replicas : kind === "model" ? live.models : kind === "node" ? live.nodes : null;
    if (!map) continue;
    if (e === null || (kind === "replica" && !HOLDING.has(e.state))) map.delete(name);
    else map.set(name, e);
  }
}

// The first drawing, from /api/view, before the stream opens: a page is not blank while
// the stream starts (or when a proxy holds it back).
async function firstView() {
  try {
    const r = await fetch(withToken("api/view"));
    if (r.ok && !streamed) {
      live = fromDoc(await r.json());
      queueDraw();
    }
  } catch (_) { /* the stream will list it */ }
}

// The stream's state (`live`, `reconnecting`), shown unless a past moment is.
let conn = ["connecting", ""];

function setConn(text, cls) {
  conn = [text, cls];
  showConn();
}

function showConn() {
  const [text, cls] = past ? [`past: ${past.time ?? "seq " + past.seq}`, "past"] : conn;
  const b = $("#conn");
  b.textContent = text;
  b.className = "badge " + cls;
}

// ------------------------------------------------------------------ ages

// `45s`, `3m`, `2h5m`, `3d4h` (services/replay/render.py's `duration`).
function duration(s) {
  s = Math.floor(s);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) {
    const h = Math.floor(s / 3600), m = Math.floor(s / 60) % 60;
    return m ? `${h}h${m}m` : `${h}h`;
  }
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24;
  return h ? `${d}d${h}h` : `${d}d`;
}

// The moment ages are counted from: now (the page's clock), or the past moment shown.
function clockMs() {
  return past && past.time ? Date.parse(past.time) : Date.now();
}

// `40s ago`, `in 17s`, `now`; an end (`kind` "end", a hold's until): `ended 5s ago`.
function ageText(stamp, kind, now) {
  const t = Date.parse(stamp);
  if (Number.isNaN(t)) return "-";
  const s = Math.round((now - t) / 1000);
  const word = duration(Math.abs(s));
  if (word === "0s") return "now";
  if (s < 0) return `in ${word}`;
  return kind === "end" ? `ended ${word} ago` : `${word} ago`;
}

function ageSpan(stamp, kind) {
  return `<span class="age" data-age="${esc(stamp)}"${kind ? ` data-kind="${kind}"` : ""}>${esc(ageText(stamp, kind, clockMs()))}</span>`;
}

function tickAges() {
  const now = clockMs();
  for (const el of document.querySelectorAll("[data-age]")) {
    const t = ageText(el.dataset.age, el.dataset.kind, now);
    if (el.textContent !== t) el.textContent = t;
  }
  for (const td of document.querySelectorAll("#holds td.left")) {
    const t = left(td.dataset.until, now);
    if (td.textContent !== t) td.textContent = t;
  }
}

// ------------------------------------------------------------------ drawing

// A big cluster is redrawn at most every DRAW_GAP_MS: at a thousand events a second a
// redraw per frame would spend the page's time drawing what the next one replaces.
const DRAW_GAP_MS = 250;
let drawnAt = 0;

function queueDraw() {
  if (drawQueued) return;
  drawQueued = true;
  const v = past || live;
  const wait = v && v.nodes.size > 100 ? Math.max(0, drawnAt + DRAW_GAP_MS - performance.now()) : 0;
  setTimeout(() => requestAnimationFrame(() => {
    drawQueued = false;
    drawnAt = performance.now();
    draw();
  }), wait);
}

function draw() {
  const v = past || live;
  if (!v) return;
  const slider = $("#slider");
  const head = live ? live.seq : v.seq;
  slider.max = Math.max(head, 1);
  if (!past) slider.value = head;
  $("#moment").textContent = past ? `seq ${v.seq} · ${v.time ?? ""}` : `seq ${head}`;
  $("#live").className = past ? "" : "on";
  // The past is shown as the past: its badge is its moment, never `live`.
  showConn();
  $("#where").textContent = `seq ${v.seq}${v.time ? " · " + v.time : ""}`;
  drawGrid(v);
  drawModels(v);
  drawHolds(v);
  drawQuota(v);
  drawDecisions(v);
  drawFeed();
  drawHealth();
  // The first drawing of a listed view, for the first-paint benchmark.
  if (!painted && live) {
    painted = true;
    performance.mark("llmgw:first-paint");
  }
}

function holders(v) {
  const out = new Map();
  for (const r of v.replicas.values()) {
    if (!HOLDING.has(r.state)) continue;
    for (const s of r.shards) for (const g of s.gpus) out.set(s.node + "/" + g, r);
  }
  return out;
}

// engineSays: what a replica's engine said of its load in its metrics (replica.used's
// `engine`), for its cell's title; "" when none said.
function engineSays(e) {
  if (!e) return "";
  const said = [];
  if (e.running !== null || e.waiting !== null) said.push(`${e.running ?? 0} running, ${e.waiting ?? 0} waiting`);
  if (e.kv_cache_usage !== null) said.push(`KV cache ${Math.round(e.kv_cache_usage * 100)}%`);
  if (e.prefix_cache_hit_rate !== null) said.push(`prefix cache hits ${Math.round(e.prefix_cache_hit_rate * 100)}%`);
  if (e.prompt_tokens !== null) said.push(`tokens ${e.prompt_tokens} in / ${e.generation_tokens ?? 0} out`);
  return said.length ? `; engine: ${said.join(", ")}` : "";
}

function drawGrid(v) {
  const held = holders(v);
  const models = new Set();
  let used = 0, total = 0;
  const rows = [];
  for (const name of [...v.nodes.keys()].sort()) {
    const n = v.nodes.get(name);
    const cls = "node" + (n.lost ? " lost" : "") + (n.cordoned ? " cordoned" : "");
    const cells = n.gpus.map((g) => {
      total++;
      const r = held.get(name + "/" + g.index);
      if (!r) return `<span class="cell${g.healthy ? "" : " unhealthy"}" data-node="${esc(name)}" data-gpu="${g.index}" title="${esc(name)} GPU ${g.index} ${esc(g.model)}: free"></span>`;
      used++;
      models.add(r.model);
      const tip = `${name} GPU ${g.index}: ${r.id} (${r.model}, ${r.state}${r.preempted_for ? ", preempted for " + r.preempted_for : ""})${engineSays(r.engine)}`;
      return `<span class="cell ${esc(r.state)}" style="background-color:${colour(r.model)}" data-node="${esc(name)}" data-gpu="${g.index}" data-replica="${esc(r.id)}" data-model="${esc(r.model)}" data-state="${esc(r.state)}" title="${esc(tip)}">${esc(r.id.slice(0, 11))}</span>`;
    });
    const lost = n.lost ? `<span class="lost-tag" title="${esc(n.lost_reason ?? "")}">LOST${n.lost_reason ? ": " + esc(n.lost_reason) : ""}</span>` : "";
    rows.push(`<div class="${cls}" data-node="${esc(name)}"><span class="name" title="${esc(name)}">${esc(name)}</span>${cells.join("")}${lost}</div>`);
  }
  $("#grid").innerHTML = rows.join("") || '<span class="muted">no nodes have reported</span>';
  $("#gpu-count").textContent = `${v.nodes.size} nodes, ${used}/${total} GPUs held`;
  $("#legend").innerHTML = [...models].sort().map((m) => `<span><i style="background:${colour(m)}"></i>${esc(m)}</span>`).join("");
}

function drawModels(v) {
  const rows = [...v.models.values()].sort((a, b) => a.name.localeCompare(b.name)).map((m) => {
    const note = [];
    if (!m.declared) note.push("not declared");
    if (m.hold) note.push(`held for ${m.hold.for_model}`);
    if (m.demand && m.demand.waiting > 0) note.push(`demand: ${m.demand.waiting} waiting since ${m.demand.since.slice(11, 19)}`);
    if (m.scaled_reason) note.push(`scaled: ${m.scaled_reason}`);
    if (m.declared && m.min !== null && m.live < m.min) note.push(`below its minimum (${m.min})`);
    else if (m.live < m.desired && !note.length) note.push("below desired");
    // The traffic is now's: a past moment shows none.
    const t = past ? null : traffic[m.name];
    const rps = t ? t.rps.toFixed(1) : "-";
    const inflight = t && t.inflight !== null ? String(t.inflight) : "-";
    const held = t && t.held !== null && t.held !== undefined ? String(t.held) : "-";
    // The prefix cache's hit rate, from the log's reports of cached prompt tokens.
    const hit = t && t.hit !== null && t.hit !== undefined ? `${Math.round(t.hit * 100)}%` : "-";
    const from = t ? ` title="from the ${t.source === "gateway" ? "gateway's counters" : "log's replica.used reports"}"` : "";
    return `<tr data-model="${esc(m.name)}"><td>${esc(m.name)}</td><td>${esc(m.class ?? "-")}</td><td>${esc(m.owner ?? "-")}</td><td>${m.live}/${m.desired}</td><td>${m.min ?? "-"}..${m.max ?? "-"}</td><td class="rps"${from}>${rps}</td><td class="inflight"${from}>${inflight}</td><td class="held"${from}>${held}</td><td class="hit">${hit}</td><td>${esc(note.join("; "))}</td></tr>`;
  });
  $("#models tbody").innerHTML = rows.join("");
}

// What is left of a hold: `17s`, `1m5s`; once passed, when it ended (`ended 5s ago`).
function left(until, now) {
  const s = Math.round((Date.parse(until) - now) / 1000);
  if (s <= 0) return ageText(until, "end", now);
  return s >= 60 ? `${Math.floor(s / 60)}m${s % 60}s` : `${s}s`;
}

function drawHolds(v) {
  // Live, a hold counts down against the clock; in the past, against the view's time.
  const now = clockMs();
  const rows = [];
  for (const m of v.models.values()) {
    if (!m.hold) continue;
    rows.push(`<tr data-model="${esc(m.name)}"><td>${esc(m.name)}</td><td>${esc(m.hold.for_model)}</td><td>${esc(m.hold.until)}</td><td class="left" data-until="${esc(m.hold.until)}">${left(m.hold.until, now)}</td></tr>`);
  }
  $("#holds tbody").innerHTML = rows.join("") || '<tr><td colspan="4" class="muted">no holds</td></tr>';
}

function drawQuota(v) {
  const g = (a) => (a ? a.gpus : "-");
  $("#quota tbody").innerHTML = (v.quota || [])
    .map((q) => `<tr><td>${esc(q.owner)}${q.declared ? "" : " (undeclared)"}</td><td>${g(q.guarantee)}</td><td>${q.declared && !q.limit ? "none" : g(q.limit)}</td><td>${g(q.used)}</td><td>${q.borrowed_gpus}</td></tr>`)
    .join("") || '<tr><td colspan="5" class="muted">no quota declared</td></tr>';
}

// The banner: the worst facts now, whatever moment is shown: a plane with no leader, a
// stale projector or its `up` gone (plane.running false); a node lost, with its reason;
// a model below its minimum (critical ones first); dead letters that grew within the
// health's window.
const CLASS_RANK = { critical: 0, standard: 1, opportunistic: 2 };

function bannerFacts() {
  const out = [];
  const plane = health.plane;
  if (plane && !plane.running) out.push(["plane", `The control plane is not running: ${(plane.problems || []).join("; ")}`]);
  if (live) {
    for (const n of [...live.nodes.values()].sort((a, b) => a.name.localeCompare(b.name))) {
      if (n.lost) out.push(["node", `Node ${n.name} LOST: ${n.lost_reason || "no reason recorded"}`]);
    }
    const below = [...live.models.values()]
      .filter((m) => m.declared && m.min !== null && m.live < m.min)
      .sort((a, b) => (CLASS_RANK[a.class] ?? 9) - (CLASS_RANK[b.class] ?? 9) || a.name.localeCompare(b.name));
    for (const m of below) out.push(["model", `Model ${m.name} (${m.class}) below its minimum: ${m.live} live of min ${m.min}`]);
  }
  const grown = Object.entries(health.dead_letters_new || {});
  if (grown.length) {
    const mins = Math.round((health.dead_letters_window_s || 300) / 60);
    out.push(["dead", `Dead letters growing: ${grown.map(([c, n]) => `${c} +${n}`).join(", ")} in the last ${mins} min`]);
  }
  return out;
}

function drawBanner() {
  const b = $("#banner");
  const facts = bannerFacts();
  b.hidden = !facts.length;
  b.innerHTML = facts.map(([k, t]) => `<div class="fact" data-fact="${k}">${esc(t)}</div>`).join("");
}

function drawHealth() {
  const h = health;
  drawBanner();
  if (!h || h.last_seq === undefined) return;
  const p = h.projector;
  const dead = Object.entries(h.dead_letters || {});
  const total = dead.reduce((a, [, n]) => a + n, 0);
  $("#health").textContent = `seq ${h.last_seq}; ` +
    (p ? `projector ${p.lag_events} behind (${p.lag_s} s); ` : "projector: not known here; ") +
    (total ? `${total} dead letters (${dead.map(([k, n]) => k + " " + n).join(", ")})` : "no dead letters") +
    (live && live.rejected ? `; ${live.rejected} events rejected by the fold` : "");
}

// The decisions, newest first, each with its one-line why: no click needed. One said
// again and again (a retry of a count that cannot be placed) is one row with its count.
function drawDecisions(v) {
  const rows = (v.decisions || []).slice().reverse().map((d) =>
    `<tr data-model="${esc(d.model)}" data-type="${esc(d.type)}" data-count="${esc(d.count || 1)}"><td class="when" title="${esc((d.count || 1) > 1 ? `${d.count} times, from ${d.first_time} (seq ${d.first_seq}) to ${d.time} (seq ${d.seq})` : d.time)}">${(d.count || 1) > 1 ? `\u00d7${esc(d.count)}, last ` : ""}${ageSpan(d.time)}</td><td>${esc(d.type)}</td><td>${esc(d.model)}</td><td>${esc(d.outcome)}</td><td class="why">${esc(d.summary)}</td></tr>`);
  $("#decisions tbody").innerHTML = rows.join("") || '<tr><td colspan="5" class="muted">no decisions yet</td></tr>';
}

function drawFeed() {
  const fm = $("#f-model").value.trim(), fn = $("#f-node").value.trim(), ft = $("#f-type").value;
  const types = $("#f-type");
  for (const c of feed) {
    if (c.type && !types.querySelector(`option[value="${CSS.escape(c.type)}"]`)) types.add(new Option(c.type, c.type));
  }
  const shown = [];
  // At a past moment the feed ends there: nothing after the moment shown.
  const upTo = past ? past.seq : Infinity;
  for (let i = feed.length - 1; i >= 0 && shown.length < 200; i--) {
    const c = feed[i];
    if (c.seq > upTo) continue;
    if (ft && c.type !== ft) continue;
    if (fm && !c.models.some((m) => m.includes(fm))) continue;
    if (fn && !c.nodes.some((n) => n.includes(fn))) continue;
    const rep = c.replicas[0], mod = c.models[0];
    const data = rep ? ` data-replica="${esc(rep)}"` : mod ? ` data-model="${esc(mod)}"` : "";
    shown.push(`<li class="${c.rejected ? "rejected" : ""}" data-type="${esc(c.type)}"${data}><span class="seq">${c.seq}</span><span class="time" title="${esc(c.time ?? "")}">${esc(c.time ? c.time.slice(11, 19) : "")}</span><span class="type">${esc(c.type)}</span>${esc(c.key ?? "")} ${esc(c.summary ?? "")}${c.rejected ? " REJECTED: " + esc(c.rejected) : ""}</li>`);
  }
  $("#feed").innerHTML = shown.join("") || `<li class="muted">${past ? `no event kept here at or before seq ${past.seq}` : "no events yet"}</li>`;
}

// ------------------------------------------------------------------ time travel

let asked = 0;
async function showSeq(seq) {
  const n = ++asked;
  const r = await fetch(withToken(`api/view?seq=${seq}`));
  if (n !== asked || !r.ok) return;
  const doc = await r.json();
  past = fromDoc(doc);
  draw();
}

function goLive() {
  past = null;
  asked++;
  draw();
  tickAges();
}

// ------------------------------------------------------------------ explanations

async function explainIt(kind, name) {
  const box = $("#explain");
  box.hidden = false;
  $("#explain-title").textContent = `${kind} ${name}`;
  $("#explain-text").textContent = "reading the log…";
  const seq = past ? `?seq=${past.seq}` : "";
  const r = await fetch(withToken(`api/explain/${kind}/${encodeURIComponent(name)}${seq}`));
  const doc = await r.json();
  if (!r.ok) {
    $("#explain-text").textContent = doc.error || r.statusText;
    return;
  }
  const tl = (doc.timeline || []).slice(-20).map((e) => `${String(e.seq).padStart(7)} ${e.time} ${e.type.padEnd(19)} ${e.summary}${e.rejected ? "  REJECTED: " + e.rejected : ""}`);
  $("#explain-text").innerHTML = withAges([...doc.text, "", "timeline", ...tl].join("\n"));
}

// The explanation's `STAMP (3m ago)` ages, counted again from the page's clock and kept
// ticking: the server counted them when it answered, and the answer stays on screen.
const STAMPED = /(until )?(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) \((?:now|in \w+|\w+ ago)\)/g;
function withAges(text) {
  return esc(text).replace(STAMPED, (_, until, stamp) => `${until ?? ""}${stamp} (${ageSpan(stamp, until ? "end" : "")})`);
}

document.addEventListener("click", (ev) => {
  const el = ev.target.closest("[data-replica], [data-model]");
  if (!el || el.closest("#explain")) return;
  if (el.dataset.replica) explainIt("replica", el.dataset.replica);
  else explainIt("model", el.dataset.model);
});

$("#explain-close").addEventListener("click", () => ($("#explain").hidden = true));
$("#slider").addEventListener("change", (e) => {
  const seq = Number(e.target.value);
  if (live && seq >= live.seq) goLive();
  else showSeq(seq);
});
$("#live").addEventListener("click", goLive);
for (const id of ["#f-model", "#f-node", "#f-type"]) $(id).addEventListener("input", drawFeed);

async function pollHealth() {
  try {
    const r = await fetch(withToken("api/health"));
    if (r.ok) health = await r.json();
    drawHealth();
  } catch (_) { /* the stream's badge says it */ }
}

// Countdowns and ages tick without events.
setInterval(tickAges, 1000);
setInterval(pollHealth, 3000);
pollHealth();
firstView().then(connect);
