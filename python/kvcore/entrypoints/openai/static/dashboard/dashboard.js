// kvcore's live dashboard: polls /dashboard/api/state once a second and redraws. Charts are
// Chart.js (vendored beside this file); the block map is one <span> per cell.
"use strict";
const KEY = new URLSearchParams(location.search).get("key");
const HEADERS = KEY ? { Authorization: "Bearer " + KEY } : {};
const STATES = ["free", "cached", "running", "shared"];
const COLORS = ["#2f6fb0", "#d64545", "#3a9a5b", "#f2a541", "#8a5cc2", "#6b7785", "#1aa3a3"];
const charts = {};
const history = [];  // metric points, newest last (the server sends only new ones)

function lineChart(id, title, series, opts = {}) {
  const datasets = series.map((s, i) => ({
    label: s, data: [], borderColor: COLORS[i % COLORS.length], borderWidth: 1.5,
    pointRadius: 0, spanGaps: true, tension: 0.2,
  }));
  charts[id] = new Chart(document.getElementById(id), {
    type: "line",
    data: { labels: [], datasets },
    options: {
      animation: false, responsive: true, maintainAspectRatio: false,
      plugins: { title: { display: true, text: title }, legend: { labels: { boxWidth: 10 } } },
      scales: { x: { ticks: { maxTicksLimit: 6 } }, y: { beginAtZero: true, ...opts.y } },
    },
  });
}

lineChart("c-kv", "KV cache usage and prefix hit rate", ["kv_cache_usage_perc", "hit rate"],
  { y: { max: 1 } });
lineChart("c-req", "Requests", ["num_requests_running", "num_requests_waiting", "preemptions/s"]);
lineChart("c-tok", "Tokens/s", ["generation", "prompt"]);
lineChart("c-ttft", "Time to first token (ms)", ["p50", "p99"]);
lineChart("c-itl", "Inter-token latency (ms)", ["p50", "p99"]);
lineChart("c-tiers", "Tier moves (blocks/s)", ["loads/s", "offloads/s"]);
lineChart("c-tenant-blocks", "Blocks held per cache_salt", []);
lineChart("c-tenant-hits", "Prefix hits per cache_salt", []);

function setSeries(chart, labels, named) {
  chart.data.labels = labels;
  const names = Object.keys(named);
  names.forEach((name, i) => {
    let ds = chart.data.datasets.find((d) => d.label === name);
    if (!ds) {
      ds = { label: name, data: [], borderColor: COLORS[i % COLORS.length], borderWidth: 1.5,
             pointRadius: 0, spanGaps: true, tension: 0.2 };
      chart.data.datasets.push(ds);
    }
    ds.data = named[name];
  });
  chart.update("none");
}

function drawCharts(history) {
  const labels = history.map((p) => new Date(p.t * 1000).toLocaleTimeString());
  const col = (k) => history.map((p) => p[k]);
  const c = charts;
  setSeries(c["c-kv"], labels, { kv_cache_usage_perc: col("kv_usage"), "hit rate": col("hit_rate") });
  setSeries(c["c-req"], labels, { num_requests_running: col("running"),
    num_requests_waiting: col("waiting"), "preemptions/s": col("preemptions_per_s") });
  setSeries(c["c-tok"], labels, { generation: col("gen_tokens_per_s"), prompt: col("prompt_tokens_per_s") });
  setSeries(c["c-ttft"], labels, { p50: col("ttft_p50_ms"), p99: col("ttft_p99_ms") });
  setSeries(c["c-itl"], labels, { p50: col("itl_p50_ms"), p99: col("itl_p99_ms") });
  setSeries(c["c-tiers"], labels, { "loads/s": col("loads_per_s"), "offloads/s": col("offloads_per_s") });
  const tenants = new Set();
  history.forEach((p) => Object.keys(p.tenants || {}).forEach((t) => tenants.add(t)));
  const per = (field) => Object.fromEntries([...tenants].map(
    (t) => [t, history.map((p) => (p[field] || {})[t] ?? 0)]));
  setSeries(c["c-tenant-blocks"], labels, per("tenants"));
  setSeries(c["c-tenant-hits"], labels, per("tenant_hits"));
}

function drawMap(kv) {
  const map = document.getElementById("map");
  const cells = kv.cells;
  while (map.children.length < cells.length) {
    const s = document.createElement("span");
    s.className = "cell s0";
    map.appendChild(s);
  }
  while (map.children.length > cells.length) map.lastChild.remove();
  for (let i = 0; i < cells.length; i++) {
    const el = map.children[i];
    const st = +cells[i];
    const cls = "cell s" + st;
    if (el.className !== cls) el.className = cls;
    el.dataset.state = STATES[st];
    let title;
    if (kv.group > 1) {
      const a = i * kv.group + 1, b = Math.min((i + 1) * kv.group, kv.num_blocks);
      title = `blocks ${a}-${b}: ${STATES[st]} (most referenced)`;
    } else {
      title = kv.hover[i] || `block ${i + 1}: ${STATES[st]}`;
    }
    if (el.title !== title) el.title = title;
  }
  for (const s of STATES) document.getElementById("count-" + s).textContent = kv.counts[s];
  document.getElementById("pool-size").textContent =
    `${kv.num_blocks} blocks` + (kv.group > 1 ? `, ${kv.group} per cell` : ", one per cell");
}

function esc(s) {
  return String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

function drawTables(d) {
  document.getElementById("hot").innerHTML = d.kv.hot_prefixes.map((p) =>
    `<tr data-testid="hot-row"><td class="text" title="${esc(p.text)}">${esc(p.text)}</td>` +
    `<td>${esc(p.salt ?? "")}</td><td>${p.tokens}</td><td>${p.blocks}</td><td>${p.pinned}</td>` +
    `<td class="hits">${p.hits}</td><td>${p.last_use_s_ago}s ago</td></tr>`).join("") ||
    "<tr><td colspan=7>no prefix hit yet</td></tr>";
  const t = d.tiers;
  const rows = [];
  if (!t) {
    rows.push(["tiers", "off (--kv-tiers)"]);
    rows.push(["L1 (pool)", d.kv.counts.running + d.kv.counts.shared + d.kv.counts.cached, "L1"]);
  } else {
    for (const [k, v] of Object.entries(t.resident)) rows.push([k + " resident blocks", v ?? "—", k]);
    const p = d.point;
    rows.push(["loads/s", p.loads_per_s], ["offloads/s", p.offloads_per_s],
      ["blocks loaded / offloaded / fetched", `${t.loaded_blocks} / ${t.offloaded_blocks} / ${t.fetched_blocks}`],
      ["fetch latency p50 / p95 (ms)", `${t.fetch_p50_ms ?? "—"} / ${t.fetch_p95_ms ?? "—"}`],
      ["L2 load latency p50 (ms)", t.load_p50_ms ?? "—"]);
  }
  document.getElementById("tiers").innerHTML = rows.map(([k, v, id]) =>
    `<tr><th>${esc(k)}</th><td${id ? ` id="tier-${id}" data-testid="tier-${id}"` : ""}>${esc(v)}</td></tr>`).join("");
  const r = d.kv.retention;
  const ret = [["released blocks (total)", r.released_total]];
  for (const [k, v] of Object.entries(r.released_live_by_policy)) ret.push([`released by ${k} (live requests)`, v]);
  document.getElementById("retention").innerHTML = ret.map(([k, v]) =>
    `<tr><th>${esc(k)}</th><td>${esc(v)}</td></tr>`).join("");
}

async function poll() {
  try {
    const since = history.length ? history[history.length - 1].t : 0;
    const res = await fetch("/dashboard/api/state?since=" + since,
      { headers: HEADERS, cache: "no-store" });
    if (!res.ok) throw new Error("HTTP " + res.status);
    const d = await res.json();
    history.push(...d.history);
    if (history.length > 300) history.splice(0, history.length - 300);
    document.getElementById("model").textContent = d.model;
    drawMap(d.kv);
    drawTables(d);
    drawCharts(history);
    const st = document.getElementById("status");
    st.textContent = `updated ${new Date(d.time * 1000).toLocaleTimeString()} · ` +
      `${d.kv.num_running} running, ${d.kv.num_waiting} waiting`;
    st.dataset.updates = String(+(st.dataset.updates || 0) + 1);
  } catch (e) {
    document.getElementById("status").textContent = "error: " + e.message;
  }
  setTimeout(poll, 1000);
}
poll();
