// The simple commands of a shell command line, as a task's `bash` rule is matched against each
// (permission_rules.js imports it). Not a plugin itself: OpenCode is never told to load this module.
//
// Split at ; & | (so && ||), line breaks, parentheses, backticks and $( (inside double quotes only
// at a substitution: $(, a backtick, a closing parenthesis; never inside single quotes or after a
// backslash), each trimmed, its leading NAME=value assignments left out, empty ones dropped:
// "cd x && git push" is ["cd x", "git push"]. A command run through sh -c '...' or eval stays
// inside one quoted word (OpenCode's own matcher does not look there either). The Python twin is
// opencode_runner.shell_commands; tests/test_rules_matching.py holds both to one table.

// Blanks spelled out: JavaScript's \s and trim() and Python's differ beyond these.
const ASSIGNMENTS = /^(?:[A-Za-z_][A-Za-z0-9_]*=(?:'[^']*'|"[^"]*"|[^ \t\n\r\f\v'"])*[ \t\n\r\f\v]+)+/;
const EDGES = /^[ \t\n\r\f\v]+|[ \t\n\r\f\v]+$/g;

export function shellCommands(line) {
  const chars = [...String(line)];
  const parts = [];
  let current = "";
  let quote = "";
  for (let i = 0; i < chars.length; ) {
    const char = chars[i];
    const two = char + (chars[i + 1] ?? "");
    if (quote === "'") {
      if (char === "'") quote = "";
    } else if (char === "\\") {
      current += two;
      i += 2;
      continue;
    } else if (two === "$(" || char === "`" || char === ")" || (!quote && ";&|\n(".includes(char))) {
      parts.push(current);
      current = "";
      i += two === "$(" ? 2 : 1;
      continue;
    } else if (char === '"' || (char === "'" && !quote)) {
      quote = quote === char ? "" : !quote ? char : quote;
    }
    current += char;
    i += 1;
  }
  parts.push(current);
  return parts.map((part) => part.replace(EDGES, "").replace(ASSIGNMENTS, "").replace(EDGES, ""))
    .filter((command) => command);
}
