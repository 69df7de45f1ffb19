// The llmgw dashboard: list, then watch (/api/events), and draw. No build step.
//
// `live` is the view as the stream keeps it: listed once, then patched with the
// entities each change carries. `shown` is what is drawn: `live`, or a past view from
// /api/view?seq=N while the slider is away from the head. Drawing is coalesced to one
// per animation frame, whatever the event rate.

const token = new URLSearchParams(location.search).get("token");
const withToken = (url) => (token ? url + (url.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(token) : url);
const $ = (sel) => document.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

const HOLDING = new Set(["pending", "starting", "loading", "ready", "draining"]);
const FEED_MAX = 300;

let traffic = {}; // model -> {rps, inflight (null: unknown), source: gateway | log}
let live = null; // {seq, time, nodes: Map, models: Map, replicas: Map, quota, ...}
let past = null; // a past view document, while the slider is away from live
let feed = [];
let source = null;
let drawQueued = false;
let painted = false;
let health = {};
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

function setConn(text, cls) {
  const b = $("#conn");
  b.textContent = text;
  b.className = "badge " + cls;
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
  $("#where").textContent = `seq ${v.seq}${v.time ? " · " + v.time : ""}`;
  drawGrid(v);
  drawModels(v);
  drawHolds(v);
  drawQuota(v);
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
      const tip = `${name} GPU ${g.index}: ${r.id} (${r.model}, ${r.state}${r.preempted_for ? ", preempted for " + r.preempted_for : ""})`;
      return `<span class="cell ${esc(r.state)}" style="background-color:${colour(r.model)}" data-node="${esc(name)}" data-gpu="${g.index}" data-replica="${esc(r.id)}" data-model="${esc(r.model)}" data-state="${esc(r.state)}" title="${esc(tip)}">${esc(r.id.slice(0, 11))}</span>`;
    });
    rows.push(`<div class="${cls}" data-node="${esc(name)}"><span class="name" title="${esc(name)}">${esc(name)}</span>${cells.join("")}</div>`);
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
    if (m.live < m.desired && !note.length) note.push("below desired");
    // The traffic is now's: a past moment shows none.
    const t = past ? null : traffic[m.name];
    const rps = t ? t.rps.toFixed(1) : "-";
    const inflight = t && t.inflight !== null ? String(t.inflight) : "-";
    const from = t ? ` title="from the ${t.source === "gateway" ? "gateway's counters" : "log's replica.used reports"}"` : "";
    return `<tr data-model="${esc(m.name)}"><td>${esc(m.name)}</td><td>${esc(m.class ?? "-")}</td><td>${esc(m.owner ?? "-")}</td><td>${m.live}/${m.desired}</td><td>${m.min ?? "-"}..${m.max ?? "-"}</td><td class="rps"${from}>${rps}</td><td class="inflight"${from}>${inflight}</td><td>${esc(note.join("; "))}</td></tr>`;
  });
  $("#models tbody").innerHTML = rows.join("");
}

function left(until, now) {
  const s = Math.round((Date.parse(until) - now) / 1000);
  if (s <= 0) return "over";
  return s >= 60 ? `${Math.floor(s / 60)}m${s % 60}s` : `${s}s`;
}

function drawHolds(v) {
  // Live, a hold counts down against the clock; in the past, against the view's time.
  const now = past ? Date.parse(v.time) : Date.now();
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

// The banner: a plane with no leader, a stale projector or its `up` gone is a headline.
function drawBanner(plane) {
  const b = $("#banner");
  const down = plane && !plane.running;
  b.hidden = !down;
  b.textContent = down ? `The control plane is not running: ${(plane.problems || []).join("; ")}` : "";
}

function drawHealth() {
  const h = health;
  if (!h || h.last_seq === undefined) return;
  drawBanner(h.plane);
  const p = h.projector;
  const dead = Object.entries(h.dead_letters || {});
  const total = dead.reduce((a, [, n]) => a + n, 0);
  $("#health").textContent = `seq ${h.last_seq}; ` +
    (p ? `projector ${p.lag_events} behind (${p.lag_s} s); ` : "projector: not known here; ") +
    (total ? `${total} dead letters (${dead.map(([k, n]) => k + " " + n).join(", ")})` : "no dead letters") +
    (live && live.rejected ? `; ${live.rejected} events rejected by the fold` : "");
}

function drawFeed() {
  const fm = $("#f-model").value.trim(), fn = $("#f-node").value.trim(), ft = $("#f-type").value;
  const types = $("#f-type");
  for (const c of feed) {
    if (c.type && !types.querySelector(`option[value="${CSS.escape(c.type)}"]`)) types.add(new Option(c.type, c.type));
  }
  const shown = [];
  for (let i = feed.length - 1; i >= 0 && shown.length < 200; i--) {
    const c = feed[i];
    if (ft && c.type !== ft) continue;
    if (fm && !c.models.some((m) => m.includes(fm))) continue;
    if (fn && !c.nodes.some((n) => n.includes(fn))) continue;
    const rep = c.replicas[0], mod = c.models[0];
    const data = rep ? ` data-replica="${esc(rep)}"` : mod ? ` data-model="${esc(mod)}"` : "";
    shown.push(`<li class="${c.rejected ? "rejected" : ""}" data-type="${esc(c.type)}"${data}><span class="seq">${c.seq}</span><span class="type">${esc(c.type)}</span>${esc(c.key ?? "")} ${esc(c.summary ?? "")}${c.rejected ? " REJECTED: " + esc(c.rejected) : ""}</li>`);
  }
  $("#feed").innerHTML = shown.join("");
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
  $("#explain-text").textContent = [...doc.text, "", "timeline", ...tl].join("\n");
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

// Countdowns tick without events.
setInterval(() => {
  if (!past) for (const td of document.querySelectorAll("#holds td.left")) td.textContent = left(td.dataset.until, Date.now());
}, 1000);
setInterval(pollHealth, 3000);
pollHealth();
connect();
