// The chat page: streams answers from /v1/chat/completions (SSE) and keeps
// the conversation, so each turn sends the whole history. Model output is
// rendered by markdown.js, which builds DOM nodes and never parses the
// model's text as HTML.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const ui = {
    messages: $("messages"), input: $("input"), composer: $("composer"), send: $("send"), stop: $("stop"),
    usage: $("usage"), error: $("error"), model: $("model"), modelName: $("model-name"), system: $("system"),
    temperature: $("temperature"), topP: $("top-p"), maxTokens: $("max-tokens"), keyForm: $("key-form"),
    keyReason: $("key-reason"), apiKey: $("api-key"), changeKey: $("change-key"), newChat: $("new-chat"),
    settings: $("settings"), toggleSettings: $("toggle-settings"),
  };
  const KEY_STORE = "mlxfast.apiKey";
  const SETTINGS_STORE = "mlxfast.settings";
  const SETTINGS = { system: ui.system, temperature: ui.temperature, top_p: ui.topP, max_tokens: ui.maxTokens };

  const chat = {
    history: [], // [{role, content}] as sent to the server
    controller: null, // the AbortController of the reply streaming now
    apiKey: sessionStorage.getItem(KEY_STORE) || "",
  };

  // ------------------------------------------------------------ settings

  function loadSettings() {
    try {
      const saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}");
      for (const [k, input] of Object.entries(SETTINGS)) if (typeof saved[k] === "string") input.value = saved[k];
    } catch (e) { /* a damaged entry: defaults */ }
  }

  function saveSettings() {
    const out = {};
    for (const [k, input] of Object.entries(SETTINGS)) out[k] = input.value;
    try { localStorage.setItem(SETTINGS_STORE, JSON.stringify(out)); } catch (e) { /* private mode */ }
  }

  function number(input, fallback) {
    const v = parseFloat(input.value);
    return Number.isFinite(v) ? v : fallback;
  }

  // ------------------------------------------------------------ helpers

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (chat.apiKey) h.Authorization = "Bearer " + chat.apiKey;
    return h;
  }

  function showError(msg) {
    ui.error.textContent = msg || "";
    ui.error.hidden = !msg;
  }

  async function errorText(r) {
    try {
      const body = await r.json();
      if (body && body.error) return body.error.message || JSON.stringify(body.error);
      return JSON.stringify(body);
    } catch (e) {
      return "HTTP " + r.status;
    }
  }

  function askKey(reason) {
    ui.keyReason.textContent = reason;
    ui.keyForm.hidden = false;
    ui.apiKey.value = chat.apiKey;
    ui.apiKey.focus();
  }

  function setBusy(busy) {
    document.body.dataset.busy = busy ? "true" : "false";
    ui.messages.setAttribute("aria-busy", busy ? "true" : "false");
    ui.send.disabled = busy;
    ui.stop.disabled = !busy;
  }

  function scrollDown() {
    ui.messages.scrollTop = ui.messages.scrollHeight;
  }

  // ------------------------------------------------------------ models

  let retry = null;

  async function loadModels() {
    clearTimeout(retry);
    let r;
    try {
      r = await fetch("v1/models", { headers: headers() });
    } catch (e) {
      showError("Cannot reach the server: " + e.message);
      retry = setTimeout(loadModels, 3000);
      return;
    }
    if (r.status === 401) {
      askKey(chat.apiKey ? "The API key was not accepted; enter it again." : "This server needs an API key.");
      return;
    }
    if (!r.ok) {
      showError(await errorText(r));
      retry = setTimeout(loadModels, 3000);
      return;
    }
    const body = await r.json();
    const previous = ui.model.value;
    let warning = "";
    ui.model.replaceChildren();
    for (const m of body.data || []) {
      const o = document.createElement("option");
      o.value = m.id;
      o.textContent = m.id;
      ui.model.appendChild(o);
      if (m.has_chat_template === false) {
        warning = "The model '" + m.id + "' has no chat template: start the server with --chat-template FILE.";
      }
    }
    if (previous && [...ui.model.options].some((o) => o.value === previous)) ui.model.value = previous;
    ui.modelName.textContent = ui.model.value;
    ui.keyForm.hidden = true;
    showError(warning);
    document.body.dataset.ready = "true";
  }

  // ------------------------------------------------------------ messages

  function addUser(textContent) {
    const div = document.createElement("div");
    div.className = "message user";
    div.dataset.role = "user";
    div.textContent = textContent;
    ui.messages.appendChild(div);
    scrollDown();
    return div;
  }

  // An assistant message: reasoning folded in a <details>, then the answer.
  function addAssistant() {
    const div = document.createElement("div");
    div.className = "message assistant";
    div.dataset.role = "assistant";
    const details = document.createElement("details");
    details.className = "reasoning";
    details.hidden = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const thoughts = document.createElement("div");
    thoughts.className = "reasoning-text";
    details.append(summary, thoughts);
    const body = document.createElement("div");
    body.className = "content";
    div.append(details, body);
    ui.messages.appendChild(div);
    scrollDown();

    // Drawn again at most every 30 ms, and no more than a fifth of the
    // time: a long reply's Markdown takes longer to render.
    let content = "", reasoning = "", timer = null, cost = 0;
    const draw = () => {
      timer = null;
      const t0 = performance.now();
      if (reasoning) {
        details.hidden = false;
        thoughts.textContent = reasoning;
      }
      body.replaceChildren(window.MlxMarkdown.render(content));
      scrollDown();
      cost = performance.now() - t0;
    };
    return {
      element: div,
      update(c, r) {
        content = c;
        reasoning = r;
        if (timer === null) timer = setTimeout(draw, Math.max(30, 4 * cost));
      },
      finish(note) {
        clearTimeout(timer);
        draw();
        div.dataset.done = "true";
        if (note) {
          const p = document.createElement("p");
          p.className = "note";
          p.textContent = note;
          div.appendChild(p);
        }
      },
    };
  }

  // Server-sent events of one response: calls onData(json) per data line.
  async function readEvents(response, onData) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let k;
      while ((k = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, k).replace(/\r$/, "");
        buf = buf.slice(k + 1);
        if (!line.startsWith("data:")) continue;
        const payload = line.slice(5).trim();
        if (payload === "[DONE]") return;
        if (payload) onData(JSON.parse(payload));
      }
    }
  }

  function showUsage(usage, t) {
    const ds = ui.usage.dataset;
    if (!usage) {
      ui.usage.textContent = "";
      delete ds.promptTokens;
      delete ds.completionTokens;
      delete ds.cachedTokens;
      return;
    }
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    let speed = null;
    if (usage.completion_tokens > 1 && t.last > t.first) {
      speed = (usage.completion_tokens - 1) / ((t.last - t.first) / 1000);
    } else if (usage.completion_tokens > 0 && t.end > t.start) {
      speed = usage.completion_tokens / ((t.end - t.start) / 1000);
    }
    ds.promptTokens = usage.prompt_tokens;
    ds.completionTokens = usage.completion_tokens;
    ds.cachedTokens = cached;
    const parts = [
      usage.completion_tokens + " tokens",
      "prompt " + usage.prompt_tokens + " (" + cached + " cached)",
    ];
    if (speed !== null) parts.push(speed.toFixed(1) + " tok/s");
    if (t.first) parts.push("first token " + Math.round(t.first - t.start) + " ms");
    ui.usage.textContent = parts.join(" · ");
  }

  async function send() {
    const question = ui.input.value;
    if (!question.trim() || chat.controller) return;
    showError("");
    ui.input.value = "";
    const history = chat.history; // a new chat meanwhile starts another list: this turn stays in its own
    const turn = { role: "user", content: question };
    history.push(turn);
    const userEl = addUser(question);
    const view = addAssistant();
    const messages = [];
    if (ui.system.value.trim()) messages.push({ role: "system", content: ui.system.value });
    messages.push(...history);
    const body = {
      model: ui.model.value || "default", messages, stream: true, stream_options: { include_usage: true },
      temperature: number(ui.temperature, 0.7), top_p: number(ui.topP, 1),
      max_tokens: Math.max(1, Math.round(number(ui.maxTokens, 512))),
    };
    const controller = new AbortController();
    chat.controller = controller;
    setBusy(true);
    let content = "", reasoning = "", usage = null, finish = null, failure = null, stopped = false;
    const t = { start: performance.now(), first: 0, last: 0, end: 0 };
    try {
      const r = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
      });
      if (r.status === 401) {
        askKey("The server needs an API key (or did not accept this one).");
        throw new Error(await errorText(r));
      }
      if (!r.ok) throw new Error(await errorText(r));
      await readEvents(r, (data) => {
        if (data.error) throw new Error(data.error.message || "the server reported an error");
        if (data.usage) usage = data.usage;
        for (const ch of data.choices || []) {
          const d = ch.delta || {};
          if (d.reasoning_content) reasoning += d.reasoning_content;
          if (d.content) content += d.content;
          if (ch.finish_reason) finish = ch.finish_reason;
          if (d.content || d.reasoning_content) {
            t.last = performance.now();
            if (!t.first) t.first = t.last;
          }
        }
        view.update(content, reasoning);
      });
    } catch (e) {
      if (e.name === "AbortError") {
        stopped = true;
      } else {
        failure = e.message || String(e);
        controller.abort(); // close the connection: the server ends the request
      }
    } finally {
      t.end = performance.now();
      if (chat.controller === controller) chat.controller = null;
      setBusy(false);
    }
    if (failure && !content) {
      // Nothing was answered: the turn leaves the history, its text goes back to the input.
      history.splice(history.indexOf(turn), 1);
      userEl.classList.add("failed");
      if (!ui.input.value) ui.input.value = question;
      view.finish("Error: " + failure);
      view.element.classList.add("error");
      showError(failure);
      return;
    }
    history.push({ role: "assistant", content });
    if (history !== chat.history) return; // the chat was cleared meanwhile
    view.finish(stopped ? "Stopped." : failure ? "Error: " + failure : finish === "length" ? "(cut at max tokens)" : "");
    showUsage(usage, t);
    ui.input.focus();
  }

  function stop() {
    if (chat.controller) chat.controller.abort();
  }

  function newChat() {
    stop();
    chat.history = [];
    ui.messages.replaceChildren();
    showUsage(null, {});
    showError("");
    ui.input.focus();
  }

  // ------------------------------------------------------------ wiring

  ui.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  ui.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  ui.stop.addEventListener("click", stop);
  ui.newChat.addEventListener("click", newChat);
  ui.keyForm.addEventListener("submit", (e) => {
    e.preventDefault();
    chat.apiKey = ui.apiKey.value.trim();
    try { sessionStorage.setItem(KEY_STORE, chat.apiKey); } catch (err) { /* private mode */ }
    loadModels();
  });
  ui.changeKey.addEventListener("click", () => askKey("API key for this server:"));
  ui.model.addEventListener("change", () => { ui.modelName.textContent = ui.model.value; });
  for (const input of Object.values(SETTINGS)) input.addEventListener("change", saveSettings);
  ui.toggleSettings.addEventListener("click", () => {
    ui.settings.hidden = !ui.settings.hidden;
    ui.toggleSettings.setAttribute("aria-expanded", String(!ui.settings.hidden));
  });

  loadSettings();
  setBusy(false);
  loadModels();
  ui.input.focus();
})();
