// TaskBridge's permission rules: an OpenCode plugin that `opencode run` loads for a task that
// carries its own rules (worker.py adds it to OPENCODE_CONFIG_CONTENT's "plugin" list and names
// the rules file in TASKBRIDGE_RULES).
//
// Why: a headless `opencode run` cannot hold one of OpenCode's own permission asks (without
// --auto it rejects them, with --auto it approves them; measured with 1.18.33), so a planner
// could never decide. Before every tool call (tool.execute.before: the main agent's and its
// sub-agents'), this hook matches the call against the task's rules, OpenCode's format
// ({"bash": {"git push*": "ask"}}: wildcards * and ?, \* and \? for the characters themselves,
// the last matching pattern wins; a bash command line is matched command by command, as OpenCode
// matches it, and the strictest answer wins: "cd x && git push" meets "git push*"):
// - deny: the call fails with a message naming the rule (the agent sees it and goes on);
// - allow, or no rule: the call runs (OpenCode's own permissions still apply);
// - ask: unless the planner allowed exactly this call once ("once" in the rules file, used up
//   here and acknowledged in "<run>/reply/rules.used"), the request {tool, subject, reason} is written
//   to "<run>/reply/rules.ask" (the worker believes that reply only when the rules do say ask for
//   it: the agent's shell can write there too) and the call fails with a message saying it waits
//   for the planner; the session's next model call is then held (chat.params), so nothing more
//   is asked of the model. The call fails rather than being held itself because a step ends, and
//   OpenCode prints its step_finish (its tokens and cost, which the worker books), only once its
//   tool calls have ended: a held call hid the cost of the step that made it. The worker ends the
//   run once that step_finish is printed; the task waits for the planner's answer, which resumes
//   the same session with the call to make again or to leave.
// The rules file: {"rules": {...}, "once": [{"tool", "subject"}]}. Imports only files.js and
// shell_commands.js (beside it).
import { readJson, replyPath, writeJson } from "./files.js";
import { commandForms } from "./shell_commands.js";

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
// The start of a held call's error, as opencode_runner.RULES_REFUSALS reads it in the event stream.
const HELD = "TaskBridge: this call waits for the planner's permission:";
const EDITS = new Set(["edit", "write", "patch", "multiedit", "apply_patch"]);

function ruleKey(tool) {
  return EDITS.has(tool) ? "edit" : tool === "list" ? "list" : tool;
}

function subjectOf(tool, args) {
  const a = args || {};
  if (tool === "bash") return String(a.command ?? "");
  if (tool === "task") return String(a.subagent_type ?? "");
  if (tool === "skill") return String(a.name ?? "");
  if (tool === "webfetch") return String(a.url ?? "");
  if (tool === "websearch") return String(a.query ?? "");
  if (tool === "glob" || tool === "grep") return String(a.pattern ?? "");
  return String(a.filePath ?? a.path ?? "");
}

// OpenCode's wildcard (* any run, ? one character) plus escapes: \* \? \\ stand for the character
// itself, so the rule an "always" answer adds matches exactly the request asked about (a command
// holding * or ? included). A backslash before any other character is literal. The Python twin is
// opencode_runner.wildcard_match(escapes=True).
function wildcard(text, pattern) {
  let re = "";
  const chars = [...pattern];
  for (let i = 0; i < chars.length; i++) {
    let c = chars[i];
    if (c === "\\" && "*?\\".includes(chars[i + 1] ?? "")) c = "\\" + chars[++i];
    re += c === "*" ? "[\\s\\S]*" : c === "?" ? "[\\s\\S]" : c.slice(-1).replace(/[.*?+^${}()|[\]\\]/g, "\\$&");
  }
  return new RegExp(`^${re}$`).test(text);
}

// The last of the tool's patterns that matches one of `subjects` (a path in both its forms): its
// action, or null. The Python twin is opencode_runner._action_of.
function actionOf(rules, key, subjects) {
  const rule = rules[key];
  if (rule === undefined) return null;
  const patterns = typeof rule === "string" ? { "*": rule } : rule;
  let action = null;
  for (const [pattern, act] of Object.entries(patterns)) {
    if (subjects.some((s) => wildcard(s, pattern))) action = act;
  }
  return action;
}

const SEVERITY = { deny: 3, ask: 2, allow: 1 };

// What the rules say of the call: for bash the strictest of its commands' actions (deny, ask,
// allow), each command matched as written and without its wrappers (commandForms), else
// actionOf. The Python twin is opencode_runner.rule_action.
function actionFor(rules, key, subject, subjects) {
  if (key !== "bash") return actionOf(rules, key, subjects);
  const commands = [...new Set(commandForms(subject).flat())].filter((form) => form);
  let action = null;
  for (const command of commands.length ? commands : [subject]) {
    const act = actionOf(rules, key, [command]);
    if ((SEVERITY[act] ?? 0) > (SEVERITY[action] ?? 0)) action = act;
  }
  return action;
}

export const TaskbridgePermissionRules = async ({ directory }) => {
  const path = process.env.TASKBRIDGE_RULES;
  const used = [];
  const asking = new Set(); // sessions with a call waiting for the planner: their next model call is held
  return {
    "chat.params": async (input) => {
      if (asking.has(input.sessionID)) for (;;) await sleep(1000); // the worker ends this run
    },
    "tool.execute.before": async (input, output) => {
      if (!path) return;
      const file = readJson(path);
      if (!file || typeof file.rules !== "object") {
        // Fail closed: rules that cannot be read (gone, unreadable, rewritten) refuse every call.
        throw new Error("TaskBridge: this task's permission rules cannot be read, so every tool call is refused");
      }
      const tool = String(input.tool);
      const key = ruleKey(tool);
      const subject = subjectOf(tool, output.args);
      const subjects = [subject];
      if (key === "edit" || key === "read" || key === "list") {
        const base = String(directory || "").replace(/\/+$/, "");
        if (base && subject.startsWith(base + "/")) subjects.push(subject.slice(base.length + 1));
      }
      const action = actionFor(file.rules || {}, key, subject, subjects);
      if (action === "deny") {
        throw new Error(`TaskBridge: the task's rules deny ${key} ${subject}; do not try it again, go on without it`);
      }
      if (action !== "ask") return;
      const once = (file.once || []).findIndex((g, i) => g.tool === key && g.subject === subject && !used.includes(i));
      if (once >= 0) {
        used.push(once);
        writeJson(replyPath(path, ".used"), { used });
        return;
      }
      if (asking.has(input.sessionID)) {
        // One ask at a time: a second call of the same step is not shown to the planner now.
        throw new Error(`${HELD} ${key} ${subject}; another call already waits for the planner: make this one again after the answer`);
      }
      const reason = String((output.args && output.args.description) || "");
      writeJson(replyPath(path, ".ask"), { tool: key, subject, reason, at: Date.now() });
      asking.add(input.sessionID);
      throw new Error(`${HELD} ${key} ${subject}; the task pauses here for the planner's answer`);
    },
  };
};
