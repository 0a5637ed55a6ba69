// Vision path of a real request: the picture as the tower sees it with its patch grid and merge blocks drawn
// over it, the merged tokens' place in the prompt (the <|image_pad|> run) and their (t, h, w) mRoPE positions.
import { api, badge, el } from "./draw.js";
import { t } from "./i18n.js";

const out = () => document.getElementById("vision-out");
const DISPLAY_SIDE = 384; // longest side of the drawn picture, CSS pixels
const MAX_ROWS = 1024; // merged-token table rows shown per image
let summary = null; // GET /inspect/api/vision
let detail = null; // GET /inspect/api/vision/request
let selected = null; // request id
let error = null;
const hover = {}; // image index -> merged token under the mouse

export function show() { load(); }

async function load() {
  error = null;
  try {
    summary = await api("/inspect/api/vision");
    const ids = summary.requests.map((r) => r.request_id);
    if (!ids.includes(selected)) selected = ids[0] ?? null;
    detail = selected === null ? null
      : await api(`/inspect/api/vision/request?${new URLSearchParams({ request_id: selected })}`);
  } catch (e) { error = e.message; }
  render();
}

async function pick(id) { selected = id; detail = null; await load(); }

const triple = (p) => `(${p.join(", ")})`;

// Which merged token of image `im` a point (x, y in CSS pixels over the drawn picture) falls in.
function tokenAt(im, x, y, scale) {
  const [, gh, gw] = im.merged_grid;
  const side = im.patch_size * im.merge_size * scale;
  const r = Math.floor(y / side), c = Math.floor(x / side);
  return r >= 0 && r < gh && c >= 0 && c < gw ? r * gw + c : null;
}

function drawGrid(canvas, picture, im, scale) {
  const g = canvas.getContext("2d");
  g.imageSmoothingEnabled = false;
  g.drawImage(picture, 0, 0, canvas.width, canvas.height);
  const [, h, w] = im.grid_thw;
  const p = im.patch_size * scale, m = im.merge_size;
  const line = (x0, y0, x1, y1) => { g.beginPath(); g.moveTo(x0, y0); g.lineTo(x1, y1); g.stroke(); };
  for (const merged of [false, true]) { // patches thin, merge blocks (one token each) thick
    g.strokeStyle = merged ? "rgba(36,86,201,0.95)" : "rgba(255,255,255,0.55)";
    g.lineWidth = merged ? 2 : 1;
    for (let c = 0; c <= w; c += merged ? m : 1) line(c * p, 0, c * p, h * p);
    for (let r = 0; r <= h; r += merged ? m : 1) line(0, r * p, w * p, r * p);
  }
  const k = hover[im.index];
  if (k !== null && k !== undefined) {
    const gw = im.merged_grid[2], side = p * m;
    g.fillStyle = "rgba(255,200,0,0.45)";
    g.fillRect((k % gw) * side, Math.floor(k / gw) * side, side, side);
  }
}

function imageCard(im) {
  const [W, H] = im.resized_size;
  const fit = DISPLAY_SIDE / Math.max(W, H);
  const scale = fit >= 1 ? Math.floor(fit) : fit; // whole pixels up, any ratio down
  const canvas = el("canvas", { class: "vision-grid", id: `vision-grid-${im.index}`, width: Math.round(W * scale),
    height: Math.round(H * scale), "data-patches": im.num_patches, "data-tokens": im.num_tokens });
  const info = el("p", { class: "vision-hover", id: `vision-hover-${im.index}` }, t("vision_hover"));
  const picture = new Image();
  picture.onload = () => { drawGrid(canvas, picture, im, scale); canvas.dataset.drawn = "1"; };
  picture.src = im.thumbnail;
  const rows = im.positions.slice(0, MAX_ROWS).map((pos, k) => {
    const [, , gw] = im.merged_grid;
    const r = Math.floor((k % (im.merged_grid[1] * gw)) / gw), c = k % gw, m = im.merge_size;
    return el("tr", { "data-token": k }, el("td", {}, k), el("td", {}, im.token_start + k),
      el("td", {}, pos[0]), el("td", {}, pos[1]), el("td", {}, pos[2]),
      el("td", { class: "l" }, `${r * m}–${r * m + m - 1}`), el("td", { class: "l" }, `${c * m}–${c * m + m - 1}`));
  });
  const table = el("table", { class: "vision-tokens", id: `vision-tokens-${im.index}` },
    el("thead", {}, el("tr", {}, ["merged token", t("prompt_index"), "t", "h", "w", t("patch_rows"), t("patch_cols")]
      .map((x) => el("th", {}, x)))), el("tbody", {}, rows));
  const setHover = (k) => {
    hover[im.index] = k;
    drawGrid(canvas, picture, im, scale);
    table.querySelectorAll("tr.sel").forEach((r) => r.classList.remove("sel"));
    if (k === null) { info.textContent = t("vision_hover"); return; }
    table.querySelector(`tr[data-token='${k}']`)?.classList.add("sel");
    info.textContent = `merged token ${k} · ${t("prompt_index")} ${im.token_start + k} · (t, h, w) = ${triple(im.positions[k])}`;
  };
  canvas.addEventListener("mousemove", (ev) => {
    const rect = canvas.getBoundingClientRect();
    const k = tokenAt(im, (ev.clientX - rect.left) * (canvas.width / rect.width),
      (ev.clientY - rect.top) * (canvas.height / rect.height), scale);
    if (k !== hover[im.index]) setHover(k);
  });
  canvas.addEventListener("mouseleave", () => setHover(null));
  const [gt, gh, gw] = im.grid_thw;
  const facts = el("ul", { class: "vision-facts" },
    el("li", {}, `${t("sent")}: ${im.sent_size ? im.sent_size.join("×") : "—"} px → ${t("resized")}: ${W}×${H} px`),
    el("li", { id: `vision-grid-thw-${im.index}` }, `grid_thw (t, h, w) = (${gt}, ${gh}, ${gw}) ${t("patches_of")} ${im.patch_size}×${im.patch_size}`
      + ` (temporal patch ${im.temporal_patch_size}) = ${im.num_patches} patches`),
    el("li", {}, `spatial merge ${im.merge_size}×${im.merge_size} → ${triple(im.merged_grid)} = ${im.num_tokens} merged tokens`),
    el("li", { id: `vision-span-${im.index}` }, `<|image_pad|> × ${im.num_tokens}: ${t("prompt_tokens")} [${im.token_start}, ${im.token_end})`),
    el("li", {}, `mRoPE: ${triple(im.positions[0])} … ${triple(im.positions[im.positions.length - 1])}`
      + (im.next_text_position ? ` · ${t("text_continues")} ${triple(im.next_text_position)}` : "")));
  return el("div", { class: "panel vision-image", "data-image": im.index },
    el("h3", {}, `${t("image")} ${im.index}`, badge("measured")),
    el("div", { class: "vision-row" }, el("div", {}, canvas, info), facts),
    im.positions.length > MAX_ROWS ? el("p", { class: "muted" }, `${MAX_ROWS} / ${im.positions.length}`) : null,
    el("details", { open: im.num_tokens <= 64 ? "" : null }, el("summary", {}, t("token_table")), table));
}

function sequence(d) {
  return el("div", { class: "tokens", id: "vision-sequence" }, d.segments.map((s) => el("span", {
    class: `tok seg-${s.kind}`, "data-kind": s.kind, "data-start": s.start, "data-end": s.end,
    title: `${triple(s.first_position)} … ${triple(s.last_position)}`,
  }, s.kind === "image" ? `${t("image")} ${s.image}: <|image_pad|> × ${s.end - s.start}` : s.text,
  el("span", { class: "id" }, `[${s.start}, ${s.end}) · ${triple(s.first_position)}…${triple(s.last_position)}`))));
}

export function render() {
  const head = el("div", { class: "panel" }, el("h2", {}, t("vision_title"), badge("measured")),
    el("p", { class: "muted" }, t("vision_note")));
  if (error) { out().replaceChildren(head, el("p", { class: "panel error" }, error)); return; }
  if (!summary) { out().replaceChildren(head); return; }
  if (!summary.enabled) { out().replaceChildren(head, el("p", { class: "panel muted", id: "vision-off" }, t("vision_off"))); return; }
  const choose = el("div", { class: "row" },
    el("label", {}, `${t("request")} `, el("select", { id: "vision-request", onchange: (e) => pick(e.target.value) },
      summary.requests.map((r) => el("option", { value: r.request_id, selected: r.request_id === selected ? "" : null },
        `${r.request_id} · ${r.num_images} ${t("image")} · ${r.prompt_tokens} tokens`)))),
    el("button", { class: "btn", id: "vision-refresh", onclick: load }, t("refresh")));
  head.append(choose);
  if (!detail) { out().replaceChildren(head, el("p", { class: "panel muted", id: "vision-empty" }, t("vision_empty"))); return; }
  const seq = el("div", { class: "panel", id: "vision-request-detail", "data-request": detail.request_id },
    el("h3", {}, `${t("vision_sequence")} · ${detail.prompt_tokens} tokens · mRoPE delta ${detail.mrope_delta}`), sequence(detail));
  out().replaceChildren(head, seq, ...detail.images.map(imageCard));
}
