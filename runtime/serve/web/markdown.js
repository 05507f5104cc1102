// A small markdown subset to HTML, for the model's answers. Everything the text holds is
// escaped first (& < > " '); the only tags in the output are the ones made here (p, br,
// h1-h6, ul/ol/li, pre/code, blockquote, hr, strong, em, del, a with an http(s) URL), so an
// answer can never inject HTML, whatever it says (a <script> in it is shown as text).
// Handled: fenced code blocks (``` or ~~~, unclosed ones too while streaming), headings,
// bullet and numbered lists, block quotes, rules, paragraphs with line breaks, `code`,
// **bold**, __bold__, *italic*, _italic_, ~~strike~~ and [links](https://...).

const ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

export function renderMarkdown(text) {
  const lines = String(text).replace(/\u0000/g, "").replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let paragraph = [];
  let list = null;
  let quote = [];
  const flushParagraph = () => {
    if (paragraph.length) out.push("<p>" + paragraph.map(inline).join("<br>") + "</p>");
    paragraph = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}>` + list.items.map((x) => `<li>${inline(x)}</li>`).join("") + `</${list.tag}>`);
    list = null;
  };
  const flushQuote = () => {
    if (quote.length) out.push("<blockquote>" + renderMarkdown(quote.join("\n")) + "</blockquote>");
    quote = [];
  };
  const flush = () => { flushParagraph(); flushList(); flushQuote(); };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*(`{3,}|~{3,})\s*([\w+.#-]*)\s*$/);
    if (fence) {
      flush();
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) body.push(lines[i]);
      const lang = fence[2] ? ` data-lang="${escapeHtml(fence[2])}"` : "";
      out.push(`<pre${lang}><code>${escapeHtml(body.join("\n"))}</code></pre>`);
      continue;
    }
    const quoted = line.match(/^\s*>\s?(.*)$/);
    if (quoted) { flushParagraph(); flushList(); quote.push(quoted[1]); continue; }
    flushQuote();
    const heading = line.match(/^\s*(#{1,6})\s+(.*?)\s*#*\s*$/);
    if (heading) {
      flush();
      out.push(`<h${heading[1].length}>${inline(heading[2])}</h${heading[1].length}>`);
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flush(); out.push("<hr>"); continue; }
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d{1,9}[.)]\s+(.*)$/);
    if (bullet || numbered) {
      flushParagraph();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      list = list || {tag, items: []};
      list.items.push((bullet || numbered)[1]);
      continue;
    }
    if (!line.trim()) { flush(); continue; }
    if (list && /^\s{2,}\S/.test(line)) { list.items[list.items.length - 1] += " " + line.trim(); continue; }
    flushList();
    paragraph.push(line);
  }
  flush();
  return out.join("");
}

// One line's inline marks: code spans are cut out first (their text escaped and left alone),
// the rest escaped, then marked.
function inline(text) {
  return text.split(/(`+[^`]+?`+)/).map((part) => {
    const code = part.match(/^(`+)([^`]+?)\1$/);
    return code ? `<code>${escapeHtml(code[2])}</code>` : emphasis(escapeHtml(part));
  }).join("");
}

// Marks on escaped text. Links are set aside behind \u0000 place-holders first, so that no
// mark is made inside a URL; a link's URL is escaped text that starts with http:// or
// https:// (no javascript: or data: URL can be made).
function emphasis(escaped) {
  const links = [];
  let s = escaped.replace(/\[([^\]]+)\]\((https?:\/\/[^\s()]+)\)/g, (m, label, url) => {
    links.push([label, url]);
    return `\u0000${links.length - 1}\u0000`;
  });
  s = s.replace(/\*\*\*(\S(?:.*?\S)?)\*\*\*/g, "<strong><em>$1</em></strong>")
    .replace(/\*\*(\S(?:.*?\S)?)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(\S(?:.*?\S)?)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*])\*([^\s*](?:[^*]*?[^\s*])?)\*(?!\*)/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_([^\s_](?:[^_]*?[^\s_])?)_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(\S(?:.*?\S)?)~~/g, "<del>$1</del>");
  return s.replace(/\u0000(\d+)\u0000/g, (m, n) => {
    const [label, url] = links[Number(n)];
    return `<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`;
  });
}
