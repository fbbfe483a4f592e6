// The simple commands of a shell command line, as a task's `bash` rule is matched against each
// (permission_rules.js imports it). Not a plugin itself: OpenCode is never told to load this module.
//
// Split at ; & | (so && ||; not the & of a redirection such as 2>&1), line breaks, parentheses,
// $( ... ) and backticks (a substitution is read as a line of its own, inside double quotes too;
// $((...)) is arithmetic, a word, when it ends in "))"), never inside single quotes or after a
// backslash; a # that starts a word comments out the rest of its line; blanks run together to
// one space, and leading assignments, { } !, compound-command keywords (if then do ...) and
// wrappers (time sudo env nohup exec command builtin) left out; empty ones dropped:
// "cd x && git push" is ["cd x", "git push"]. A command inside a quoted word (sh -c '...',
// eval "..."), a heredoc's body read as lines, a script, or behind another wrapper (xargs) is
// not seen. The Python twin is
// opencode_runner.shell_commands; tests/test_rules_matching.py holds both to one table and to
// random lines.

// Blanks spelled out: JavaScript's \s and trim() and Python's differ beyond these.
const BLANK_RUN = /[ \t\n\r\f\v]+/g;
const LEAD = new RegExp(
  "^(?:[A-Za-z_][A-Za-z0-9_]*=(?:'[^']*'|\"[^\"]*\"|[^ '\"])* |(?:[{}!]|if|then|else|elif|fi|do|done" +
    "|while|until|time|exec|command|builtin|nohup|sudo|env)(?: |$))+",
);

// Where $(( ... )) that opened before `start` ends (past its "))"), or the line's end; null when
// its first "(" closes apart from the other ("$((cmd) )": bash runs a subshell in a substitution).
function arithmeticEnd(chars, start) {
  let depth = 2;
  for (let at = start; at < chars.length; at++) {
    depth += chars[at] === "(" ? 1 : chars[at] === ")" ? -1 : 0;
    if (depth === 1) return chars[at + 1] === ")" ? at + 2 : null;
  }
  return chars.length;
}

// The simple commands, each without its leading assignments, keywords and wrappers.
export function shellCommands(line) {
  return commandForms(line)
    .map(([, stripped]) => stripped)
    .filter((command) => command);
}

// Each simple command in two forms: as written (blanks run together) and without its leading
// assignments, keywords and wrappers (maybe empty: a bare "sudo"). A rule is matched against
// both, so "sudo *" meets "sudo apt install" and "apt *" does too. Commands empty as written are
// dropped. The twin of opencode_runner.command_forms.
export function commandForms(line) {
  const chars = [...String(line)];
  const parts = [];
  const opened = []; // [opener, the quote around it]
  let current = []; // characters, and an escape as one item of two
  let quote = "";
  for (let i = 0; i < chars.length; ) {
    const char = chars[i];
    const two = char + (chars[i + 1] ?? "");
    const top = opened[opened.length - 1];
    const arithmetic = quote !== "'" && two === "$(" && chars[i + 2] === "(" ? arithmeticEnd(chars, i + 3) : null;
    let cut = 0; // characters of a separator to skip
    if (quote === "'") {
      if (char === "'") quote = "";
    } else if (char === "\\") {
      current.push(two);
      i += 2;
      continue;
    } else if (arithmetic !== null) {
      current.push(chars.slice(i, arithmetic).join(""));
      i = arithmetic;
      continue;
    } else if (char === "#" && !quote && (!current.length || " \t".includes(current[current.length - 1]))) {
      const end = chars.indexOf("\n", i); // a word starting with #: a comment up to the line's end
      i = end < 0 ? chars.length : end;
      continue;
    } else if (top && ((char === ")" && top[0] === "$(" && !quote) || (char === "`" && top[0] === "`"))) {
      quote = opened.pop()[1]; // a substitution ends: the quoting around it again
      cut = 1;
    } else if (two === "$(" || char === "`") {
      opened.push([two === "$(" ? two : "`", quote]); // a line of its own, unquoted inside
      quote = "";
      cut = two === "$(" ? 2 : 1;
    } else if (
      !quote &&
      (";|\n()".includes(char) || (char === "&" && !"<>".includes(chars[i - 1] ?? "x") && chars[i + 1] !== ">"))
    ) {
      cut = 1;
    } else if (char === '"' || (char === "'" && !quote)) {
      quote = quote === char ? "" : !quote ? char : quote;
    }
    if (cut) {
      parts.push(current.join(""));
      current = [];
      i += cut;
      continue;
    }
    current.push(char);
    i += 1;
  }
  parts.push(current.join(""));
  return parts
    .map((part) => part.replace(BLANK_RUN, " ").replace(/^ +| +$/g, ""))
    .filter((command) => command)
    .map((command) => [command, command.replace(LEAD, "").replace(/^ +| +$/g, "")]);
}
