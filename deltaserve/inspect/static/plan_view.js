// Memory plan: the planner as a form, the loaded model beside the real 27B configs.
import { api, badge, bytes, el } from "./draw.js";
import { t } from "./i18n.js";
import { state } from "./state.js";

const out = () => document.getElementById("plan-out");
// tp starts at the engine's own tensor-parallel size: the loaded model's column plans what really runs.
const inputs = { max_model_len: 32768, max_num_seqs: 8, kv_cache_dtype: "auto", tp: null };
let data = null;

export function show() { if (!data) load(); else render(); }

async function load() {
  if (inputs.tp === null) inputs.tp = state.model?.tensor_parallel_size || 1;
  const q = new URLSearchParams(inputs).toString();
  try { data = await api(`/inspect/api/plan?${q}`); } catch (e) { data = { error: e.message }; }
  render();
}

const ROWS = [
  ["weights", "weight_bytes", bytes], ["kv_tok_layer", "kv_bytes_per_token_per_layer", bytes],
  ["kv_total", "kv_cache_bytes", bytes], ["gdn_rec", "gdn_recurrent_bytes_per_layer", bytes],
  ["gdn_seq", "gdn_state_bytes_per_seq", bytes], ["gdn_total", "gdn_state_bytes", bytes],
  ["total_rank", "total_bytes", bytes],
];

export function render() {
  const field = (key, label, opts) => el("label", {}, `${t(label)} `, opts
    ? el("select", { id: `plan-${key}`, onchange: (e) => { inputs[key] = e.target.value; } },
      opts.map((o) => el("option", { value: o, selected: String(o) === String(inputs[key]) ? "" : null }, String(o))))
    : el("input", { id: `plan-${key}`, type: "number", min: 1, value: inputs[key], onchange: (e) => { inputs[key] = +e.target.value; } }));
  const form = el("div", { class: "row" }, field("max_model_len", "ctx_len"), field("max_num_seqs", "concurrency"),
    field("kv_cache_dtype", "kv_dtype", ["auto", "bfloat16", "float32", "fp8"]), field("tp", "tp_size", [1, 2, 4, 8]),
    el("button", { class: "btn", id: "plan-go", onclick: load }, t("compute_plan")));
  const panel = el("div", { class: "panel" }, el("h2", {}, t("plan_title"), badge("config")),
    el("p", { class: "muted" }, t("plan_note")), form);
  if (data?.error) panel.append(el("p", { class: "error" }, data.error));
  else if (data) {
    const plans = data.plans;
    const head = el("tr", {}, el("th", {}), plans.map((p) => el("th", { class: "l" }, p.name)));
    const body = ROWS.map(([label, key, f]) => el("tr", {}, el("td", { class: "l" }, t(label)),
      plans.map((p) => el("td", {}, p.error ? "—" : f(p[key])))));
    body.push(el("tr", {}, el("td", { class: "l" }, "dtypes (model / weights / KV / S)"),
      plans.map((p) => el("td", {}, p.error ? "—" : `${p.model_dtype} / ${p.weight_dtype} / ${p.kv_cache_dtype} / ${p.ssm_state_dtype}`))));
    body.push(el("tr", {}, el("td", { class: "l" }, "layers (GDN + attention)"),
      plans.map((p) => el("td", {}, p.error ? "—" : `${p.layers} (${p.gdn_layers} + ${p.attention_layers})`))));
    panel.append(el("table", { id: "plan-table" }, el("thead", {}, head), el("tbody", {}, body)));
    plans.filter((p) => p.error).forEach((p) => panel.append(el("p", { class: "error" }, `${p.name}: ${p.error}`)));
    const a = plans[0].allocated;
    if (a) {
      panel.append(el("h3", {}, t("allocated"), badge("measured")), el("p", {},
        `KV ${bytes(a.kv_bytes)} (${a.num_blocks} blocks × ${a.block_size} tokens) · GDN ${bytes(a.gdn_state_bytes)} (${a.num_slots} slots) · max_model_len ${a.max_model_len}`));
    }
    plans.filter((p) => p.text).forEach((p) => panel.append(el("details", {}, el("summary", {}, p.name), el("pre", {}, p.text))));
  }
  out().replaceChildren(panel);
}
