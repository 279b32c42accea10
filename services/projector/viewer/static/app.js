// Rollwire trajectory viewer: runs -> a run's rollouts -> one rollout's timeline.
// Plain DOM, no build step. Agent output is untrusted: every string goes in through textContent.
"use strict";

const TOKEN_KEY = "rollwire.adminToken";
const POLL_MS = 2000;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const RELATIVE = new Set(["long", "many-samples"]);
const state = { token: localStorage.getItem(TOKEN_KEY) || "", timer: null, generation: 0, meanings: {} };

// ---- small helpers ------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

// replaceChildren without the nulls that conditional children leave behind.
function put(el, ...children) {
  el.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
}

const fmt = {
  int: (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString()),
  num: (n, d = 2) => (n === null || n === undefined ? "–" : Number(n).toFixed(d)),
  tokens: (n) => (n === null || n === undefined ? "–" : n >= 10000 ? `${(n / 1000).toFixed(1)}k` : String(n)),
  dur: (s) => {
    if (s === null || s === undefined) return "–";
    if (s < 60) return `${s.toFixed(1)} s`;
    if (s < 3600) return `${Math.floor(s / 60)} m ${Math.round(s % 60)} s`;
    return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} m`;
  },
  ago: (t) => (t ? `${fmt.dur(Math.max(0, Date.now() / 1000 - t))} ago` : "–"),
  time: (t) => new Date(t * 1000).toLocaleTimeString(),
};

function enc(part) { return encodeURIComponent(part); }

function pill(status) { return h("span", { class: `pill ${status}`, text: status }); }

function chip(flag) {
  const name = flag.split(":")[0];
  const meaning = state.meanings[name] || "";
  const detail = flag.includes(":") ? flag.slice(flag.indexOf(":") + 1).trim() : "";
  const cls = RELATIVE.has(name) ? "chip relative" : "chip";
  return h("span", { class: cls, text: name, title: [meaning, detail].filter(Boolean).join(" — ") });
}

// Continuous prompt mode: "extended" (an earlier call's prompt + sampled ids, verbatim) or "fresh: <why>".
function continuityChip(value) {
  if (!value) return null;
  const fresh = value.startsWith("fresh");
  const title = fresh ? "continuous prompt mode: rendered from the messages, a new chain of ids starts"
    : "continuous prompt mode: an earlier call's prompt and sampled ids, then the new turns";
  return h("span", { class: `chip continuity ${fresh ? "relative" : "info"}`, title: `${value} — ${title}`,
    text: value.length > 80 ? `${value.slice(0, 79)}…` : value });
}

function clipped(text, limit = 1200) {
  const body = h("pre", { text });
  if (text.length <= limit) return body;
  const box = h("div", { class: "clip" }, body);
  const toggle = h("button", { class: "toggle", type: "button", text: `show all (${text.length.toLocaleString()} chars)` });
  toggle.addEventListener("click", () => {
    box.classList.toggle("open");
    toggle.textContent = box.classList.contains("open") ? "show less" : `show all (${text.length.toLocaleString()} chars)`;
  });
  return h("div", {}, box, toggle);
}

function pretty(value) {
  if (typeof value === "string") {
    try { return JSON.stringify(JSON.parse(value), null, 2); } catch { return value; }
  }
  return JSON.stringify(value, null, 2);
}

// Low-probability tokens are shaded red: alpha grows with -logprob (p = 1 is clear, p < 1% is solid).
function shade(logprob) {
  if (logprob === null || logprob === undefined) return "transparent";
  const alpha = Math.min(0.85, Math.max(0, -logprob) / 4.6 * 0.85);
  return `rgba(214, 69, 69, ${alpha.toFixed(3)})`;
}

// ---- data ---------------------------------------------------------------------------------

class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path) {
  const headers = state.token ? { Authorization: `Bearer ${state.token}` } : {};
  const response = await fetch(`api${path}`, { headers });
  let body = null;
  try { body = await response.json(); } catch { body = null; }
  if (!response.ok) throw new HttpError(response.status, (body && body.error) || response.statusText);
  if (body && body.meanings) Object.assign(state.meanings, body.meanings);
  return body;
}

function askToken() {
  const dialog = document.getElementById("token-dialog");
  const input = document.getElementById("token-input");
  input.value = "";
  dialog.returnValue = "";
  dialog.showModal();
  dialog.addEventListener("close", () => {
    if (dialog.returnValue === "ok" && input.value.trim()) {
      state.token = input.value.trim();
      localStorage.setItem(TOKEN_KEY, state.token);
      route();
    }
  }, { once: true });
}

function showError(error) {
  const view = document.getElementById("view");
  put(view, h("div", { class: "error" },
    error.status === 401 ? "The viewer needs the admin token. " : "",
    error.status === 503 ? "The read models are unavailable: " : "",
    error.message,
    error.status === 401 ? h("button", { class: "ghost", type: "button", onclick: askToken, text: " enter token" }) : null));
  if (error.status === 401 && !document.getElementById("token-dialog").open) askToken();
}

function crumbs(...parts) {
  const nav = document.getElementById("crumbs");
  put(nav, ...parts.flatMap((part, i) => [
    i ? h("span", { class: "sep", text: "/" }) : null,
    part.href ? h("a", { href: part.href, text: part.text, title: part.text }) : h("span", { text: part.text, title: part.text }),
  ]));
}

function setLive(on) { document.getElementById("live").hidden = !on; }

function poll(fn) {
  clearInterval(state.timer);
  state.timer = setInterval(fn, POLL_MS);
}

// ---- runs -------------------------------------------------------------------------------

async function renderRuns(generation) {
  crumbs({ text: "Runs" });
  const data = await api("/runs");
  if (generation !== state.generation) return;
  const view = document.getElementById("view");
  if (!data.runs.length) {
    view.replaceChildren(h("div", { class: "empty", text: "No runs yet. Start one with POST /api/runs, or create rollouts." }));
    return;
  }
  const rows = data.runs.map((run) => h("tr", { onclick: () => { location.hash = `#/run/${enc(run.run_id)}`; } },
    h("td", {}, h("b", { text: run.run_id }), run.live ? h("span", { class: "chip info", text: "live", title: "events in the last minute" }) : null,
      run.name ? h("div", { class: "muted", text: run.name }) : null),
    h("td", {}, h("div", { class: "pills" }, Object.entries(run.by_status).map(([s, n]) => h("span", { class: `pill ${s}`, text: `${n} ${s}` })))),
    h("td", { class: "num", text: fmt.int(run.rollouts) }),
    h("td", { class: "num", text: fmt.num(run.reward_mean, 3) }),
    h("td", { class: "num", text: fmt.num(run.calls_per_rollout, 1) }),
    h("td", { class: "num", text: fmt.tokens(run.tokens_per_rollout && Math.round(run.tokens_per_rollout)) }),
    h("td", { class: "num" }, run.flagged ? h("span", { class: "chip", text: String(run.flagged) }) : "0"),
    h("td", { text: run.phase ? `${run.phase}${run.weights_version !== null ? ` · v${run.weights_version}` : ""}` : "–" }),
    h("td", { class: "muted", text: fmt.ago(run.last_event_at) }),
  ));
  view.replaceChildren(
    h("h1", { text: "Runs" }),
    h("p", { class: "muted", text: `Projection applied up to stream seq ${data.applied_seq}.` }),
    h("table", {},
      h("thead", {}, h("tr", {}, ["Run", "Rollouts by status", "Rollouts", "Reward mean", "Calls / rollout", "Tokens / rollout", "Flagged", "Phase", "Last event"]
        .map((t, i) => h("th", { class: i >= 2 && i <= 6 ? "num" : "", text: t })))),
      h("tbody", {}, rows)));
  setLive(data.runs.some((run) => run.live));
}

// ---- one run's rollouts -----------------------------------------------------------------

const COLUMNS = [
  ["Rollout", "created"], ["Group", null], ["Status", "status"], ["Reward", "reward", true], ["Attempts", "attempts", true],
  ["Calls", "calls", true], ["Samples", "samples", true], ["Tokens", "tokens", true], ["Duration", "duration", true], ["Flags", "flags"],
];

function runFilters(run) {
  const key = `rollwire.filters.${run}`;
  const saved = JSON.parse(sessionStorage.getItem(key) || "{}");
  return { sort: "created", desc: false, status: "", flagged: false, q: "", limit: 200, ...saved, save() {
    const { save, ...rest } = this; sessionStorage.setItem(key, JSON.stringify(rest));
  } };
}

async function renderRun(run, generation) {
  crumbs({ text: "Runs", href: "#/" }, { text: run });
  const filters = runFilters(run);
  const view = document.getElementById("view");
  const table = h("div", {});
  const cards = h("div", { class: "cards" });
  const status = h("select", { "aria-label": "status" }, ["", ...["queuing", "preparing", "running", "requeuing", "succeeded", "failed", "cancelled"]]
    .map((s) => h("option", { value: s, text: s || "any status" })));
  status.value = filters.status;
  const flagged = h("input", { type: "checkbox", id: "flagged-only" });
  flagged.checked = filters.flagged;
  const search = h("input", { type: "search", placeholder: "rollout or group id", value: filters.q });
  const refresh = () => { filters.save(); load(true); };
  status.addEventListener("change", () => { filters.status = status.value; refresh(); });
  flagged.addEventListener("change", () => { filters.flagged = flagged.checked; refresh(); });
  let debounce = null;
  search.addEventListener("input", () => { clearTimeout(debounce); debounce = setTimeout(() => { filters.q = search.value; refresh(); }, 250); });
  view.replaceChildren(h("h1", { text: `Run ${run}` }), cards,
    h("div", { class: "toolbar" }, status, h("label", { for: "flagged-only" }, flagged, "flagged or unusually long only"), search,
      h("span", { class: "legend" }, "red rows: a rule flagged a call; orange: long for this run")),
    table);

  async function loadSummary() {
    const data = await api("/runs");
    const summary = data.runs.find((r) => r.run_id === run);
    if (!summary || generation !== state.generation) return summary;
    const done = (summary.by_status.succeeded || 0);
    const ended = done + (summary.by_status.failed || 0) + (summary.by_status.cancelled || 0);
    cards.replaceChildren(
      h("div", { class: "card" }, h("b", { text: fmt.int(summary.rollouts) }), h("span", { text: "rollouts" })),
      h("div", { class: "card" }, h("b", { text: ended ? `${Math.round((100 * done) / ended)}%` : "–" }), h("span", { text: "succeeded of ended" })),
      h("div", { class: "card" }, h("b", { text: fmt.num(summary.reward_mean, 3) }), h("span", { text: `reward mean (${summary.rewarded} rewarded)` })),
      h("div", { class: "card" }, h("b", { text: fmt.num(summary.calls_per_rollout, 1) }), h("span", { text: "calls / rollout" })),
      h("div", { class: "card" }, h("b", { text: fmt.tokens(summary.prompt_tokens + summary.response_tokens) }), h("span", { text: "tokens (prompt + response)" })),
      h("div", { class: "card" }, h("b", { text: fmt.int(summary.flagged) }), h("span", { text: "rollouts with flags" })),
      h("div", { class: "card" }, h("b", { text: fmt.dur(summary.duration_mean_s) }), h("span", { text: "mean duration" })),
    );
    return summary;
  }

  async function load() {
    const params = new URLSearchParams({ sort: filters.sort, desc: filters.desc ? "1" : "0", limit: String(filters.limit) });
    if (filters.status) params.set("status", filters.status);
    if (filters.flagged) params.set("flagged", "1");
    if (filters.q) params.set("q", filters.q);
    const [data, summary] = await Promise.all([api(`/runs/${enc(run)}/rollouts?${params}`), loadSummary()]);
    if (generation !== state.generation) return;
    const head = h("tr", {}, COLUMNS.map(([title, sort, num]) => {
      const th = h("th", { class: [sort ? "sortable" : "", num ? "num" : "", filters.sort === sort ? "sorted" : "", filters.sort === sort && filters.desc ? "desc" : ""].join(" "), text: title });
      if (sort) th.addEventListener("click", () => {
        filters.desc = filters.sort === sort ? !filters.desc : Boolean(num);
        filters.sort = sort;
        refresh();
      });
      return th;
    }));
    const body = data.rollouts.map((r) => h("tr", {
      class: r.flags.some((f) => !RELATIVE.has(f)) ? "flagged" : r.flags.length ? "long" : "",
      onclick: () => { location.hash = `#/run/${enc(run)}/rollout/${enc(r.rollout_id)}`; },
    },
      h("td", { class: "mono", text: r.rollout_id }),
      h("td", { class: "mono muted", text: r.group_id || "–" }),
      h("td", {}, pill(r.status)),
      h("td", { class: "num", text: fmt.num(r.reward, 2) }),
      h("td", { class: "num", text: fmt.int(r.attempts) }),
      h("td", { class: "num" }, fmt.int(r.calls), r.failed_calls ? h("span", { class: "muted", text: ` (${r.failed_calls} failed)` }) : null),
      h("td", { class: "num", text: fmt.int(r.samples) }),
      h("td", { class: "num", text: fmt.tokens(r.prompt_tokens + r.response_tokens), title: `${r.prompt_tokens} prompt + ${r.response_tokens} response` }),
      h("td", { class: "num", text: fmt.dur(r.duration_s) }),
      h("td", {}, r.flags.map(chip)),
    ));
    const note = h("p", { class: "muted", text: `${data.matching} of ${data.total} rollouts · median ${fmt.num(data.median_calls, 1)} calls, ${fmt.tokens(Math.round(data.median_tokens))} tokens` });
    const more = data.matching > data.rollouts.length
      ? h("button", { class: "ghost more", type: "button", text: `show ${Math.min(200, data.matching - data.rollouts.length)} more`, onclick: () => { filters.limit += 200; refresh(); } })
      : null;
    put(table, note, data.rollouts.length ? h("table", { id: "rollouts" }, h("thead", {}, head), h("tbody", {}, body))
      : h("div", { class: "empty", text: "No rollout matches." }), more);
    const live = summary && summary.live;
    setLive(Boolean(live));
  }

  await load();
  poll(() => { if (generation === state.generation && !document.hidden) load().catch(() => {}); });
}

// ---- one rollout --------------------------------------------------------------------------

function messageBlock(message) {
  return h("div", { class: `msg ${message.role || ""}` },
    h("div", { class: "role", text: message.role + (message.name ? ` · ${message.name}` : "") }),
    clipped(message.content || ""));
}

function responseBlock(ev) {
  const box = h("div", { class: "response" });
  if (ev.response_pieces && ev.response_pieces.length) {
    const pre = h("pre", {});
    ev.response_pieces.forEach((piece, i) => {
      const lp = ev.logprobs[i];
      pre.append(h("span", { class: "tok", style: `background:${shade(lp)}`,
        title: `id ${ev.response_ids[i]} · logprob ${lp === null || lp === undefined ? "?" : lp.toFixed(3)} · p ${lp === null || lp === undefined ? "?" : Math.exp(lp).toFixed(3)}`,
        text: piece }));
    });
    box.append(pre);
  } else {
    if (ev.response_text) box.append(clipped(ev.response_text, 2000));
    if (ev.logprobs && ev.logprobs.length) {
      box.append(h("div", { class: "strip", title: "response tokens, shaded by logprob (no tokenizer known: ids only)" },
        ev.logprobs.map((lp, i) => h("i", { style: `background:${lp === null ? "#ccc" : shade(lp)};outline:1px solid #e6e6e6`, title: `token ${i}: id ${ev.response_ids[i]} · logprob ${lp === null ? "?" : lp.toFixed(3)}` }))));
    }
  }
  const ruleFlags = ev.flags.filter((f) => !f.startsWith("truncated") && !f.startsWith("failed-call"));
  for (const tool of ev.tool_calls) {
    box.append(h("div", { class: `tool-call ${ruleFlags.length ? "flagged" : ""}` },
      h("b", { text: `${tool.name || "tool"}(…)` }), clipped(pretty(tool.arguments || ""), 800)));
  }
  return box;
}

async function fullPrompt(seq, into) {
  const call = await api(`/calls/${seq}`);
  const messages = (call.request && Array.isArray(call.request.messages)) ? call.request.messages : [];
  put(into,
    call.prompt_text !== null ? h("div", { class: "msg" }, h("div", { class: "role", text: `prompt as the model read it (${call.prompt_ids.length} tokens)` }), clipped(call.prompt_text, 4000)) : null,
    ...messages.map((m) => messageBlock({ role: m.role, name: m.name, content: typeof m.content === "string" ? m.content : pretty(m.content) })));
}

function eventCard(ev, index) {
  switch (ev.type) {
    case "model_request": {
      const failed = ev.status !== "ok";
      const ruleFlags = ev.flags.filter((f) => !f.startsWith("truncated") && !f.startsWith("failed-call"));
      const prompt = h("div", {});
      const hidden = ev.messages_total - ev.new_messages.length;
      const card = h("div", { class: `ev ${failed ? "failed" : ""} ${ruleFlags.length ? "flagged" : ""}`, "data-seq": ev.seq },
        h("div", { class: "ev-head" },
          h("span", { class: "kind", text: `Call ${index}` }),
          h("span", { class: "meta", text: [ev.model, `${fmt.tokens(ev.prompt_tokens)} → ${fmt.tokens(ev.response_tokens)} tokens`, `${fmt.num(ev.latency_s, 2)} s`, ev.finish_reason && `finish ${ev.finish_reason}`, ev.weights_version !== null && `weights v${ev.weights_version}`].filter(Boolean).join(" · ") }),
          ev.new_sample && index > 1 ? h("span", { class: "chip relative", text: "new sample", title: "this call does not extend the conversation so far: the trainer starts a new sample here" }) : null,
          continuityChip(ev.continuity),
          failed ? h("span", { class: "pill failed", text: ev.status }) : null,
          ev.flags.map(chip),
          h("span", { class: "seq", text: `seq ${ev.seq} · ${fmt.time(ev.time)}` })),
        failed && ev.error ? h("div", { class: "error", text: ev.error }) : null,
        hidden > 0 ? h("div", { class: "muted" }, `${hidden} earlier message${hidden === 1 ? "" : "s"} of this prompt not shown · `,
          h("button", { class: "toggle", type: "button", text: "full prompt", onclick: () => fullPrompt(ev.seq, prompt).catch(showError) })) : null,
        prompt,
        responseBlock(ev));
      prompt.append(...ev.new_messages.map(messageBlock));
      return card;
    }
    case "reward":
      return h("div", { class: "ev reward" }, h("div", { class: "ev-head" },
        h("span", { class: "kind", text: `Reward ${fmt.num(ev.value, 3)}` }),
        h("span", { class: "meta", text: [ev.name, ev.source && `from ${ev.source}`, ev.step !== null && ev.step !== undefined && `step ${ev.step}`, ev.attempt_id && `attempt ${ev.attempt_id}`].filter(Boolean).join(" · ") }),
        h("span", { class: "seq", text: `seq ${ev.seq} · ${fmt.time(ev.time)}` })));
    case "custom":
      return h("div", { class: `ev ${ev.name.startsWith("flag") ? "flagged" : ""}` }, h("div", { class: "ev-head" },
        h("span", { class: "kind", text: ev.name }), h("span", { class: "meta", text: "custom event" }),
        h("span", { class: "seq", text: `seq ${ev.seq} · ${fmt.time(ev.time)}` })),
        clipped(pretty(ev.payload), 600));
    case "rollout.status": {
      const bad = ev.status === "failed" || ev.status === "cancelled";
      return h("div", { class: `ev line ${bad ? "" : ""}` }, h("span", { class: "dot", style: `background:var(--${ev.status === "succeeded" ? "ok" : bad ? "bad" : ev.status === "running" ? "run" : "wait"})` }),
        h("b", { text: ev.status }), ev.attempt_id ? ` · attempt ${ev.attempt_id}` : "",
        ev.reason ? h("span", { style: bad ? "color:var(--bad)" : "", text: ` — ${ev.reason}` }) : "",
        h("span", { class: "muted", text: `  ${fmt.time(ev.time)}` }));
    }
    case "attempt.started":
      return h("div", { class: "ev line" }, h("span", { class: "dot" }), `attempt ${ev.attempt_id} (#${ev.sequence}) started`,
        ev.executor ? ` on ${ev.executor}` : "", h("span", { class: "muted", text: `  ${fmt.time(ev.time)}` }));
    case "rollout.created":
      return h("div", { class: "ev line" }, h("span", { class: "dot" }), "created", ev.group_id ? ` in group ${ev.group_id}` : "",
        h("span", { class: "muted", text: `  ${fmt.time(ev.time)}` }));
    default:
      return h("div", { class: "ev line", text: `${ev.type} · seq ${ev.seq}` });
  }
}

function sidePanel(r) {
  const end = r.ended_at || Date.now() / 1000;
  return h("div", { class: "side" },
    h("div", { class: "card" },
      h("div", { class: "ev-head" }, pill(r.status), h("b", { text: `reward ${fmt.num(r.reward, 3)}` })),
      r.reason ? h("p", { class: TERMINAL.has(r.status) && r.status !== "succeeded" ? "error" : "muted", text: r.reason }) : null,
      h("dl", { class: "kv" },
        h("dt", { text: "group" }), h("dd", { class: "mono", text: r.group_id || "–" }),
        h("dt", { text: "mode" }), h("dd", { text: r.mode }),
        h("dt", { text: "calls" }), h("dd", { text: `${r.calls}${r.failed_calls ? ` (${r.failed_calls} failed)` : ""}` }),
        h("dt", { text: "samples" }), h("dd", { text: String(r.samples) }),
        h("dt", { text: "tokens" }), h("dd", { text: `${r.prompt_tokens.toLocaleString()} prompt · ${r.response_tokens.toLocaleString()} response` }),
        h("dt", { text: "duration" }), h("dd", { text: fmt.dur(end - r.created_at) }),
        h("dt", { text: "created" }), h("dd", { text: new Date(r.created_at * 1000).toLocaleString() })),
      r.flags.length ? h("div", {}, h("h2", { text: "Flags" }), r.flags.map((f) => h("div", {}, chip(f), h("span", { class: "muted", text: ` ${state.meanings[f] || ""}` })))) : null),
    h("div", { class: "card" }, h("h2", { text: `Attempts (${r.attempts.length} of max ${r.max_attempts})` }),
      r.attempts.length ? r.attempts.map((a) => h("div", { class: "kv" },
        h("dt", { class: "mono", text: a.attempt_id }),
        h("dd", { text: `#${a.sequence}${a.ended ? " · ended" : " · current"} · ${a.calls ?? 0} calls · reward ${fmt.num(a.reward, 2)}` })))
        : h("span", { class: "muted", text: "none yet" })),
    h("div", { class: "card" }, h("h2", { text: "Input" }), clipped(pretty(r.input), 500)),
    h("span", { class: "legend" }, "response tokens:", h("i"), "low probability"));
}

async function renderRollout(run, rollout, generation) {
  crumbs({ text: "Runs", href: "#/" }, { text: run, href: `#/run/${enc(run)}` }, { text: rollout });
  const base = `/runs/${enc(run)}/rollouts/${enc(rollout)}`;
  const [detail, timeline] = await Promise.all([api(base), api(`${base}/timeline`)]);
  if (generation !== state.generation) return;
  const view = document.getElementById("view");
  const list = h("div", { class: "timeline", id: "timeline" });
  let calls = 0;
  let lastSeq = timeline.last_seq;
  const append = (events) => events.forEach((ev) => list.append(eventCard(ev, ev.type === "model_request" ? ++calls : 0)));
  append(timeline.events);
  let side = sidePanel(detail);
  const layout = h("div", { class: "layout" }, side, h("div", {}, list));
  view.replaceChildren(h("h1", { class: "mono", text: rollout }), layout);
  if (!timeline.events.length) list.append(h("div", { class: "empty", text: "No events yet." }));
  const live = () => !TERMINAL.has(detail.status) || Date.now() / 1000 - detail.last_event_at < 30;
  setLive(live());
  poll(async () => {
    if (generation !== state.generation || document.hidden) return;
    const [fresh, more] = await Promise.all([api(base), api(`${base}/timeline?after_seq=${lastSeq}`)]);
    if (generation !== state.generation) return;
    if (more.events.length) { append(more.events); lastSeq = more.last_seq; }
    Object.assign(detail, fresh);
    const next = sidePanel(detail);
    side.replaceWith(next);
    side = next;
    setLive(live());
  });
}

// ---- routing ------------------------------------------------------------------------------

async function route() {
  const generation = ++state.generation;
  clearInterval(state.timer);
  setLive(false);
  const hash = location.hash;
  const token = hash.match(/token=([^&]+)/);
  if (token) {
    state.token = decodeURIComponent(token[1]);
    localStorage.setItem(TOKEN_KEY, state.token);
    history.replaceState(null, "", location.pathname + "#/");
    return route();
  }
  const parts = hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  try {
    if (parts[0] === "run" && parts[2] === "rollout" && parts[3]) await renderRollout(parts[1], parts[3], generation);
    else if (parts[0] === "run" && parts[1]) await renderRun(parts[1], generation);
    else {
      await renderRuns(generation);
      poll(() => { if (generation === state.generation && !document.hidden) renderRuns(generation).catch(() => {}); });
    }
  } catch (error) {
    if (generation === state.generation) showError(error);
  }
}

document.getElementById("token-button").addEventListener("click", askToken);
window.addEventListener("hashchange", route);
route();
