// The edgefl dashboard: one snapshot from /api/state, then a new one with every server-sent event.
"use strict";

const PAGE_SIZE = 50;
const token = new URLSearchParams(location.search).get("token");
const withToken = (url) => (token ? `${url}?token=${encodeURIComponent(token)}` : url);
let state = null;
let page = 0;
let countdown = null;

const el = (id) => document.getElementById(id);
const text = (value) => (value === null || value === undefined ? "" : String(value));
const palette = ["#3b7dd8", "#e07b39", "#3aa657", "#b44bbf", "#c9a227", "#2aa3a3", "#d64550", "#6b6ecf", "#8c6d31", "#7f7f7f"];

function makeChart(id, type, yLabel) {
  return new Chart(el(id), {
    type,
    data: { labels: [], datasets: [] },
    options: {
      animation: false, responsive: true, maintainAspectRatio: false,
      scales: { x: { title: { display: true, text: "round" } }, y: { beginAtZero: true, title: { display: true, text: yLabel } } },
      plugins: { legend: { labels: { boxWidth: 12, font: { size: 11 } } } },
    },
  });
}
const charts = {
  accuracy: makeChart("accuracy", "line", "test accuracy"),
  communication: makeChart("communication", "bar", "KB (10^3 bytes)"),
  clock: makeChart("clock", "line", "virtual seconds"),
};
charts.accuracy.options.scales.y.max = 1;

function humanBytes(n) {
  if (n === null || n === undefined) return "";
  for (const [unit, f] of [["GB", 1e9], ["MB", 1e6], ["KB", 1e3]]) if (n >= f) return `${(n / f).toFixed(1)} ${unit}`;
  return `${n} B`;
}

const judged = (rows) => rows.filter((r) => r.accuracy && r.accuracy.overall !== null && r.accuracy.overall !== undefined);

function drawCharts(rounds, baselineRounds) {
  const evaluated = judged(rounds);
  const baseline = judged(baselineRounds || []);
  const archs = [...new Set(evaluated.flatMap((r) => Object.keys(r.accuracy.per_arch || {})))].sort();
  // rounds are the x labels: the baseline's points sit at the same rounds (it is judged on the same schedule)
  const labels = [...new Set(evaluated.map((r) => r.round).concat(baseline.map((r) => r.round)))].sort((a, b) => a - b);
  const at = (rows, pick) => labels.map((round) => { const row = rows.find((r) => r.round === round); return row ? pick(row) : null; });
  charts.accuracy.data.labels = labels;
  charts.accuracy.data.datasets = archs.map((arch, i) => ({
    label: arch, data: at(evaluated, (r) => r.accuracy.per_arch[arch] ?? null), borderColor: palette[i % palette.length],
    backgroundColor: palette[i % palette.length], pointRadius: 3, borderWidth: 1, borderDash: i >= palette.length ? [6, 3] : [],
  })).concat([{ label: "overall (mean over judged devices)", data: at(evaluated, (r) => r.accuracy.overall),
    borderColor: "#111", backgroundColor: "#111", pointRadius: 4, borderWidth: 2.5 }]);
  // say what the accuracy was measured on: the server's test set, or devices' own held-out data (device-held data)
  const last = evaluated.length ? evaluated[evaluated.length - 1].accuracy : null;
  charts.accuracy.options.scales.y.title.text = last && last.judged_on ? `accuracy on the ${last.judged_on}` : "test accuracy";
  if (evaluated.some((r) => r.accuracy.device_validation)) {
    charts.accuracy.data.datasets.push({ label: "devices' own validation data, mean",
      data: at(evaluated, (r) => (r.accuracy.device_validation ? r.accuracy.device_validation.overall : null)),
      borderColor: "#555", backgroundColor: "#555", pointRadius: 3, borderWidth: 2, borderDash: [2, 3] });
  }
  if (baseline.length) {
    charts.accuracy.data.datasets.push({ label: "Local-only baseline, overall", data: at(baseline, (r) => r.accuracy.overall),
      borderColor: "#111", backgroundColor: "#fff", pointRadius: 4, borderWidth: 2, borderDash: [8, 4] });
  }
  charts.accuracy.update();

  charts.communication.data.labels = rounds.map((r) => r.round);
  charts.communication.data.datasets = [
    { label: "up (all devices)", data: rounds.map((r) => (r.bytes_up || 0) / 1e3), backgroundColor: palette[0] },
    { label: "down (all devices)", data: rounds.map((r) => (r.bytes_down || 0) / 1e3), backgroundColor: palette[1] },
  ];
  charts.communication.update();

  const timed = rounds.filter((r) => r.virtual_time_by_profile);
  el("clock-panel").hidden = timed.length === 0;
  if (timed.length) {
    const classes = [...new Set(timed.flatMap((r) => Object.keys(r.virtual_time_by_profile)))].sort();
    charts.clock.data.labels = timed.map((r) => r.round);
    charts.clock.data.datasets = classes.map((c, i) => ({
      label: c, data: timed.map((r) => r.virtual_time_by_profile[c] ?? null), borderColor: palette[i % palette.length], pointRadius: 3,
    }));
    charts.clock.update();
  }
}

function drawRound(s) {
  const r = s.round;
  const box = el("round");
  if (countdown) clearInterval(countdown);
  if (!r) { box.textContent = s.rounds.length ? `${s.rounds.length} rounds played` : "no round yet"; return; }
  const reported = r.reported.length;
  const n = Math.max(1, r.selected.length);
  // a simulation's devices all train before the server reads their uploads: "trained" is what its console counts as done
  const trained = Math.max((r.trained || []).length, reported);
  const counts = s.run.runner === "simulation"
    ? `<b id="trained">${trained}</b> of ${r.selected.length} selected trained, <b id="reported">${reported}</b> reported to the server`
    : `<b id="reported">${reported}</b> of ${r.selected.length} selected reported`;
  const closed = r.outcome ? ` - closed: ${r.outcome}` : "";
  const strag = (r.stragglers || []).length ? `, stragglers: ${r.stragglers.join(", ")}` : "";
  box.innerHTML = `<div id="round-line">round ${r.round}${s.run.rounds ? " of " + s.run.rounds : ""}: `
    + `${counts} (quorum ${r.quorum})${closed}${strag}`
    + ` <span id="deadline"></span></div><div class="bar"><div class="trained" style="width:${(100 * trained) / n}%"></div>`
    + `<div class="reported" style="width:${(100 * reported) / n}%"></div></div>`;
  if (!r.outcome && r.deadline_unix && s.run.runner === "fleet") {
    const tick = () => {
      const left = Math.max(0, r.deadline_unix - Date.now() / 1000);
      el("deadline").textContent = `deadline in ${left.toFixed(0)} s`;
    };
    tick();
    countdown = setInterval(tick, 1000);
  }
}

function latestAccuracy(rounds) {
  for (let i = rounds.length - 1; i >= 0; i--) {
    const acc = rounds[i].accuracy;
    if (acc && acc.per_client) return acc.per_client;
  }
  return {};
}

function drawDevices(s) {
  const ids = Object.keys(s.devices).sort();
  const groups = [...new Set(ids.map((d) => groupOf(s.devices[d])))].sort();
  const select = el("group");
  const chosen = select.value;
  if (select.options.length !== groups.length + 1) {
    select.innerHTML = '<option value="">all</option>' + groups.map((g) => `<option>${escapeHtml(g)}</option>`).join("");
    select.value = groups.includes(chosen) ? chosen : "";
  }
  const problems = el("only-problems").checked;
  const accuracy = latestAccuracy(s.rounds);
  const shown = ids.filter((d) => (!select.value || groupOf(s.devices[d]) === select.value)
    && (!problems || s.devices[d].online === false || (s.devices[d].receipts || {}).rejected));
  const pages = Math.max(1, Math.ceil(shown.length / PAGE_SIZE));
  page = Math.min(page, pages - 1);
  el("page").textContent = `page ${page + 1} of ${pages}`;
  const online = ids.filter((d) => s.devices[d].online === true).length;
  const ended = s.status === "finished" || s.status === "interrupted";
  el("device-count").textContent = `(${ids.length}; ${online} online${ended ? ", the run has ended" : ""})`;
  el("devices").querySelector("tbody").innerHTML = shown.slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE).map((d) => {
    const dev = s.devices[d];
    const rc = dev.receipts || {};
    const on = dev.online === true ? '<span class="on">online</span>' : dev.online === false ? '<span class="off">offline</span>'
      : '<span class="unknown">?</span>';
    const acc = accuracy[d] === undefined || accuracy[d] === null ? "" : accuracy[d].toFixed(4);
    return `<tr data-device="${escapeHtml(d)}"><td>${escapeHtml(d)}</td><td>${on}</td><td>${escapeHtml(text(dev.profile))}</td>`
      + `<td>${escapeHtml(text(dev.arch))}</td><td class="num">${text(dev.last_round)}</td><td class="num">${text(rc.accepted)}</td>`
      + `<td class="num">${text(rc.late)}</td><td class="num">${text(rc.duplicate)}</td><td class="num">${text(rc.rejected)}</td>`
      + `<td class="reason">${escapeHtml(text(dev.last_reason))}</td><td class="num">${acc}</td></tr>`;
  }).join("");
}

function groupOf(dev) { return dev.profile ? `${dev.profile} / ${dev.arch}` : text(dev.arch); }

function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function drawRejections(s) {
  el("refused-count").textContent = s.rejections_total ? `(${s.rejections_total} in all; the last ${s.rejections.length})` : "(none)";
  el("rejections").innerHTML = [...s.rejections].reverse().map((r) =>
    `<li><b>${escapeHtml(text(r.device))}</b>: ${escapeHtml(text(r.reason))}</li>`).join("");
}

function draw(s) {
  state = s;
  document.title = `edgefl - ${s.run.name}`;
  el("title").textContent = s.run.name;
  el("facts").textContent = [s.run.method, s.run.dataset, s.run.runner, s.run.rounds ? `${s.run.rounds} rounds` : "",
    s.run.seed !== undefined && s.run.seed !== null ? `seed ${s.run.seed}` : ""].filter(Boolean).join(" / ");
  const badge = el("status");
  badge.textContent = s.status;
  badge.className = `badge ${s.status}`;
  drawRound(s);
  drawCharts(s.rounds, s.baseline_rounds);
  drawDevices(s);
  drawRejections(s);
}

el("prev").addEventListener("click", () => { page = Math.max(0, page - 1); if (state) drawDevices(state); });
el("next").addEventListener("click", () => { page += 1; if (state) drawDevices(state); });
el("group").addEventListener("change", () => { page = 0; if (state) drawDevices(state); });
el("only-problems").addEventListener("change", () => { page = 0; if (state) drawDevices(state); });

fetch(withToken("api/state")).then((r) => r.json()).then(draw);
const source = new EventSource(withToken("api/events"));
source.addEventListener("state", (e) => draw(JSON.parse(e.data)));
source.onerror = () => { el("status").textContent = state ? `${state.status} (reconnecting)` : "connecting"; };
