// TaskBridge's warm-up stop: an OpenCode plugin only a kept `opencode serve` loads (worker.py adds
// it to the server's OPENCODE_CONFIG_CONTENT "plugin" list and names the warm-up file in
// TASKBRIDGE_WARM_UP; engine_slots.py, engine.Engine.warm_up).
//
// Why: the first model call in a folder the server has not worked in costs 1–2.5 s of OpenCode's
// own set-up (the project, its config and instructions, the agent's tools, the provider), paid
// after the task was claimed. The worker opens the slot's worktree before the claim with one
// prompt in a session of its own, and this hook, which OpenCode runs just before each model call
// (chat.params), throws for that session: everything up to the request is done and loaded, and
// no request leaves (nothing is sent to the provider, nothing is spent). Every other session's
// calls go on untouched. Reads only the warm-up file (files.js); writes nothing.
// Not run by hand: OpenCode loads it. Env: TASKBRIDGE_WARM_UP (that file's path).
import { isWarmUp } from "./files.js";

export const TaskbridgeWarmUp = async () => ({
  "chat.params": async (input) => {
    if (isWarmUp(input && input.sessionID)) {
      throw new Error("TaskBridge warm-up: the folder is loaded; no model call is made");
    }
  },
});
