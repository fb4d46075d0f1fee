// Flywheel status page: polls GET /status every 2 s, keeps the history in this tab, draws it with uPlot.
// Every request goes to this page's own origin (relative URLs); the admin token lives in this page's
// memory (and, if asked, in this tab's sessionStorage) and is sent only as the Authorization header.
"use strict";

(() => {
  const POLL_MS = 2000;
  const MAX_POINTS = 3600; // two hours at one point every 2 s
  const TOKEN_KEY = "flywheel.admin-token";

  const points = []; // {t, ret, sampled, trained, backlog, lagMean, lagP95, lagMax, syncP50, syncP95, version, trainerVersion}
  let token = "";
  // Reads need the token too where the admin closes them (admin.public_reads false: compose, Kubernetes).
  const readHeaders = () => (token ? {Authorization: `Bearer ${token}`} : {});
  let versionsShownFor; // the policy.version the versions table was loaded for
  let busy = false;

  // ---- small helpers ------------------------------------------------------------------------
  const $ = (sel) => document.querySelector(sel);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children.flat()) {
      if (c !== undefined && c !== null) node.append(c instanceof Node ? c : String(c));
    }
    return node;
  }

  const num = (x) => (typeof x === "number" && Number.isFinite(x) ? x : null);
  const fmt = (x, digits = 1) => (num(x) === null ? "–" : x.toLocaleString(undefined, {maximumFractionDigits: digits}));
  const clock = (t) => (num(t) === null ? "–" : new Date(t * 1000).toLocaleTimeString());
  function stamp(t) { // the time alone when it is today
    if (num(t) === null) return "–";
    const d = new Date(t * 1000);
    if (d.toDateString() === new Date().toDateString()) return d.toLocaleTimeString();
    return d.toLocaleString(undefined, {month: "short", day: "numeric", hour: "2-digit", minute: "2-digit"});
  }

  function ago(t) {
    if (num(t) === null) return "–";
    const s = Math.max(0, Date.now() / 1000 - t);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    return `${(s / 3600).toFixed(1)} h ago`;
  }

  // ---- one status snapshot -> one point -----------------------------------------------------
  function toPoint(s, t) {
    const live = (s.samplers || []).filter((x) => x.alive);
    return {
      t,
      ret: num(s.episode_return?.mean),
      sampled: live.length ? live.reduce((a, x) => a + (num(x.steps_per_s) ?? 0), 0) : 0,
      trained: num(s.trainer?.samples_per_s),
      backlog: num(s.backlog?.records),
      lagMean: num(s.staleness?.mean),
      lagP95: num(s.staleness?.p95),
      lagMax: num(s.staleness?.max),
      syncP50: num(s.sync?.latency_p50_s),
      syncP95: num(s.sync?.latency_p95_s),
      version: num(s.policy?.version),
      trainerVersion: num(s.trainer?.policy_version),
    };
  }

  // While the admin is unreachable the curves break instead of drawing a line across the outage.
  function gapPoint(t) {
    const p = toPoint({}, t);
    for (const k of Object.keys(p)) if (k !== "t") p[k] = null;
    return {...p, gap: true};
  }

  function addPoint(p) {
    points.push(p);
    if (points.length > MAX_POINTS) points.splice(0, points.length - MAX_POINTS);
  }

  // GET /status/history: {"points": [...]}, oldest first, each a compact sample (`t`, `episode_return`,
  // `sampled_steps_per_s`, `trained_steps_per_s`, `backlog`, `staleness_mean|p95|max`, `sync_p50_s`,
  // `sync_p95_s`, `policy_version`) or a whole /status snapshot. Without a time (`t`, `at`, `ts`, Unix
  // seconds) the samples are taken as 2 s apart, ending now.
  function fromHistory(h, i, n) {
    let t = Date.now() / 1000 - (n - i) * (POLL_MS / 1000);
    for (const k of ["t", "at", "ts"]) if (num(h[k]) !== null) { t = h[k]; break; }
    if ("policy" in h || "samplers" in h) return toPoint(h, t);
    return {
      t,
      ret: num(h.episode_return),
      sampled: num(h.sampled_steps_per_s),
      trained: num(h.trained_steps_per_s),
      backlog: num(h.backlog),
      lagMean: num(h.staleness_mean),
      lagP95: num(h.staleness_p95),
      lagMax: num(h.staleness_max),
      syncP50: num(h.sync_p50_s),
      syncP95: num(h.sync_p95_s),
      version: num(h.policy_version),
      trainerVersion: num(h.trainer_policy_version),
    };
  }

  // ---- charts -------------------------------------------------------------------------------
  const COLORS = ["#2563eb", "#f97316", "#16a34a", "#9333ea", "#dc2626"];
  const CHARTS = {
    return: [["return", "ret"]],
    throughput: [["sampled", "sampled"], ["trained", "trained"]],
    backlog: [["records", "backlog"]],
    lag: [["mean", "lagMean"], ["p95", "lagP95"], ["max", "lagMax"]],
    sync: [["p50", "syncP50"], ["p95", "syncP95"]],
    version: [["published", "version", true], ["trainer", "trainerVersion", true]],
  };
  const plots = {};

  // One line of local time per tick (uPlot's default adds a date line that crowds small charts).
  function timeTicks(u, splits) {
    const span = splits.length > 1 ? splits[splits.length - 1] - splits[0] : 0;
    const parts = span >= 600 ? {hour: "2-digit", minute: "2-digit"} : {hour: "2-digit", minute: "2-digit", second: "2-digit"};
    return splits.map((t) => new Date(t * 1000).toLocaleTimeString([], parts));
  }

  function makeChart(name, fig) {
    const box = fig.querySelector(".plot");
    const stepped = window.uPlot.paths.stepped({align: 1});
    const opts = {
      width: Math.max(240, box.clientWidth),
      height: 170,
      legend: {live: true},
      cursor: {drag: {x: false, y: false}},
      scales: {x: {time: true}},
      axes: [
        {stroke: "#64748b", grid: {stroke: "#eef2f7"}, ticks: {stroke: "#e2e8f0"}, space: 80, size: 32, values: timeTicks},
        {stroke: "#64748b", grid: {stroke: "#eef2f7"}, ticks: {stroke: "#e2e8f0"}, size: 56},
      ],
      series: [{}].concat(CHARTS[name].map(([label, , step], i) => ({
        label,
        stroke: COLORS[i],
        width: 2,
        spanGaps: false,
        paths: step ? stepped : undefined,
        points: {show: false},
        // hovering: the value under the cursor; otherwise the latest one
        value: (u, v, si, idx) => fmt(idx === null || idx === undefined ? latest(u.data[si]) : v, 2),
      }))),
    };
    const plot = new window.uPlot(opts, chartData(name), box);
    new ResizeObserver(() => plot.setSize({width: Math.max(240, box.clientWidth), height: 170})).observe(box);
    return plot;
  }

  function latest(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null && values[i] !== undefined) return values[i];
    return null;
  }

  function chartData(name) {
    return [points.map((p) => p.t)].concat(CHARTS[name].map(([, key]) => points.map((p) => p[key])));
  }

  function drawCharts() {
    if (!window.uPlot) return;
    for (const fig of document.querySelectorAll("figure.chart")) {
      const name = fig.dataset.chart;
      if (!plots[name]) plots[name] = makeChart(name, fig);
      else plots[name].setData(chartData(name));
      const key = CHARTS[name][0][1];
      fig.dataset.points = String(points.filter((p) => p[key] !== null).length);
    }
  }

  // ---- rendering ----------------------------------------------------------------------------
  function setConn(state, text) {
    const c = $("#conn");
    c.dataset.state = state;
    c.textContent = text;
  }

  function renderTiles(s, p) {
    const tile = (label, value, sub) => el("div", {class: "tile"},
      el("div", {class: "label"}, label), el("div", {class: "value"}, value), el("div", {class: "sub"}, sub || ""));
    $("#tiles").replaceChildren(
      tile("Policy version", fmt(p.version, 0), s.policy?.published_at ? `published ${ago(s.policy.published_at)}` : "none published"),
      tile("Trainer step", fmt(s.trainer?.step, 0), s.trainer?.alive ? `updated ${ago(s.trainer.last_update_at)}` : "trainer down"),
      tile("Episode return", fmt(p.ret, 1), `${fmt(s.episode_return?.count, 0)} episodes`),
      tile("Sampled steps / s", fmt(p.sampled, 0), `trained ${fmt(p.trained, 0)} / s`),
      tile("Backlog", fmt(p.backlog, 0), "fragments"),
      tile("Policy lag", fmt(p.lagMean, 1), `p95 ${fmt(p.lagP95, 1)} · max ${fmt(p.lagMax, 0)}`),
      tile("Sync latency", p.syncP50 === null ? "–" : `${fmt(p.syncP50, 2)} s`, `p95 ${fmt(p.syncP95, 2)} s`),
    );
  }

  function renderAlerts(s) {
    const items = [];
    const stalled = s.trainer?.stalled;
    if (stalled) {
      items.push(el("div", {class: "alert bad"}, el("strong", {}, "Training stalled"),
        stalled.since ? ` since ${clock(stalled.since)} (${ago(stalled.since)})` : "", ": ", stalled.reason || "no reason given"));
    }
    const notOk = Object.entries(s.services || {}).filter(([, h]) => h.state !== "ok");
    if (notOk.length) {
      items.push(el("div", {class: "alert warn"}, el("strong", {}, `${notOk.length} not ok: `),
        notOk.map(([name, h]) => `${name} ${h.state}`).join(", ")));
    }
    $("#alerts").replaceChildren(...items);
  }

  function pill(kind, text, title) {
    return el("span", {class: `pill ${kind}`, title}, text);
  }

  function renderSamplers(s) {
    const rows = (s.samplers || []).map((x) => {
      let state;
      if (!x.alive) state = pill("bad", "down");
      else if (x.paused) state = pill("warn", x.paused_since ? `paused ${ago(x.paused_since)}` : "paused",
        x.paused_since ? `since ${stamp(x.paused_since)}` : undefined);
      else state = pill("ok", "running");
      const action = x.paused
        ? el("button", {type: "button", class: "small", onclick: () => act("resume", {sampler: x.id})}, "Resume")
        : el("button", {type: "button", class: "small", onclick: () => act("pause", {sampler: x.id})}, "Pause");
      return el("tr", {"data-sampler": x.id},
        el("td", {class: "mono"}, x.id), el("td", {}, state), el("td", {class: "num"}, fmt(x.policy_version, 0)),
        el("td", {class: "num"}, fmt(x.steps_per_s, 1)), el("td", {title: stamp(x.last_seen)}, ago(x.last_seen)),
        el("td", {class: "right"}, action));
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", {colspan: 6, class: "muted"}, "No sampler heard from yet.")));
    $("#samplers tbody").replaceChildren(...rows);
  }

  function renderServices(s) {
    const kind = {ok: "ok", degraded: "warn", down: "bad"};
    const rows = Object.entries(s.services || {}).map(([name, h]) => el("tr", {},
      el("td", {class: "mono"}, name), el("td", {}, pill(kind[h.state] || "muted", h.state)),
      el("td", {class: "num"}, fmt(h.restarts, 0)),
      el("td", {class: "reasons"}, Object.entries(h.reasons || {}).map(([dep, why]) => el("div", {}, el("b", {}, dep), ": ", why)))));
    if (!rows.length) rows.push(el("tr", {}, el("td", {colspan: 4, class: "muted"}, "This admin reports no per-service health.")));
    $("#services tbody").replaceChildren(...rows);
  }

  function render(s, p) {
    $("#run").textContent = s.run ? `run ${s.run}` : "";
    document.title = s.run ? `Flywheel · ${s.run}` : "Flywheel";
    renderTiles(s, p);
    renderAlerts(s);
    renderSamplers(s);
    renderServices(s);
  }

  // ---- policy versions ----------------------------------------------------------------------
  async function loadVersions() {
    const note = $("#versions-note");
    let r;
    try {
      r = await fetch("policy/versions", {cache: "no-store", headers: readHeaders()});
    } catch (e) {
      return; // the status poll reports the connection
    }
    if (r.status === 404) {
      note.hidden = false;
      note.textContent = "This admin does not list policy versions (GET /policy/versions answered 404).";
      $("#versions tbody").replaceChildren();
      return;
    }
    if (!r.ok) {
      note.hidden = false;
      note.textContent = `Could not load versions: ${await errorText(r)}`;
      return;
    }
    const body = await r.json();
    note.hidden = true;
    const current = body.current;
    const rows = (body.versions || []).slice().sort((a, b) => b.version - a.version).map((v) => {
      const isCurrent = v.version === current;
      return el("tr", {class: isCurrent ? "current" : undefined, "data-version": v.version},
        el("td", {class: "num"}, fmt(v.version, 0), isCurrent ? el("span", {class: "badge"}, "current") : ""),
        el("td", {title: ago(v.published_at)}, stamp(v.published_at),
          num(v.rollback_of) !== null ? el("div", {class: "muted"}, `rollback of v${v.rollback_of}`) : ""),
        el("td", {class: "num"}, fmt(v.trainer_step, 0)),
        el("td", {class: "num"}, fmt(v.return_mean, 1)),
        el("td", {class: "mono", title: v.sha256 || ""}, (v.sha256 || "").slice(0, 10)),
        el("td", {class: "right"}, isCurrent ? "" : el("button", {type: "button", class: "small",
          onclick: () => rollback(v.version)}, "Rollback")));
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", {colspan: 6, class: "muted"}, "No version published yet.")));
    $("#versions tbody").replaceChildren(...rows);
  }

  // ---- actions ------------------------------------------------------------------------------
  function notify(kind, text) {
    const n = $("#notice");
    n.hidden = false;
    n.className = `notice ${kind}`;
    n.textContent = text;
  }

  async function errorText(r) {
    if (r.status === 401 || r.status === 403) return "wrong or missing token";
    let detail;
    try {
      detail = (await r.json()).detail;
    } catch (e) { /* not JSON */ }
    if (Array.isArray(detail)) detail = detail.map((d) => d.msg || JSON.stringify(d)).join("; ");
    return detail ? `${detail} (HTTP ${r.status})` : `HTTP ${r.status} ${r.statusText}`;
  }

  async function post(path, body, label) {
    if (busy) return null;
    busy = true;
    document.body.classList.add("busy");
    const headers = {"Content-Type": "application/json"};
    if (token) headers.Authorization = `Bearer ${token}`;
    try {
      const r = await fetch(path, {method: "POST", headers, body: JSON.stringify(body), cache: "no-store"});
      if (!r.ok) {
        notify("error", `${label} failed: ${await errorText(r)}`);
        if (r.status === 401) $("#token").focus();
        return null;
      }
      const text = await r.text();
      return text ? JSON.parse(text) : {};
    } catch (e) {
      notify("error", `${label} failed: admin unreachable (${e.message})`);
      return null;
    } finally {
      busy = false;
      document.body.classList.remove("busy");
    }
  }

  async function act(what, body) {
    const who = body.sampler ? `sampler ${body.sampler}` : "all samplers";
    const label = `${what === "pause" ? "Pause" : "Resume"} ${who}`;
    const res = await post(`samplers/${what}`, body, label);
    if (res === null) return;
    notify("ok", `${what === "pause" ? "Pause" : "Resume"} sent to ${who}.`);
    poll(false);
  }

  async function rollback(version) {
    if (!window.confirm(`Roll back to version ${version}? Its weights are published as a new version.`)) return;
    const res = await post("policy/rollback", {version}, `Rollback to version ${version}`);
    if (res === null) return;
    const now = num(res.new_version);
    notify("ok", now !== null ? `Rolled back to version ${version}: its weights are now version ${now}.`
      : `Rollback to version ${version} stored, pending: ${res.reason || "not applied yet"}; ` +
        "paramsync applies it when it runs.");
    await loadVersions();
    poll(false);
  }

  // ---- polling ------------------------------------------------------------------------------
  let timer;

  async function poll(schedule = true) {
    try {
      const r = await fetch("status", {cache: "no-store", headers: readHeaders()});
      if (!r.ok) throw new Error(await errorText(r));
      const s = await r.json();
      const p = toPoint(s, Date.now() / 1000);
      addPoint(p);
      render(s, p);
      setConn("ok", `live · ${clock(p.t)}`);
      if (s.policy?.version !== versionsShownFor) {
        versionsShownFor = s.policy?.version;
        loadVersions();
      }
    } catch (e) {
      if (points.length && !points[points.length - 1].gap) addPoint(gapPoint(Date.now() / 1000));
      setConn("bad", `admin unreachable: ${e.message}`);
    }
    drawCharts();
    if (schedule) timer = setTimeout(poll, POLL_MS);
  }

  async function loadHistory() {
    try {
      const r = await fetch("status/history", {cache: "no-store", headers: readHeaders()});
      if (!r.ok) return; // 404: this admin keeps no history; the page builds its own
      const snaps = (await r.json()).points || [];
      snaps.slice(-MAX_POINTS).forEach((h, i, all) => addPoint(fromHistory(h, i, all.length)));
      points.sort((a, b) => a.t - b.t);
    } catch (e) { /* no history: fine */ }
  }

  function setupToken() {
    const input = $("#token");
    const remember = $("#remember");
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) {
      token = saved;
      input.value = saved;
      remember.checked = true;
    }
    const keep = () => {
      token = input.value.trim();
      if (remember.checked && token) sessionStorage.setItem(TOKEN_KEY, token);
      else sessionStorage.removeItem(TOKEN_KEY);
    };
    input.addEventListener("input", keep);
    remember.addEventListener("change", keep);
    $("#token-form").addEventListener("submit", (e) => e.preventDefault());
  }

  window.flywheelPoints = () => points.map((p) => ({...p}));

  document.addEventListener("DOMContentLoaded", async () => {
    setupToken();
    $("#pause-all").addEventListener("click", () => act("pause", {}));
    $("#resume-all").addEventListener("click", () => act("resume", {}));
    await loadHistory();
    clearTimeout(timer);
    poll();
  });
})();
