// The page's shared state: the loaded model, the latest trace and the current selections.
export const state = {
  model: null, // GET /inspect/api/model
  trace: null, // POST /inspect/api/trace
  layer: 0, // selected layer (trace table, layer detail)
  token: 0, // selected token position
  metric: "x_out_norm",
  tp: 1,
  gdnLayer: null, gdnHead: 0, gdnData: null,
  attnLayer: null, attnHead: 0, attnData: null,
};

export function layersOfType(kind) {
  return (state.model?.layer_types || []).map((t, i) => [t, i]).filter(([t]) => t === kind).map(([, i]) => i);
}
