// UI strings in Chinese and English. t(key) reads the current language; setLang re-renders via listeners.
const STRINGS = {
  title: ["deltaserve 检查器：逐层看真实模型", "deltaserve inspector: the real model, layer by layer"],
  subtitle: ["下面每个数字都来自这台服务器上正在运行的模型，并标明出处。",
    "Every number below comes from the model running on this server, and says where it comes from."],
  tab_trace: ["前向追踪", "Forward trace"], tab_gdn: ["GDN 状态实验台", "GDN state lab"],
  tab_attn: ["注意力实验台", "Attention lab"], tab_plan: ["显存规划", "Memory plan"],
  tab_live: ["实时引擎", "Live engine"], tab_vision: ["视觉", "Vision"],
  src_measured: ["本次实测", "measured in this run"], src_config: ["由配置推导", "computed from config"],
  src_doc: ["文档事实", "documented fact"],
  prompt: ["提示词", "Prompt"], chat_mode: ["作为聊天消息（套用 chat template）", "as a chat message (chat template)"],
  run_trace: ["追踪", "Trace"], coords: ["残差流坐标", "residual coordinates"],
  running: ["计算中…", "running…"],
  model: ["模型", "Model"], layers: ["层", "layers"], params: ["参数", "parameters"],
  tokenization: ["分词：字符串先变成 token ID", "Tokenization: the string becomes token ids first"],
  tok_note: ["ID 不是语义坐标；一个汉字可能被拆成几个字节级 token（�表示半个字符）。",
    "Ids are not semantic coordinates; a CJK character may split into several byte-level tokens (� marks part of a character)."],
  heatmap: ["层 × token 热图", "Layer × token heatmap"], metric: ["指标", "metric"],
  heat_note: ["行=层（真实顺序），列=token 位置。点击单元格选择层与 token。",
    "Rows = layers (real order), columns = token positions. Click a cell to pick layer and token."],
  per_layer: ["逐层表（所选 token）", "Per-layer table (selected token)"],
  layer: ["层", "layer"], type: ["类型", "type"], token: ["token", "token"],
  x_in: ["‖X输入‖", "‖X_in‖"], d_mix: ["‖Δmix‖", "‖Δmix‖"], d_ffn: ["‖Δffn‖", "‖Δffn‖"], x_out: ["‖X输出‖", "‖X_out‖"],
  rel_mix: ["‖Δmix‖/‖X输入‖", "‖Δmix‖/‖X_in‖"],
  coord_vals: ["坐标值（输入 / Δmix / Δffn / 输出）", "coordinates (in / Δmix / Δffn / out)"],
  residual_check: ["残差核对：max|X输出 − (X输入+Δmix+Δffn)|", "residual check: max|X_out − (X_in+Δmix+Δffn)|"],
  layer_detail: ["第 {0} 层：算子链、形状、dtype 与生命周期", "Layer {0}: operator chain, shapes, dtypes, lifetimes"],
  tp_size: ["TP 大小", "TP size"], op: ["算子", "op"], compute: ["计算", "computation"], shape: ["真实逻辑形状", "real logical shape"],
  structure: ["数据结构", "data structure"], kind: ["种类", "kind"], lifetime: ["生命周期", "lifetime"],
  global_shape: ["全局形状", "global shape"], rank_shape: ["每 rank 形状", "per-rank shape"],
  kind_weight: ["权重", "weight"], kind_activation: ["激活", "activation"], kind_cache: ["缓存", "cache"],
  life_model: ["模型装载到卸载", "load to unload"], life_layer: ["本层临时量", "this layer only"],
  life_request: ["每请求，随请求释放", "per request, freed with it"],
  loaded_weights: ["已加载参数", "loaded parameters"],
  final_title: ["最后一层之后：final norm → LM head → 下一个 token 的概率", "After the last layer: final norm → LM head → next-token probabilities"],
  final_note: ["每个位置的 top-k（温度 1）。“实际下一个”是提示词中真实的下一个 token 及其概率。",
    "Top-k at each position (temperature 1). “actual next” is the prompt's real next token and its probability."],
  actual_next: ["实际下一个", "actual next"], pos: ["位置", "pos"],
  gdn_title: ["GDN 状态：每个 token 之后的递推状态 S (dk × dv)", "GDN state: the recurrent state S (dk × dv) after each token"],
  gdn_note: ["S̄ = e^g·S; u = β(v − S̄ᵀk); S = S̄ + k uᵀ。由该层真实的 q,k,v,g,β 重新跑 delta rule 得到。",
    "S̄ = e^g·S; u = β(v − S̄ᵀk); S = S̄ + k uᵀ. Recomputed with the delta-rule kernel from this layer's real q, k, v, g, β."],
  value_head: ["value head", "value head"], key_head: ["共享 key head", "shares key head"],
  decay: ["衰减 e^g", "decay e^g"], beta: ["β", "β"], write: ["写入 ‖k uᵀ‖", "write ‖k uᵀ‖"],
  err: ["预测误差 ‖v − S̄ᵀk‖", "prediction error ‖v − S̄ᵀk‖"], snorm: ["‖S‖", "‖S‖"],
  need_trace: ["先在“前向追踪”中运行一次提示词。", "Run a prompt in “Forward trace” first."],
  attn_title: ["注意力权重（每个 query head，按共享的 KV head 分组）", "Attention weights per query head, grouped by the KV head they share"],
  attn_note: ["A = softmax(QKᵀ/√hd + causal mask)；每行和为 1。门控 = sigmoid(G)，在 o_proj 之前逐元素相乘。",
    "A = softmax(QKᵀ/√hd + causal mask); each row sums to 1. Gate = sigmoid(G), multiplied in before o_proj."],
  kv_group: ["KV head {0}：Q heads {1}", "KV head {0}: Q heads {1}"],
  gate_mean: ["输出门 sigmoid(G) 的均值（行=token，列=head）", "output gate sigmoid(G), mean (rows = tokens, cols = heads)"],
  rope_title: ["部分 RoPE：旋转维 vs 未旋转维", "Partial RoPE: rotated vs unrotated dims"],
  rope_note: ["每个 head 只有前 {0}/{1} 维被旋转（partial_rotary_factor={2}）。分数拆成两部分：旋转维携带位置，未旋转维只比较内容。",
    "Only the first {0} of {1} dims of each head rotate (partial_rotary_factor={2}). The score splits in two: rotated dims carry position, unrotated dims compare content only."],
  score_rot: ["旋转维贡献", "rotated-dims part"], score_plain: ["未旋转维贡献", "unrotated-dims part"],
  wavelengths: ["每对旋转维的波长（token）", "wavelength of each rotated pair (tokens)"],
  q_energy: ["Q 能量：旋转维 / 未旋转维", "Q energy: rotated / unrotated dims"],
  query_head: ["query head", "query head"],
  plan_title: ["显存规划（deltaserve.engine.planner）", "Memory plan (deltaserve.engine.planner)"],
  plan_note: ["逻辑估算，按 TP rank；不含激活与 allocator 开销。“本次分配”是引擎实际申请的缓存张量。",
    "Logical estimate per TP rank; activations and allocator overhead not included. “allocated” is what this engine really allocated."],
  ctx_len: ["上下文长度", "context length"], concurrency: ["并发序列", "concurrent sequences"],
  kv_dtype: ["KV dtype", "KV dtype"], compute_plan: ["计算", "Compute"],
  weights: ["权重", "weights"], kv_tok_layer: ["每 token · 每注意力层 KV", "KV per token per attention layer"],
  kv_total: ["KV 缓存合计", "KV cache total"], gdn_seq: ["每序列 GDN 状态", "GDN state per sequence"],
  gdn_rec: ["每层递推状态", "recurrent state per layer"], gdn_total: ["GDN 状态合计", "GDN state total"],
  total_rank: ["每 rank 合计", "total per rank"], allocated: ["本次分配（实测）", "allocated in this run (measured)"],
  live_title: ["实时引擎：每个 step 的调度", "Live engine: what each step schedules"],
  live_note: ["来自正在服务的引擎（step_listeners → SSE），不是模拟。没人观看时不产生任何开销。",
    "Streamed from the serving engine (step_listeners → SSE), not simulated. Costs nothing when nobody watches."],
  connected: ["已连接", "connected"], disconnected: ["未连接", "disconnected"],
  step: ["step", "step"], budget: ["token 预算", "token budget"], waiting: ["等待", "waiting"], running_q: ["运行", "running"],
  preemptions: ["抢占", "preemptions"], prefill: ["prefill 块", "prefill chunk"], decode_k: ["decode", "decode"],
  drafts: ["投机草稿", "speculative drafts"], blocks_title: ["KV block 池（颜色=所属请求）", "KV block pool (colour = owning request)"],
  slots_title: ["GDN 状态槽位", "GDN state slots"], history: ["最近的 step（每列一个 step，高度=token 数）", "recent steps (one column per step, height = tokens)"],
  mtp_title: ["MTP 投机解码", "MTP speculative decoding"], not_enabled: ["未启用", "not enabled"],
  prefix_title: ["前缀缓存（KV block + GDN 快照）", "Prefix cache (KV blocks + GDN snapshots)"],
  prefix_hits: ["命中", "hits"], cached_blocks: ["已缓存 block", "cached blocks"],
  shared_blocks: ["共享 block（黑框）", "shared blocks (outlined)"], snapshots: ["GDN 快照", "GDN snapshots"],
  acceptance: ["接受率", "acceptance rate"], idle: ["引擎空闲：发送请求到 /v1 即可看到调度。", "Engine idle: send requests to /v1 to watch it schedule."],
  free: ["空闲", "free"], lang: ["English", "中文"],
  vision_title: ["视觉路径：一个真实请求的图片如何变成 token", "Vision path: how a real request's picture becomes tokens"],
  vision_note: ["来自引擎处理该请求图片时的记录：缩放后的图片（塔看到的样子）、patch 网格（细线）与合并块（粗线，每块一个 token）、<|image_pad|> 在提示词中的位置，以及每个合并 token 的 (t, h, w) mRoPE 位置。",
    "Recorded where the engine processed the request's images: the picture as the tower sees it (resized), its patch grid (thin lines) and merge blocks (thick, one token each), where the <|image_pad|> run sits in the prompt, and each merged token's (t, h, w) mRoPE position."],
  vision_off: ["此模型没有视觉塔（或在张量并行下运行），不接受图片。", "This model has no vision tower (or runs tensor-parallel), so it takes no images."],
  vision_empty: ["还没有带图片的请求：向 /v1/chat/completions 发送一个 image_url 后点“刷新”。",
    "No request with images yet: send an image_url to /v1/chat/completions, then Refresh."],
  vision_hover: ["把鼠标移到图片上查看合并 token。", "Hover over the picture to see its merged tokens."],
  vision_sequence: ["token 序列（文本段与图片段）", "Token sequence (text and image runs)"],
  request: ["请求", "request"], refresh: ["刷新", "Refresh"], image: ["图片", "image"],
  prompt_index: ["提示词位置", "prompt index"], patch_rows: ["patch 行", "patch rows"], patch_cols: ["patch 列", "patch cols"],
  sent: ["发送尺寸", "sent"], resized: ["缩放后", "resized"], patches_of: ["个 patch，每个", "patches of"],
  prompt_tokens: ["提示词 token", "prompt tokens"], text_continues: ["后续文本从", "text after continues at"],
  token_table: ["合并 token → (t, h, w)", "merged token → (t, h, w)"],
  error: ["错误", "error"],
};

let lang = localStorage.getItem("deltaserve.lang") || (navigator.language.startsWith("zh") ? "zh" : "en");
const listeners = [];

export function t(key, ...args) {
  const pair = STRINGS[key];
  let s = pair ? pair[lang === "zh" ? 0 : 1] : key;
  args.forEach((a, i) => { s = s.replaceAll(`{${i}}`, a); });
  return s;
}

export function getLang() { return lang; }

export function setLang(next) {
  lang = next;
  localStorage.setItem("deltaserve.lang", lang);
  document.documentElement.lang = lang === "zh" ? "zh-CN" : "en";
  listeners.forEach((fn) => fn());
}

export function onLangChange(fn) { listeners.push(fn); }

// Static markup carries data-i18n="key"; this fills it in.
export function translatePage(root = document) {
  root.querySelectorAll("[data-i18n]").forEach((el) => { el.textContent = t(el.dataset.i18n); });
}
