// Small drawing and DOM helpers shared by the views: element builder, colour scales, canvas heatmaps.
import { t } from "./i18n.js";

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// Where a number comes from: measured in this run, computed from the config, or a documented fact.
export function badge(source) {
  const key = { measured: "src_measured", config: "src_config", doc: "src_doc" }[source] || "src_measured";
  return el("span", { class: `badge badge-${source}`, title: t(key) }, t(key));
}

export function fmt(x, digits = 4) {
  if (x === null || x === undefined) return "—";
  if (typeof x !== "number") return String(x);
  if (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e5)) return x.toExponential(2);
  return x.toFixed(digits);
}

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [u, s] of units) if (Math.abs(n) >= s) return `${(n / s).toFixed(2)} ${u}`;
  return `${n} B`;
}

// Sequential scale (0..1) for magnitudes; diverging scale (-1..1) for signed values.
export function seq(v) {
  const x = Math.max(0, Math.min(1, v));
  const r = Math.round(255 - 200 * x), g = Math.round(250 - 170 * x), b = Math.round(240 - 90 * x);
  return `rgb(${r},${g},${b})`;
}

export function div(v) {
  const x = Math.max(-1, Math.min(1, v));
  if (x >= 0) return `rgb(255,${Math.round(255 - 180 * x)},${Math.round(255 - 200 * x)})`;
  return `rgb(${Math.round(255 + 200 * x)},${Math.round(255 + 140 * x)},255)`;
}

// A stable colour per request id (the live view's block grid and step bars).
export function idColor(id) {
  let h = 0;
  for (const ch of String(id)) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360},65%,${50 + (h >> 9) % 15}%)`;
}

// A canvas heatmap of rows x cols; values mapped by colorOf. Returns the canvas; onPick(row, col).
export function heatmap(values, { cell = 14, colorOf, onPick, maxWidth = 900, title } = {}) {
  const rows = values.length, cols = rows ? values[0].length : 0;
  const cw = Math.max(2, Math.min(cell, Math.floor(maxWidth / Math.max(cols, 1))));
  const ch = Math.max(2, Math.min(cell, cw * 2));
  const canvas = el("canvas", { width: cols * cw, height: rows * ch, class: "heat" });
  if (title) canvas.title = title;
  const ctx = canvas.getContext("2d");
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) {
      const v = values[r][c];
      ctx.fillStyle = v === null || Number.isNaN(v) ? "#eee" : colorOf(v, r, c);
      ctx.fillRect(c * cw, r * ch, cw, ch);
    }
  }
  canvas.dataset.cw = cw;
  canvas.dataset.ch = ch;
  if (onPick) {
    canvas.addEventListener("click", (ev) => {
      const rect = canvas.getBoundingClientRect();
      const x = (ev.clientX - rect.left) * (canvas.width / rect.width);
      const y = (ev.clientY - rect.top) * (canvas.height / rect.height);
      onPick(Math.floor(y / ch), Math.floor(x / cw));
    });
  }
  return canvas;
}

// Outline one cell (the current selection) on a heatmap canvas drawn by heatmap().
export function markCell(canvas, row, col) {
  const cw = +canvas.dataset.cw, ch = +canvas.dataset.ch;
  const ctx = canvas.getContext("2d");
  ctx.strokeStyle = "#111";
  ctx.lineWidth = 2;
  ctx.strokeRect(col * cw + 1, row * ch + 1, cw - 2, ch - 2);
}

export function absMax(matrix) {
  let m = 0;
  for (const row of matrix) for (const v of row) if (v !== null && Math.abs(v) > m) m = Math.abs(v);
  return m || 1;
}

export async function api(path, opts = {}) {
  const res = await fetch(path, opts);
  const body = await res.json();
  if (!res.ok) throw new Error(body?.error?.message || `${res.status}`);
  return body;
}
