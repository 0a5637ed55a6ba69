// Forward trace: tokenization, layer x token heatmap, per-layer table, layer detail, final top-k.
import { absMax, api, badge, div, el, fmt, heatmap, markCell, seq } from "./draw.js";
import { t } from "./i18n.js";
import { state } from "./state.js";

const out = () => document.getElementById("trace-out");
const METRICS = ["x_out_norm", "x_in_norm", "mix_norm", "ffn_norm", "rel_mix"];
const METRIC_LABEL = { x_out_norm: "x_out", x_in_norm: "x_in", mix_norm: "d_mix", ffn_norm: "d_ffn", rel_mix: "rel_mix" };
let layerDetail = null; // last /api/layer answer

export function init() {
  document.getElementById("trace-form").addEventListener("submit", (ev) => { ev.preventDefault(); run(); });
}

async function run() {
  const status = document.getElementById("trace-status");
  const text = document.getElementById("prompt").value;
  const chat = document.getElementById("chat-mode").checked;
  const coords = document.getElementById("coords").value.split(",").map((s) => s.trim()).filter(Boolean).map(Number);
  const body = chat ? { messages: [{ role: "user", content: text }] } : { prompt: text };
  body.coords = coords;
  status.textContent = t("running");
  status.className = "status";
  try {
    state.trace = await api("/inspect/api/trace", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    state.token = state.trace.num_tokens - 1;
    state.gdnData = null;
    state.attnData = null;
    status.textContent = "";
    render();
    loadLayer(state.layer);
  } catch (e) {
    status.textContent = `${t("error")}: ${e.message}`;
    status.className = "status error";
  }
}

function metricValues(metric) {
  return state.trace.layers.map((L) => {
    if (metric === "rel_mix") return L.mix_norm.map((v, i) => v / (L.x_in_norm[i] || 1));
    if (metric.startsWith("coord")) return L.x_out.map((row) => row[+metric.slice(5)]);
    return L[metric];
  });
}

function select(layer, token) {
  if (layer !== null) state.layer = layer;
  if (token !== null) state.token = token;
  render();
  if (layer !== null) loadLayer(layer);
}

async function loadLayer(layer) {
  try {
    layerDetail = await api(`/inspect/api/layer?layer=${layer}&tp=${state.tp}&tokens=${state.trace?.num_tokens || 1}`);
  } catch (e) {
    layerDetail = { error: e.message, layer };
  }
  const holder = document.getElementById("layer-detail");
  if (holder) holder.replaceChildren(renderLayerDetail());
}

function tokenPanel() {
  const tr = state.trace;
  const chips = tr.tokens.map((tok, i) => el("div", {
    class: `tok${i === state.token ? " sel" : ""}${tok.special ? " special" : ""}`,
    title: `piece ${tok.piece ?? ""}${tok.span ? ` · chars [${tok.span[0]}, ${tok.span[1]})` : ""}`,
    onclick: () => select(null, i),
  }, tok.text.replace(/\n/g, "⏎") || "␣", el("span", { class: "id" }, `#${i} · ${tok.id}`),
  tok.bytes ? el("span", { class: "bytes" }, tok.bytes) : null));
  return el("div", { class: "panel", id: "tokens" },
    el("h2", {}, t("tokenization"), badge("measured")),
    el("p", { class: "muted" }, t("tok_note"), ` (T = ${tr.num_tokens})`),
    tr.text !== null ? el("pre", {}, tr.text) : null,
    el("div", { class: "tokens" }, chips));
}

function heatPanel() {
  const tr = state.trace;
  const metrics = [...METRICS, ...tr.coords.map((c, i) => `coord${i}`)];
  const sel = el("select", { id: "metric", onchange: (e) => { state.metric = e.target.value; render(); } },
    metrics.map((m) => el("option", { value: m, selected: m === state.metric ? "" : null },
      m.startsWith("coord") ? `X_out[${tr.coords[+m.slice(5)]}]` : t(METRIC_LABEL[m]))));
  const values = metricValues(state.metric);
  const signed = state.metric.startsWith("coord");
  const max = absMax(values);
  const canvas = heatmap(values, {
    cell: 16, maxWidth: 1000,
    colorOf: (v) => (signed ? div(v / max) : seq(v / max)),
    onPick: (r, c) => select(r, c),
  });
  markCell(canvas, state.layer, state.token);
  const labels = el("div", { class: "heatlabels" }, tr.layers.map((L) => el("div", {
    class: `type-${L.type}`, style: `height:${canvas.dataset.ch}px`,
  }, `L${String(L.layer).padStart(2, "0")} ${L.type === "gdn" ? "GDN" : "ATT"}`)));
  return el("div", { class: "panel", id: "heat" },
    el("h2", {}, t("heatmap"), badge("measured")),
    el("div", { class: "row" }, el("label", {}, `${t("metric")} `, sel),
      el("span", { class: "muted" }, `max ${fmt(max)} · ${t("heat_note")}`)),
    el("div", { class: "heatwrap" }, labels, canvas));
}

function tablePanel() {
  const tr = state.trace;
  const k = state.token;
  const head = el("tr", {}, el("th", {}, t("layer")), el("th", {}, t("type")), el("th", {}, t("x_in")),
    el("th", {}, t("d_mix")), el("th", {}, t("d_ffn")), el("th", {}, t("x_out")),
    el("th", { class: "l" }, `${t("coord_vals")} [${tr.coords.join(",")}]`), el("th", {}, "resid. err"));
  const rows = tr.layers.map((L) => el("tr", {
    class: `click layer-row${L.layer === state.layer ? " sel" : ""}`, "data-layer": L.layer, "data-type": L.type,
    onclick: () => select(L.layer, null),
  }, el("td", {}, `L${String(L.layer).padStart(2, "0")}`), el("td", { class: `l type-${L.type}` }, L.type === "gdn" ? "GDN" : "Attention"),
  el("td", {}, fmt(L.x_in_norm[k])), el("td", {}, fmt(L.mix_norm[k])), el("td", {}, fmt(L.ffn_norm[k])),
  el("td", {}, fmt(L.x_out_norm[k])),
  el("td", { class: "l" }, [L.x_in, L.mix, L.ffn, L.x_out].map((m) => `[${m[k].map((v) => fmt(v, 3)).join(", ")}]`).join(" → ")),
  el("td", {}, fmt(L.residual_error, 2))));
  const tok = tr.tokens[k];
  return el("div", { class: "panel", id: "layer-table" },
    el("h2", {}, `${t("per_layer")}: #${k} “${tok.text}” (${tok.id})`, badge("measured")),
    el("p", { class: "muted" }, t("residual_check")),
    el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
}

function renderLayerDetail() {
  const d = layerDetail;
  const tpSel = el("select", { id: "tp", onchange: (e) => { state.tp = +e.target.value; loadLayer(state.layer); } },
    [1, 2, 4, 8].map((n) => el("option", { value: n, selected: n === state.tp ? "" : null }, String(n))));
  const box = el("div", { "data-layer": d?.layer, "data-tp": d?.tp }, el("h2", {}, t("layer_detail", d?.layer ?? state.layer), badge("config")),
    el("div", { class: "row" }, el("label", {}, `${t("tp_size")} `, tpSel)));
  if (!d) return box;
  if (d.error) { box.append(el("p", { class: "error" }, d.error)); return box; }
  box.append(el("p", { class: "muted" }, `${d.module} · ${d.type === "gdn" ? "Gated DeltaNet" : "gated GQA"} · T=${d.num_tokens} · TP${d.tp}: `,
    JSON.stringify(d.rank)));
  box.append(el("table", { id: "ops" }, el("thead", {}, el("tr", {}, el("th", {}, t("op")), el("th", { class: "l" }, t("compute")),
    el("th", { class: "l" }, t("shape")))), el("tbody", {}, d.ops.map((o, i) => el("tr", {},
    el("td", {}, String(i + 1)), el("td", { class: "l" }, o.formula), el("td", { class: "l" }, o.shape))))));
  box.append(el("h3", {}, t("structure")));
  box.append(el("table", {}, el("thead", {}, el("tr", {}, ["structure", "kind", "global_shape", "rank_shape", "lifetime"]
    .map((k) => el("th", { class: "l" }, t(k))), el("th", { class: "l" }, "dtype"))),
  el("tbody", {}, d.tensors.map((x) => el("tr", {}, el("td", { class: "l" }, x.name), el("td", { class: "l" }, t(`kind_${x.kind}`)),
    el("td", { class: "l" }, x.shape), el("td", { class: "l" }, x.rank_shape), el("td", { class: "l" }, t(`life_${x.lifetime}`)),
    el("td", { class: "l" }, x.dtype))))));
  box.append(el("h3", {}, t("loaded_weights"), badge("measured")));
  box.append(el("table", {}, el("tbody", {}, d.weights.map((w) => el("tr", {}, el("td", { class: "l" }, w.name),
    el("td", { class: "l" }, `[${w.shape.join(", ")}]`), el("td", { class: "l" }, w.dtype), el("td", {}, w.numel.toLocaleString()))))));
  return box;
}

function finalPanel() {
  const tr = state.trace;
  const f = tr.final;
  const k = state.token;
  const p = f.positions[k];
  const coordRow = (label, v) => el("tr", {}, el("td", { class: "l" }, label), v.map((x) => el("td", {}, fmt(x))));
  const top = el("table", { id: "topk" }, el("tbody", {}, p.top.map((c) => el("tr", {},
    el("td", { class: "l" }, JSON.stringify(c.text)), el("td", {}, `#${c.id}`), el("td", {}, `logit ${fmt(c.logit, 3)}`),
    el("td", { class: "l" }, el("div", { style: `background:#2456c9;height:10px;width:${Math.max(1, c.p * 200)}px` })),
    el("td", {}, `${(c.p * 100).toFixed(2)}%`)))));
  const all = el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, t("pos")), el("th", { class: "l" }, "token"),
    el("th", { class: "l" }, "top-1"), el("th", { class: "l" }, "top-2"), el("th", { class: "l" }, "top-3"), el("th", { class: "l" }, t("actual_next")))),
  el("tbody", {}, f.positions.map((q, i) => el("tr", { class: `click${i === k ? " sel" : ""}`, onclick: () => select(null, i) },
    el("td", {}, String(i)), el("td", { class: "l" }, JSON.stringify(tr.tokens[i].text)),
    q.top.slice(0, 3).map((c) => el("td", { class: "l" }, `${JSON.stringify(c.text)} ${(c.p * 100).toFixed(1)}%`)),
    el("td", { class: "l" }, q.next_id === null ? "—" : `${JSON.stringify(tr.tokens[i + 1].text)} ${(q.p_next * 100).toFixed(2)}%`)))));
  return el("div", { class: "panel", id: "final" },
    el("h2", {}, t("final_title"), badge("measured")),
    el("p", { class: "muted" }, `h = RMSNorm(X_L)·(1+γ); logits = h W_lm; p = softmax(logits). ${t("final_note")}`),
    el("table", {}, el("tbody", {}, coordRow(`X_L[${tr.coords}] ‖${fmt(f.x_norm[k])}‖`, f.x[k]),
      coordRow(`h[${tr.coords}] ‖${fmt(f.h_norm[k])}‖`, f.h[k]))),
    el("h3", {}, `#${k} “${tr.tokens[k].text}” → top-${f.top_k}`), top,
    el("h3", {}, t("pos")), all);
}

export function render() {
  if (!state.trace) { out().replaceChildren(); return; }
  const detail = el("div", { class: "panel", id: "layer-detail" }, renderLayerDetail());
  out().replaceChildren(tokenPanel(), heatPanel(), tablePanel(), detail, finalPanel());
}
