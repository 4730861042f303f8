// The dashboard: polls GET /admin/v1/dashboard with the admin token and draws the answer.
// Every value goes into the page as text (textContent), never as markup: node ids, model
// names and messages come from the fleet's shared store and from requests.
"use strict";

const NUMBERS_URL = "/admin/v1/dashboard";
const POLL_MS = 1000;
const HISTORY = 120; // points in each plot: two minutes at one poll a second
const TOKEN_KEY = "edgeserve.adminToken"; // sessionStorage: this tab only, gone when it closes
const SVG = "http://www.w3.org/2000/svg";

const history = { at: [], tokensPerS: [], kvUtilization: [], queued: [] };
let previous = null; // the last answer, to turn counters into rates
let timer = null;

function $(id) {
  return document.getElementById(id);
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "–" : String(text);
  if (className) td.className = className;
  return td;
}

function row(cells) {
  const tr = document.createElement("tr");
  tr.append(...cells);
  return tr;
}

function emptyRow(columns, text) {
  const td = cell(text, "empty");
  td.colSpan = columns;
  return row([td]);
}

function fill(tableId, rows, columns, emptyText) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren(...(rows.length ? rows : [emptyRow(columns, emptyText)]));
}

function integer(value) {
  return Number(value).toLocaleString("en-US");
}

function meter(value) {
  const m = document.createElement("meter");
  m.min = 0;
  m.max = 1;
  m.value = value;
  m.title = `${Math.round(value * 100)}%`;
  return m;
}

function drawNodes(nodes) {
  fill(
    "nodes",
    nodes.map((n) => {
      const pages = cell(`${integer(n.num_used_pages)} / ${integer(n.num_free_pages)}`, "num");
      pages.append(" ", meter(n.num_pages ? n.num_used_pages / n.num_pages : 0));
      const tr = row([
        cell(n.node_id, "node-id"),
        cell(n.role),
        cell(n.models.join(", ")),
        pages,
        cell(n.kv_dtype),
        cell(integer(n.num_running), "num"),
        cell(integer(n.num_waiting), "num"),
        cell(n.load.toFixed(2), "num"),
        cell(n.tokens_per_s.toFixed(1), "num node-tokens"),
        cell(`${n.age_s.toFixed(1)} s ago`, "num"),
      ]);
      tr.dataset.node = n.node_id;
      return tr;
    }),
    10,
    "no live node",
  );
}

function drawModels(models) {
  fill(
    "models",
    models.map((m) => {
      const kv = cell(`${(m.kv_utilization * 100).toFixed(1)}%`, "num");
      kv.append(" ", meter(m.kv_utilization));
      const tr = row([
        cell(m.model),
        cell(integer(m.num_nodes), "num"),
        kv,
        cell(integer(m.num_running), "num"),
        cell(integer(m.num_waiting), "num"),
      ]);
      tr.dataset.model = m.model;
      return tr;
    }),
    5,
    "no model served",
  );
}

function drawUsage(usage) {
  const note = $("usage-note");
  $("usage-day").textContent = usage ? `(${usage.day}, UTC)` : "";
  if (!usage || usage.error) {
    note.hidden = false;
    note.textContent = usage ? usage.error : "no ledger: this gateway has none wired in";
    fill("usage", [], 6, "–");
    return;
  }
  note.hidden = true;
  fill(
    "usage",
    usage.accounts.map((a) => {
      const tr = row([
        cell(a.account_id, "account"),
        cell(integer(a.requests), "num requests"),
        cell(integer(a.input_tokens), "num input-tokens"),
        cell(integer(a.cached_tokens), "num cached-tokens"),
        cell(integer(a.output_tokens), "num output-tokens"),
        cell(a.cost === null ? "unpriced" : `${a.cost} ${usage.currency}`, "num cost"),
      ]);
      tr.dataset.account = a.account_id;
      return tr;
    }),
    6,
    "no billed request today",
  );
}

function drawRefusals(rejections) {
  const reasons = Object.keys(rejections);
  fill(
    "refusals",
    reasons.map((reason) => row([cell(reason), cell(integer(rejections[reason]), "num")])),
    2,
    "none",
  );
}

function drawErrors(errors) {
  fill(
    "errors",
    errors.map((e) =>
      row([
        cell(new Date(e.at * 1000).toLocaleTimeString()),
        cell(e.status, "num"),
        cell(`${e.method} ${e.path}`),
        cell(e.message),
        cell(e.request_id),
      ]),
    ),
    5,
    "none",
  );
}

// A line per series over the plot's 300 x 80 box, scaled to the largest value shown.
function drawPlot(svgId, series, captionId, caption) {
  const svg = $(svgId);
  const shapes = [];
  for (const y of [20, 40, 60]) {
    const line = document.createElementNS(SVG, "line");
    line.setAttribute("class", "grid");
    line.setAttribute("x1", "0");
    line.setAttribute("x2", "300");
    line.setAttribute("y1", String(y));
    line.setAttribute("y2", String(y));
    shapes.push(line);
  }
  series.forEach(({ values, top }, i) => {
    if (values.length < 2) return;
    const step = 300 / (HISTORY - 1);
    const x0 = 300 - step * (values.length - 1);
    const points = values.map((v, j) => {
      const y = 78 - (top > 0 ? (v / top) * 76 : 0);
      return `${(x0 + j * step).toFixed(1)},${y.toFixed(1)}`;
    });
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("class", i === 0 ? "series" : "series second");
    line.setAttribute("points", points.join(" "));
    shapes.push(line);
  });
  svg.replaceChildren(...shapes);
  $(captionId).textContent = caption;
}

function remember(key, value) {
  history[key].push(value);
  if (history[key].length > HISTORY) history[key].shift();
}

function draw(numbers) {
  const g = numbers.gateway;
  let tokensPerS = null;
  if (previous !== null && numbers.at > previous.at) {
    const made = g.num_output_tokens - previous.gateway.num_output_tokens;
    tokensPerS = Math.max(0, made) / (numbers.at - previous.at);
  }
  const pages = numbers.nodes.reduce((sum, n) => sum + n.num_pages, 0);
  const used = numbers.nodes.reduce((sum, n) => sum + n.num_used_pages, 0);
  const kvUtilization = pages ? used / pages : 0;

  $("num-queued").textContent = integer(numbers.num_queued);
  $("num-generations").textContent = integer(g.num_generations);
  $("num-failed").textContent = integer(g.num_failed);
  $("num-input-tokens").textContent = integer(g.num_input_tokens);
  $("num-output-tokens").textContent = integer(g.num_output_tokens);
  $("tokens-per-s").textContent = tokensPerS === null ? "–" : tokensPerS.toFixed(1);
  $("registry-away").hidden = !numbers.is_registry_away;
  drawNodes(numbers.nodes);
  drawModels(numbers.models);
  drawUsage(numbers.usage);
  drawRefusals(g.admission_rejections);
  drawErrors(numbers.errors);

  if (tokensPerS !== null) remember("tokensPerS", tokensPerS);
  remember("kvUtilization", kvUtilization);
  remember("queued", numbers.num_queued);
  const topTokens = Math.max(1, ...history.tokensPerS);
  drawPlot("tokens-plot", [{ values: history.tokensPerS, top: topTokens }], "tokens-plot-max",
    `(top of the plot: ${topTokens.toFixed(0)} tokens/s)`);
  const topQueued = Math.max(1, ...history.queued);
  drawPlot("kv-plot", [{ values: history.kvUtilization, top: 1 }, { values: history.queued, top: topQueued }],
    "kv-plot-max", `(orange: KV 0–100%, blue: queued 0–${topQueued})`);
  previous = numbers;
}

function setStatus(text, className) {
  const status = $("status");
  status.textContent = text;
  status.className = `status ${className}`;
}

function showLogin(message) {
  clearTimeout(timer);
  sessionStorage.removeItem(TOKEN_KEY);
  $("board").hidden = true;
  $("sign-out").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  setStatus("not connected", "");
  $("token").focus();
}

async function poll() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) {
    showLogin("");
    return;
  }
  try {
    const response = await fetch(NUMBERS_URL, {
      headers: { authorization: `Bearer ${token}` },
      cache: "no-store",
      credentials: "omit",
    });
    if (response.status === 401) {
      showLogin("That token was refused.");
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const body = await response.json();
    $("login").hidden = true;
    $("board").hidden = false;
    $("sign-out").hidden = false;
    draw(body.result);
    setStatus(`live, updated ${new Date().toLocaleTimeString()}`, "live");
  } catch (error) {
    setStatus(`no answer from the gateway (${error.message}); retrying`, "failing");
  }
  timer = setTimeout(poll, POLL_MS);
}

function start() {
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    poll();
  });
  $("sign-out").addEventListener("click", () => showLogin(""));
  poll();
}

document.addEventListener("DOMContentLoaded", start);
