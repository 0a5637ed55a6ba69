// Live engine: step events from the serving engine over SSE (EventSource), drawn as they arrive.
import { badge, el, idColor } from "./draw.js";
import { t } from "./i18n.js";

const out = () => document.getElementById("live-out");
const HISTORY = 120;
let source = null;
let status = null; // the engine's shape (budget, blocks, slots) when we connected
let last = null; // newest step event with block / slot maps
const steps = []; // recent step events (without maps)
let connected = false;
let pending = false;

export function show() {
  if (!source) connect();
  render();
}

function connect() {
  source = new EventSource("/inspect/api/live");
  source.addEventListener("open", () => { connected = true; schedule(); });
  source.addEventListener("error", () => { connected = false; schedule(); });
  source.addEventListener("status", (e) => { status = JSON.parse(e.data); schedule(); });
  source.addEventListener("step", (e) => {
    const ev = JSON.parse(e.data);
    steps.push(ev);
    if (steps.length > HISTORY) steps.shift();
    if (ev.blocks) last = ev;
    schedule();
  });
}

// Redraw at most once per animation frame, however many events arrive.
function schedule() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => { pending = false; render(); });
}

function budgetBar(ev) {
  const budget = ev.budget;
  return el("div", { class: "bar", id: "budget-bar", title: `${ev.num_tokens} / ${budget}` },
    ev.scheduled.map((s) => el("div", {
      class: `seg ${s.kind}`,
      style: `width:${(100 * s.n) / budget}%;background:${idColor(s.id)}`,
      title: `${s.id}: ${s.n} ${s.kind}${s.drafts ? ` (+${s.drafts} drafts)` : ""}, context ${s.context}`,
    }, `${s.id}·${s.n}`)));
}

function historyChart() {
  const w = 6, h = 60;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", HISTORY * w);
  svg.setAttribute("height", h);
  svg.id = "step-history";
  steps.forEach((ev, i) => {
    let y = h;
    for (const s of ev.scheduled) {
      const bh = (s.n / ev.budget) * h;
      y -= bh;
      const r = document.createElementNS(svg.namespaceURI, "rect");
      Object.entries({ x: i * w, y, width: w - 1, height: Math.max(bh, 0.5), fill: idColor(s.id), opacity: s.kind === "decode" ? 0.55 : 1 })
        .forEach(([k, v]) => r.setAttribute(k, v));
      svg.append(r);
    }
  });
  return svg;
}

function blockGrid(ev) {
  const owner = new Array(ev.num_blocks).fill(null);
  const holders = new Array(ev.num_blocks).fill(0); // > 1: a prefix block shared by several requests
  for (const [rid, blocks] of Object.entries(ev.blocks)) for (const b of blocks) { owner[b] = rid; holders[b] += 1; }
  const cell = ev.num_blocks > 2000 ? 4 : 10;
  const cols = Math.max(1, Math.floor(900 / cell));
  const canvas = el("canvas", { id: "block-grid", width: cols * cell, height: Math.ceil(ev.num_blocks / cols) * cell });
  const ctx = canvas.getContext("2d");
  owner.forEach((rid, b) => {
    ctx.fillStyle = rid === null ? "#e6e9ee" : idColor(rid);
    ctx.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, cell - 1, cell - 1);
    if (holders[b] > 1) {
      ctx.strokeStyle = "#111";
      ctx.strokeRect((b % cols) * cell + 0.5, Math.floor(b / cols) * cell + 0.5, cell - 2, cell - 2);
    }
  });
  return canvas;
}

function slotRow(ev) {
  const bySlot = new Array(ev.num_slots).fill(null);
  for (const [rid, s] of Object.entries(ev.slots)) bySlot[s] = rid;
  return el("div", { class: "chips", id: "slots" }, bySlot.map((rid, s) => el("span", {
    class: "chip", style: `background:${rid === null ? "#c5cbd3" : idColor(rid)}`, title: rid ?? t("free"),
  }, `${s}${rid === null ? "" : `:${rid}`}`)));
}

const chips = (ids) => el("div", { class: "chips" }, ids.map((id) => el("span", { class: "chip", style: `background:${idColor(id)}` }, id)));

export function render() {
  const head = el("div", { class: "panel" }, el("h2", {}, t("live_title"), badge("measured")),
    el("p", { class: "muted" }, t("live_note")),
    el("p", { id: "live-conn" }, connected ? `● ${t("connected")}` : `○ ${t("disconnected")}`,
      status ? ` · ${t("budget")} ${status.budget} · max_num_seqs ${status.max_num_seqs} · ${status.num_blocks} blocks × ${status.block_size} · ${status.num_slots} slots` : ""));
  const ev = steps[steps.length - 1];
  const spec = (ev || status)?.spec;
  const mtp = el("div", { class: "panel", id: "mtp" }, el("h3", {}, t("mtp_title")),
    !spec || !spec.enabled ? el("p", { class: "muted" }, t("not_enabled"))
      : el("p", { id: "mtp-stats" }, `${t("acceptance")}: ${spec.acceptance_rate !== undefined ? (spec.acceptance_rate * 100).toFixed(1) + "%" : "—"}`,
        ` · mean acceptance length ${spec.mean_acceptance_length?.toFixed(2) ?? "—"} · drafts ${spec.num_drafts ?? 0}`,
        ` · accepted per position [${(spec.accepted_per_position || []).join(", ")}] · ${JSON.stringify(spec.config)}`));
  const pc = (ev || status)?.prefix;
  const mib = (n) => `${(n / 1048576).toFixed(2)} MiB`;
  const prefix = el("div", { class: "panel", id: "prefix-cache" }, el("h3", {}, t("prefix_title")),
    !pc || !pc.enabled ? el("p", { class: "muted" }, t("not_enabled"))
      : el("p", { id: "prefix-stats" }, `${t("prefix_hits")}: ${pc.hits} / ${pc.queries} tokens (${(pc.hit_rate * 100).toFixed(1)}%)`,
        ` · ${t("cached_blocks")} ${pc.cached_blocks} · ${t("shared_blocks")} ${pc.shared_blocks}`,
        ` · ${t("snapshots")} ${pc.snapshots}/${pc.total_snapshots} (${mib(pc.snapshot_bytes)})`));
  if (!ev) { out().replaceChildren(head, el("p", { class: "panel muted" }, t("idle")), mtp, prefix); return; }
  const counts = { prefill: 0, decode: 0, drafts: 0 };
  ev.scheduled.forEach((s) => {
    if (s.kind === "prefill") counts.prefill += s.n;
    else { counts.decode += s.n - (s.drafts || 0); counts.drafts += s.drafts || 0; } // decode, or verify = 1 + drafts
  });
  const stepPanel = el("div", { class: "panel", id: "live-step", "data-step": ev.step, "data-running": ev.num_running },
    el("h3", {}, `${t("step")} ${ev.step} · ${ev.num_tokens}/${ev.budget} tokens · ${t("prefill")} ${counts.prefill} · ${t("decode_k")} ${counts.decode} · ${t("drafts")} ${counts.drafts}`),
    budgetBar(ev),
    el("div", { class: "cols" },
      el("div", {}, el("h3", {}, `${t("waiting")} (${ev.num_waiting})`), chips(ev.waiting)),
      el("div", {}, el("h3", {}, `${t("running_q")} (${ev.num_running})`), chips(ev.running)),
      el("div", {}, el("h3", {}, `${t("preemptions")}: ${ev.num_preemptions}`), chips(ev.preempted))),
    el("h3", {}, t("history")), historyChart());
  const cache = el("div", { class: "panel" });
  if (last) {
    const used = Object.values(last.blocks).reduce((a, b) => a + b.length, 0);
    cache.append(el("h3", {}, `${t("blocks_title")} · ${used}/${last.num_blocks} · ${t("step")} ${last.step}`), blockGrid(last),
      el("h3", {}, `${t("slots_title")} · ${Object.keys(last.slots).length}/${last.num_slots}`), slotRow(last));
  }
  out().replaceChildren(head, stepPanel, cache, mtp, prefix);
}
