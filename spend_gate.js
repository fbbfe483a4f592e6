// TaskBridge's spend gate: an OpenCode plugin that `opencode run` loads for a task with a spending
// limit or under a daily budget (worker.py adds it to OPENCODE_CONFIG_CONTENT's "plugin" list and
// names the gate file in TASKBRIDGE_GATE).
//
// Why: between a step_finish event on stdout and OpenCode's next model request there are ~10 ms,
// so a limit read only from the event stream cannot stop the next request. Before each model call
// of the run's own session this hook waits until the worker has metered every step that session
// finished (after each step_finish the worker writes {"steps": n, "stop": reason|null} to the
// gate file); when the worker says stop, the call is never sent and the worker ends the process
// tree at that step boundary. A worker that does not answer within TASKBRIDGE_GATE_WAIT_MS
// (default 30000) does not hang the run: the call goes out. Sub-agents' calls are not gated (their
// steps are not in the event stream). Reads and writes nothing else; no dependencies.
import fs from "fs";

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function readGate(path) {
  try {
    return JSON.parse(fs.readFileSync(path, "utf8"));
  } catch {
    return null; // not written yet, or caught mid-rename
  }
}

export const TaskbridgeSpendGate = async () => {
  const path = process.env.TASKBRIDGE_GATE;
  const waitMs = Number(process.env.TASKBRIDGE_GATE_WAIT_MS || 30000);
  const finished = new Map(); // session id -> ids of its finished steps
  let main = null;
  return {
    event: async ({ event }) => {
      const part = event && event.type === "message.part.updated" && event.properties && event.properties.part;
      if (part && part.type === "step-finish") {
        if (!finished.has(part.sessionID)) finished.set(part.sessionID, new Set());
        finished.get(part.sessionID).add(part.id);
      }
    },
    "chat.params": async (input) => {
      if (!path) return;
      main = main || input.sessionID;
      if (input.sessionID !== main) return;
      const need = (finished.get(main) || new Set()).size;
      const until = Date.now() + waitMs;
      for (;;) {
        const gate = readGate(path);
        if (gate && gate.stop) {
          for (;;) await sleep(1000); // the worker ends this process; no request goes out
        }
        if (gate && gate.steps >= need) return;
        if (Date.now() > until) return;
        await sleep(5);
      }
    },
  };
};
