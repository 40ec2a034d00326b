// trio-nsqadmin's page: plain JS, no build step. It reads nsqadmin's JSON API every 2 s and keeps the
// last minutes of figures per topic and channel in memory, to draw live graphs of rates and depth.
"use strict";

const S = window.NSQADMIN || { basePath: "/" };
const BASE = S.basePath;
const POLL_MS = 2000;
const KEEP = 150; // samples kept per series: 5 minutes at one every 2 s
const series = new Map(); // key -> [{t, message_count, depth, processed}]
let timer = null;

const $ = (sel, el = document) => el.querySelector(sel);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const num = (n) => Number(n || 0).toLocaleString("en-US");
const bytes = (n) => (n >= 1 << 30 ? `${(n / (1 << 30)).toFixed(1)} GiB` : n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB`
  : n >= 1 << 10 ? `${(n / (1 << 10)).toFixed(1)} KiB` : `${num(n)} B`);
const age = (ms) => (!ms ? "—" : ms >= 3600000 ? `${(ms / 3600000).toFixed(1)} h` : ms >= 60000 ? `${(ms / 60000).toFixed(1)} min`
  : `${(ms / 1000).toFixed(1)} s`);

// trio-nsqd's delivery-to-FIN percentiles (ns): one quantile's value, or "—" without FINs (or from Go nsqd)
const dur = (ns) => (ns >= 1e9 ? `${(ns / 1e9).toFixed(1)} s` : ns >= 1e6 ? `${(ns / 1e6).toFixed(1)} ms`
  : ns >= 1e3 ? `${(ns / 1e3).toFixed(1)} µs` : `${Math.round(ns)} ns`);
function finAt(latency, q) {
  const p = latency && latency.count ? (latency.percentiles || []).find((x) => x.quantile === q) : null;
  return p ? dur(p.value) : "—";
}
const finCells = (latency) => `<td class="fins">${num(latency ? latency.count : 0)}</td>`
  + [0.5, 0.9, 0.99, 0.999].map((q) => `<td class="fin-p${String(q).slice(2)}">${finAt(latency, q)}</td>`).join("");

function status(text, error = false) {
  $("#status").innerHTML = text ? `<div class="msg${error ? " error" : ""}">${esc(text)}</div>` : "";
}

async function api(path, options = {}) {
  const response = await fetch(BASE + path.replace(/^\//, ""), options);
  let body = {};
  try { body = await response.json(); } catch (e) { /* empty body */ }
  if (!response.ok) throw new Error(body.message || `${response.status} ${response.statusText}`);
  return body;
}

function record(key, row) {
  const list = series.get(key) || [];
  list.push({ t: Date.now() / 1000, message_count: row.message_count, depth: row.depth,
              processed: row.message_count - row.depth - (row.in_flight_count || 0) });
  if (list.length > KEEP) list.shift();
  series.set(key, list);
  return list;
}

function rates(list, field) {
  const out = [];
  for (let i = 1; i < list.length; i++) {
    const dt = list[i].t - list[i - 1].t;
    out.push(dt > 0 ? Math.max(0, (list[i][field] - list[i - 1][field]) / dt) : 0);
  }
  return out;
}

function graph(title, values, unit) {
  const w = 300, h = 80, n = values.length;
  const max = Math.max(1, ...values);
  const pts = values.map((v, i) => `${n > 1 ? (i * w / (n - 1)).toFixed(1) : 0},${(h - 4 - (v / max) * (h - 8)).toFixed(1)}`);
  const area = pts.length ? `<polygon points="0,${h} ${pts.join(" ")} ${w},${h}"></polygon>` : "";
  const now = n ? values[n - 1] : 0;
  return `<div class="graph" data-graph="${esc(title)}">
    <div class="title"><span>${esc(title)}</span><span class="now">${num(Math.round(now))} ${unit}</span></div>
    <svg viewBox="0 0 ${w} ${h}" preserveAspectRatio="none">${area}<polyline points="${pts.join(" ")}"></polyline></svg>
  </div>`;
}

// falling behind: depth rising over the last 5 polls, or every consumer's RDY used up
function behind(list, row) {
  const last = list.slice(-5);
  const rising = last.length === 5 && last.every((s, i) => i === 0 || s.depth > last[i - 1].depth) && last[4].depth > 0;
  const clients = (row.nodes || []).flatMap((n) => n.clients || []);
  const rdy = clients.reduce((a, c) => a + (c.ready_count || 0), 0);
  const atMax = clients.length > 0 && row.in_flight_count > 0 && row.in_flight_count >= rdy;
  return rising || atMax;
}

const pausedTag = (p) => (p ? '<span class="tag paused">paused</span>' : "");

async function act(method, path, body, done) {
  try {
    const answer = await api(path, { method, headers: { "Content-Type": "application/json" }, body: JSON.stringify(body || {}) });
    status(`${done}${answer.message ? " — " + answer.message : ""}`);
  } catch (e) {
    status(`${done.replace(/ed$/, "")} failed: ${e.message}`, true);
  }
  refresh();
}

function buttons(kind, path, paused, label) {
  return `<div class="actions">
    <button data-act="${paused ? "unpause" : "pause"}">${paused ? "Unpause" : "Pause"} ${kind}</button>
    <button data-act="empty">Empty ${kind}</button>
    <button class="danger" data-act="delete">Delete ${kind}</button>
  </div>`;
}

// a channel's seek (trio-nsqd: its cursor moves in the topic's log; what it held is dropped)
function seekForm() {
  return `<form class="seek" data-seek>
    <label>Deliver again from <select name="to"><option value="earliest">the earliest message kept</option>
      <option value="time">a time</option><option value="latest">now (skip what is waiting)</option></select></label>
    <input name="time" type="datetime-local" step="1">
    <button type="submit" data-act-seek>Seek</button></form>`;
}

function wireSeek(path, name) {
  const form = $("form[data-seek]");
  if (!form) return;
  form.onsubmit = (e) => {
    e.preventDefault();
    let to = form.to.value;
    if (to === "time") {
      if (!form.time.value) { status("Pick a time to seek to", true); return; }
      to = String(new Date(form.time.value).getTime());
    }
    if (!confirm(`Seek ${name} to ${to}? What it holds now is dropped.`)) return;
    act("POST", path, { action: "seek", to }, `${name} sought to ${to}`);
  };
}

// a topic's or channel's settings (trio-nsqd's /topic/config, /channel/config; a Go nsqd has none): the
// form is kept across the page's redraws, so what is being typed stays; an empty field unsets
const SETTINGS = [
  ["max_depth", "Max depth", "number"], ["depth_policy", "When full", ["", "refuse", "drop-oldest"]],
  ["message_ttl", "Message TTL", "text"], ["expired_to_dead_letter", "Expired to dead letters", ["", "true", "false"]],
  ["max_attempts", "Max attempts", "number"], ["dead_letter_topic", "Dead-letter topic", "text"],
  ["mem_queue_size", "Memory queue size", "number"],
];
let settingsForm = null; // {key, el}

function settingsFormFor(key, settings, path, name) {
  if (settingsForm && settingsForm.key === key) return settingsForm.el;
  if (!settings) return null;
  const el = document.createElement("form");
  el.className = "settings";
  el.dataset.settings = key;
  const fields = SETTINGS.map(([k, label, type]) => {
    const set = settings.config[k];
    const value = set === undefined ? "" : String(set);
    const shown = esc(String(settings.effective[k]));
    const input = Array.isArray(type)
      ? `<select name="${k}">${type.map((o) => `<option value="${o}"${o === value ? " selected" : ""}>${o ? esc(o) : `(${shown})`}</option>`).join("")}</select>`
      : `<input name="${k}" ${type === "number" ? 'type="number" min="0"' : 'type="text"'} value="${esc(value)}" placeholder="${shown}">`;
    return `<label>${label} ${input}</label>`;
  });
  el.innerHTML = `<h2>Settings</h2>${fields.join("")}
    <button type="submit" data-save-settings>Save settings</button> <span class="muted">empty: the topic's or the flag's (shown)</span>`;
  el.onsubmit = (e) => {
    e.preventDefault();
    const values = {};
    for (const [k] of SETTINGS) values[k] = el.elements[k].value;
    settingsForm = null; // drawn again from what the brokers now say
    act("POST", path, { action: "config", settings: values }, `${name} settings saved`);
  };
  settingsForm = { key, el };
  return el;
}

function placeSettings(el) {
  const slot = $("#settings-slot");
  if (slot && el) slot.replaceWith(el);
}

function wire(path, name, back) {
  for (const b of document.querySelectorAll("[data-act]")) {
    b.onclick = () => {
      const a = b.dataset.act;
      if (a === "delete") {
        if (!confirm(`Delete ${name}?`)) return;
        act("DELETE", path, null, `${name} deleted`).then(() => go(back));
      } else {
        act("POST", path, { action: a }, `${name} ${a === "empty" ? "emptied" : a + "d"}`);
      }
    };
  }
}

// --- views -------------------------------------------------------------------------------------------

async function topicsView() {
  const data = await api("/api/topics");
  const rows = data.topics.map((t) => `<tr><td><a href="${BASE}topics/${encodeURIComponent(t)}" data-nav>${esc(t)}</a></td></tr>`);
  $("#view").innerHTML = `<h1>Topics</h1>
    <table><thead><tr><th>Topic</th></tr></thead><tbody>${rows.join("") || '<tr><td class="muted">no topics</td></tr>'}</tbody></table>`;
  if (data.message) status(data.message, true);
}

async function topicView(topic) {
  const t = await api(`/api/topics/${encodeURIComponent(topic)}`);
  const list = record(`t:${topic}`, t);
  const chanRows = t.channels.map((c) => {
    const cl = record(`c:${topic}:${c.channel_name}`, c);
    return `<tr data-channel="${esc(c.channel_name)}"><td><a href="${BASE}topics/${encodeURIComponent(topic)}/${encodeURIComponent(c.channel_name)}" data-nav>${esc(c.channel_name)}</a>${pausedTag(c.paused)}${behind(cl, c) ? '<span class="tag behind">falling behind</span>' : ""}</td>
      <td class="depth">${num(c.depth)}</td><td>${num(c.memory_depth)} + ${num(c.backend_depth)}</td><td>${num(c.in_flight_count)}</td>
      <td>${num(c.deferred_count)}</td><td>${num(c.requeue_count)}</td><td>${num(c.timeout_count)}</td><td>${num(c.message_count)}</td><td>${num(c.client_count)}</td>
      <td class="lag">${num(c.lag_messages)}</td><td class="age">${age(c.oldest_unfinished_age_ms)}</td>
      <td class="fin">${finAt(c.delivery_to_fin_latency, 0.5)} / ${finAt(c.delivery_to_fin_latency, 0.99)}</td></tr>`;
  });
  const nodeRows = t.nodes.map((n) => `<tr><td>${esc(n.node)}${pausedTag(n.paused)}</td><td>${num(n.depth)}</td><td>${num(n.memory_depth)} + ${num(n.backend_depth)}</td><td>${num(n.message_count)}</td><td>${n.channels.length}</td>
    <td class="log">${num(n.log_messages)} / ${bytes(n.log_bytes)}</td><td class="muted">${num(n.log_first_position)} – ${num(n.log_end_position)}</td></tr>`);
  const channelGraphs = t.channels.map((c) => graph(`${c.channel_name}: delivered /s`, rates(series.get(`c:${topic}:${c.channel_name}`), "processed"), "msg/s"));
  $("#view").innerHTML = `<h1>Topic <span data-topic>${esc(topic)}</span>${pausedTag(t.paused)}</h1>
    ${buttons("topic", `/api/topics/${encodeURIComponent(topic)}`, t.paused)}
    <div class="graphs">${graph("published /s", rates(list, "message_count"), "msg/s")}${graph("depth", list.map((s) => s.depth), "msgs")}${channelGraphs.join("")}</div>
    <h2>Nodes</h2>
    <table><thead><tr><th>Node</th><th>Depth</th><th>Memory + Disk</th><th>Messages</th><th>Channels</th><th>Log (messages / bytes)</th><th>Log positions</th></tr></thead>
      <tbody><tr class="total"><td>Total</td><td>${num(t.depth)}</td><td>${num(t.memory_depth)} + ${num(t.backend_depth)}</td><td>${num(t.message_count)}</td><td>${t.channels.length}</td><td class="log">${num(t.log_messages)} / ${bytes(t.log_bytes)}</td><td></td></tr>${nodeRows.join("")}</tbody></table>
    ${replicationTable(t.replication)}
    <div id="settings-slot"></div>
    <h2>Channels</h2>
    <table><thead><tr><th>Channel</th><th>Depth</th><th>Memory + Disk</th><th>In flight</th><th>Deferred</th><th>Requeued</th><th>Timed out</th><th>Messages</th><th>Clients</th><th>Lag</th><th>Oldest unfinished</th><th title="delivery to FIN over the last 5-10 minutes">Delivery→FIN p50 / p99</th></tr></thead>
      <tbody>${chanRows.join("") || '<tr><td class="muted" colspan="12">no channels</td></tr>'}</tbody></table>`;
  wire(`/api/topics/${encodeURIComponent(topic)}`, `topic ${topic}`, "");
  placeSettings(settingsFormFor(`t:${topic}`, t.settings, `/api/topics/${encodeURIComponent(topic)}`, `topic ${topic}`));
  if (t.message) status(t.message, true);
}

// a replicated topic (trio-nsqd with --etcd-endpoints: docs/cluster.md): its replicas, which leads, the epoch,
// the in-sync replicas and the high watermark (no channel delivers past it), each replica as it reports itself
function replicationTable(r) {
  if (!r) return "";
  const rows = r.replicas.map((x) => `<tr data-replica="${esc(x.id)}"><td>${esc(x.id)}${x.leader ? '<span class="tag up">leader</span>' : ""}${x.reachable ? "" : '<span class="tag down">unreachable</span>'}</td>
    <td class="role">${esc(x.role || "—")}</td><td class="in-isr">${x.in_isr ? "yes" : '<span class="tag behind">no</span>'}</td>
    <td>${x.reachable ? num(x.epoch) : "—"}</td><td class="hwm">${x.reachable ? num(x.high_watermark) : "—"}</td><td>${x.reachable ? num(x.log_end) : "—"}</td></tr>`);
  const short = r.isr.length < r.min_isr;
  return `<h2>Replication</h2>
    <p data-replication>leader <b data-leader>${esc(r.leader || "none")}</b>, epoch <b data-epoch>${num(r.epoch)}</b>,
      in sync <b data-isr>${r.isr.map(esc).join(", ") || "none"}</b> (at least ${num(r.min_isr)} for a publish${short ? ': <span class="tag behind">publishes refused</span>' : ""}),
      high watermark <b data-hwm>${num(r.high_watermark)}</b> of ${num(r.log_end)}</p>
    <table data-replicas><thead><tr><th>Replica</th><th>Role</th><th>In sync</th><th>Epoch</th><th title="what no channel delivers past">High watermark</th><th>Log end</th></tr></thead>
      <tbody>${rows.join("")}</tbody></table>`;
}

// a look at a channel's messages (trio-nsqd's /channel/messages): which, since when, until when
const MESSAGE_STATES = [["in_flight", "In flight"], ["deferred", "Deferred"], ["queued", "Queued"]];
let messagesState = "in_flight";

function messagesTable(m) {
  if (!m) return "";
  const nowMs = Date.now();
  const when = (row) => (row.deadline !== undefined
    ? `${row.deadline / 1e6 >= nowMs ? "in" : "past"} ${age(Math.abs(row.deadline / 1e6 - nowMs))}`
    : `${age(row.age_ms)} old`);
  const rows = m.messages.map((row) => `<tr><td>${esc(row.id)}</td><td>${esc(row.node)}</td><td>${num(row.attempts)}</td>
    <td>${esc(when(row))}</td><td class="body">${esc(row.body_preview)}${row.body_size > 64 ? "…" : ""}</td></tr>`);
  return `<h2>Messages</h2>
    <div class="actions" data-message-states>${MESSAGE_STATES.map(([k, label]) => `<button data-state="${k}"${k === m.state ? ' class="on"' : ""}>${label}</button>`).join("")}
      <span class="muted">${num(m.count)} ${m.state.replace("_", " ")}${m.messages.length < m.count ? `, the first ${m.messages.length} shown` : ""}</span></div>
    <table data-messages><thead><tr><th>Id</th><th>Node</th><th>Attempts</th><th>${m.state === "in_flight" ? "Times out" : m.state === "deferred" ? "Due" : "Age"}</th><th>Body</th></tr></thead>
      <tbody>${rows.join("") || '<tr><td class="muted" colspan="5">none</td></tr>'}</tbody></table>`;
}

async function channelView(topic, channel) {
  const c = await api(`/api/topics/${encodeURIComponent(topic)}/${encodeURIComponent(channel)}`);
  // only where a broker has settings (trio-nsqd): a Go nsqd has no listing either
  const m = c.settings ? await api(`/api/topics/${encodeURIComponent(topic)}/${encodeURIComponent(channel)}/messages?state=${messagesState}&limit=20`).catch(() => null) : null;
  const before = $("form[data-seek]");  // the page is drawn again every poll: keep what was chosen
  const chosen = before ? { to: before.to.value, time: before.time.value } : null;
  const list = record(`c:${topic}:${channel}`, c);
  const clients = c.nodes.flatMap((n) => n.clients || []);
  const clientRows = clients.map((k) => `<tr><td>${esc(k.hostname)} <span class="muted">${esc(k.remote_address)}</span></td><td>${esc(k.node)}</td><td>${esc(k.user_agent)}</td>
    <td>${num(k.ready_count)}</td><td>${num(k.in_flight_count)}</td><td>${num(k.finish_count)}</td><td>${num(k.requeue_count)}</td><td>${num(k.message_count)}</td></tr>`);
  const nodeRows = c.nodes.map((n) => `<tr><td>${esc(n.node)}${pausedTag(n.paused)}</td><td>${num(n.depth)}</td><td>${num(n.in_flight_count)}</td><td>${num(n.deferred_count)}</td><td>${num(n.requeue_count)}</td><td>${num(n.timeout_count)}</td><td>${num(n.message_count)}</td><td>${num(n.client_count)}</td><td>${num(n.lag_messages)}</td><td>${age(n.oldest_unfinished_age_ms)}</td>${finCells(n.delivery_to_fin_latency)}</tr>`);
  $("#view").innerHTML = `<h1><a href="${BASE}topics/${encodeURIComponent(topic)}" data-nav>${esc(topic)}</a> / <span data-channel-name>${esc(channel)}</span>${pausedTag(c.paused)}${behind(list, c) ? '<span class="tag behind">falling behind</span>' : ""}</h1>
    ${buttons("channel", `/api/topics/${encodeURIComponent(topic)}/${encodeURIComponent(channel)}`, c.paused)}
    ${seekForm()}
    <div class="graphs">${graph("delivered /s", rates(list, "processed"), "msg/s")}${graph("depth", list.map((s) => s.depth), "msgs")}</div>
    <h2>Nodes</h2>
    <table><thead><tr><th>Node</th><th>Depth</th><th>In flight</th><th>Deferred</th><th>Requeued</th><th>Timed out</th><th>Messages</th><th>Clients</th><th>Lag</th><th>Oldest unfinished</th><th title="FINs over the last 5-10 minutes">FINs</th><th title="delivery to FIN">p50</th><th>p90</th><th>p99</th><th>p99.9</th></tr></thead>
      <tbody><tr class="total"><td>Total</td><td class="depth">${num(c.depth)}</td><td>${num(c.in_flight_count)}</td><td>${num(c.deferred_count)}</td><td>${num(c.requeue_count)}</td><td>${num(c.timeout_count)}</td><td>${num(c.message_count)}</td><td>${num(c.client_count)}</td><td class="lag">${num(c.lag_messages)}</td><td class="age">${age(c.oldest_unfinished_age_ms)}</td>${finCells(c.delivery_to_fin_latency)}</tr>${nodeRows.join("")}</tbody></table>
    <p class="muted">Delivery→FIN: how long consumers took from delivery to FIN over the last 5-10 minutes (the total: each percentile's worst node).</p>
    <h2>Dead letters and limits</h2>
    <table data-dead-letters><thead><tr><th>Node</th><th>Dead-lettered</th><th>Expired</th><th>Refused</th><th>Dropped</th></tr></thead>
      <tbody><tr class="total"><td>Total</td><td class="dead">${num(c.dead_lettered_count)}</td><td class="expired">${num(c.expired_count)}</td><td class="refused">${num(c.refused_count)}</td><td class="dropped">${num(c.dropped_count)}</td></tr>${c.nodes.map((n) => `<tr><td>${esc(n.node)}</td><td>${num(n.dead_lettered_count)}</td><td>${num(n.expired_count)}</td><td>${num(n.refused_count)}</td><td>${num(n.dropped_count)}</td></tr>`).join("")}</tbody></table>
    ${c.settings ? `<div class="actions"><button data-redrive>Re-drive dead letters</button> <span class="muted">from ${esc(c.settings.effective.dead_letter_topic || "(no dead-letter topic)")}</span></div>` : ""}
    <div id="settings-slot"></div>
    ${messagesTable(m)}
    <h2>Clients</h2>
    <table><thead><tr><th>Client</th><th>Node</th><th>User agent</th><th>RDY</th><th>In flight</th><th>Finished</th><th>Requeued</th><th>Messages</th></tr></thead>
      <tbody>${clientRows.join("") || '<tr><td class="muted" colspan="8">no clients</td></tr>'}</tbody></table>`;
  wire(`/api/topics/${encodeURIComponent(topic)}/${encodeURIComponent(channel)}`, `channel ${topic}/${channel}`, `topics/${encodeURIComponent(topic)}`);
  wireSeek(`/api/topics/${encodeURIComponent(topic)}/${encodeURIComponent(channel)}`, `channel ${topic}/${channel}`);
  const channelPath = `/api/topics/${encodeURIComponent(topic)}/${encodeURIComponent(channel)}`;
  placeSettings(settingsFormFor(`c:${topic}:${channel}`, c.settings, channelPath, `channel ${topic}/${channel}`));
  for (const b of document.querySelectorAll("[data-message-states] button")) {
    b.onclick = () => { messagesState = b.dataset.state; refresh(); };
  }
  const redrive = $("[data-redrive]");
  if (redrive) {
    redrive.onclick = async () => {
      try {
        const answer = await api(channelPath, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ action: "redrive" }) });
        status(`re-drove ${num(answer.moved)} messages into ${topic}/${channel}${answer.message ? " — " + answer.message : ""}`);
      } catch (e) {
        status(`re-drive failed: ${e.message}`, true);
      }
      refresh();
    };
  }
  if (chosen) { const form = $("form[data-seek]"); form.to.value = chosen.to; form.time.value = chosen.time; }
  if (c.message) status(c.message, true);
}

async function nodesView() {
  const data = await api("/api/nodes");
  const checks = await Promise.all(data.nodes.map((n) =>
    api(`/api/nodes/${encodeURIComponent(n.broadcast_address + ":" + n.http_port)}`).then((r) => !r.message, () => false)));
  const rows = data.nodes.map((n, i) => `<tr data-node="${esc(n.broadcast_address)}:${n.http_port}"><td>${esc(n.hostname)} <span class="muted">${esc(n.broadcast_address)}:${n.http_port}</span>
      ${checks[i] ? '<span class="tag up">up</span>' : '<span class="tag down">not answering</span>'}</td>
      <td>${esc(n.version)}</td><td>${n.tcp_port}</td><td>${n.topics.length}</td></tr>`);
  $("#view").innerHTML = `<h1>Nodes</h1>
    <table><thead><tr><th>Node</th><th>Version</th><th>TCP port</th><th>Topics</th></tr></thead><tbody>${rows.join("") || '<tr><td class="muted" colspan="4">no nodes</td></tr>'}</tbody></table>`;
  if (data.message) status(data.message, true);
}

async function counterView() {
  const data = await api("/api/counter");
  const total = Object.values(data.stats).reduce((a, s) => a + s.message_count, 0);
  const list = record("counter", { message_count: total, depth: 0 });
  $("#view").innerHTML = `<h1>Messages processed</h1><p class="now" style="font-size:40px;margin:8px 0">${num(total)}</p>
    <div class="graphs">${graph("messages /s", rates(list, "message_count"), "msg/s")}</div>`;
}

// --- routing -------------------------------------------------------------------------------------------

function route() {
  const path = decodeURI(location.pathname.slice(BASE.length - 1));
  const parts = path.split("/").filter(Boolean);
  if (parts[0] === "topics" && parts.length === 2) return () => topicView(parts[1]);
  if (parts[0] === "topics" && parts.length === 3) return () => channelView(parts[1], parts[2]);
  if (parts[0] === "nodes") return nodesView;
  if (parts[0] === "counter") return counterView;
  return topicsView;
}

async function refresh() {
  clearTimeout(timer);
  try {
    await route()();
    $("#live").textContent = "live";
  } catch (e) {
    status(e.message, true);
  }
  timer = setTimeout(refresh, POLL_MS);
}

function go(path) {
  history.pushState(null, "", BASE + path.replace(/^\//, ""));
  status("");
  refresh();
}

document.addEventListener("click", (e) => {
  const a = e.target.closest("a[data-nav]");
  if (a && !e.metaKey && !e.ctrlKey) { e.preventDefault(); go(a.getAttribute("href").slice(BASE.length)); }
});
window.addEventListener("popstate", refresh);
refresh();
