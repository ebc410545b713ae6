// The web console (docs/console.md): plain JavaScript, no build step, no
// library. Everything the page shows comes from the server's JSON API with
// the signed-in key; text is only ever set with textContent, never parsed
// as HTML. The key lives in sessionStorage (this tab, until it closes or
// signs out), never in a URL, and is never shown back.
"use strict";

(() => {
  const KEY_SLOT = "runtime.console.key";
  const REFRESH_MS = 3000;
  const main = document.getElementById("main");
  const toast = document.getElementById("toast");

  // ---- small helpers -------------------------------------------------

  /** An element: el("td", {class: "num"}, "text", child, ...). */
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else if (v === true) e.setAttribute(k, "");
      else e.setAttribute(k, String(v));
    }
    for (const c of children.flat()) {
      if (c === undefined || c === null || c === false) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  function show(...nodes) {
    main.replaceChildren(...nodes);
  }

  let toastTimer = null;
  function notify(text) {
    toast.textContent = text;
    toast.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { toast.hidden = true; }, 6000);
  }

  /** Random hex (an Idempotency-Key); works outside secure contexts too. */
  function randomHex(bytes) {
    const a = new Uint8Array(bytes);
    crypto.getRandomValues(a);
    return Array.from(a, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function dollars(micros) {
    if (micros === null || micros === undefined || micros === "") return "—";
    const n = Number(micros) / 1e6;
    if (n !== 0 && Math.abs(n) < 0.01) return "$" + n.toFixed(4);
    return "$" + n.toFixed(2);
  }

  function since(iso) {
    if (!iso) return "—";
    const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    return span(s);
  }

  function span(s) {
    if (s < 60) return Math.floor(s) + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + Math.floor(s % 60) + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }

  function lease(s) {
    if (s.state !== "running" && s.state !== "starting") {
      return s.stopReason ? s.state + " (" + s.stopReason + ")" : "—";
    }
    if (!s.endsAt) return "no limit";
    const left = (Date.parse(s.endsAt) - Date.now()) / 1000;
    const then = s.onLeaseEnd || "pause";
    return left > 0 ? then + " in " + span(left) : then + " now";
  }

  function memory(mib) {
    return mib >= 1024 ? (mib / 1024).toFixed(mib % 1024 ? 1 : 0) + " GiB" : mib + " MiB";
  }

  function badge(state) {
    return el("span", { class: "badge " + state }, state);
  }

  function errorBox(e) {
    return el("div", { class: "error", "data-code": e.code || "" }, describe(e));
  }

  function describe(e) {
    if (e instanceof ApiError) {
      return e.message + (e.requestId ? " (" + e.code + ", request " + e.requestId + ")" : "");
    }
    return String(e && e.message ? e.message : e);
  }

  // ---- the key and the API -------------------------------------------

  const session = {
    key() { return sessionStorage.getItem(KEY_SLOT); },
    set(k) { sessionStorage.setItem(KEY_SLOT, k); },
    clear() { sessionStorage.removeItem(KEY_SLOT); },
    me: null,
  };

  class ApiError extends Error {
    constructor(message, code, status, requestId) {
      super(message);
      this.code = code;
      this.status = status;
      this.requestId = requestId;
    }
  }

  /** One API call with the signed-in key; throws ApiError with the API's message. */
  async function api(method, path, body, keyOverride) {
    const key = keyOverride || session.key();
    const headers = { Accept: "application/json" };
    if (key) headers.Authorization = "Bearer " + key;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (method !== "GET") headers["Idempotency-Key"] = "console-" + randomHex(16);
    const r = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
      credentials: "omit",
      redirect: "error",
    });
    const text = await r.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
    if (!r.ok) {
      const e = data && data.error;
      const err = new ApiError(e ? e.message : "HTTP " + r.status, e ? e.code : "http_" + r.status,
        r.status, e ? e.requestId : r.headers.get("x-request-id"));
      if (r.status === 401 && !keyOverride && session.key()) {
        signOut("The key is no longer valid: " + err.message);
      }
      throw err;
    }
    return data;
  }

  const enc = encodeURIComponent;

  // ---- views and the router ------------------------------------------

  let timers = [];
  let leaving = [];
  function every(ms, fn) { timers.push(setInterval(fn, ms)); }
  function onLeave(fn) { leaving.push(fn); }
  function leaveView() {
    timers.forEach(clearInterval);
    timers = [];
    leaving.forEach((f) => { try { f(); } catch (_) { /* best effort */ } });
    leaving = [];
  }

  function route() {
    leaveView();
    const hash = location.hash || "#/sandboxes";
    const nav = document.getElementById("nav");
    if (!session.key()) {
      nav.hidden = true;
      document.getElementById("signout").hidden = true;
      document.getElementById("who").textContent = "";
      return signInView();
    }
    nav.hidden = false;
    document.getElementById("signout").hidden = false;
    const parts = hash.slice(2).split("/");
    for (const a of nav.querySelectorAll("a")) {
      a.classList.toggle("active", a.dataset.view === parts[0] || (parts[0] === "sandbox" && a.dataset.view === "sandboxes"));
    }
    switch (parts[0]) {
      case "sandbox": return sandboxView(decodeURIComponent(parts[1] || ""));
      case "keys": return keysView();
      case "usage": return usageView();
      default: return sandboxesView();
    }
  }

  function signOut(why) {
    session.clear();
    session.me = null;
    if (why) notify(why);
    location.hash = "#/signin";
    route();
  }

  async function loadMe() {
    const me = await api("GET", "/v1/me");
    session.me = me;
    const who = document.getElementById("who");
    who.textContent = (me.credentialName || me.credentialId) + " · " + me.role + (me.access === "read" ? " (read-only)" : "");
    return me;
  }

  // ---- sign in ---------------------------------------------------------

  function signInView() {
    const keyInput = el("input", { type: "password", id: "key", name: "key", autocomplete: "off", spellcheck: "false", required: true, placeholder: "rtcloud_…" });
    const err = el("div");
    const form = el("form", { id: "signin", onsubmit: async (ev) => {
      ev.preventDefault();
      const k = keyInput.value.trim();
      keyInput.value = "";
      err.replaceChildren();
      try {
        await api("GET", "/v1/me", undefined, k);
        session.set(k);
        await loadMe();
        location.hash = "#/sandboxes";
        route();
      } catch (e) {
        err.replaceChildren(errorBox(e));
      }
    } },
    el("label", { for: "key" }, "API key"),
    keyInput,
    el("p", { class: "muted" }, "Kept in this tab only (sessionStorage) until you sign out or close it; never shown again or put in a URL."),
    el("button", { type: "submit", class: "primary", id: "signin-button" }, "Sign in"));

    const approval = el("div");
    const ask = el("button", { type: "button", id: "ask-approval", onclick: () => askApproval(approval, ask) }, "Ask an admin to approve this browser");

    show(el("div", { class: "signin" },
      el("h1", {}, "Sign in"),
      el("section", { class: "card" }, form, err),
      el("section", { class: "card" },
        el("h2", {}, "No key at hand?"),
        el("p", { class: "muted" }, "An admin approves this browser on the server's approval page (as for runtime login); the new key comes to this tab only."),
        ask, approval)));
    keyInput.focus();
  }

  /** The approval flow of `runtime login`, with this tab as the computer. */
  async function askApproval(box, button) {
    button.disabled = true;
    let req;
    try {
      const r = await fetch("/v1/login/requests", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "application/json" },
        body: JSON.stringify({ computer: "web console (" + navigator.platform + ")" }),
        cache: "no-store",
        credentials: "omit",
      });
      req = await r.json();
      if (!r.ok) throw new ApiError(req.error ? req.error.message : "HTTP " + r.status, req.error && req.error.code, r.status, req.error && req.error.requestId);
    } catch (e) {
      box.replaceChildren(errorBox(e));
      button.disabled = false;
      return;
    }
    // The poll token stays in this closure: it is what receives the key.
    const pollToken = req.pollToken;
    const link = location.origin + req.approvePath;
    const status = el("p", { class: "muted", id: "approval-status" }, "Waiting for approval…");
    box.replaceChildren(el("div", { class: "notice" },
      el("p", {}, "Check that the approval page shows this code:"),
      el("p", { class: "code", id: "approval-code" }, req.code),
      el("p", {}, "Approval page (send it to an admin): ", el("a", { href: link, target: "_blank", rel: "noopener noreferrer", id: "approval-link" }, link)),
      status));
    const deadline = Date.now() + req.expiresInSeconds * 1000;
    const tick = async () => {
      if (session.key()) return;
      if (Date.now() > deadline) { status.textContent = "The request expired; ask again."; button.disabled = false; return; }
      try {
        const r = await fetch("/v1/login/requests/" + enc(req.id) + ":poll", {
          method: "POST",
          headers: { "Content-Type": "application/json", Accept: "application/json" },
          body: JSON.stringify({ pollToken }),
          cache: "no-store",
          credentials: "omit",
        });
        const a = await r.json();
        if (a.status === "approved" && a.key) {
          session.set(a.key);
          await loadMe();
          location.hash = "#/sandboxes";
          route();
          return;
        }
        if (a.status === "denied" || !r.ok) {
          status.textContent = a.status === "denied" ? "The request was denied." : (a.error ? a.error.message : "The request is gone.");
          button.disabled = false;
          return;
        }
      } catch (_) { /* try again */ }
      setTimeout(tick, 2000);
    };
    setTimeout(tick, 2000);
  }

  // ---- sandboxes -------------------------------------------------------

  async function listSandboxes(includeStopped) {
    const out = [];
    let cursor = null;
    for (let page = 0; page < 10; page++) {
      let q = "/v1/sandboxes?limit=100" + (includeStopped ? "&includeStopped=true" : "");
      if (cursor) q += "&cursor=" + enc(cursor);
      const r = await api("GET", q);
      out.push(...(r.data || []));
      cursor = r.nextCursor;
      if (!cursor) break;
    }
    return out;
  }

  function sandboxesView() {
    let includeStopped = false;
    const body = el("tbody", { id: "sandbox-rows" });
    const err = el("div");
    const updated = el("span", { class: "muted" });
    const toggle = el("input", { type: "checkbox", id: "include-stopped", onchange: () => { includeStopped = toggle.checked; refresh(); } });
    show(el("h1", {}, "Sandboxes"),
      el("section", { class: "card" },
        el("div", { class: "actions" }, el("label", { class: "check", for: "include-stopped" }, toggle, "Show stopped"), updated),
        err,
        el("table", { id: "sandboxes" },
          el("thead", {}, el("tr", {},
            el("th", {}, "Sandbox"), el("th", {}, "State"), el("th", {}, "Shape"), el("th", {}, "Age"),
            el("th", { class: "num" }, "Cost so far"), el("th", { class: "num" }, "Held"), el("th", {}, "Lease"))),
          body)));
    async function refresh() {
      try {
        const list = await listSandboxes(includeStopped);
        body.replaceChildren(...list.map((s) => el("tr", { "data-id": s.id, "data-state": s.state },
          el("td", {}, el("a", { href: "#/sandbox/" + enc(s.id) }, s.name || s.id), s.name ? el("div", { class: "mono muted" }, s.id) : null),
          el("td", { class: "state" }, badge(s.state)),
          el("td", {}, s.vcpu + " vCPU · " + memory(s.memoryMiB)),
          el("td", {}, since(s.createdAt)),
          el("td", { class: "num" }, dollars(s.chargedMicros)),
          el("td", { class: "num" }, dollars(s.heldMicros)),
          el("td", {}, lease(s)))));
        if (!list.length) body.replaceChildren(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "No sandboxes.")));
        err.replaceChildren();
        updated.textContent = "Updated " + new Date().toLocaleTimeString();
      } catch (e) {
        err.replaceChildren(errorBox(e));
      }
    }
    refresh();
    every(REFRESH_MS, refresh);
  }

  // ---- one sandbox -------------------------------------------------------

  function sandboxView(id) {
    const head = el("div");
    const actionsErr = el("div", { id: "action-error" });
    const procs = el("div", { id: "processes" }, el("p", { class: "muted" }, "Loading…"));
    const previews = el("div", { id: "previews" }, el("p", { class: "muted" }, "Loading…"));
    const network = el("div", { id: "network" }, el("p", { class: "muted" }, "Loading…"));
    const consoleLog = el("pre", { class: "log", id: "console-log" }, "Loading…");
    const consoleErr = el("div");
    const path = "/v1/sandboxes/" + enc(id);

    const act = (label, verb, cls) => {
      const b = el("button", { type: "button", class: cls || "", "data-action": verb }, label);
      let armed = false;
      b.addEventListener("click", async () => {
        if (verb === "delete" && !armed) {
          armed = true;
          b.textContent = "Confirm delete";
          b.className = "confirm";
          setTimeout(() => { armed = false; b.textContent = label; b.className = cls || ""; }, 5000);
          return;
        }
        b.disabled = true;
        actionsErr.replaceChildren();
        try {
          if (verb === "delete") {
            await api("DELETE", path);
            notify("Deleted " + id);
            location.hash = "#/sandboxes";
            return;
          }
          await api("POST", path + ":" + verb, {});
          refreshRecord();
        } catch (e) {
          actionsErr.replaceChildren(errorBox(e));
        } finally {
          b.disabled = false;
          armed = false;
          b.textContent = label;
          b.className = cls || "";
        }
      });
      return b;
    };

    const term = terminal(id);
    onLeave(term.close);

    show(el("p", {}, el("a", { href: "#/sandboxes" }, "← Sandboxes")),
      head,
      el("div", { class: "actions" }, act("Pause", "pause"), act("Wake", "wake"), act("Stop", "stop"), act("Delete", "delete", "danger")),
      actionsErr,
      el("div", { class: "grid" },
        el("section", { class: "card" }, el("h2", {}, "Processes"), procs),
        el("section", { class: "card" }, el("h2", {}, "Previews"), previews),
        el("section", { class: "card" }, el("h2", {}, "Network rules"), network)),
      el("section", { class: "card", style: null }, el("h2", {}, "Terminal"), term.node),
      el("section", { class: "card" }, el("h2", {}, "Console log (serial console tail)"), consoleErr, consoleLog));

    async function refreshRecord() {
      try {
        const s = await api("GET", path);
        head.replaceChildren(
          el("h1", { id: "sandbox-title" }, s.name || s.id, " ", badge(s.state)),
          el("dl", { class: "kv", id: "sandbox-facts" },
            el("dt", {}, "Id"), el("dd", { class: "mono" }, s.id),
            el("dt", {}, "Shape"), el("dd", {}, s.vcpu + " vCPU · " + memory(s.memoryMiB) + " · disk " + memory(s.diskMiB)),
            el("dt", {}, "Age"), el("dd", {}, since(s.createdAt)),
            el("dt", {}, "Cost so far"), el("dd", {}, dollars(s.chargedMicros) + " (held " + dollars(s.heldMicros) + ")"),
            el("dt", {}, "Lease"), el("dd", {}, lease(s)),
            el("dt", {}, "Image"), el("dd", {}, s.image || "default"),
            el("dt", {}, "Labels"), el("dd", {}, Object.entries(s.labels || {}).map(([k, v]) => k + "=" + v).join(", ") || "—")));
      } catch (e) {
        head.replaceChildren(el("h1", {}, id), errorBox(e));
      }
    }

    async function refreshProcesses() {
      try {
        const r = await api("GET", path + "/processes");
        const rows = (r.data || []).slice().reverse();
        procs.replaceChildren(rows.length ? el("table", {},
          el("thead", {}, el("tr", {}, el("th", {}, "Command"), el("th", {}, "State"), el("th", {}, "Exit"), el("th", {}, "Started"))),
          el("tbody", {}, rows.map((p) => el("tr", { "data-id": p.id },
            el("td", { class: "mono" }, p.command || (p.argv || []).join(" ")),
            el("td", {}, p.state),
            el("td", {}, p.exitCode === null || p.exitCode === undefined ? "—" : String(p.exitCode)),
            el("td", {}, since(p.startedAt) + " ago"))))) : el("p", { class: "muted" }, "No processes."));
      } catch (e) {
        procs.replaceChildren(errorBox(e));
      }
    }

    async function refreshPreviews() {
      try {
        const r = await api("GET", path + "/previews");
        const rows = r.data || [];
        // Tokens are not shown: the URL alone, and whether it needs one.
        previews.replaceChildren(rows.length ? el("table", {},
          el("thead", {}, el("tr", {}, el("th", {}, "Port"), el("th", {}, "Visibility"), el("th", {}, "URL"))),
          el("tbody", {}, rows.map((p) => el("tr", {},
            el("td", {}, String(p.port)), el("td", {}, p.visibility),
            el("td", { class: "mono" }, p.url))))) : el("p", { class: "muted" }, "No previews."));
      } catch (e) {
        previews.replaceChildren(errorBox(e));
      }
    }

    async function refreshNetwork() {
      try {
        const n = await api("GET", path + "/network");
        const rows = [];
        for (const [k, v] of Object.entries(n)) {
          if (k === "sandboxId") continue;
          rows.push(el("dt", {}, k), el("dd", { class: "mono" }, Array.isArray(v) ? (v.length ? v.join(", ") : "—") : (v === null ? "—" : typeof v === "object" ? JSON.stringify(v) : String(v))));
        }
        network.replaceChildren(el("dl", { class: "kv" }, rows));
      } catch (e) {
        network.replaceChildren(errorBox(e));
      }
    }

    async function refreshConsole() {
      try {
        const r = await api("GET", path + "/console?bytes=16384");
        const atEnd = consoleLog.scrollTop + consoleLog.clientHeight >= consoleLog.scrollHeight - 4;
        consoleLog.hidden = false;
        consoleLog.textContent = stripAnsi(r.text) || "(empty)";
        if (atEnd) consoleLog.scrollTop = consoleLog.scrollHeight;
        consoleErr.replaceChildren();
      } catch (e) {
        consoleLog.hidden = true;
        consoleErr.replaceChildren(errorBox(e));
      }
    }

    const all = () => { refreshRecord(); refreshProcesses(); refreshPreviews(); refreshNetwork(); refreshConsole(); };
    all();
    every(REFRESH_MS, all);
  }

  // ---- the terminal ------------------------------------------------------

  /** Terminal escape sequences out, carriage returns and backspaces applied. */
  function stripAnsi(s) {
    return s
      .replace(/\x1b\][^\x07\x1b]*(\x07|\x1b\\)/g, "")      // OSC (titles)
      .replace(/\x1b\[[0-?]*[ -/]*[@-~]/g, "")             // CSI
      .replace(/\x1b[PX^_][^\x1b]*\x1b\\/g, "")            // DCS, SOS, PM, APC
      .replace(/\x1b[()][A-Za-z0-9]/g, "")                 // charsets
      .replace(/\x1b[@-Z\\-_=>]/g, "")                    // other two-byte ones
      .replace(/\r\n/g, "\n")
      .replace(/[\x00-\x07\x0b\x0c\x0e-\x1a\x1c-\x1f]/g, "");
  }

  const KEYS = {
    Enter: "\r", Backspace: "\x7f", Tab: "\t", Escape: "\x1b",
    ArrowUp: "\x1b[A", ArrowDown: "\x1b[B", ArrowRight: "\x1b[C", ArrowLeft: "\x1b[D",
    Home: "\x1b[H", End: "\x1b[F", Delete: "\x1b[3~", PageUp: "\x1b[5~", PageDown: "\x1b[6~",
  };

  /**
   * A minimal terminal over the sandbox's terminal WebSocket. A browser
   * cannot send Authorization on a WebSocket, so the page first makes a
   * short-lived session for this sandbox and this page's origin, offers its
   * token as a subprotocol, and revokes the session once the socket is open.
   */
  function terminal(id) {
    const out = el("pre", { class: "term", id: "terminal", tabindex: "0", "aria-label": "Terminal: click and type" });
    const status = el("span", { class: "muted", id: "terminal-status" }, "Closed.");
    const err = el("div", { id: "terminal-error" });
    let ws = null;
    let text = "";
    let line = "";
    const decoder = new TextDecoder();
    const COLS = 100;
    const ROWS = 30;

    function write(chunk) {
      for (const ch of stripAnsi(chunk)) {
        if (ch === "\r") { line = ""; continue; }
        if (ch === "\b") { line = line.slice(0, -1); continue; }
        if (ch === "\n") { text += line + "\n"; line = ""; continue; }
        line += ch;
      }
      if (text.length > 200000) text = text.slice(-150000);
      out.textContent = text + line;
      out.scrollTop = out.scrollHeight;
    }

    function send(s) {
      if (ws && ws.readyState === WebSocket.OPEN) ws.send(new TextEncoder().encode(s));
    }

    async function open() {
      close();
      err.replaceChildren();
      text = ""; line = "";
      out.textContent = "";
      status.textContent = "Opening…";
      let sess;
      try {
        sess = await api("POST", "/v1/sandboxes/" + enc(id) + "/sessions",
          { ttlSeconds: 60, origins: [location.origin], name: "console terminal" });
      } catch (e) {
        status.textContent = "Closed.";
        err.replaceChildren(errorBox(e));
        return;
      }
      const scheme = location.protocol === "https:" ? "wss:" : "ws:";
      const url = scheme + "//" + location.host + "/v1/sandboxes/" + enc(id) + "/terminal?cols=" + COLS + "&rows=" + ROWS;
      const sock = new WebSocket(url, ["runtime-terminal", "runtime-session." + sess.token]);
      sess.token = null;
      const revoke = () => api("POST", "/v1/sandboxes/" + enc(id) + "/sessions/" + enc(sess.id) + ":revoke", {}).catch(() => {});
      ws = sock;
      sock.binaryType = "arraybuffer";
      sock.onopen = () => { status.textContent = "Connected."; revoke(); out.focus(); };
      sock.onmessage = (m) => {
        if (typeof m.data === "string") {
          try {
            const v = JSON.parse(m.data);
            if (v.type === "exit") status.textContent = "Exited (" + v.exitCode + ").";
          } catch (_) { write(m.data); }
          return;
        }
        write(decoder.decode(new Uint8Array(m.data), { stream: true }));
      };
      sock.onerror = () => { err.replaceChildren(el("div", { class: "error" }, "The terminal could not connect (is the sandbox running?).")); };
      sock.onclose = () => { if (ws === sock) { ws = null; status.textContent = "Closed."; } revoke(); };
    }

    function close() {
      if (ws) { const s = ws; ws = null; s.close(); }
    }

    out.addEventListener("keydown", (ev) => {
      if (!ws) return;
      let s = null;
      if (ev.ctrlKey && !ev.altKey && ev.key.length === 1) {
        const c = ev.key.toUpperCase().charCodeAt(0);
        if (c >= 64 && c <= 95) s = String.fromCharCode(c - 64);
      } else if (KEYS[ev.key]) {
        s = KEYS[ev.key];
      } else if (ev.key.length === 1 && !ev.metaKey) {
        s = ev.key;
      }
      if (s !== null) { ev.preventDefault(); send(s); }
    });
    out.addEventListener("paste", (ev) => {
      ev.preventDefault();
      send((ev.clipboardData || new DataTransfer()).getData("text"));
    });

    const node = el("div", {},
      el("div", { class: "actions" },
        el("button", { type: "button", id: "terminal-open", class: "primary", onclick: open }, "Open terminal"),
        el("button", { type: "button", id: "terminal-close", onclick: close }, "Close"),
        status),
      err,
      el("p", { class: "muted" }, "Click the terminal and type. Output is shown without colours or cursor movement."),
      out);
    return { node, close };
  }

  // ---- keys --------------------------------------------------------------

  function keysView() {
    const rows = el("tbody", { id: "key-rows" });
    const listErr = el("div");
    const created = el("div", { id: "created" });
    const formErr = el("div", { id: "key-error" });
    const name = el("input", { type: "text", id: "new-key-name", maxlength: 100, placeholder: "e.g. ci" });
    const readOnly = el("input", { type: "checkbox", id: "new-key-read-only" });
    const accountWide = el("input", { type: "checkbox", id: "new-key-account-wide" });
    const limit = el("input", { type: "text", id: "new-key-limit", inputmode: "decimal", placeholder: "none" });

    // The new key is held only by this node while shown; "Done", or
    // leaving the page, drops it.
    const forgetCreated = () => created.replaceChildren();
    onLeave(forgetCreated);

    const form = el("form", { id: "new-key", onsubmit: async (ev) => {
      ev.preventDefault();
      formErr.replaceChildren();
      forgetCreated();
      const body = { readOnly: readOnly.checked, accountWide: accountWide.checked };
      if (name.value.trim()) body.name = name.value.trim();
      if (limit.value.trim()) {
        const micros = parseDollars(limit.value);
        if (micros === null) { formErr.replaceChildren(el("div", { class: "error" }, "The daily limit must be an amount in dollars, such as 5 or 0.25.")); return; }
        body.dailyLimitMicros = micros;
      }
      try {
        const k = await api("POST", "/v1/keys", body);
        const box = el("div", { class: "secret", id: "new-key-secret" }, k.key);
        delete k.key;
        const copy = el("button", { type: "button", id: "copy-key", onclick: async () => {
          try { await navigator.clipboard.writeText(box.textContent); notify("Copied."); } catch (_) { notify("Select the key and copy it."); }
        } }, "Copy");
        created.replaceChildren(el("div", { class: "notice" },
          el("p", {}, "The new key ", el("b", {}, k.name || k.id), ". Copy it now: it is shown this once and the server keeps only its hash."),
          box,
          el("div", { class: "actions" }, copy, el("button", { type: "button", id: "key-done", class: "primary", onclick: forgetCreated }, "Done"))));
        name.value = ""; limit.value = ""; readOnly.checked = false; accountWide.checked = false;
        refresh();
      } catch (e) {
        formErr.replaceChildren(errorBox(e));
      }
    } },
    el("div", { class: "row" },
      el("div", {}, el("label", { for: "new-key-name" }, "Name"), name),
      el("div", {}, el("label", { for: "new-key-limit" }, "Daily limit ($)"), limit)),
    el("label", { class: "check" }, readOnly, "Read-only (sees everything, changes nothing)"),
    el("label", { class: "check" }, accountWide, "Account-wide (uses every sandbox)"),
    el("p", {}, el("button", { type: "submit", class: "primary", id: "create-key" }, "Create key")));

    show(el("h1", {}, "Keys"),
      el("section", { class: "card" }, el("h2", {}, "Create a key"), form, formErr, created),
      el("section", { class: "card" }, el("h2", {}, "Keys"), listErr,
        el("table", { id: "keys" },
          el("thead", {}, el("tr", {}, el("th", {}, "Name"), el("th", {}, "Access"), el("th", {}, "Daily limit"),
            el("th", {}, "Created"), el("th", {}, "State"), el("th", {}, ""))),
          rows)));

    async function refresh() {
      try {
        const r = await api("GET", "/v1/keys");
        rows.replaceChildren(...(r.data || []).map(keyRow));
        listErr.replaceChildren();
      } catch (e) {
        listErr.replaceChildren(errorBox(e));
      }
    }

    function keyRow(k) {
      const rowErr = el("div");
      const limitInput = el("input", { type: "text", class: "limit", inputmode: "decimal", size: 8,
        value: k.dailyLimitMicros === null ? "" : String(k.dailyLimitMicros / 1e6), placeholder: "none" });
      const setLimit = el("button", { type: "button", class: "set-limit", onclick: async () => {
        rowErr.replaceChildren();
        const v = limitInput.value.trim();
        const micros = v ? parseDollars(v) : null;
        if (v && micros === null) { rowErr.replaceChildren(el("div", { class: "error" }, "An amount in dollars, or empty for none.")); return; }
        try { await api("POST", "/v1/keys/" + enc(k.id) + ":limit", { dailyLimitMicros: micros }); notify("Limit saved."); refresh(); }
        catch (e) { rowErr.replaceChildren(errorBox(e)); }
      } }, "Set");
      let armed = false;
      const revoke = el("button", { type: "button", class: "danger revoke", onclick: async () => {
        if (!armed) { armed = true; revoke.textContent = "Confirm revoke"; revoke.className = "confirm revoke"; return; }
        rowErr.replaceChildren();
        try {
          await api("POST", "/v1/keys/" + enc(k.id) + ":revoke", {});
          if (k.current) { signOut("This key was revoked."); return; }
          refresh();
        } catch (e) { rowErr.replaceChildren(errorBox(e)); }
      } }, k.current ? "Revoke (sign out)" : "Revoke");
      const revoked = !!k.revokedAt;
      return el("tr", { "data-id": k.id, "data-name": k.name || "" },
        el("td", {}, k.name || "—", k.current ? el("span", { class: "muted" }, " (this key)") : null, el("div", { class: "mono muted" }, k.id)),
        el("td", {}, k.access === "read" ? "read-only" : "full", k.accountWide ? " · account-wide" : ""),
        el("td", {}, revoked ? dollars(k.dailyLimitMicros) : el("span", { class: "actions" }, limitInput, setLimit)),
        el("td", {}, since(k.createdAt) + " ago"),
        el("td", {}, revoked ? badge("revoked") : badge("active")),
        // The API refuses an account-wide key revoking itself: not offered.
        el("td", {}, revoked || (k.current && k.accountWide) ? null : revoke, rowErr));
    }

    refresh();
  }

  /** Dollars as typed ("5", "0.25", "$1,000") to microdollars, or null. */
  function parseDollars(s) {
    const t = s.trim().replace(/^\$/, "").replace(/,/g, "");
    if (!/^(\d+(\.\d{0,6})?|\.\d{1,6})$/.test(t)) return null;
    const [w, f = ""] = t.split(".");
    return Number(w || "0") * 1e6 + Number((f + "000000").slice(0, 6));
  }

  // ---- usage -------------------------------------------------------------

  function usageView() {
    const box = el("div", {}, el("p", { class: "muted" }, "Loading…"));
    show(el("h1", {}, "Usage"), box);
    (async () => {
      try {
        const [u, d] = await Promise.all([api("GET", "/v1/usage"), api("GET", "/v1/usage/daily?days=30")]);
        const days = d.days || [];
        const max = Math.max(1, ...days.map((x) => Number(x.spentMicros)));
        const names = {};
        for (const k of u.keys || []) names[k.keyId] = k.name || k.keyId;
        box.replaceChildren(
          el("section", { class: "card" },
            el("div", { class: "summary" },
              el("div", {}, el("span", { class: "muted" }, "Spent in all"), el("b", { id: "spent" }, dollars(u.spent))),
              el("div", {}, el("span", { class: "muted" }, "Held by running leases"), el("b", {}, dollars(u.held))),
              el("div", {}, el("span", { class: "muted" }, "Last 24 hours"), el("b", {}, dollars((u.keys || []).reduce((a, k) => a + Number(k.last24hMicros), 0)))))),
          el("section", { class: "card" }, el("h2", {}, "By day (UTC, last 30 days)"),
            days.length ? el("table", { id: "usage-days" },
              el("thead", {}, el("tr", {}, el("th", {}, "Day"), el("th", { class: "num" }, "Spent"), el("th", {}, ""), el("th", {}, "By key"))),
              el("tbody", {}, days.slice().reverse().map((x) => el("tr", {},
                el("td", {}, x.date),
                el("td", { class: "num" }, dollars(x.spentMicros)),
                el("td", { style: null }, el("span", { class: "bar", "data-w": "1" })),
                el("td", {}, x.keys.map((k) => (k.name || names[k.keyId] || k.keyId) + " " + dollars(k.spentMicros)).join(" · ")))))) : el("p", { class: "muted" }, "Nothing spent yet.")),
          el("section", { class: "card" }, el("h2", {}, "By key"),
            el("table", { id: "usage-keys" },
              el("thead", {}, el("tr", {}, el("th", {}, "Key"), el("th", { class: "num" }, "Spent"), el("th", { class: "num" }, "Held"), el("th", { class: "num" }, "Last 24 h"))),
              el("tbody", {}, (u.keys || []).map((k) => el("tr", {},
                el("td", {}, k.name || k.keyId), el("td", { class: "num" }, dollars(k.spentMicros)),
                el("td", { class: "num" }, dollars(k.heldMicros)), el("td", { class: "num" }, dollars(k.last24hMicros))))))),
          el("section", { class: "card" }, el("h2", {}, "By sandbox"),
            el("table", { id: "usage-sandboxes" },
              el("thead", {}, el("tr", {}, el("th", {}, "Sandbox"), el("th", {}, "Key"), el("th", {}, "State"), el("th", { class: "num" }, "Charged"), el("th", { class: "num" }, "Held"))),
              el("tbody", {}, (u.sandboxes || []).map((s) => el("tr", {},
                el("td", {}, s.state === "deleted" ? (s.name || s.sandboxId) : el("a", { href: "#/sandbox/" + enc(s.sandboxId) }, s.name || s.sandboxId)),
                el("td", {}, names[s.keyId] || s.keyId), el("td", {}, badge(s.state)),
                el("td", { class: "num" }, dollars(s.chargedMicros)), el("td", { class: "num" }, dollars(s.heldMicros))))))));
        // Bar widths set through the CSSOM (allowed by the CSP), not inline style attributes.
        const bars = box.querySelectorAll("#usage-days .bar");
        days.slice().reverse().forEach((x, i) => { if (bars[i]) bars[i].style.width = Math.max(2, Math.round(160 * Number(x.spentMicros) / max)) + "px"; });
      } catch (e) {
        box.replaceChildren(errorBox(e));
      }
    })();
  }

  // ---- start -------------------------------------------------------------

  document.getElementById("signout").addEventListener("click", () => signOut("Signed out."));
  window.addEventListener("hashchange", route);
  (async () => {
    if (session.key()) {
      try { await loadMe(); } catch (_) { /* 401 signs out; else show the view's error */ }
    }
    route();
  })();
})();
