// The server's API from the page: the key, when the server asks for one (a 401), asked in a
// dialog and kept in this tab's sessionStorage, then sent as "Authorization: Bearer KEY".
const $ = (id) => document.getElementById(id);
const KEY = "qwen3vl-api-key";

function headers() {
  const key = sessionStorage.getItem(KEY);
  return {"Content-Type": "application/json", ...(key ? {Authorization: `Bearer ${key}`} : {})};
}

export async function api(path, init = {}) {
  for (;;) {
    const response = await fetch(path, {...init, headers: headers()});
    if (response.status !== 401) return response;
    await askKey(sessionStorage.getItem(KEY) ? "The server refused that key." : "");
  }
}

function askKey(message) {
  const dialog = $("key-dialog");
  $("key-error").textContent = message;
  $("key").value = "";
  dialog.oncancel = (event) => event.preventDefault();  // Escape: the page cannot go on without it
  if (!dialog.open) dialog.showModal();
  return new Promise((resolve) => {
    $("key-form").onsubmit = (event) => {
      event.preventDefault();
      const key = $("key").value.trim();
      if (!key) { $("key-error").textContent = "Enter the key."; return; }
      sessionStorage.setItem(KEY, key);
      dialog.close();
      resolve();
    };
  });
}

export async function errorText(response) {
  try { return (await response.json()).error.message; } catch { return `HTTP ${response.status}`; }
}
