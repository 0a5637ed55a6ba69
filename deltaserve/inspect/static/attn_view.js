// Attention lab: softmax weights per query head grouped by shared KV head, output gates, partial RoPE.
import { absMax, api, badge, div, el, fmt, heatmap, seq } from "./draw.js";
import { t } from "./i18n.js";
import { layersOfType, state } from "./state.js";

const out = () => document.getElementById("attn-out");

export function show() { if (state.trace && !state.attnData) load(); else render(); }

async function load() {
  const layers = layersOfType("attention");
  if (state.attnLayer === null || !layers.includes(state.attnLayer)) state.attnLayer = layers[0];
  try {
    state.attnData = await api(`/inspect/api/attention?trace=${state.trace.trace_id}&layer=${state.attnLayer}&head=${state.attnHead}`);
  } catch (e) {
    state.attnData = { error: e.message };
  }
  render();
}

export function render() {
  if (!state.trace) { out().replaceChildren(el("p", { class: "muted panel" }, t("need_trace"))); return; }
  const layerSel = el("select", { id: "attn-layer", onchange: (e) => { state.attnLayer = +e.target.value; load(); } },
    layersOfType("attention").map((i) => el("option", { value: i, selected: i === state.attnLayer ? "" : null }, `L${String(i).padStart(2, "0")} Attention`)));
  const panel = el("div", { class: "panel" }, el("h2", {}, t("attn_title"), badge("measured")),
    el("p", { class: "muted" }, t("attn_note")), el("div", { class: "row" }, el("label", {}, `${t("layer")} `, layerSel)));
  const d = state.attnData;
  if (!d) { out().replaceChildren(panel); return; }
  if (d.error) { panel.append(el("p", { class: "error" }, d.error)); out().replaceChildren(panel); return; }
  const T = state.trace.num_tokens;
  const cell = Math.max(2, Math.min(10, Math.floor(160 / T)));
  d.groups.forEach((heads, g) => {
    panel.append(el("div", { class: "group", "data-kv": g }, el("h3", {}, t("kv_group", g, `${heads[0]}–${heads[heads.length - 1]}`)),
      el("div", { class: "grid-heads" }, heads.map((h) => el("div", {
        class: `head-card${h === d.head ? " sel" : ""}`, "data-head": h,
        onclick: () => { state.attnHead = h; load(); },
      }, heatmap(d.weights[h], { cell, maxWidth: 200, colorOf: (v) => seq(Math.sqrt(v)) }), `Q${h}`)))));
  });
  const gate = d.gate_mean;
  panel.append(el("h3", {}, t("gate_mean"), badge("measured")),
    heatmap(gate, { cell: 12, colorOf: (v) => seq(v) }),
    el("p", { class: "muted" }, `min ${fmt(Math.min(...d.gate_min.flat()), 3)} · max ${fmt(Math.max(...d.gate_max.flat()), 3)}`));
  const r = d.rope;
  const scale = Math.max(absMax(r.score_rotated), absMax(r.score_unrotated));
  panel.append(el("div", { class: "panel", id: "rope" }, el("h2", {}, t("rope_title"), badge("config"), badge("measured")),
    el("p", { class: "muted" }, t("rope_note", r.rotary_dim, r.head_dim, r.partial_rotary_factor), ` θ=${r.theta}`),
    el("div", { class: "row" },
      el("div", { class: "head-card" }, heatmap(r.score_rotated, { cell: Math.max(cell, 6), colorOf: (v) => div(v / scale) }), `${t("score_rot")} · Q${d.head}`),
      el("div", { class: "head-card" }, heatmap(r.score_unrotated, { cell: Math.max(cell, 6), colorOf: (v) => div(v / scale) }), `${t("score_plain")} · Q${d.head}`)),
    el("h3", {}, t("wavelengths")), el("p", {}, r.wavelengths.map((w) => fmt(w, 1)).join(" · ")),
    el("h3", {}, t("q_energy")), el("table", {}, el("tbody", {},
      el("tr", {}, el("th", {}, t("query_head")), r.q_energy_rotated.map((_, h) => el("th", {}, `Q${h}`))),
      el("tr", {}, el("td", { class: "l" }, `dims [0,${r.rotary_dim})`), r.q_energy_rotated.map((v) => el("td", {}, fmt(v, 3)))),
      el("tr", {}, el("td", { class: "l" }, `dims [${r.rotary_dim},${r.head_dim})`), r.q_energy_unrotated.map((v) => el("td", {}, fmt(v, 3))))))));
  out().replaceChildren(panel);
}
