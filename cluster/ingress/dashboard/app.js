// radixserve dashboard: polls GET ../admin/pools?history=true every second and draws each pool;
// controls call POST ../admin/pools/{pool}/scale and ../admin/replicas/{id}/(un)drain.
// Plain JS, canvas charts drawn here; no build step, nothing loaded from elsewhere.
"use strict";

const POLL_MS = 1000;
const KEY_ITEM = "radixserve-admin-key";
const CHARTS = [
  { title: "queue (waiting, running)", series: [["waiting", "#c2410c"], ["running", "#2f6fde"]] },
  { title: "KV usage", series: [["kv_usage", "#7c3aed"]], max: 1, percent: true },
  { title: "cache hit rate", series: [["cache_hit_rate", "#15803d"]], max: 1, percent: true },
  { title: "TTFT / ITL p90 (ms)", series: [["ttft_p90_ms", "#db2777"], ["itl_p90_ms", "#0891b2"]] },
  { title: "tokens/s", series: [["tokens_per_s", "#2f6fde"]] },
  { title: "replicas (ready, target)", series: [["replicas", "#15803d"], ["target", "#6b7385"]], integer: true },
];

const state = { key: null, timer: null, cards: new Map(), busy: false };
const $ = (sel, root = document) => root.querySelector(sel);

function fmt(value, field) {
  if (value === null || value === undefined) return "–";
  if (field === "kv_usage" || field === "cache_hit_rate") return (100 * value).toFixed(1) + "%";
  if (field.endsWith("_ms")) return value.toFixed(value < 10 ? 1 : 0) + " ms";
  if (field === "tokens_per_s") return value.toFixed(1);
  return String(value);
}

async function api(method, path, body) {
  const init = { method, headers: { Authorization: "Bearer " + state.key } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch("../admin/" + path, init);
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    const err = new Error((data.error && data.error.message) || resp.statusText);
    err.status = resp.status;
    throw err;
  }
  return data;
}

function setStatus(text, cls) {
  const el = $("#status");
  el.textContent = text;
  el.className = "status " + (cls || "");
}

function showLogin(message) {
  stop();
  $("#login").hidden = false;
  $("#logout").hidden = true;
  const err = $("#login-error");
  err.hidden = !message;
  err.textContent = message || "";
  setStatus("not connected");
}

function stop() {
  if (state.timer) clearInterval(state.timer);
  state.timer = null;
}

function connect(key) {
  state.key = key;
  sessionStorage.setItem(KEY_ITEM, key);
  $("#login").hidden = true;
  $("#logout").hidden = false;
  stop();
  poll();
  state.timer = setInterval(poll, POLL_MS);
}

async function poll() {
  if (state.busy) return;
  state.busy = true;
  try {
    const data = await api("GET", "pools?history=true");
    for (const pool of data.pools) render(pool);
    setStatus("live · " + new Date(data.time * 1000).toLocaleTimeString(), "live");
  } catch (err) {
    if (err.status === 401) {
      sessionStorage.removeItem(KEY_ITEM);
      showLogin("admin key rejected (401)");
    } else {
      setStatus("update failed: " + err.message, "failed");
    }
  } finally {
    state.busy = false;
  }
}

function card(pool) {
  let c = state.cards.get(pool.name);
  if (c) return c;
  const node = $("#pool-template").content.firstElementChild.cloneNode(true);
  node.dataset.pool = pool.name;
  $(".pool-name", node).textContent = pool.name + " pool";
  const charts = $(".charts", node);
  const canvases = CHARTS.map((spec) => {
    const box = document.createElement("div");
    box.className = "chart";
    box.innerHTML = '<div class="title"></div><canvas></canvas>';
    $(".title", box).textContent = spec.title;
    charts.appendChild(box);
    return $("canvas", box);
  });
  c = { node, canvases, inputsSet: false };
  state.cards.set(pool.name, c);
  node.addEventListener("click", (ev) => onClick(pool.name, ev));
  $("#pools").appendChild(node);
  return c;
}

function render(pool) {
  const c = card(pool);
  const node = c.node;
  node.dataset.mode = pool.mode;
  node.dataset.target = pool.target_replicas;
  node.dataset.ready = pool.ready_replicas;
  $(".mode", node).textContent = pool.mode === "autoscaling"
    ? `autoscaling ${pool.min_replicas}–${pool.max_replicas}` : "fixed size";
  $(".decision", node).textContent = pool.last_decision;
  for (const el of node.querySelectorAll(".figures [data-field]")) {
    el.textContent = fmt(pool[el.dataset.field], el.dataset.field);
  }
  if (!c.inputsSet) {  // never overwrite what the operator is typing
    $(".replicas-input", node).value = pool.target_replicas;
    $(".min-input", node).value = pool.min_replicas;
    $(".max-input", node).value = pool.max_replicas;
    c.inputsSet = true;
  }
  renderReplicas(node, pool);
  CHARTS.forEach((spec, i) => drawChart(c.canvases[i], pool.history, spec));
}

// A replica's GPUs: "4 (TP 4)" for four tensor-parallel ranks on four GPUs, "CPU", "–" before its first report.
function gpus(r) {
  if (r.gpus === null || r.gpus === undefined) return "–";
  const where = r.gpus > 0 ? String(r.gpus) : "CPU";
  return r.tensor_parallel_size > 1 ? `${where} (TP ${r.tensor_parallel_size})` : where;
}

function renderReplicas(node, pool) {
  const body = $("tbody", node);
  body.textContent = "";
  for (const r of pool.replicas) {
    const tr = document.createElement("tr");
    tr.dataset.replica = r.replica_id;
    const cells = [r.replica_id, r.state, gpus(r), r.running, r.waiting, fmt(r.kv_usage, "kv_usage"),
                   fmt(r.cache_hit_rate, "cache_hit_rate"), r.routed_requests];
    for (const v of cells) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    tr.children[1].className = "state-" + r.state;
    const td = document.createElement("td");
    const draining = ["draining", "drained"].includes(r.state);
    if (r.state === "running" || draining) {
      const b = document.createElement("button");
      b.type = "button";
      b.dataset.action = draining ? "undrain" : "drain";
      b.dataset.replica = r.replica_id;
      b.textContent = draining ? "Undrain" : "Drain";
      td.appendChild(b);
    }
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

async function onClick(poolName, ev) {
  const button = ev.target.closest("button[data-action]");
  if (!button) return;
  const c = state.cards.get(poolName);
  const node = c.node;
  const err = $(".action-error", node);
  err.textContent = "";
  const input = $(".replicas-input", node);
  const action = button.dataset.action;
  try {
    if (action === "inc" || action === "dec") {
      const n = Math.max(1, Number(node.dataset.target) + (action === "inc" ? 1 : -1));
      input.value = n;
      await api("POST", `pools/${poolName}/scale`, { replicas: n });
    } else if (action === "set") {
      await api("POST", `pools/${poolName}/scale`, { replicas: Number(input.value) });
    } else if (action === "autoscale") {
      await api("POST", `pools/${poolName}/scale`, { autoscaling: true,
        min_replicas: Number($(".min-input", node).value), max_replicas: Number($(".max-input", node).value) });
    } else if (action === "drain" || action === "undrain") {
      await api("POST", `replicas/${button.dataset.replica}/${action}`, action === "drain" ? {} : undefined);
    }
    c.inputsSet = false;
    await poll();
  } catch (e) {
    if (e.status === 401) showLogin("admin key rejected (401)");
    else err.textContent = e.message;
  }
}

function drawChart(canvas, history, spec) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 260, h = canvas.clientHeight || 110;
  if (canvas.width !== w * dpr || canvas.height !== h * dpr) {
    canvas.width = w * dpr;
    canvas.height = h * dpr;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const pts = (history || []).slice(-300);
  const left = 38, right = 6, top = 8, bottom = 16;
  let max = spec.max || 0;
  for (const [field] of spec.series) for (const p of pts) if (p[field] != null) max = Math.max(max, p[field]);
  if (!spec.max) max = max > 0 ? max * 1.15 : 1;
  if (spec.integer) max = Math.max(2, Math.ceil(max));
  ctx.strokeStyle = "#dfe3ea";
  ctx.fillStyle = "#6b7385";
  ctx.font = "10px system-ui, sans-serif";
  ctx.lineWidth = 1;
  for (const frac of [0, 0.5, 1]) {
    const y = top + (h - top - bottom) * (1 - frac);
    ctx.beginPath();
    ctx.moveTo(left, y);
    ctx.lineTo(w - right, y);
    ctx.stroke();
    const v = max * frac;
    ctx.fillText(spec.percent ? (100 * v).toFixed(0) + "%" : v >= 100 ? v.toFixed(0) : v.toFixed(1), 2, y + 3);
  }
  if (pts.length < 2) {
    ctx.fillText("collecting…", left + 6, h / 2);
    return;
  }
  const t0 = pts[0].time, t1 = pts[pts.length - 1].time;
  const x = (t) => left + (w - left - right) * (t1 > t0 ? (t - t0) / (t1 - t0) : 1);
  const y = (v) => top + (h - top - bottom) * (1 - Math.min(v, max) / max);
  ctx.fillText(`${Math.round(t1 - t0)} s`, w - right - 28, h - 3);
  spec.series.forEach(([field, color], i) => {
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.6;
    ctx.beginPath();
    let pen = false;
    for (const p of pts) {
      if (p[field] == null) { pen = false; continue; }
      if (pen) ctx.lineTo(x(p.time), y(p[field])); else ctx.moveTo(x(p.time), y(p[field]));
      pen = true;
    }
    ctx.stroke();
    ctx.fillStyle = color;
    ctx.fillText(field, left + 6 + i * 90, h - 3);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  $("#login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    connect($("#admin-key").value);
  });
  $("#logout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_ITEM);
    state.key = null;
    showLogin();
  });
  const saved = sessionStorage.getItem(KEY_ITEM);
  if (saved) connect(saved); else showLogin();
});
