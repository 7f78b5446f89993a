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
      onclick: () => {
        // the row's drawing was saved with the widget: drawn here, with or without a kernel
        const tensors = model.get("tensors") || [];
        model.set("selected", i);
        if (tensors[i]) model.set("tensor", tensors[i]);
        model.save_changes();
      },
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

function styled(tag, style, attrs = {}, ...children) {
  // styles computed in Python (the HTML fallback applies the same), as CSS property names
  const node = el(tag, attrs, ...children);
  for (const [k, v] of Object.entries(style || {})) node.style.setProperty(k, v);
  return node;
}

function drawTensor(model, root) {
  const t = model.get("tensor");
  if (!t || !t.shape) return;
  root.append(el("div", { class: "meshlab-caption" }, el("b", {}, t.name || "tensor"), ` ${t.head}`));
  drawDimPickers(model, t, root);
  const several = t.parts.length > 1;
  const detail = el("div", { class: "meshlab-detail" }, "hover or click a block");
  const show = (b, part) => {
    detail.replaceChildren(el("div", {}, el("b", {}, b.label), b.note ? ` · ${b.note}` : "",
      several || part.fqn ? ` · ${part.name}` : ""),
      ...b.detail.map((s) => el("div", {},
        `rank ${s.rank}` + (s.coordinate.length ? ` at [${s.coordinate}]` : "") +
        `: local [${s.local_shape}] from offset [${s.offsets}], ${fmtBytes(s.bytes)}` +
        (s.place.length ? ` · ${s.place.map(([a, i]) => `${a} ${i}`).join(", ")}` : ""))));
  };
  const panels = el("div", { class: "meshlab-parts" });
  for (const part of t.parts) {
    const panel = el("div", { class: "meshlab-part", "data-ranks": part.data_ranks,
      style: { width: `${part.panel_width}px` } });
    if (several) panel.append(el("div", { class: "meshlab-holder" }, el("b", {}, part.holder), el("br"), part.holds));
    const grid = el("div", { class: "meshlab-grid", style: { width: `${part.width}px`, height: `${part.height}px` } });
    for (const b of t.blocks.filter((b) => b.part === part.index)) {
      const box = styled("div", b.style, {
        class: "meshlab-block" + (b.replicated ? " replicated" : "") + (b.partial ? " partial" : ""),
        "data-ranks": b.data_ranks,
        title: `${b.label} ${b.ranges}` + (b.note ? ` (${b.note})` : ""),
        tabindex: "0", role: "button",
        "aria-label": `${b.label}, ${b.ranges}` + (b.note ? `, ${b.note}` : ""),
        onmouseenter: () => show(b, part), onclick: () => show(b, part), onfocus: () => show(b, part),
        onkeydown: (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); show(b, part); } },
      },
      ...b.band.map((s) => styled("div", s)),
      ...b.lines.map((line) => styled("span", line.style, { class: line.class }, line.text)));
      grid.append(box);
    }
    panel.append(grid);
    // what a block too small for its whole label does not show, with its colour
    if (part.key.length) panel.append(el("div", { class: "meshlab-key" }, ...part.key.map((k) =>
      el("div", {}, styled("span", k.swatch), k.text))));
    if (part.empty_text) panel.append(el("div", { class: "meshlab-empty" }, part.empty_text));
    panels.append(panel);
  }
  root.append(panels);
  root.append(detail);
}

function render({ model, el: host }) {
  host.classList.add("meshlab-widget"); // its saved state draws everything: see sharding.css
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
