// The page's settings, kept in localStorage: temperature, max tokens, thinking on or off
// (chat_template_kwargs.enable_thinking) and extra request fields, a JSON object merged into
// every request body as it is (any field the API takes: top_p, seed, response_format,
// guided_choice, ...; not messages or stream; the browser tests force exact answers with
// guided_choice through it).
const $ = (id) => document.getElementById(id);
const SETTINGS = "qwen3vl-settings";

export function readSettings() {
  const extraText = $("extra").value.trim();
  let extra = {};
  if (extraText) {
    try { extra = JSON.parse(extraText); } catch (e) { throw new Error(`Extra request fields: not JSON: ${e.message}`); }
    if (!extra || typeof extra !== "object" || Array.isArray(extra)) throw new Error("Extra request fields: expected a JSON object");
  }
  return {temperature: Number($("temperature").value), maxTokens: Math.round(Number($("max-tokens").value)),
          thinking: $("thinking").checked, extra, extraText};
}

export function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}"); } catch { /* defaults */ }
  if (saved.temperature !== undefined) $("temperature").value = saved.temperature;
  if (saved.maxTokens !== undefined) $("max-tokens").value = saved.maxTokens;
  if (saved.thinking !== undefined) $("thinking").checked = saved.thinking;
  if (saved.extraText !== undefined) $("extra").value = saved.extraText;
}

export function saveSettings() {
  try {
    const s = readSettings();
    $("extra-error").textContent = "";
    localStorage.setItem(SETTINGS, JSON.stringify({temperature: s.temperature, maxTokens: s.maxTokens,
                                                   thinking: s.thinking, extraText: s.extraText}));
  } catch (e) {
    $("extra-error").textContent = e.message;
  }
}
