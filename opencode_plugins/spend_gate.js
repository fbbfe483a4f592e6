// TaskBridge's spend gate: an OpenCode plugin that `opencode run` loads for a task with a spending
// limit or under a daily budget (worker.py adds it to OPENCODE_CONFIG_CONTENT's "plugin" list and
// names the gate file in TASKBRIDGE_GATE).
//
// Why a plugin: OpenCode makes its next model request ~10 ms after a step finishes, and
// `opencode run --format json` prints that step_finish only once the next call is under way
// (measured with 1.18.33: a held call held the printed event with it). A limit read from the
// printed stream therefore always lets one more request out. This hook runs before each model call
// of the run's own session: it sums the cost and tokens of the steps this run finished, from
// OpenCode's own storage (the session's messages), and when they reach what the worker allows
// ({"allow_usd": x | null, "allow_tokens": n | null, "stop": reason | null} in the gate file), it
// writes {"steps", "cost_usd", "tokens"} to "<run>/reply/gate.held" and never lets the call go: the worker
// sees that file, ends the process tree at this step boundary and pauses the task. (The agent's shell
// can write that folder too, so the worker books nothing from the file: it pauses once the printed
// event stream shows the run's spend at the allowance, and sets aside a reply it does not bear out.)
// Sub-agents' calls are not gated (their steps are not in the event stream either). A gate file
// that cannot be read lets the call go. Imports only files.js (beside it); writes only the .held file.
// Not run by hand: OpenCode loads it. Env: TASKBRIDGE_GATE (the gate file's path; unset, every call goes).
import { isWarmUp, readJson, replyPath, writeJson } from "./files.js";

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// The step-finish parts of the session, oldest first, from OpenCode's storage; null when unreadable.
async function finishedSteps(client, sessionID) {
  try {
    const answer = await client.session.messages({ path: { id: sessionID } });
    const messages = Array.isArray(answer) ? answer : answer && Array.isArray(answer.data) ? answer.data : null;
    if (!messages) return null;
    return messages.flatMap((m) => m.parts || []).filter((p) => p.type === "step-finish");
  } catch {
    return null;
  }
}

function tokensOf(part) {
  const t = part.tokens || {};
  if (typeof t.total === "number") return t.total;
  const cache = t.cache || {};
  return (t.input || 0) + (t.output || 0) + (t.reasoning || 0) + (cache.read || 0) + (cache.write || 0);
}

async function hold() {
  for (;;) await sleep(1000); // the worker ends this process; the call is never sent
}

export const TaskbridgeSpendGate = async ({ client }) => {
  const path = process.env.TASKBRIDGE_GATE;
  let main = null;
  let before = null; // steps the session had finished before this run (a resumed session)
  return {
    "chat.params": async (input) => {
      if (!path || (!main && isWarmUp(input.sessionID))) return;
      main = main || input.sessionID;
      if (input.sessionID !== main) return;
      const gate = readJson(path);
      if (gate && gate.stop) return hold();
      const steps = await finishedSteps(client, main);
      if (steps === null || !gate) return;
      if (before === null) before = steps.length;
      const mine = steps.slice(before);
      const cost = mine.reduce((sum, p) => sum + (Number(p.cost) || 0), 0);
      const tokens = mine.reduce((sum, p) => sum + tokensOf(p), 0);
      const overUsd = typeof gate.allow_usd === "number" && cost >= gate.allow_usd;
      const overTokens = typeof gate.allow_tokens === "number" && tokens >= gate.allow_tokens;
      if (!overUsd && !overTokens) return;
      writeJson(replyPath(path, ".held"), { steps: mine.length, cost_usd: cost, tokens });
      return hold();
    },
  };
};
