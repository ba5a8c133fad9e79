// The chat page of `distconf api`: sends the conversation to /v1/chat/completions with stream: true and
// shows the answer as its server-sent events arrive. No external resources; text is only ever set as
// textContent (never parsed as HTML).
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, messages: [], controller: null };

function setStatus(text) { $("status").textContent = text; }

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addEntry(role, text) {
  const li = document.createElement("li");
  li.className = role;
  li.textContent = text;
  $("log").appendChild(li);
  li.scrollIntoView({ block: "end" });
  return li;
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return "HTTP " + response.status;
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) {
    setStatus("cannot list the models: " + (await errorText(response)));
    return;
  }
  const body = await response.json();
  state.model = body.data.length ? body.data[0].id : null;
  $("model").textContent = state.model || "no model";
  setStatus(state.model ? "ready" : "this server has no model");
}

// Read a stream of server-sent events; call onData with each parsed JSON payload until [DONE].
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  $("input").disabled = on;
}

async function send(text) {
  if (!state.model) await loadModel();
  if (!state.model) return;
  showError("");
  state.messages.push({ role: "user", content: text });
  addEntry("user", text);
  const entry = addEntry("assistant streaming", "");
  let answer = "";
  const started = performance.now();
  let tokens = 0;
  state.controller = new AbortController();
  busy(true);
  setStatus("waiting for the first token…");
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: state.controller.signal,
      body: JSON.stringify({
        model: state.model, messages: state.messages, stream: true,
        temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
      }),
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      if (choice.delta && choice.delta.content) {
        answer += choice.delta.content;
        tokens += 1;
        entry.textContent = answer;
        entry.scrollIntoView({ block: "end" });
        setStatus("answering…");
      }
      if (choice.finish_reason) entry.dataset.finish = choice.finish_reason;
    });
    state.messages.push({ role: "assistant", content: answer });
    const seconds = (performance.now() - started) / 1000;
    setStatus("done: " + tokens + " pieces in " + seconds.toFixed(1) + " s");
  } catch (err) {
    if (err.name === "AbortError") {
      state.messages.push({ role: "assistant", content: answer });
      setStatus("stopped");
    } else {
      state.messages.pop();
      showError(err.message);
      setStatus("error");
    }
  } finally {
    entry.classList.remove("streaming");
    entry.dataset.done = "1";
    state.controller = null;
    busy(false);
    $("input").focus();
  }
}

function init() {
  $("form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("reset").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    $("log").replaceChildren();
    showError("");
    setStatus("ready");
  });
  $("api-key").addEventListener("change", loadModel);
  loadModel().catch((err) => setStatus("cannot reach the server: " + err.message));
}

init();
