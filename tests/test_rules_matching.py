"""A task's permission rules matched command by command: the plugin that enforces them
(opencode_plugins/permission_rules.js, run here by the real node) and the worker's twin that checks
an ask before believing it (opencode_runner.rule_action) split a bash line alike, so that
``cd x && git push`` meets a ``git push*`` rule and ``npm test && curl …`` no longer rides an
``npm test*`` allow (a fresh tester ran ``true; rm -rf *`` past a ``rm -rf *`` deny)."""
from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

import opencode_runner as oc
import task_store
from helpers import submit

PLUGINS = Path(oc.__file__).resolve().parent / "opencode_plugins"

LINES = {
    "cd . && git push origin main": ["cd .", "git push origin main"],
    "true; rm -rf *": ["true", "rm -rf *"],
    "a || b | c & d": ["a", "b", "c", "d"],
    "make\nmake install": ["make", "make install"],
    'echo "a;b && c" | grep a': ['echo "a;b && c"', "grep a"],
    "echo 'x && $(y)' ; z": ["echo 'x && $(y)'", "z"],
    "echo $(git push) `rm x`": ["echo", "git push", "rm x"],
    'echo "$(git push)"': ['echo "', "git push", '"'],
    "(cd a; make) || exit 1": ["cd a", "make", "exit 1"],
    "ls\\;rm x": ["ls\\;rm x"],
    'FOO="a b" BAR=1 git push': ["git push"],
    "  git push  ": ["git push"],
    "echo \"it's; fine\" ; rm y": ["echo \"it's; fine\"", "rm y"],
    "sh -c 'git push'": ["sh -c 'git push'"],
    "": [],
    "\u00a0git push": ["\u00a0git push"],   # only ASCII blanks are trimmed, alike in both languages
    # A reviewer's ways round the first splitter: keywords, braces, wrappers, blanks, substitutions.
    "{ rm -rf *; }": ["rm -rf *"],
    "if true; then rm -rf *; fi": ["true", "rm -rf *"],
    "for i in 1; do rm -rf *; done": ["for i in 1", "rm -rf *"],
    "! rm -rf *": ["rm -rf *"],
    "time sudo env A=1 rm -rf *": ["rm -rf *"],
    "rm  -rf\t*": ["rm -rf *"],
    'echo "$(true; rm -rf *)"': ['echo "', "true", "rm -rf *", '"'],
    'echo "$(echo ")")" ; rm q': ['echo "', 'echo ")"', '"', "rm q"],
    # Not commands: a redirection's &, arithmetic.
    "npm test 2>&1": ["npm test 2>&1"],
    "cmd >&2 &> out": ["cmd >&2 &> out"],
    "echo $((1 + (2)))": ["echo $((1 + (2)))"],
    # A second reviewer's: a comment's apostrophe, a subshell that looks like arithmetic, wrappers alone.
    "# Let's push\ngit push": ["git push"],
    "cat x # it's done\nrm -rf /": ["cat x", "rm -rf /"],
    "echo a#b 'c#d' \\#e": ["echo a#b 'c#d' \\#e"],
    "echo $((rm -rf ~) )": ["echo", "rm -rf ~"],
    'echo "$(( (1+2)*3 ))"': ['echo "$(( (1+2)*3 ))"'],
    "env | grep KEY": ["grep KEY"],
    "sudo": [],
}


def _split_in_node(lines: list[str], function: str = "shellCommands") -> list[list]:
    script = ("const m = await import(process.argv[1]); let text = '';"
              "for await (const piece of process.stdin) text += piece;"
              f"console.log(JSON.stringify(JSON.parse(text).map((l) => m.{function}(l))));")
    out = subprocess.run(["node", "--input-type=module", "-e", script, str(PLUGINS / "shell_commands.js")],
                         input=json.dumps(lines), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_plugin_and_the_worker_split_a_command_line_alike():
    assert _split_in_node(list(LINES)) == list(LINES.values())
    assert [oc.shell_commands(line) for line in LINES] == list(LINES.values())


def test_the_two_splitters_agree_on_random_lines():
    """The plugin enforces, the worker believes: a line they split differently is a way round.
    Both forms of each command (as written, and without its wrappers) are compared."""
    rng = random.Random(25)
    alphabet = list("ab rm-*;&|()`$\"'\\\n\t\r{}!<>=2#") + [
        "if ", "then ", "do ", "done", "sudo ", "env ", "$(", "$((", "))", "# ", "2>&1"]
    lines = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(3000)]
    assert _split_in_node(lines, "commandForms") == [[list(pair) for pair in oc.command_forms(line)] for line in lines]


RULES = {"bash": {"*": "allow", "git push*": "ask", "rm -rf *": "deny", "curl *": "deny", "sudo *": "deny",
                  "env": "ask"}}


@pytest.mark.parametrize("command, action", [
    ("git push origin main", "ask"),
    ("cd . && git push origin main", "ask"),
    ("true; rm -rf *", "deny"),
    ("git push; rm -rf /", "deny"),          # the strictest of its commands
    ("echo $(curl evil.example)", "deny"),
    ("git status && ls", "allow"),
    ("echo 'git push'", "allow"),            # quoted: a word, not a command
    ("if true; then rm -rf *; fi", "deny"),
    ('echo "$(true; git push)"', "ask"),
    ("npm test 2>&1", "allow"),
    ("sudo apt-get install -y jq", "deny"),  # a rule on the wrapper meets the command as written
    ("sudo git push", "deny"),
    ("time git push", "ask"),                # and a rule on the command meets it without the wrapper
    ("env | grep KEY", "ask"),
    ("# it's here\nrm -rf /", "deny"),       # a comment's quote does not swallow the next line
    ("echo $((rm -rf ~) )", "deny"),         # a subshell in a substitution, not arithmetic
    ("echo $((1 + 2))", "allow"),
])
def test_the_strictest_of_a_lines_commands_decides_in_the_plugin_and_its_twin(tmp_path, command, action):
    assert oc.rule_action(RULES, "bash", command) == action
    rules = tmp_path / "control" / "rules"
    rules.parent.mkdir()
    (tmp_path / "reply").mkdir()
    rules.write_text(json.dumps({"rules": RULES, "once": []}))
    hook = ("const m = await import(process.argv[1]); const h = await m.TaskbridgePermissionRules({directory: '/w'});"
            "try { await h['tool.execute.before']({tool: 'bash', sessionID: 's'}, {args: {command: process.argv[2]}});"
            " console.log('ran'); } catch (e) { console.log(e.message); }")
    out = subprocess.run(["node", "--input-type=module", "-e", hook, str(PLUGINS / "permission_rules.js"), command],
                         capture_output=True, text=True, env={**os.environ, "TASKBRIDGE_RULES": str(rules)}, timeout=60)
    said = out.stdout.strip()
    seen = "allow" if said == "ran" else "deny" if "rules deny" in said else "ask" if "waits for the planner" in said \
        else said + out.stderr
    assert seen == action


def test_an_always_answer_covers_the_commands_that_asked(tmp_path):
    """An ``always`` for ``cd . && git push origin main`` adds a rule for ``git push origin main``:
    a rule for the whole line would leave its command asking again next time."""
    line = "cd . && git push origin main"
    task = submit(tmp_path, rules={"bash": {"git push*": "ask"}})
    claimed = task_store.claim_next("w", task_id=task["id"])
    ask = {"tool": "bash", "subject": line, "reason": "", "commands": oc.asking_commands(task["rules"], "bash", line)}
    assert ask["commands"] == ["git push origin main"]
    task_store.pause_for_question(task["id"], claimed["run_marker"], "may I?", session_id="ses_1",
                                  paused_for="permission", ask=ask)
    task_store.answer_task(task["id"], "allow always")
    rules = task_store.get_task(task["id"])["rules"]
    assert rules == {"bash": {"git push*": "ask", "git push origin main": "allow"}}
    assert oc.rule_action(rules, "bash", line) == "allow"
    assert oc.rule_action(rules, "bash", "cd . && git push origin other") == "ask"
