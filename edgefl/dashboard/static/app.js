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

function makeChart(id, type, yLabel, tweak = (options) => options) {
  return new Chart(el(id), {
    type,
    data: { labels: [], datasets: [] },
    options: tweak({
      animation: false, responsive: true, maintainAspectRatio: false,
      scales: { x: { title: { display: true, text: "round" } }, y: { beginAtZero: true, title: { display: true, text: yLabel } } },
      plugins: { legend: { labels: { boxWidth: 12, font: { size: 11 } } } },
    }),
  });
}
const charts = {
  accuracy: makeChart("accuracy", "line", "test accuracy"),
  communication: makeChart("communication", "bar", "KB (10^3 bytes)"),
  clock: makeChart("clock", "line", "virtual seconds"),
  // stacked: devices that did not answer each stage; the tooltip names them and says why a round
  // failed (drawn on the canvas: text, never HTML)
  dropouts: makeChart("dropouts", "bar", "devices", (o) => {
    o.scales.x.stacked = true;
    Object.assign(o.scales.y, { stacked: true, ticks: { precision: 0 } });
    o.plugins.tooltip = { callbacks: {
      afterLabel: (ctx) => few((ctx.dataset.ids || [])[ctx.dataIndex] || [], (ctx.dataset.counts || [])[ctx.dataIndex] || 0),
      footer: (items) => {
        const r = items.length && items[0].chart.$rounds ? items[0].chart.$rounds[items[0].dataIndex] : null;
        return r && r.failure ? `round failed: ${r.failure}` : "";
      },
    } };
    return o;
  }),
};
charts.accuracy.options.scales.y.max = 1;

function humanBytes(n) {
  if (n === null || n === undefined) return "";
  for (const [unit, f] of [["GB", 1e9], ["MB", 1e6], ["KB", 1e3]]) if (n >= f) return `${(n / f).toFixed(1)} ${unit}`;
  return `${n} B`;
}

// "a, b, c and 4 more": `ids` are the first of `count`
function few(ids, count, show = 10) {
  const listed = ids.slice(0, show);
  const more = Math.max(count, ids.length) - listed.length;
  return listed.join(", ") + (more > 0 ? ` and ${more} more` : "");
}

const dropped = (s) => (s && s.dropped ? s.dropped : { count: 0, ids: [] });
const stageNames = (rounds) => [...new Set(rounds.flatMap((r) => Object.keys(r.stages || {})))];
const afterSharing = (r) => Object.values((r.secagg || {}).groups || {}).reduce(
  (acc, g) => ({ count: acc.count + dropped({ dropped: g.dropped_after_sharing }).count,
    ids: acc.ids.concat(dropped({ dropped: g.dropped_after_sharing }).ids) }), { count: 0, ids: [] });

// who did not answer a stage: the count, the ids under it (a <details>: click or hover)
function dropCell(label, d) {
  if (!d.count) return "";
  return `<details class="dropped" title="${escapeHtml(few(d.ids, d.count, 50))}"><summary>${escapeHtml(label)}: ${d.count}</summary>`
    + `<span class="ids">${escapeHtml(few(d.ids, d.count, 50))}</span></details>`;
}

// a round's stages: what each asked and got, and who dropped out (ids escaped: they come from devices)
function stagesHtml(stages) {
  return Object.entries(stages || {}).map(([name, st]) => {
    const d = dropped(st);
    const got = st.answered === undefined || st.answered === null ? `${text(st.asked)} asked, under way` : `${st.answered} of ${text(st.asked)}`;
    return `<span class="stage${st.failed ? " failed" : ""}" data-stage="${escapeHtml(name)}">${escapeHtml(name)} ${got}`
      + `${d.count ? dropCell("dropped", d) : ""}</span>`;
  }).join(" ");
}

function securedHtml(r) {
  if (r.secured === undefined || r.secured === null) return "";
  if (!r.secured) return '<span class="unsecured">no</span>';
  const groups = Object.entries((r.secagg || {}).groups || {}).map(([name, g]) =>
    `${name}: ${text(g.summed)} of ${text(g.shared)} summed (threshold ${text(g.threshold)} of ${text(g.neighbours)} neighbours)`);
  return `<span class="secured" title="${escapeHtml(groups.join("; "))}">secured</span>` + dropCell("dropped after sharing", afterSharing(r));
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

  // devices that did not answer a stage, per round and stage (and a secured round's devices that
  // shared their keys but sent no masked upload)
  const names = stageNames(rounds);
  const staged = rounds.filter((r) => r.stages || r.secagg);
  el("dropouts-panel").hidden = staged.length === 0;
  if (staged.length) {
    charts.dropouts.$rounds = staged;
    charts.dropouts.data.labels = staged.map((r) => (r.outcome === "failed" ? `${r.round} (failed)` : r.round));
    const series = names.map((name) => ({ label: name, pick: (r) => dropped((r.stages || {})[name]) }));
    if (staged.some((r) => afterSharing(r).count)) series.push({ label: "shared keys, no masked upload", pick: afterSharing });
    charts.dropouts.data.datasets = series.map((x, i) => ({
      label: x.label, data: staged.map((r) => x.pick(r).count), ids: staged.map((r) => x.pick(r).ids),
      counts: staged.map((r) => x.pick(r).count), backgroundColor: palette[i % palette.length],
    }));
    charts.dropouts.update();
  }
}

// every round: outcome, reports, accuracy, and with stages or secure aggregation, whether it was
// secured, who dropped out where and why a round failed (newest first)
const ROUNDS_SHOWN = 100;
// the epsilon each differential-privacy filter has spent after a round: "dp-fedavg 2.31 (delta 1e-05)"
function privacyText(r) {
  return Object.entries(r.privacy || {}).map(([name, p]) => `${name} ${Number(p.epsilon).toPrecision(3)} (delta ${p.delta})`).join("; ");
}

function drawRoundTable(s) {
  const staged = s.rounds.some((r) => r.stages || r.secagg || r.failure);
  const private_ = s.rounds.some((r) => r.privacy);
  el("rounds-head").innerHTML = "<tr><th>round</th><th>outcome</th><th>reported</th><th>accuracy</th>"
    + (private_ ? "<th>epsilon spent</th>" : "")
    + (staged ? "<th>secured</th><th>dropped in stages</th><th>why it failed</th>" : "") + "</tr>";
  const last = s.rounds.length ? privacyText(s.rounds[s.rounds.length - 1]) : "";
  el("privacy-now").textContent = last ? `differential privacy: epsilon spent ${last}` : "";
  const only = el("only-dropped").checked;
  const rows = s.rounds.filter((r) => !only || r.outcome === "failed" || r.failure
    || Object.values(r.stages || {}).some((st) => dropped(st).count) || afterSharing(r).count);
  const shown = rows.slice(-ROUNDS_SHOWN).reverse();
  el("rounds-count").textContent = `(${s.rounds.length}${only ? `; ${rows.length} with drop-outs or failed` : ""}`
    + `${shown.length < rows.length ? `; the last ${shown.length}` : ""})`;
  el("rounds-body").innerHTML = shown.map((r) => {
    const acc = r.accuracy && r.accuracy.overall !== null && r.accuracy.overall !== undefined ? r.accuracy.overall.toFixed(4) : "";
    const drops = Object.entries(r.stages || {}).map(([name, st]) => dropCell(name, dropped(st))).join("");
    return `<tr data-round="${text(r.round)}"><td class="num">${text(r.round)}</td>`
      + `<td class="${r.outcome === "failed" ? "off" : ""}">${escapeHtml(text(r.outcome))}</td>`
      + `<td class="num">${text(r.reported)} of ${text(r.selected)}</td><td class="num">${acc}</td>`
      + (private_ ? `<td class="num">${escapeHtml(privacyText(r))}</td>` : "")
      + (staged ? `<td>${securedHtml(r)}</td><td>${drops}</td><td class="reason">${escapeHtml(text(r.failure))}</td>` : "")
      + "</tr>";
  }).join("");
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
  // until its stages before training end a round has no selection to count (they ask the devices
  // first), and a round they failed never gets one
  const unselected = !r.selected.length && Object.keys(r.stages || {}).length > 0;
  const counts = unselected ? "" : s.run.runner === "simulation"
    ? `<b id="trained">${trained}</b> of ${r.selected.length} selected trained, <b id="reported">${reported}</b> reported to the server`
    : `<b id="reported">${reported}</b> of ${r.selected.length} selected reported`;
  const quorum = r.quorum === null || r.quorum === undefined ? "" : ` (quorum ${r.quorum})`;
  const stage = r.stage && !r.outcome ? `<span id="stage-now">in stage ${escapeHtml(r.stage)}</span>` : "";
  const closed = r.outcome ? `closed: ${escapeHtml(r.outcome)}` : "";
  const strag = (r.stragglers || []).length ? `, stragglers: ${escapeHtml(r.stragglers.join(", "))}` : "";
  const secured = r.secured ? ' <span class="secured">secured</span>' : "";
  const stages = Object.keys(r.stages || {}).length ? `<div id="round-stages">stages: ${stagesHtml(r.stages)}</div>` : "";
  const failure = r.failure ? `<div id="round-failure" class="failure">failed: ${escapeHtml(r.failure)}</div>` : "";
  box.innerHTML = `<div id="round-line">round ${text(r.round)}${s.run.rounds ? " of " + s.run.rounds : ""}: `
    + [counts ? counts + quorum : "", stage, closed].filter(Boolean).join(" - ") + `${strag}${secured}`
    + ` <span id="deadline"></span></div>${stages}${failure}`
    + (unselected ? "" : `<div class="bar"><div class="trained" style="width:${(100 * trained) / n}%"></div>`
      + `<div class="reported" style="width:${(100 * reported) / n}%"></div></div>`);
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
    && (!problems || s.devices[d].online === false || (s.devices[d].receipts || {}).rejected || (s.devices[d].receipts || {}).dropped));
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
      + `<td class="num"${dev.last_dropped ? ` title="last: round ${text(dev.last_dropped.round)}, stage ${escapeHtml(text(dev.last_dropped.stage))}"` : ""}>`
      + `${text(rc.dropped)}</td>`
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
  const secured = s.rounds.filter((r) => r.secured).length;
  const withSecagg = s.rounds.filter((r) => r.secured !== undefined).length;
  el("secured").hidden = withSecagg === 0;
  el("secured").textContent = withSecagg ? `secure aggregation: ${secured} of ${s.rounds.length} rounds secured` : "";
  drawRound(s);
  drawCharts(s.rounds, s.baseline_rounds);
  drawRoundTable(s);
  drawDevices(s);
  drawRejections(s);
}

el("prev").addEventListener("click", () => { page = Math.max(0, page - 1); if (state) drawDevices(state); });
el("next").addEventListener("click", () => { page += 1; if (state) drawDevices(state); });
el("group").addEventListener("change", () => { page = 0; if (state) drawDevices(state); });
el("only-problems").addEventListener("change", () => { page = 0; if (state) drawDevices(state); });
el("only-dropped").addEventListener("change", () => { if (state) drawRoundTable(state); });

fetch(withToken("api/state")).then((r) => r.json()).then(draw);
const source = new EventSource(withToken("api/events"));
source.addEventListener("state", (e) => draw(JSON.parse(e.data)));
source.onerror = () => { el("status").textContent = state ? `${state.status} (reconnecting)` : "connecting"; };
