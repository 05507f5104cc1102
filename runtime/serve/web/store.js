// Conversations kept in the browser (IndexedDB, database "qwen3vl-chat"), and their export
// and import as JSON. A conversation: {id, title, created, updated, messages}; a message:
// {role: "user" | "assistant", content, reasoning?, media?: [{kind, url, name}], error?,
// stopped?}; media as data: URLs, so an export holds the images too.

const DB = "qwen3vl-chat";
const STORE = "conversations";
const FORMAT = "qwen3vl-chat";
let opened = null;

function database() {
  opened = opened || new Promise((resolve, reject) => {
    const request = indexedDB.open(DB, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE, {keyPath: "id"});
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
  return opened;
}

async function transaction(mode, work) {
  const db = await database();
  return new Promise((resolve, reject) => {
    const tx = db.transaction(STORE, mode);
    const request = work(tx.objectStore(STORE));
    tx.oncomplete = () => resolve(request.result);
    tx.onerror = tx.onabort = () => reject(tx.error);
  });
}

export function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
}

export async function listConversations() {
  const all = await transaction("readonly", (s) => s.getAll());
  return all.sort((a, b) => b.updated - a.updated);
}

export const getConversation = (id) => transaction("readonly", (s) => s.get(id));
export const saveConversation = (c) => transaction("readwrite", (s) => s.put(c));
export const deleteConversation = (id) => transaction("readwrite", (s) => s.delete(id));

export function exportJson(conversations) {
  return JSON.stringify({format: FORMAT, version: 1, conversations}, null, 1);
}

// The conversations of an export (or a bare list of them), checked; Error naming the fault.
export function importJson(text) {
  let data;
  try { data = JSON.parse(text); } catch (e) { throw new Error(`not JSON: ${e.message}`); }
  const list = Array.isArray(data) ? data : data && data.conversations;
  if (!Array.isArray(list)) throw new Error('expected {"conversations": [...]} as Export writes it');
  return list.map((c, i) => {
    if (!c || !Array.isArray(c.messages)) throw new Error(`conversations[${i}]: no messages list`);
    c.messages.forEach((m, j) => {
      if (!m || !["user", "assistant"].includes(m.role) || typeof m.content !== "string") {
        throw new Error(`conversations[${i}].messages[${j}]: expected {role: user|assistant, content: text}`);
      }
      const media = m.media || [];
      if (!Array.isArray(media) || media.some((x) => !x || !/^data:(image|video)\//.test(String(x.url)))) {
        throw new Error(`conversations[${i}].messages[${j}].media: expected data: URLs of images or videos`);
      }
    });
    const now = Date.now();
    return {id: typeof c.id === "string" && c.id ? c.id : newId(), title: String(c.title || "Imported chat"),
            created: Number(c.created) || now, updated: Number(c.updated) || now, messages: c.messages};
  });
}
