// TaskBridge's note courier: an OpenCode plugin that `opencode run` loads for every task run
// (worker.py adds it to OPENCODE_CONFIG_CONTENT's "plugin" list and names the notes file in
// TASKBRIDGE_NOTES).
//
// Why: a planner's note on a running task should reach the agent in the session it is in, not
// only at its next attempt. Before each model call of the run's own session (the
// experimental.chat.messages.transform hook, OpenCode 1.18), it reads the notes the worker wrote
// to the notes file ({"notes": [{"id", "author", "text"}]}), adds each new one to the
// conversation as a user message after the last message (a step boundary: the model has just
// seen its tool results), keeps adding the notes it gave at their places on every later call
// (the hook sees the stored messages, which do not hold them), and records what it delivered in
// "<run>/reply/notes.ack" ({"delivered": [{"id", "at": ms}]}) for the worker's receipt. Sub-agents'
// sessions are left alone. Reads and writes nothing else; imports only files.js (beside it).
import { isWarmUp, readJson, replyPath, writeJson } from "./files.js";

function noteMessage(template, note, index) {
  const id = `${template.info.id}_taskbridge_note_${note.id}_${index}`;
  const text = `A note from the planner (${note.author}), sent while you work on this task; take it into account from now on:\n\n${note.text}`;
  const textPart = template.parts.find((part) => part.type === "text") || {};
  return {
    info: { ...template.info, id, time: { created: Date.now() } },
    parts: [{ ...textPart, id: `${id}_part`, messageID: id, type: "text", text, synthetic: false }],
  };
}

export const TaskbridgeNotes = async () => {
  const path = process.env.TASKBRIDGE_NOTES;
  const given = []; // {note, anchor}: in the order they were delivered
  const delivered = [];
  let main = null;
  return {
    "experimental.chat.messages.transform": async (_input, output) => {
      const messages = output && output.messages;
      if (!path || !Array.isArray(messages) || messages.length === 0) return;
      const session = messages[0].info && messages[0].info.sessionID;
      if (!main && isWarmUp(session)) return;
      main = main || session;
      if (session !== main) return;
      const template = messages.find((m) => m.info && m.info.role === "user");
      if (!template) return;
      const file = readJson(path);
      const known = new Set(given.map((g) => g.note.id));
      const fresh = ((file && file.notes) || []).filter((note) => !known.has(note.id));
      if (fresh.length) {
        const anchor = messages[messages.length - 1].info.id;
        for (const note of fresh) {
          given.push({ note, anchor });
          delivered.push({ id: note.id, at: Date.now() });
        }
        writeJson(replyPath(path, ".ack"), { delivered });
      }
      given.forEach(({ note, anchor }, index) => {
        const at = messages.findIndex((m) => m.info && m.info.id === anchor);
        let place = at < 0 ? messages.length : at + 1;
        while (place < messages.length && String(messages[place].info.id).includes("_taskbridge_note_")) place++;
        messages.splice(place, 0, noteMessage(template, note, index));
      });
    },
  };
};
