// Sharding view: draws the blocks computed in Python; clicks choose what to draw.
// No network, no build step: anywidget loads this file as an ES module.

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "style") Object.assign(node.style, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function drawModule(model, root) {
  const rows = model.get("rows");
  if (!rows.length) return;
  const totals = model.get("totals");
  const ranks = Object.keys(totals);
  const table = el("table", { class: "meshlab-params" });
  table.append(el("tr", {}, ...["name", "shape", "placements", ...ranks.map((r) => `rank ${r}`)]
    .map((h) => el("th", {}, h))));
  rows.forEach((row, i) => {
    const tr = el("tr", {
      class: "meshlab-param" + (i === model.get("selected") ? " selected" : ""),
      "data-index": String(i),
      onclick: () => { model.set("selected", i); model.save_changes(); },
    }, el("td", {}, row.name + (row.buffer ? " (buffer)" : "")), el("td", {}, `[${row.shape}]`),
      el("td", {}, row.placements), ...ranks.map((r) => el("td", {}, fmtBytes(row.bytes[r] || 0))));
    table.append(tr);
  });
  table.append(el("tr", { class: "meshlab-total" }, el("td", {}, "total per rank"), el("td"),
    el("td"), ...ranks.map((r) => el("td", {}, fmtBytes(totals[r])))));
  root.append(table);
}

function drawDimPickers(model, t, root) {
  if (t.shape.length <= 2) return;
  const pick = (which) => {
    const select = el("select", { class: `meshlab-dim-${which}`, onchange: () => {
      const dims = [...t.dims];
      dims[which] = Number(select.value);
      model.set("dims", dims);
      model.save_changes();
    } });
    t.shape.forEach((n, d) => {
      const opt = el("option", { value: String(d) }, `dim ${d} (${n})`);
      if (d === t.dims[which]) opt.selected = true;
      select.append(opt);
    });
    return select;
  };
  root.append(el("div", { class: "meshlab-dims" }, "rows: ", pick(0), " columns: ", pick(1)));
}

function drawTensor(model, root) {
  const t = model.get("tensor");
  if (!t || !t.shape) return;
  const placed = t.placements.length ? t.placements.join(", ") : "local tensor (one per rank)";
  const mesh = t.mesh_shape.length ? ` on mesh [${t.mesh_shape}] (${t.mesh_axes.join(", ")})` : "";
  root.append(el("div", { class: "meshlab-caption" },
    el("b", {}, t.name || "tensor"), ` [${t.shape}] ${t.dtype} · ${placed}${mesh}`));
  drawDimPickers(model, t, root);
  const nRows = t.dims.length ? Math.max(t.shape[t.dims[0]], 1) : 1;
  const nCols = t.dims.length > 1 ? Math.max(t.shape[t.dims[1]], 1) : 1;
  // Keep the tensor's aspect ratio inside 360 x 360; thin tensors stay visible.
  const scale = Math.min(360 / nCols, 360 / nRows);
  const width = Math.max(40, nCols * scale);
  const height = Math.max(24, nRows * scale);
  const grid = el("div", { class: "meshlab-grid", style: { width: `${width}px`, height: `${height}px` } });
  const detail = el("div", { class: "meshlab-detail" }, "hover or click a block");
  const show = (b) => {
    detail.replaceChildren(el("div", {}, el("b", {}, b.label),
      b.replicated ? " · replicated" : "", b.partial ? " · partial: pending reduction" : ""),
      ...b.detail.map((s) => el("div", {},
        `rank ${s.rank}` + (s.coordinate.length ? ` at [${s.coordinate}]` : "") +
        `: local [${s.local_shape}] from offset [${s.offsets}], ${fmtBytes(s.bytes)}`)));
  };
  for (const b of t.blocks) {
    const box = el("div", {
      class: "meshlab-block" + (b.replicated ? " replicated" : "") + (b.partial ? " partial" : ""),
      "data-ranks": b.ranks.join(","),
      title: `${b.label} ${b.ranges}`,
      tabindex: "0", role: "button",
      "aria-label": `${b.label}, ${b.ranges}` + (b.partial ? ", partial" : ""),
      style: {
        left: `${(b.c0 / nCols) * width}px`, top: `${(b.r0 / nRows) * height}px`,
        width: `${((b.c1 - b.c0) / nCols) * width}px`, height: `${((b.r1 - b.r0) / nRows) * height}px`,
        // not the `background` shorthand: it would reset the Partial hatch
        backgroundColor: b.fill["background-color"],
        backgroundImage: b.fill["background-image"] || "none",
      },
      onmouseenter: () => show(b), onclick: () => show(b), onfocus: () => show(b),
      onkeydown: (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); show(b); } },
    },
    // the label sits on its first rank's colour, in black or white, whatever lies behind
    el("span", { class: "meshlab-label", style: { color: b.text, backgroundColor: b.color } }, b.label),
    el("span", { class: "meshlab-range", style: { color: b.text, backgroundColor: b.color } }, b.ranges));
    grid.append(box);
  }
  root.append(grid);
  if (t.empty.length) root.append(el("div", { class: "meshlab-empty" }, `holding nothing: ranks ${t.empty.join(", ")}`));
  root.append(detail);
}

function render({ model, el: host }) {
  const root = document.createElement("div");
  root.className = "meshlab-sharding";
  host.append(root);
  const redraw = () => {
    root.replaceChildren();
    drawModule(model, root);
    drawTensor(model, root);
  };
  model.on("change:tensor", redraw);
  model.on("change:rows", redraw);
  model.on("change:selected", redraw);
  redraw();
}

export default { render };
