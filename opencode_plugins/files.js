// The file exchange TaskBridge's OpenCode plugins share with the worker: JSON files the worker
// writes atomically (a rename) and the plugins read, and the answers the plugins write back the same
// way. Not a plugin itself: OpenCode is never told to load this module; the plugins import it.

import fs from "fs";

// The JSON in `path`, or null when it is missing, unreadable or caught mid-rename.
export function readJson(path) {
  try {
    return JSON.parse(fs.readFileSync(path, "utf8"));
  } catch {
    return null;
  }
}

// Write `value` as JSON to `path` atomically: a temporary file beside it, then a rename.
export function writeJson(path, value) {
  const tmp = `${path}.${process.pid}.tmp`;
  fs.writeFileSync(tmp, JSON.stringify(value));
  fs.renameSync(tmp, path);
}
