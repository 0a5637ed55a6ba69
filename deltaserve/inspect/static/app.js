// Entry point: tabs, language toggle, model summary; each tab's view renders itself from `state`.
import { api, el } from "./draw.js";
import { getLang, onLangChange, setLang, t, translatePage } from "./i18n.js";
import { state } from "./state.js";
import * as traceView from "./trace_view.js";
import * as gdnView from "./gdn_view.js";
import * as attnView from "./attn_view.js";
import * as planView from "./plan_view.js";
import * as liveView from "./live_view.js";
import * as visionView from "./vision_view.js";

const views = { trace: traceView, gdn: gdnView, attn: attnView, plan: planView, live: liveView, vision: visionView };
let current = "trace";

function showTab(name) {
  current = name;
  document.querySelectorAll("nav button").forEach((b) => b.classList.toggle("active", b.dataset.tab === name));
  document.querySelectorAll(".tab").forEach((s) => s.classList.toggle("active", s.id === `tab-${name}`));
  views[name].show?.();
}

function renderChrome() {
  translatePage();
  document.getElementById("lang-toggle").textContent = t("lang");
  const m = state.model;
  const line = document.getElementById("model-line");
  if (m) {
    const gdn = m.layer_types.filter((x) => x === "gdn").length;
    line.replaceChildren(
      `${t("model")}: ${m.model} · ${m.layer_types.length} ${t("layers")} (${gdn} GDN + ${m.layer_types.length - gdn} attention) · `,
      `${(m.params / 1e6).toFixed(2)}M ${t("params")} · ${m.dtype} · hidden ${m.hidden_size}`,
    );
  }
}

async function main() {
  document.getElementById("lang-toggle").addEventListener("click", () => setLang(getLang() === "zh" ? "en" : "zh"));
  document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  onLangChange(() => { renderChrome(); Object.values(views).forEach((v) => v.render()); });
  setLang(getLang());
  try {
    state.model = await api("/inspect/api/model");
  } catch (e) {
    document.getElementById("model-line").replaceChildren(el("span", { class: "error" }, String(e)));
    return;
  }
  renderChrome();
  Object.values(views).forEach((v) => v.init?.({ showTab }));
  document.body.dataset.ready = "1";
}

main();
