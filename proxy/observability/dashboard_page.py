"""The `/dashboard` page: one self-contained HTML document (inline CSS and JS, no CDN, no fonts, no images),
so it works in an air-gapped cluster. It polls `dashboard/data` every 2 s and redraws.

Kept as a Python string rather than a package-data file so an installed wheel always carries it.
"""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>affinity-proxy · backends over time</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
:root { --bg:#0f1419; --panel:#171d24; --fg:#d8dee6; --dim:#8a96a3; --line:#2a333d; --hot:#ff3b30; --spread:#ff2dd4; }
* { box-sizing:border-box; }
body { margin:0; padding:16px 20px; background:var(--bg); color:var(--fg);
       font:13px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
h1 { font-size:17px; margin:0 0 2px; font-weight:600; }
h2 { font-size:13px; margin:0 0 8px; color:var(--dim); font-weight:600; text-transform:uppercase; letter-spacing:.04em; }
.sub { color:var(--dim); margin-bottom:12px; }
.panel { background:var(--panel); border:1px solid var(--line); border-radius:6px; padding:12px 14px; margin-bottom:14px; }
.row { display:flex; gap:14px; flex-wrap:wrap; }
.row > .panel { flex:1 1 380px; }
.metrics button { background:#222b35; color:var(--fg); border:1px solid var(--line); border-radius:4px;
                  padding:4px 9px; margin:0 4px 8px 0; cursor:pointer; font:inherit; }
.metrics button.on { background:#2f6feb; border-color:#2f6feb; color:#fff; }
#heatmap { display:grid; gap:1px; align-items:center; }
.name { padding-right:8px; white-space:nowrap; overflow:hidden; text-overflow:ellipsis; font-variant-numeric:tabular-nums; }
.name.hot { color:var(--hot); font-weight:600; } .name.spreading { color:var(--spread); font-weight:600; }
.cell { height:20px; border-radius:1px; background:#232a32; position:relative; }
.cell.open { opacity:.75; }
.cell[data-mark="over"]::after { content:""; position:absolute; left:50%; top:50%; width:4px; height:4px;
       margin:-2px 0 0 -2px; border-radius:50%; background:var(--hot); }
.cell[data-mark="hot"] { outline:2px solid var(--hot); outline-offset:-2px; }
.cell[data-mark="spreading"] { outline:2px solid var(--spread); outline-offset:-2px;
       background-image:repeating-linear-gradient(45deg, rgba(255,45,212,.55) 0 2px, transparent 2px 5px); }
.axis { color:var(--dim); font-size:11px; display:flex; justify-content:space-between; }
.legend { display:flex; align-items:center; gap:14px; color:var(--dim); font-size:12px; margin-top:8px; flex-wrap:wrap; }
.scale { width:160px; height:10px; border-radius:2px; }
.sw { display:inline-block; width:14px; height:12px; vertical-align:-2px; margin-right:4px; background:#232a32; }
table { border-collapse:collapse; width:100%; font-variant-numeric:tabular-nums; }
th, td { text-align:left; padding:4px 8px; border-bottom:1px solid var(--line); }
th { color:var(--dim); font-weight:600; font-size:12px; }
.badge { display:inline-block; padding:1px 6px; border-radius:3px; font-size:11px; font-weight:600; }
.b-healthy { background:#1f6f3f; } .b-unknown { background:#555; } .b-unhealthy { background:#a4262c; }
.b-draining { background:#8a6d1c; } .b-hot { background:var(--hot); color:#fff; } .b-spreading { background:var(--spread); color:#fff; }
.mixbar { display:flex; height:18px; border-radius:3px; overflow:hidden; margin-bottom:8px; background:#232a32; }
.mixbar div { height:100%; }
.mixrow { display:flex; justify-content:space-between; padding:2px 0; }
.events div { padding:2px 0; color:var(--dim); } .events b { color:var(--fg); }
#status { float:right; color:var(--dim); }
#status.err { color:var(--hot); }
</style></head>
<body>
<span id="status">loading…</span>
<h1>affinity-proxy · backends over time</h1>
<div class="sub"><span id="span"></span> <span id="rule"></span></div>
<div class="panel">
  <div class="metrics" id="metrics"></div>
  <div id="heatmap" role="grid" aria-label="heatmap of backends by time window"></div>
  <div class="axis" id="axis"></div>
  <div class="legend" id="legend"></div>
</div>
<div class="row">
  <div class="panel"><h2>Backends</h2><table id="fleet"><thead><tr><th>backend</th><th>health</th><th>load score</th>
    <th>metrics age</th><th>in flight</th><th>state</th></tr></thead><tbody></tbody></table></div>
  <div class="panel"><h2>Routing mix (last minute)</h2><div class="mixbar" id="mixbar"></div><div id="mix"></div></div>
  <div class="panel"><h2>Hot-spot transitions</h2><div class="events" id="events"></div></div>
</div>
<script>
"use strict";
const METRICS = [
  ["ttft_p99", "TTFT p99", v => fmtS(v), "log"],
  ["e2e_p99", "e2e p99", v => fmtS(v), "log"],
  ["error_rate", "error rate", v => (100 * v).toFixed(1) + "%", "rate"],
  ["load_score", "load score", v => v.toFixed(2), "unit"],
  ["inflight", "in flight", v => v.toFixed(1), "lin"],
];
const MIX_COLORS = ["#2f6feb","#3fb950","#d29922","#a371f7","#f0883e","#39c5cf","#db61a2","#8b949e"];
const VIRIDIS = [[68,1,84],[59,82,139],[33,145,140],[94,201,98],[253,231,37]];
let metric = new URLSearchParams(location.search).get("metric") || "ttft_p99";
let last = null;

function fmtS(v) { return v >= 1 ? v.toFixed(2) + " s" : (1000 * v).toFixed(0) + " ms"; }
function color(t) {
  t = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - i, a = VIRIDIS[i], b = VIRIDIS[i + 1];
  return "rgb(" + a.map((x, k) => Math.round(x + (b[k] - x) * f)).join(",") + ")";
}
function scaleFor(kind, values) {
  const vs = values.filter(v => v !== null && v > 0);
  if (kind === "unit") return v => v;
  if (kind === "rate") { const hi = Math.max(0.1, ...vs); return v => v / hi; }
  if (!vs.length) return v => 0;
  if (kind === "log") {
    const lo = Math.log(Math.min(...vs)), hi = Math.log(Math.max(...vs));
    return v => hi > lo ? (Math.log(Math.max(v, 1e-6)) - lo) / (hi - lo) : 0.5;
  }
  const hi = Math.max(...vs); return v => v / hi;
}
function el(tag, cls, text) { const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e; }

function drawButtons() {
  const box = document.getElementById("metrics"); box.textContent = "";
  for (const [key, label] of METRICS) {
    const b = el("button", key === metric ? "on" : "", label); b.dataset.metric = key;
    b.onclick = () => { metric = key; drawButtons(); if (last) draw(last); };
    box.appendChild(b);
  }
}

function draw(data) {
  const h = data.heatmap, m = METRICS.find(x => x[0] === metric) || METRICS[0];
  const grid = document.getElementById("heatmap");
  const n = h.windows.length;
  const rows = h.metrics[m[0]];
  const scale = scaleFor(m[3], rows.flat());
  // Same backends and window count as last time: update the cells in place (no flicker, no new nodes).
  const shape = h.backends.join("\u0000") + "|" + n;
  if (grid.dataset.shape !== shape) {
    grid.style.gridTemplateColumns = "120px repeat(" + n + ", minmax(3px, 1fr))";
    grid.textContent = "";
    h.backends.forEach(name => {
      const label = el("div", "name", name); label.title = name; grid.appendChild(label);
      for (let c = 0; c < n; c++) { const cell = el("div", "cell"); cell.dataset.backend = name; grid.appendChild(cell); }
    });
    grid.dataset.shape = shape;
  }
  const nodes = grid.children;
  h.backends.forEach((name, r) => {
    const st = h.states[name] || {};
    nodes[r * (n + 1)].className = "name" + (st.spreading_anomaly ? " spreading" : st.latency_hot_spot ? " hot" : "");
    for (let c = 0; c < n; c++) {
      const v = rows[r][c], mark = h.marks[r][c], cell = nodes[r * (n + 1) + 1 + c];
      cell.className = "cell" + (h.windows[c] === h.open_window ? " open" : "");
      cell.dataset.window = h.windows[c];
      if (v !== null) { cell.style.backgroundColor = color(scale(v)); cell.dataset.value = v; }
      else { cell.style.backgroundColor = ""; delete cell.dataset.value; }
      if (mark) cell.dataset.mark = mark; else delete cell.dataset.mark;
      const t = new Date(h.windows[c] * h.window_s * 1000).toLocaleTimeString();
      cell.title = name + " · " + t + " · " + m[1] + ": " + (v === null ? "no requests" : m[2](v))
        + " · finished " + (h.metrics.requests[r][c] || 0)
        + (h.metrics.waiting[r][c] ? " · waiting for a first byte " + h.metrics.waiting[r][c] : "") + (mark ? " · " + mark : "");
    }
  });
  const axis = document.getElementById("axis"); axis.textContent = ""; axis.style.marginLeft = "120px";
  // The span shown and the window width come from the server (hotspots.window_s, history_windows).
  const total = n * h.window_s;
  const ago = s => s >= 120 ? "-" + Math.round(s / 60) + " min" : "-" + Math.round(s) + " s";
  for (const label of [ago(total), ago(total * 2 / 3), ago(total / 3), "now"])
    axis.appendChild(el("span", "", label));
  document.getElementById("span").textContent = h.window_s + " s windows over the last "
    + (total >= 120 ? Math.round(total / 60) + " minutes." : Math.round(total) + " seconds.");
  const legend = document.getElementById("legend"); legend.textContent = "";
  const vs = rows.flat().filter(v => v !== null);
  legend.appendChild(el("span", "", m[1] + ":"));
  const bar = el("span", "scale");
  bar.style.background = "linear-gradient(90deg," + [0, .25, .5, .75, 1].map(color).join(",") + ")";
  legend.appendChild(el("span", "", vs.length ? m[2](m[3] === "unit" ? 0 : Math.min(...vs)) : "–"));
  legend.appendChild(bar);
  legend.appendChild(el("span", "", vs.length ? m[2](m[3] === "unit" ? 1 : m[3] === "rate" ? Math.max(0.1, ...vs) : Math.max(...vs)) : "–"));
  for (const [cls, text] of [["hot", "latency hot spot"], ["spreading", "spreading an anomaly"], ["over", "over threshold (streak)"]]) {
    const s = el("span"), sw = el("span", "sw cell"); sw.dataset.mark = cls; sw.style.display = "inline-block";
    sw.style.height = "12px"; s.appendChild(sw); s.appendChild(document.createTextNode(text)); legend.appendChild(s);
  }
  const r = data.hotspots.rules;
  document.getElementById("rule").textContent = "Hot spot: " + r.metric + " p99 more than " + Math.round(100 * r.latency_rise)
    + "% over its baseline for " + r.windows + " windows; spreading: error rate also " + Math.round(100 * r.error_rise)
    + " points over its baseline.";
  drawFleet(data); drawMix(h.routing_mix); drawEvents(data.hotspots.events);
}

function drawFleet(data) {
  const body = document.querySelector("#fleet tbody"); body.textContent = "";
  const states = data.heatmap.states;
  for (const b of data.fleet) {
    const tr = el("tr"); tr.dataset.backend = b.name;
    tr.appendChild(el("td", "", b.name));
    const h = el("td"); h.appendChild(el("span", "badge b-" + b.health, b.health + (b.routable === false ? " · not routable" : "")));
    tr.appendChild(h);
    tr.appendChild(el("td", "", b.load_score === null || b.load_score === undefined ? "–" : b.load_score.toFixed(2)));
    tr.appendChild(el("td", "", (b.metrics_age_s === null || b.metrics_age_s === undefined ? "never" : b.metrics_age_s.toFixed(1) + " s")
      + (b.stale ? " (stale)" : "")));
    tr.appendChild(el("td", "", String(b.inflight_requests ?? 0)));
    const s = el("td"), st = states[b.name] || {};
    if (st.latency_hot_spot) s.appendChild(el("span", "badge b-hot", "hot spot"));
    if (st.spreading_anomaly) { s.appendChild(document.createTextNode(" ")); s.appendChild(el("span", "badge b-spreading", "spreading")); }
    if (!st.latency_hot_spot && !st.spreading_anomaly) s.textContent = "ok";
    tr.appendChild(s); body.appendChild(tr);
  }
}

function drawMix(mix) {
  const bar = document.getElementById("mixbar"), list = document.getElementById("mix");
  bar.textContent = ""; list.textContent = "";
  const total = Object.values(mix).reduce((a, b) => a + b, 0);
  if (!total) { list.textContent = "no routed requests in the last minute"; return; }
  Object.entries(mix).forEach(([reason, n], i) => {
    const seg = el("div"); seg.style.width = (100 * n / total) + "%"; seg.style.background = MIX_COLORS[i % MIX_COLORS.length];
    seg.title = reason; bar.appendChild(seg);
    const row = el("div", "mixrow"), k = el("span"), sw = el("span", "sw"); sw.style.background = MIX_COLORS[i % MIX_COLORS.length];
    k.appendChild(sw); k.appendChild(document.createTextNode(reason)); row.dataset.reason = reason;
    row.appendChild(k); row.appendChild(el("span", "", n + " · " + (100 * n / total).toFixed(0) + "%")); list.appendChild(row);
  });
}

function drawEvents(events) {
  const box = document.getElementById("events"); box.textContent = "";
  if (!events.length) { box.textContent = "none in memory"; return; }
  for (const e of events.slice(-12).reverse()) {
    const d = el("div"), t = new Date(e.window * last.heatmap.window_s * 1000).toLocaleTimeString();
    d.appendChild(document.createTextNode(t + " "));
    d.appendChild(el("b", "", e.backend));
    d.appendChild(document.createTextNode((e.entered ? " entered " : " left ") + e.state.replace(/_/g, " ")
      + (e.p99_s !== null ? " · p99 " + fmtS(e.p99_s) + " vs " + fmtS(e.baseline_p99_s) : "")
      + (e.error_rate !== null ? " · errors " + (100 * e.error_rate).toFixed(1) + "%" : "")));
    box.appendChild(d);
  }
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const resp = await fetch("dashboard/data", {cache: "no-store"});
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    last = await resp.json(); draw(last);
    status.className = ""; status.textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (err) { status.className = "err"; status.textContent = "update failed: " + err.message; }
  setTimeout(poll, 2000);
}
drawButtons(); poll();
</script></body></html>
"""
