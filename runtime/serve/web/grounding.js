// Qwen3-VL's grounding: asked to find things, it answers with JSON such as
//   [{"bbox_2d": [x1, y1, x2, y2], "label": "cat"}, {"point_2d": [x, y], "label": "eye"}]
// in a 0-1000 frame of the image (0,0 its top left corner, 1000,1000 its bottom right),
// whatever the image's size. Read leniently: in a fenced block or not, a list or objects one
// by one, keys quoted with " or ' or not, trailing commas, a list cut off mid-way (while the
// answer streams): every innermost {...} that holds a bbox_2d or point_2d is one item.

const NUM = String.raw`(-?\d+(?:\.\d+)?)`;
const SEP = String.raw`\s*,\s*`;
const KEY = (name) => String.raw`["']?${name}["']?\s*:\s*\[\s*`;
const BOX = new RegExp(KEY("bbox_2d") + [NUM, NUM, NUM, NUM].join(SEP) + String.raw`\s*,?\s*\]`);
const POINT = new RegExp(KEY("point_2d") + NUM + SEP + NUM + String.raw`\s*,?\s*\]`);
const LABEL = /["']?label["']?\s*:\s*(?:"((?:[^"\\]|\\.)*)"|'([^']*)')/;
const PALETTE = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#9a6324"];

const clamp = (v) => Math.min(1000, Math.max(0, v));

function unquote(text) {
  try { return JSON.parse(`"${text}"`); } catch { return text; }
}

// [{kind: "box", coords: [x1, y1, x2, y2], label} | {kind: "point", coords: [x, y], label}]
export function parseGrounding(text) {
  const items = [];
  for (const match of String(text).matchAll(/\{[^{}]*\}/g)) {
    const object = match[0];
    const label = object.match(LABEL);
    const name = label ? (label[1] !== undefined ? unquote(label[1]) : label[2]) : "";
    const box = object.match(BOX);
    const point = object.match(POINT);
    if (box) {
      const [x1, y1, x2, y2] = box.slice(1, 5).map(Number).map(clamp);
      items.push({kind: "box", coords: [Math.min(x1, x2), Math.min(y1, y2), Math.max(x1, x2), Math.max(y1, y2)],
                  label: name});
    } else if (point) {
      items.push({kind: "point", coords: point.slice(1, 3).map(Number).map(clamp), label: name});
    }
  }
  return items;
}

// A figure: the image, and over it one element per item placed in percent of the image's
// displayed size (so x/1000 of its width, y/1000 of its height), each with its label.
export function groundingFigure(imageUrl, items) {
  const figure = document.createElement("div");
  figure.className = "grounded";
  const image = document.createElement("img");
  image.src = imageUrl;
  image.alt = "the image the answer locates things in";
  figure.append(image);
  items.forEach((item, n) => {
    const mark = document.createElement("div");
    const [x, y] = item.coords;
    mark.className = item.kind === "box" ? "gbox" : "gpoint";
    mark.style.left = `${x / 10}%`;
    mark.style.top = `${y / 10}%`;
    if (item.kind === "box") {
      mark.style.width = `${(item.coords[2] - x) / 10}%`;
      mark.style.height = `${(item.coords[3] - y) / 10}%`;
    }
    mark.style.setProperty("--mark", PALETTE[n % PALETTE.length]);
    mark.dataset.coords = item.coords.join(",");
    const tag = document.createElement("span");
    tag.className = "glabel";
    tag.textContent = item.label || `#${n + 1}`;
    mark.append(tag);
    figure.append(mark);
  });
  return figure;
}
