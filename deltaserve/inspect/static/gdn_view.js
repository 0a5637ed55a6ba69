// GDN state lab: the recurrent state S of one GDN layer / value head after every prompt token.
import { api, badge, div, el, fmt, heatmap } from "./draw.js";
import { t } from "./i18n.js";
import { layersOfType, state } from "./state.js";

const out = () => document.getElementById("gdn-out");

export function show() { if (state.trace && !state.gdnData) load(); else render(); }

async function load() {
  const layers = layersOfType("gdn");
  if (state.gdnLayer === null || !layers.includes(state.gdnLayer)) state.gdnLayer = layers[0];
  try {
    state.gdnData = await api(`/inspect/api/gdn_state?trace=${state.trace.trace_id}&layer=${state.gdnLayer}&head=${state.gdnHead}`);
  } catch (e) {
    state.gdnData = { error: e.message };
  }
  render();
}

function bars(label, values, color) {
  const max = Math.max(...values.map(Math.abs), 1e-12);
  return el("tr", {}, el("td", { class: "l" }, label), values.map((v) => el("td", { title: String(v) },
    el("div", { style: `background:${color};height:${Math.max(1, (Math.abs(v) / max) * 28)}px;width:14px;margin:auto` }),
    el("div", { style: "font-size:10px" }, fmt(v, 3)))));
}

export function render() {
  if (!state.trace) { out().replaceChildren(el("p", { class: "muted panel" }, t("need_trace"))); return; }
  const m = state.model;
  const layerSel = el("select", { id: "gdn-layer", onchange: (e) => { state.gdnLayer = +e.target.value; load(); } },
    layersOfType("gdn").map((i) => el("option", { value: i, selected: i === state.gdnLayer ? "" : null }, `L${String(i).padStart(2, "0")} GDN`)));
  const headSel = el("select", { id: "gdn-head", onchange: (e) => { state.gdnHead = +e.target.value; load(); } },
    [...Array(m.linear_num_value_heads).keys()].map((h) => el("option", { value: h, selected: h === state.gdnHead ? "" : null }, String(h))));
  const panel = el("div", { class: "panel" }, el("h2", {}, t("gdn_title"), badge("measured")),
    el("p", { class: "muted" }, t("gdn_note")),
    el("div", { class: "row" }, el("label", {}, `${t("layer")} `, layerSel), el("label", {}, `${t("value_head")} `, headSel)));
  const d = state.gdnData;
  if (!d) { out().replaceChildren(panel); return; }
  if (d.error) { panel.append(el("p", { class: "error" }, d.error)); out().replaceChildren(panel); return; }
  panel.append(el("p", { class: "muted" }, `S ∈ ℝ^${d.dk}×${d.dv} (fp32) · ${t("key_head")} ${d.key_head} · max|S| ${fmt(d.abs_max)}`));
  const cell = Math.max(1, Math.floor(96 / Math.max(d.dk, d.dv)));
  const cards = d.states.map((S, i) => el("div", { class: "state-card", "data-token": i },
    heatmap(S, { cell, maxWidth: 200, colorOf: (v) => div(v / d.abs_max) }),
    el("div", {}, `#${i} “${state.trace.tokens[i].text}”`),
    el("div", {}, `e^g ${fmt(d.decay[i], 3)} · β ${fmt(d.beta[i], 3)}`),
    el("div", {}, `‖kuᵀ‖ ${fmt(d.write_norm[i], 3)}`)));
  panel.append(el("div", { class: "states", id: "gdn-states" }, cards));
  const tokens = state.trace.tokens.map((tok, i) => el("th", {}, `#${i}`));
  panel.append(el("h3", {}, "per token"), el("table", {}, el("thead", {}, el("tr", {}, el("th", {}), tokens)),
    el("tbody", {}, bars(t("decay"), d.decay, "#1d7a4e"), bars(t("beta"), d.beta, "#2456c9"),
      bars(t("write"), d.write_norm, "#a3361f"), bars(t("err"), d.error_norm, "#8a5300"), bars(t("snorm"), d.state_norm, "#555"))));
  out().replaceChildren(panel);
}
