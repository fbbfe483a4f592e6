// TaskBridge dispatch board. Plain script, no framework, no build step.
// Rules: every string from the API reaches the page as a text node or textContent (never as markup);
// the bearer token travels only in the Authorization header; GET reads, POST acts.
"use strict";

(function () {
  const TOKEN_KEY = "taskbridge.token";
  const STATUSES = ["pending", "running", "waiting", "done", "failed", "cancelled"];
  const FINISHED = ["done", "failed", "cancelled"];
  const FEED_MAX = 100;
  const ENGINE_MAX = 200;
  const LOG_MAX = 2000;

  const S = {
    token: null, cursor: 0, jobsMark: "", live: 0,
    // Keyset paging: `cursor` is this page's start, `back` the starts of the pages before it.
    list: { status: "", origin: "", search: "", cursor: null, back: [], limit: 50, total: 0, next: null },
    task: null, logNext: null, logSize: null, engineNext: null, engineSize: null,
    follow: {},                                  // running task id -> {next, size} of its log, for the feed
    refreshTimer: null,
  };

  const $ = (id) => document.getElementById(id);

  // ---- DOM building: text only -------------------------------------------------------------
  // Bidirectional controls reorder the text after them, beyond their own string (a title could
  // pull the status badge into itself): shown as escapes, as the CLI shows them.
  const BIDI = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
  function shown(value) {
    return String(value).replace(BIDI, (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));
  }
  function el(tag, props, ...kids) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = shown(value);
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, String(value));
    }
    for (const kid of kids.flat(Infinity)) {
      if (kid === null || kid === undefined || kid === false) continue;
      node.append(kid instanceof Node ? kid : document.createTextNode(shown(kid)));
    }
    return node;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }
  function taskLink(id) {
    // Ids come from the server as t_0001; the href is built from a fixed prefix, never taken whole.
    return el("a", { href: "#/task/" + encodeURIComponent(String(id)), class: "tid" }, String(id));
  }

  // ---- formatting --------------------------------------------------------------------------
  function age(iso) {
    if (!iso) return "";
    const sec = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (sec < 60) return Math.round(sec) + " s";
    if (sec < 3600) return Math.round(sec / 60) + " min";
    if (sec < 86400) return (sec / 3600).toFixed(1) + " h";
    return (sec / 86400).toFixed(1) + " d";
  }
  function usd(value) { return typeof value === "number" ? "$" + value.toFixed(value < 0.01 ? 4 : 2) : ""; }
  // The model a task ran on: its own, else the one its last run used (the worker's default, so
  // marked), else "default" for a task no run has recorded yet.
  function modelCell(t) {
    if (t.model) return t.model;
    if (t.ran_model) return [t.ran_model, el("span", { class: "empty" }, " (default)")];
    return el("span", { class: "empty", title: "the worker picks it when it claims the task" }, "default");
  }
  function ranModel(t) {
    const ran = t.result && typeof t.result === "object" ? t.result.model : null;
    return t.model || (ran ? ran + " (the default)" : "the default (chosen when it runs)");
  }
  function caller(t) { return [t.origin_name, t.origin_version].filter(Boolean).join(" ") || "-"; }

  // ---- the API -----------------------------------------------------------------------------
  class AuthError extends Error {}

  async function api(path, body) {
    const init = { headers: { Authorization: "Bearer " + S.token }, cache: "no-store" };
    if (body !== undefined) {
      init.method = "POST";
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    if (response.status === 401) throw new AuthError("the token was refused");
    let data = null;
    try { data = await response.json(); } catch (e) { data = null; }
    if (!response.ok) throw new Error((data && data.error) || ("HTTP " + response.status));
    return data;
  }

  function showError(err) {
    if (err instanceof AuthError) return askToken("The token was refused: paste the current one.");
    const box = $("error");
    box.textContent = shown(err && err.message ? err.message : err);
    box.hidden = false;
    setTimeout(() => { box.hidden = true; }, 6000);
  }

  // ---- token -------------------------------------------------------------------------------
  // A token in the address stays in the browser's history database for good (clearing the
  // address bar afterwards does not reach that), so the board never takes one from its URL: it
  // drops the fragment and says to paste the token instead.
  const FRAGMENT_REFUSED = "A token in the address is not taken: the browser's history would keep it. " +
    "Paste it here instead (and clear that address from the history).";

  function refuseFragmentToken() {
    if (!/^#token=/.test(location.hash)) return false;
    history.replaceState(null, "", location.pathname + location.search);
    return true;
  }

  function askToken(message) {
    S.token = null;
    S.live += 1;                               // ends the running live loop
    localStorage.removeItem(TOKEN_KEY);
    $("board").hidden = true;
    $("logout").hidden = true;
    clear($("tallies")); clear($("worker"));
    $("login").hidden = false;
    $("login-msg").textContent = message || "";
    $("token-input").focus();
  }

  async function start(notice) {
    S.token = localStorage.getItem(TOKEN_KEY);
    $("loading").hidden = !S.token;
    if (!S.token) return askToken(notice || "");
    if (notice) showError(notice);
    try {
      const status = await api("/api/status");
      $("login").hidden = true;
      $("board").hidden = false;
      $("logout").hidden = false;
      $("loading").hidden = true;
      renderStatus(status);
      S.cursor = status.marks.events;
      S.jobsMark = status.marks.jobs;
      await Promise.all([loadList(), loadFeed(), loadJobs(), loadEngine(), loadRunning(), route()]);
      liveLoop(++S.live);
    } catch (err) {
      $("loading").textContent = "the board could not load: " + String(err && err.message ? err.message : err);
      showError(err);
    }
  }

  // ---- status: tallies and worker ----------------------------------------------------------
  function renderStatus(status) {
    const box = clear($("tallies"));
    for (const name of STATUSES) {
      const count = (status.counts && status.counts[name]) || 0;
      box.append(el("button", { type: "button", class: "tally s-" + name, "data-status": name,
        onclick: () => { $("f-status").value = name; filtersChanged(); location.hash = "#/"; } },
        el("span", { class: "n", id: "tally-" + name }, String(count)), " " + name));
    }
    const w = status.worker || {};
    const state = w.label || "never seen";
    const parts = [el("span", { class: "badge w-" + state.replace(" ", "-"), id: "worker-state" }, "worker " + state)];
    if (w.seen && w.gone_since) {               // gone or stopped: it runs nothing now
      parts.push(" since " + age(w.gone_since) + " ago, pid " + w.pid + " on " + (w.host || "?") +
        "; when last seen " + (w.state || "?"));
      const had = w.last_tasks || [];
      if (had.length) parts.push(" with ", ...had.flatMap((t, i) => [i ? " " : "", taskLink(t)]));
    } else if (w.seen) {
      // Stale (silent on another host): it may still run its tasks, which stay its own until the reaper's limit.
      const heard = state === "stale" ? "; not heard from for " + age(w.at) : ", " + age(w.at) + " ago";
      parts.push(" pid " + w.pid + " on " + (w.host || "?") + ", " + (w.state || "?") + heard);
      const runs = state === "stale" ? ", may still run " : ", runs ";
      if (w.tasks && w.tasks.length) parts.push(runs, ...w.tasks.flatMap((t, i) => [i ? " " : "", taskLink(t)]));
      if (w.slots) parts.push(", " + w.slots + " slot(s)");
      if (w.engine) parts.push(", " + w.engine + " engine");
    }
    clear($("worker")).append(el("span", { title: w.summary || "" }, parts));
    const all = status.workers || [];
    if (all.length > 1) {                      // workers on every host, newest heartbeat first
      const list = el("span", { class: "workers", id: "workers" }, " · " + all.length + " workers:");
      for (const one of all) {
        const label = one.label || "stale";
        list.append(" ", el("span", { class: "badge w-" + label.replace(" ", "-"), title: one.summary || "" },
          (one.host || "?") + " pid " + one.pid + " " + label));
      }
      $("worker").append(list);
    }
    renderSpend(status.budget || {});
    for (const hold of status.held_accounts || []) {   // a provider at its usage limit: its tasks wait
      $("spend").append(" ", el("span", { class: "spent-out held", title: "paused: " + hold.tasks.join(", ") },
        hold.account + " at its usage limit until " + hold.until));
    }
  }

  // Today's spend against the daily budget (local day); why nothing is claimed when it is spent.
  function renderSpend(b) {
    const parts = ["today " + (usd(b.spent_usd) || "$0.00")];
    if (typeof b.daily_usd === "number") parts.push(" of " + usd(b.daily_usd));
    if (typeof b.daily_tokens === "number") parts.push(", " + b.spent_tokens + " of " + b.daily_tokens + " tokens");
    const box = clear($("spend"));
    box.append(el("span", { id: "spend-today", title: "resets at local midnight (" + (b.resets_at || "") + ")" }, parts));
    if (b.exhausted) box.append(" ", el("span", { class: "spent-out", id: "spend-out", title: b.reason || "" },
      "budget spent: no new work is claimed"));
  }

  async function loadStatus() { renderStatus(await api("/api/status")); }

  // ---- the task list -----------------------------------------------------------------------
  function filtersChanged() {
    S.list.status = $("f-status").value;
    S.list.origin = $("f-origin").value.trim();
    S.list.search = $("f-search").value.trim();
    S.list.cursor = null;
    S.list.back = [];
    loadList().catch(showError);
  }

  async function loadList() {
    const q = new URLSearchParams({ limit: S.list.limit });
    if (S.list.cursor) q.set("cursor", S.list.cursor);
    for (const key of ["status", "origin", "search"]) if (S.list[key]) q.set(key, S.list[key]);
    const page = await api("/api/tasks?" + q);
    S.list.total = page.total;
    S.list.next = page.next_cursor;
    const body = clear($("tasks").tBodies[0]);
    for (const t of page.tasks) {
      body.append(el("tr", { class: "s-" + t.status, "data-id": t.id, onclick: (e) => {
        if (e.target.tagName !== "A") location.hash = "#/task/" + encodeURIComponent(t.id);
      } },
        el("td", {}, taskLink(t.id)), el("td", { class: "title" }, t.title, t.repo ? el("span", { class: "where" },
          " " + t.repo + (t.pushed_branch ? " → " + t.pushed_branch : t.base_ref ? " @ " + t.base_ref : "")) : null),
        el("td", {}, el("span", { class: "status s-" + t.status }, t.status),
          t.status === "waiting" && t.resume_at ? el("span", { class: "resumes", title: "paused at its provider's usage limit" },
            " resumes " + t.resume_at) : null), el("td", {}, caller(t)),
        el("td", {}, modelCell(t)), el("td", {}, String(t.attempts) + "/" + String(t.max_retries + 1)),
        el("td", {}, age(t.created_at)), el("td", {}, usd(typeof t.spent_usd === "number" ? t.spent_usd : t.cost_usd))));
    }
    if (!page.tasks.length) body.append(el("tr", {}, el("td", { colspan: 8, class: "empty" }, "no tasks")));
    const first = S.list.back.length * S.list.limit;
    $("page-info").textContent = page.total ? (first + 1) + "–" + (first + page.tasks.length) + " of " + page.total : "";
    $("prev").disabled = S.list.back.length === 0;
    $("next").disabled = !page.next_cursor;
  }

  // ---- feed, jobs, engine ------------------------------------------------------------------
  function addEvents(events) {
    const feed = $("feed");
    for (const ev of events) {
      feed.prepend(el("li", { class: "ev k-" + String(ev.kind).replace(/[^a-z_]/gi, "") },
        el("time", {}, (ev.ts || "").slice(11, 19)), " ", ev.task_id ? taskLink(ev.task_id) : "", " ",
        el("b", {}, ev.kind), " ", el("span", { class: "m" }, ev.message || "")));
    }
    while (feed.children.length > FEED_MAX) feed.lastChild.remove();
  }

  function addToolLines(taskId, entries) {
    const feed = $("feed");
    for (const e of entries) {
      if (e.kind !== "tool" && e.kind !== "error") continue;
      feed.prepend(el("li", { class: "ev k-" + (e.kind === "tool" ? "tool" : "error") },
        el("time", {}, new Date().toISOString().slice(11, 19)), " ", taskLink(taskId), " ",
        el("b", {}, e.kind === "tool" ? "tool call" : "error"), " ", el("span", { class: "m" }, logEntryText(e))));
    }
    while (feed.children.length > FEED_MAX) feed.lastChild.remove();
  }

  // A model call began: said at once, since its tool calls reach the feed only when they end.
  function addCallLine(taskId, step) {
    const feed = $("feed");
    feed.prepend(el("li", { class: "ev k-step" }, el("time", {}, clock(step.at)), " ", taskLink(taskId), " ",
      el("b", {}, "model call"), " ", el("span", { class: "m" }, "call " + step.calls + " started (in progress)")));
    while (feed.children.length > FEED_MAX) feed.lastChild.remove();
  }

  // The feed follows the logs of the tasks running now, for their tool calls: new ones start at
  // the log's current end; finished ones are dropped.
  async function loadRunning() {
    const page = await api("/api/tasks?status=running&limit=16");
    const ids = page.tasks.map((t) => t.id);
    for (const id of Object.keys(S.follow)) if (!ids.includes(id)) delete S.follow[id];
    for (const id of ids) {
      if (S.follow[id]) continue;
      S.follow[id] = { next: null, size: null };
      const d = await api("/api/tasks/" + encodeURIComponent(id) + "/log");
      if (!S.follow[id]) continue;
      S.follow[id] = { next: d.next_offset, size: d.size, step: { calls: 0, last: null, at: null } };
      noteCalls(S.follow[id].step, d.model_calls);
    }
  }

  async function followLogs(sizes) {
    let grew = false;
    for (const [id, size] of Object.entries(sizes || {})) {
      const f = S.follow[id];
      if (!f || f.size === null || size === f.size) continue;
      const d = await api("/api/tasks/" + encodeURIComponent(id) + "/log?offset=" + f.next);
      if (!S.follow[id]) continue;
      const step = f.step || { calls: 0, last: null, at: null };
      const before = step.calls;
      noteCalls(step, d.model_calls);
      S.follow[id] = { next: d.next_offset, size: d.size, step };
      addToolLines(id, d.entries);
      if (step.calls > before && step.last === "start") addCallLine(id, step);
      grew = true;
    }
    if (grew) refreshSoon(false);   // the live spend in the header and the list
  }

  async function loadFeed() {
    const data = await api("/api/events?limit=50");
    clear($("feed"));
    addEvents(data.events);
  }

  async function loadJobs() {
    const data = await api("/api/jobs?limit=20");
    const body = clear($("jobs").tBodies[0]);
    for (const j of data.jobs) {
      body.append(el("tr", { class: "s-" + j.status },
        el("td", {}, "#" + j.id), el("td", {}, el("span", { class: "status s-" + j.status }, j.status)),
        el("td", {}, age(j.created_at)),
        el("td", { class: "head" }, el("div", {}, j.prompt || ""),
          j.answer ? el("div", { class: "answer" }, "→ " + j.answer) : "",
          j.error ? el("div", { class: "err" }, "✗ " + j.error) : "")));
    }
    if (!data.jobs.length) body.append(el("tr", {}, el("td", { class: "empty" }, "no jobs")));
  }

  async function loadEngine() {
    const q = S.engineNext === null ? "" : "?offset=" + S.engineNext;
    const data = await api("/api/engine" + q);
    const box = $("engine");
    if (S.engineNext === null || data.reset || box.dataset.empty) { clear(box); delete box.dataset.empty; }
    for (const line of data.lines) box.append(el("div", { class: "line" }, line));
    while (box.children.length > ENGINE_MAX) box.firstChild.remove();
    if (!box.children.length) { box.textContent = "the worker has written no log here yet"; box.dataset.empty = "1"; }
    S.engineNext = data.next_offset;
    S.engineSize = data.size;
    box.scrollTop = box.scrollHeight;
  }

  // ---- the task page -----------------------------------------------------------------------
  async function route() {
    const match = /^#\/task\/([^/]+)$/.exec(location.hash);
    if (!match) {
      S.task = null;
      $("task-view").hidden = true;
      $("list-view").hidden = false;
      return;
    }
    S.task = decodeURIComponent(match[1]);
    S.logNext = null; S.logSize = null; S.taskSeen = null; S.actionMsg = "";
    $("list-view").hidden = true;
    const view = $("task-view");
    view.hidden = false;
    clear(view).append(el("p", {}, "loading " + S.task + "…"));
    await loadTask();
    await loadLog();
  }

  function section(title, ...kids) { return el("section", { class: "part" }, el("h3", {}, title), kids); }
  function fields(rows) {
    return el("dl", { class: "fields" }, rows.filter(([, v]) => v !== null && v !== undefined && v !== "")
      .map(([k, v]) => [el("dt", {}, k), el("dd", {}, v instanceof Node ? v : String(v))]));
  }
  function list(items, render) {
    if (!items || !items.length) return el("p", { class: "empty" }, "none");
    return el("ul", {}, items.map((item) => el("li", {}, render ? render(item) : String(item))));
  }
  function show(value) { return typeof value === "string" ? value : JSON.stringify(value); }

  async function loadTask() {
    if (!S.task) return;
    const t = await api("/api/tasks/" + encodeURIComponent(S.task));
    // Unchanged data: keep the page as it is (no flicker, buttons and focus stay).
    const seen = JSON.stringify(t);
    if (seen === S.taskSeen && $("task-title")) return false;
    S.taskSeen = seen;
    S.running = t.status === "running" ? { since: t.started_at, attempt: t.attempts } : null;
    const open = !FINISHED.includes(t.status);
    // The page is rebuilt on every change of the task: keep what the person is typing.
    const typed = {};
    for (const id of ["answer-text", "note-text"]) if ($(id)) typed[id] = $(id).value;
    const view = clear($("task-view"));
    view.append(el("p", {}, el("a", { href: "#/" }, "← all tasks")),
      el("h2", { id: "task-title" }, el("span", { class: "tid" }, t.id), " ", t.title, " ",
        el("span", { class: "status s-" + t.status, id: "task-status" }, t.status)),
      why(t), actions(t, open),
      t.questions && t.questions.length ? section("Questions", list(t.questions, (q) => [
        el("pre", { class: "text question" }, "Q: " + q.question),
        el("pre", { class: "text answer" }, q.answer === null ? "(no answer yet)" : "A: " + q.answer)])) : "",
      receipt(t), usage(t), diff(t),
      section("Log", t.status === "running" ? el("p", { id: "live", class: "live" }) : "", el("div", { id: "log", class: "log" })),
      section("Instructions", el("pre", { class: "text", id: "instructions" }, t.instructions)),
      section("Dependencies", list(t.depends_on, (d) => taskLink(d))),
      section("Notes", list(t.notes, (n) => [el("b", {}, n.author), " ", el("time", {}, n.created_at || ""),
        n.delivered ? " (delivered)" : " (not yet delivered)", el("pre", { class: "text note" }, n.text)])),
      section("Task", fields([["caller", caller(t)], ["model", ranModel(t)], ["agent", t.agent],
        ["continues", t.continue_from ? taskLink(t.continue_from) : null],
        ["forked from", t.fork_from ? taskLink(t.fork_from) : null],
        ["rules", t.rules ? JSON.stringify(t.rules) : null],
        ["skills", t.skills && t.skills.length ? t.skills.join(", ") : null],
        ["sub-agents", t.subagents && t.subagents.length ? t.subagents.join(", ") : null],
        ["working dir", t.working_dir], ["repo", t.repo],
        ["base ref", t.repo ? t.base_ref || "the remote's HEAD branch" : null],
        ["host", t.host || (t.repo ? "any" : null)], ["worker host", t.lease_host],
        ["pushed", t.pushed_branch ? t.pushed_branch + " at " + String(t.pushed_commit || "").slice(0, 12) + " to " + t.repo : null],
        ["permission", t.permission], ["priority", t.priority],
        ["attempts", t.attempts + " of " + (t.max_retries + 1)], ["timeout", t.timeout_sec + " s"],
        ["branch", t.branch], ["worktree", t.worktree_path], ["created", t.created_at],
        ["started", t.started_at], ["finished", t.finished_at]])),
      section("Events", list(t.events, (e) => [el("time", {}, (e.ts || "").slice(11, 19)), " ",
        el("b", {}, e.kind), " ", e.message])));
    for (const [id, value] of Object.entries(typed)) if ($(id)) $(id).value = value;
    return true;
  }

  function actions(t, open) {
    const box = el("div", { class: "actions" });
    const msg = el("p", { class: "msg", id: "action-msg" }, S.actionMsg || "");
    // A live update may rebuild the task view while the POST is under way: the answer goes to the
    // message line on the page now (S.actionMsg keeps it for the next rebuild), not only to this one.
    function say(text) {
      S.actionMsg = text;
      ($("action-msg") || msg).textContent = shown(text);
    }
    async function act(name, body, done) {
      try {
        await api("/api/tasks/" + encodeURIComponent(t.id) + "/" + name, body);
        say(name + ": done");
        if (done) done();
        await Promise.all([loadTask().then((rebuilt) => rebuilt && loadLogKeep()), loadStatus(), loadList()]);
      } catch (err) {
        if (err instanceof AuthError) return showError(err);
        say(name + " refused: " + err.message);
      }
    }
    if (t.status === "waiting") {
      const text = el("textarea", { id: "answer-text", rows: 3, placeholder: t.resume_at ? "continue (resume now) or stop" : "your answer" });
      // A usage-limit pause is TaskBridge's, not the agent's: it resumes by itself at resume_at.
      const head = t.resume_at ? "Paused at " + (t.limit_account || "the provider") + "'s usage limit; resumes by itself at "
        + t.resume_at + ": " : t.paused_for === "usage_limit" ? "Paused at the provider's usage limit: " : "The agent asks: ";
      box.append(el("div", { class: "question-now" }, el("b", { id: "question-head" }, head),
        el("pre", { class: "text question", id: "question" }, t.question || "")),
        text, el("button", { type: "button", id: "answer-send", onclick: () => act("answer", { answer: text.value }) }, "Answer"));
    }
    if (open) {
      const note = el("textarea", { id: "note-text", rows: 2, placeholder: "a note for the agent's next prompt" });
      box.append(note, el("button", { type: "button", id: "note-send", onclick: () => act("note", { text: note.value }) }, "Add note"),
        el("button", { type: "button", id: "cancel", class: "danger", onclick: (e) => {
          // Two clicks, no dialog: the first arms the button. Kept in S, not on the button: a live
          // update may rebuild the page between the two clicks.
          if (S.armedCancel === t.id) { S.armedCancel = null; act("cancel", {}); }
          else { S.armedCancel = t.id; e.target.textContent = "Click again to cancel " + t.id; }
        } }, S.armedCancel === t.id ? "Click again to cancel " + t.id : "Cancel task"));
    }
    if (t.status === "failed" || t.status === "cancelled") {
      box.append(el("button", { type: "button", id: "retry", onclick: () => act("retry", {}) }, "Retry"));
    }
    box.append(msg);
    box.hidden = box.children.length === 1;          // a finished, un-retryable task: nothing to do
    return box;
  }

  // Why the task stands where it does, first: a failure's reason, a cancel's, or what the last
  // attempt of a task waiting for its retry hit.
  function why(t) {
    if (!t.error || !["failed", "cancelled", "pending"].includes(t.status)) return "";
    const head = { failed: "Why it failed: ", cancelled: "Why it was cancelled: " }[t.status] || "The last attempt hit: ";
    return el("p", { class: "why s-" + t.status, id: "task-why" }, el("b", {}, head), t.error);
  }

  function receipt(t) {
    const r = t.result;
    if (!r || typeof r !== "object") return section("Receipt", el("p", { class: "empty" }, t.error
      ? "no receipt: the attempt ended before writing one (why: at the top of this page)" : "no receipt yet"));
    const commands = (r.commands || []).map((c) => (typeof c === "object" && c)
      ? (c.command || c.title || show(c)) + (c.exit === undefined || c.exit === null ? "" : "  → exit " + c.exit) : show(c));
    const sandbox = r.sandbox && typeof r.sandbox === "object"
      ? Object.entries(r.sandbox).map(([k, v]) => k + ": " + show(v)) : [];
    return section("Receipt", el("pre", { class: "text", id: "summary" }, r.summary || ""),
      el("h4", {}, "Files touched"), list(r.files_touched),
      el("h4", {}, "Commands run"), list(commands),
      el("h4", {}, "Tests"), list((r.tests_run || []).map(show)),
      el("h4", {}, "Open questions"), list((r.open_questions || []).map(show)),
      el("h4", {}, "Sandbox"), list(sandbox),
      t.result_truncated ? el("p", { class: "empty" }, "long lists were cut to their last 100 items") : "");
  }

  function usage(t) {
    const u = t.usage || {};
    const r = (t.result && typeof t.result === "object") ? t.result : {};
    const tokens = u.tokens && typeof u.tokens === "object"
      ? Object.entries(u.tokens).map(([k, v]) => k + " " + show(v)).join(", ") : "";
    const limit = [usd(t.max_cost_usd), typeof t.max_tokens === "number" ? t.max_tokens + " tokens" : ""]
      .filter(Boolean).join(", ");
    return section("Usage", fields([["model", r.model || t.model], ["latency", r.latency_sec ? r.latency_sec + " s" : ""],
      ["attempts", t.attempts], ["tokens", tokens], ["cost", usd(u.cost_usd)],
      ["spent so far", t.status === "running" ? usd(t.spent_usd) + " (live)" : ""],
      ["limit", limit + (t.paused_for ? " (paused at the " + t.paused_for.replace("_", " ") + ")" : "")]]));
  }

  function diff(t) {
    if (!t.diff) return section("Diff", el("p", { class: "empty" }, "no changes recorded"));
    const files = el("ul", { class: "files", id: "diff-files" }, t.diff_files.map((f) =>
      el("li", {}, f.path, " ", el("span", { class: "add" }, "+" + f.added), " ",
        el("span", { class: "del" }, "-" + f.removed))));
    const pre = el("pre", { class: "diff", id: "diff" });
    for (const line of t.diff.split("\n")) {
      let kind = "ctx";
      if (line.startsWith("diff --git") || line.startsWith("+++") || line.startsWith("---")) kind = "file";
      else if (line.startsWith("@@")) kind = "hunk";
      else if (line.startsWith("+")) kind = "add";
      else if (line.startsWith("-")) kind = "del";
      pre.append(el("span", { class: kind }, line + "\n"));
    }
    return section("Diff", files, pre,
      t.diff_truncated ? el("p", { class: "empty" }, "the diff is longer: the first 512 KiB are shown") : "");
  }

  function logEntryText(e) {
    if (e.kind !== "tool") return e.text || "";
    return (e.tool || "tool") + (e.title ? ": " + e.title : "") + (e.status ? " [" + e.status + "]" : "")
      + (e.exit === null || e.exit === undefined ? "" : " exit " + e.exit) + (e.detail ? " — " + e.detail : "");
  }

  function logEntry(e) {
    return el("div", { class: "entry k-" + String(e.kind).replace(/[^a-z_]/gi, "") },
      el("span", { class: "kind" }, e.kind), " ", el("span", { class: "t" }, logEntryText(e)));
  }

  // A chunk's model calls (board_api.model_calls_in) folded into what is known of the run so far.
  function noteCalls(state, calls) {
    if (!state || !calls || !calls.last) return;
    state.calls += calls.started;
    state.last = calls.last;
    state.at = calls.at;
  }

  function secs(from) { return Math.max(0, Math.round(Date.now() / 1000 - from)); }
  function clock(unix) { return new Date(unix * 1000).toISOString().slice(11, 19); }

  // What a running task is doing while no tool call has ended: OpenCode reports a tool call only
  // when it ends, so this says what is known (the run's age, the model call open and since when).
  function renderLive() {
    const box = $("live");
    if (!box || !S.running) return;
    const parts = ["running: started " + age(S.running.since) + " ago (attempt " + S.running.attempt + ")"];
    const st = S.step || {};
    if (st.last === "start") {
      parts.push("model call " + st.calls + " in progress since " + clock(st.at) + " (" + secs(st.at)
        + " s): the model is answering or running the tools it asked for; a tool call shows below when it ends");
    } else if (st.last === "finish") {
      parts.push(st.calls + " model call(s) so far; the last ended at " + clock(st.at) + " (" + secs(st.at) + " s ago)");
    } else parts.push("no model call has started yet (OpenCode is starting)");
    box.textContent = parts.join(" · ");
  }

  async function loadLog() {
    if (!S.task) return;
    const q = S.logNext === null ? "" : "?offset=" + S.logNext;
    const data = await api("/api/tasks/" + encodeURIComponent(S.task) + "/log" + q);
    const box = $("log");
    if (!box) return;
    if (S.logNext === null || data.reset) { clear(box); S.step = { calls: 0, last: null, at: null }; }
    noteCalls(S.step, data.model_calls);
    renderLive();
    for (const entry of data.entries) box.append(logEntry(entry));
    while (box.children.length > LOG_MAX) box.firstChild.remove();
    S.logNext = data.next_offset;
    S.logSize = data.size;
    box.scrollTop = box.scrollHeight;
  }

  // ---- live: a long poll on the events cursor ----------------------------------------------
  function refreshSoon(taskToo) {
    if (taskToo) S.taskDirty = true;
    if (S.refreshTimer) return;
    S.refreshTimer = setTimeout(async () => {
      S.refreshTimer = null;
      const jobs = [loadStatus(), loadList(), loadRunning()];
      if (S.taskDirty && S.task) jobs.push(loadTask().then((rebuilt) => rebuilt && loadLogKeep()));
      S.taskDirty = false;
      try { await Promise.all(jobs); } catch (err) { showError(err); }
    }, 100);
  }
  async function loadLogKeep() {
    // loadTask rebuilt the page: re-read the log from its start so the box is whole again.
    S.logNext = null;
    await loadLog();
  }

  async function liveLoop(generation) {
    while (generation === S.live && S.token) {
      try {
        const q = new URLSearchParams({ cursor: S.cursor, jobs: S.jobsMark, wait: 20 });
        if (S.engineSize !== null) q.set("engine", S.engineSize);
        if (S.task) { q.set("task", S.task); if (S.logSize !== null) q.set("log", S.logSize); }
        const follow = Object.entries(S.follow).filter(([, f]) => f.size !== null).map(([id, f]) => id + ":" + f.size);
        if (follow.length) q.set("follow", follow.join(","));
        const ch = await api("/api/changes?" + q);
        if (generation !== S.live) return;
        if (ch.events.length) {
          S.cursor = ch.cursor;
          addEvents(ch.events);
          refreshSoon(ch.events.some((e) => e.task_id === S.task));
        } else if (ch.cursor !== S.cursor) {
          S.cursor = ch.cursor;
        }
        if (ch.jobs !== S.jobsMark) { S.jobsMark = ch.jobs; await loadJobs(); }
        if (S.task && S.logSize !== null && ch.log_size !== S.logSize) {
          await loadLog();
          refreshSoon(true);   // a running task's live spend grows with its log
        }
        if (S.engineSize !== null && ch.engine_size !== S.engineSize) await loadEngine();
        await followLogs(ch.follow);
      } catch (err) {
        if (err instanceof AuthError) return showError(err);
        showError(err);
        await new Promise((resolve) => setTimeout(resolve, 2000));
      }
    }
  }

  // ---- wiring ------------------------------------------------------------------------------
  function wire() {
    $("login-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const token = $("token-input").value.trim();
      if (!token) return;
      localStorage.setItem(TOKEN_KEY, token);
      $("token-input").value = "";
      start();
    });
    $("logout").addEventListener("click", () => askToken("Token forgotten."));
    $("filters").addEventListener("submit", (e) => e.preventDefault());
    $("f-status").addEventListener("change", filtersChanged);
    let typing = null;
    for (const id of ["f-origin", "f-search"]) {
      $(id).addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(filtersChanged, 250); });
    }
    $("prev").addEventListener("click", () => {
      if (S.list.back.length) { S.list.cursor = S.list.back.pop(); loadList().catch(showError); }
    });
    $("next").addEventListener("click", () => {
      if (S.list.next) { S.list.back.push(S.list.cursor); S.list.cursor = S.list.next; loadList().catch(showError); }
    });
    window.addEventListener("hashchange", () => {
      if (refuseFragmentToken()) { S.token ? showError(FRAGMENT_REFUSED) : askToken(FRAGMENT_REFUSED); return; }
      if (S.token) route().catch(showError);
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    setInterval(renderLive, 1000);
    const refused = refuseFragmentToken();
    wire();
    start(refused ? FRAGMENT_REFUSED : "");
  });
})();
