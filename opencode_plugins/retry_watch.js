// TaskBridge's retry watch: an OpenCode plugin that `opencode run` loads for every task run
// (worker.py adds it to OPENCODE_CONFIG_CONTENT's "plugin" list and names the control file in
// TASKBRIDGE_RETRY).
//
// Why: when the model's provider answers with a rate limit or a usage window, OpenCode sleeps out
// the provider's retry-after inside the run (measured with 1.18.33: five retries, each as long as
// the header says) and prints nothing on the --format json stream meanwhile, so the task's slot is
// held by a process that does nothing. OpenCode tells plugins when it schedules a retry
// (session.status {type: "retry", attempt, message, next}); this plugin writes the latest one to
// "<run>/reply/retry.json" ({"attempt", "message", "next": epoch ms, "at": epoch ms, "sessionID"})
// so the worker can end a long wait and pause the task until the reset instead. Only the run's
// first busy session (its own, not a sub-agent's) is reported. Reads nothing; writes only that file;
// imports only files.js (beside it).
import { isWarmUp, replyPath, writeJson } from "./files.js";

export const TaskbridgeRetryWatch = async () => {
  const path = process.env.TASKBRIDGE_RETRY;
  let main = null;
  return {
    event: async ({ event }) => {
      if (!path || !event || event.type !== "session.status") return;
      const props = event.properties || {};
      const status = props.status || {};
      if (!main && isWarmUp(props.sessionID)) return;
      main = main || props.sessionID;
      if (props.sessionID !== main || status.type !== "retry") return;
      writeJson(replyPath(path, ".json"), {
        attempt: status.attempt, message: String(status.message || "").slice(0, 2000),
        next: status.next, at: Date.now(), sessionID: props.sessionID,
      });
    },
  };
};
