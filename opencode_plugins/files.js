// The file exchange TaskBridge's OpenCode plugins share with the worker: JSON files the worker
// writes atomically (a rename) and the plugins read, and the answers the plugins write back the same
// way. Not a plugin itself: OpenCode is never told to load this module; the plugins import it.

import fs from "fs";
import path from "path";

// Where a plugin answers the control file `file`: the worker keeps a run's control files in
// "<run>/control/", which the agent's box mounts read-only, and takes the answers from
// "<run>/reply/<name><suffix>", the one folder of the run's the box lets the plugins write.
export function replyPath(file, suffix) {
  return path.join(path.dirname(path.dirname(file)), "reply", path.basename(file) + suffix);
}

// The JSON in `path`, or null when it is missing, unreadable or caught mid-rename.
export function readJson(file) {
  try {
    return JSON.parse(fs.readFileSync(file, "utf8"));
  } catch {
    return null;
  }
}

// Write `value` as JSON to `path` atomically: a temporary file beside it, then a rename.
export function writeJson(file, value) {
  const tmp = `${file}.${process.pid}.tmp`;
  fs.writeFileSync(tmp, JSON.stringify(value));
  fs.renameSync(tmp, file);
}

// Whether `sessionID` is the warm-up session of a kept `opencode serve` (worker.py writes
// {"session": id} to the file TASKBRIDGE_WARM_UP names, in the run's read-only control folder,
// before it prompts): TaskBridge's plugins never take it for the run's own session, and
// warm_up.js stops its model call. False when the variable is unset (every `opencode run`).
export function isWarmUp(sessionID) {
  const file = process.env.TASKBRIDGE_WARM_UP;
  if (!file || !sessionID) return false;
  const warm = readJson(file);
  return Boolean(warm && warm.session === sessionID);
}
