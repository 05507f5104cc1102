// The chat page of `qwen3vl serve` (docs/serve.md, "The chat page"): one conversation at a
// time against the server's own /v1/chat/completions, streamed; conversations in IndexedDB.
import {renderMarkdown} from "./markdown.js";
import {parseGrounding, groundingFigure} from "./grounding.js";
import * as store from "./store.js";
import {api, errorText} from "./api.js";
import {loadSettings, readSettings, saveSettings} from "./settings.js";

const $ = (id) => document.getElementById(id);
let conversation = null;                // the one shown
let pending = [];                       // attachments of the next message: {kind, url, name}
let running = null;                     // the AbortController of the answer streaming
let model = null;

async function connect() {
  try {
    const response = await api("/v1/models");
    if (!response.ok) throw new Error(await errorText(response));
    model = (await response.json()).data[0].id;
    $("model").textContent = model;
  } catch (e) {
    $("model").textContent = `not connected: ${e.message}`;
  }
}

// ---- attachments: upload, drag-and-drop, paste
function addFiles(files) {
  for (const file of files) {
    const kind = file.type.startsWith("image/") ? "image" : file.type.startsWith("video/") ? "video" : null;
    if (!kind) { flash(`${file.name}: not an image or a video`); continue; }
    const reader = new FileReader();
    reader.onload = () => { pending.push({kind, url: reader.result, name: file.name}); showAttachments(); };
    reader.readAsDataURL(file);
  }
}

function mediaElement(item) {
  const element = document.createElement(item.kind === "video" ? "video" : "img");
  element.src = item.url;
  if (item.kind === "video") { element.muted = true; element.controls = true; } else element.alt = item.name || "image";
  return element;
}

function showAttachments() {
  $("attachments").replaceChildren(...pending.map((item, n) => {
    const box = div("attachment");
    const remove = button("×", () => { pending.splice(n, 1); showAttachments(); }, "remove");
    remove.title = `Remove ${item.name || item.kind}`;
    box.append(mediaElement(item), remove);
    return box;
  }));
}

function flash(message) {
  const line = div("error notice");
  line.textContent = message;
  $("messages").append(line);
}

// ---- messages
const div = (className) => Object.assign(document.createElement("div"), {className});
function button(label, onClick, className = "") {
  const b = Object.assign(document.createElement("button"), {type: "button", textContent: label, className});
  b.addEventListener("click", onClick);
  return b;
}

// The reasoning and the answer of an assistant message: the server's reasoning_content, and
// any <think>...</think> left in the text (an unclosed one: all that follows is reasoning).
function splitThink(content, reasoning = "") {
  let answer = content;
  const open = answer.indexOf("<think>");
  const close = answer.indexOf("</think>");
  if (open >= 0 && (close < 0 || close > open)) {
    const end = close < 0 ? answer.length : close;
    reasoning += answer.slice(open + 7, end);
    answer = answer.slice(0, open) + (close < 0 ? "" : answer.slice(close + 8));
  } else if (close >= 0) {
    reasoning += answer.slice(0, close);
    answer = answer.slice(close + 8);
  }
  return {reasoning: reasoning.trim(), answer: answer.replace(/^\s+/, "")};
}

function lastImageBefore(index) {
  for (let i = index; i >= 0; i--) {
    const images = (conversation.messages[i].media || []).filter((x) => x.kind === "image");
    if (images.length) return images[images.length - 1].url;
  }
  return null;
}

function messageElement(message, index) {
  const element = div(`msg ${message.role}`);
  element.dataset.index = index;
  if (message.media && message.media.length) {
    const row = div("media");
    row.append(...message.media.map(mediaElement));
    element.append(row);
  }
  if (message.role === "assistant") {
    const details = Object.assign(document.createElement("details"), {className: "reasoning", hidden: true});
    details.append(Object.assign(document.createElement("summary"), {textContent: "Reasoning"}), div("thoughts"));
    element.append(details, div("markdown"), div("grounding"), div("status"));
  } else {
    element.append(div("text"));
  }
  element.append(div("actions"));
  fill(element, message, index);
  return element;
}

function fill(element, message, index) {
  if (message.role === "user") {
    element.querySelector(".text").textContent = message.content;
  } else {
    const {reasoning, answer} = splitThink(message.content, message.reasoning || "");
    const details = element.querySelector(".reasoning");
    details.hidden = !reasoning;
    details.querySelector(".thoughts").textContent = reasoning;
    element.querySelector(".markdown").innerHTML = renderMarkdown(answer);  // escaped first: markdown.js
    const items = parseGrounding(answer);
    const grounding = element.querySelector(".grounding");
    const image = items.length ? lastImageBefore(index) : null;
    const key = image ? JSON.stringify(items) + image.length : "";
    if (grounding.dataset.key !== key) {
      grounding.dataset.key = key;
      grounding.replaceChildren(...(image ? [groundingFigure(image, items)] : []));
    }
    const status = element.querySelector(".status");
    status.textContent = message.error ? `Error: ${message.error}` : message.stopped ? "(stopped)" : "";
    status.classList.toggle("error", Boolean(message.error));
  }
  const actions = element.querySelector(".actions");
  const last = index === conversation.messages.length - 1;
  const lastUser = conversation.messages.map((m) => m.role).lastIndexOf("user") === index;
  actions.replaceChildren(...[
    ...(message.role === "assistant" && last && !running ? [button("Regenerate", regenerate, "regenerate")] : []),
    ...(lastUser && !running ? [button("Edit", editLast, "edit")] : []),
  ]);
}

function showConversation() {
  const list = conversation ? conversation.messages : [];
  $("messages").replaceChildren(...list.map(messageElement));
  $("examples").hidden = list.length > 0;
  showList();
}

async function showList() {
  const all = await store.listConversations();
  $("conversations").replaceChildren(...all.map((c) => {
    const item = document.createElement("li");
    if (conversation && c.id === conversation.id) item.setAttribute("aria-current", "true");
    const open = button(c.title || "Untitled", () => openConversation(c.id), "open");
    const remove = button("×", async () => {
      await store.deleteConversation(c.id);
      if (conversation && conversation.id === c.id) conversation = null;
      showConversation();
    }, "delete");
    remove.title = `Delete "${c.title}"`;
    item.append(open, remove);
    return item;
  }));
}

async function openConversation(id) {
  if (running) return;
  conversation = await store.getConversation(id);
  showConversation();
}

async function save() {
  conversation.updated = Date.now();
  await store.saveConversation(conversation);
}

// ---- asking and answering
function apiMessages(messages) {
  return messages.filter((m) => !(m.role === "assistant" && m.error && !m.content)).map((m) => {
    if (m.role === "assistant") return {role: "assistant", content: splitThink(m.content).answer};
    if (!m.media || !m.media.length) return {role: "user", content: m.content};
    return {role: "user", content: [
      ...m.media.map((x) => x.kind === "video" ? {type: "video_url", video_url: {url: x.url}}
                                              : {type: "image_url", image_url: {url: x.url}}),
      {type: "text", text: m.content}]};
  });
}

async function send() {
  if (running) return;
  let settings;
  try { settings = readSettings(); } catch (e) { flash(e.message); return; }
  const text = $("prompt").value.trim();
  if (!text && !pending.length) return;
  if (!conversation) {
    conversation = {id: store.newId(), title: "", created: Date.now(), updated: Date.now(), messages: []};
  }
  conversation.messages.push({role: "user", content: text, media: pending});
  conversation.title = conversation.title || (text || pending.map((x) => x.name).join(", ")).slice(0, 60);
  pending = [];
  showAttachments();
  $("prompt").value = "";
  await answer(settings);
}

async function answer(settings) {
  const message = {role: "assistant", content: "", reasoning: ""};
  const body = {temperature: settings.temperature, max_tokens: settings.maxTokens,
                chat_template_kwargs: {enable_thinking: settings.thinking}, ...(model ? {model} : {}),
                ...settings.extra, messages: apiMessages(conversation.messages), stream: true};
  conversation.messages.push(message);
  const index = conversation.messages.length - 1;
  running = new AbortController();
  setRunning(true);
  showConversation();
  await save();
  const element = $("messages").lastElementChild;
  element.dataset.state = "streaming";
  element.dataset.chunks = "0";
  try {
    await stream(body, message, element, running.signal);
    element.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") { message.stopped = true; element.dataset.state = "stopped"; }
    else { message.error = e.message; element.dataset.state = "error"; }
  } finally {
    running = null;
    setRunning(false);
    await save();
    for (const each of $("messages").querySelectorAll(".msg")) {
      fill(each, conversation.messages[Number(each.dataset.index)], Number(each.dataset.index));
    }
    showList();
  }
  return index;
}

// The SSE stream of /v1/chat/completions into `message`, shown as it comes (at most once a frame).
async function stream(body, message, element, signal) {
  const response = await api("/v1/chat/completions", {method: "POST", body: JSON.stringify(body), signal});
  if (!response.ok) throw new Error(await errorText(response));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let frame = 0;
  const show = () => { frame = 0; fill(element, message, Number(element.dataset.index)); scrollDown(); };
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") { show(); return; }
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
        const thought = delta.reasoning_content || delta.reasoning || "";
        message.reasoning += thought;
        message.content += delta.content || "";
        if (thought || delta.content) element.dataset.chunks = String(Number(element.dataset.chunks) + 1);
        frame = frame || requestAnimationFrame(show);
      }
    }
  }
  show();
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function setRunning(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
}

async function regenerate() {
  if (running || !conversation) return;
  let settings;
  try { settings = readSettings(); } catch (e) { flash(e.message); return; }
  conversation.messages.pop();
  await answer(settings);
}

async function editLast() {
  if (running || !conversation) return;
  const at = conversation.messages.map((m) => m.role).lastIndexOf("user");
  const [message] = conversation.messages.splice(at);
  $("prompt").value = message.content;
  pending = message.media || [];
  showAttachments();
  await save();
  showConversation();
  $("prompt").focus();
}

// ---- export and import
async function exportAll() {
  const blob = new Blob([store.exportJson(await store.listConversations())], {type: "application/json"});
  const link = Object.assign(document.createElement("a"), {href: URL.createObjectURL(blob),
                                                            download: `qwen3vl-chats-${new Date().toISOString().slice(0, 10)}.json`});
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}

async function importFile(file) {
  try {
    for (const c of store.importJson(await file.text())) await store.saveConversation(c);
    showList();
  } catch (e) {
    flash(`Import ${file.name}: ${e.message}`);
  }
}

// ---- wiring
function start() {
  loadSettings();
  for (const id of ["temperature", "max-tokens", "thinking", "extra"]) $(id).addEventListener("input", saveSettings);
  $("settings-toggle").addEventListener("click", () => {
    $("settings").hidden = !$("settings").hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!$("settings").hidden));
  });
  $("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => running && running.abort());
  $("attach").addEventListener("click", () => $("file").click());
  $("file").addEventListener("change", () => { addFiles($("file").files); $("file").value = ""; });
  $("new-chat").addEventListener("click", () => { if (!running) { conversation = null; showConversation(); } });
  $("export").addEventListener("click", exportAll);
  $("import").addEventListener("click", () => $("import-file").click());
  $("import-file").addEventListener("change", () => { if ($("import-file").files[0]) importFile($("import-file").files[0]); $("import-file").value = ""; });
  for (const example of $("examples").querySelectorAll("button")) {
    example.addEventListener("click", () => { $("prompt").value = example.dataset.prompt; $("prompt").focus(); });
  }
  document.addEventListener("paste", (event) => {
    const files = event.clipboardData ? [...event.clipboardData.files] : [];
    if (files.length) { event.preventDefault(); addFiles(files); }
  });
  let depth = 0;
  document.addEventListener("dragenter", (event) => { event.preventDefault(); depth++; $("drop-hint").hidden = false; });
  document.addEventListener("dragleave", () => { if (--depth <= 0) { depth = 0; $("drop-hint").hidden = true; } });
  document.addEventListener("dragover", (event) => event.preventDefault());
  document.addEventListener("drop", (event) => {
    event.preventDefault();
    depth = 0;
    $("drop-hint").hidden = true;
    addFiles(event.dataTransfer ? event.dataTransfer.files : []);
  });
  showConversation();
  connect().then(() => { document.body.dataset.ready = "true"; });
}

start();
