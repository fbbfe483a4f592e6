"""Docs stay honest: every env knob, CLI command, MCP tool and file in the code is in its reference
page under docs/, the generated parts of those pages are what the code says now, every link
points somewhere, the README stays a front page, and the Quick start is what CI runs."""
from __future__ import annotations

import ast
import re

import pytest
from click.testing import CliRunner

import tasks_cli
from helpers import BRIDGE_TOOL_COUNT, ROOT

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
CONFIGURATION, CLI, TOOLS, COMPONENTS = ((DOCS / name).read_text() for name in
                                        ("configuration.md", "cli.md", "mcp-tools.md", "components.md"))
SCRIPTS = list(ROOT.glob("*.py")) + list((ROOT / "launchd").glob("*.py"))
OS_VARIABLES = {"PATH", "USER", "HOME", "PWD", "CI", "SHELL", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "TMPDIR"}
KNOB = re.compile(r"""(?:environ(?:\.get)?\(?\[?|_env_\w+\()\s*["']([A-Z][A-Z0-9_]+)["']""")


def knobs_in_code() -> set[str]:
    found = set()
    for path in SCRIPTS:
        found |= set(KNOB.findall(path.read_text()))
    for path in ROOT.glob("*.sh"):   # the shell scripts' knobs: ${NAME:-default}
        found |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]+):-", path.read_text()))
    import knobs  # the numeric knobs and the XDG folders are read by name through its tables
    return (found | set(knobs.REGISTRY) | set(knobs.XDG_DEFAULTS)) - OS_VARIABLES


@pytest.mark.parametrize("script", sorted(SCRIPTS, key=str), ids=lambda p: p.name)
def test_every_script_opens_with_a_docstring_naming_its_env(script):
    """What it is, how it is run (or that it is not run on its own) and the env it reads."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    assert re.search(r"\benv\b", doc, re.I), f"{script.name}: its docstring names no env (say 'Env: none')"
    assert re.search(
        r"python |\.sh\b|tasks_cli\.py |used by|not run on its own|mounted by|shared by|^ *import \w+$",
        doc,
        re.I | re.M,
    ), f"{script.name}: its docstring does not say how it is run"


def test_the_spend_gate_plugin_says_what_it_reads():
    head = (ROOT / "opencode_plugins" / "spend_gate.js").read_text().split("\nimport ", 1)[0]
    assert "Env: TASKBRIDGE_GATE" in head and "OpenCode loads it" in head


def test_knob_scan_finds_known_knobs():
    assert {"TASK_DB_PATH", "WORKER_STALE_SEC", "MCP_ALLOWED_HOSTS", "TUNNEL_HOST", "TASKBRIDGE_DIR"} <= knobs_in_code()


@pytest.mark.parametrize("knob", sorted(knobs_in_code()))
def test_every_env_knob_is_documented(knob):
    assert f"`{knob}`" in CONFIGURATION, \
        f"{knob} is read by the code but missing from docs/configuration.md's table"


@pytest.mark.parametrize("command", sorted(tasks_cli.cli.commands))
def test_every_cli_command_documented_and_has_help(command):
    assert re.search(rf"\| `{command}\b", CLI), f"CLI command {command} missing from docs/cli.md's table"
    result = CliRunner().invoke(tasks_cli.cli, [command, "--help"])
    assert result.exit_code == 0 and "Usage:" in result.output
    assert tasks_cli.cli.commands[command].help


def mcp_tools(module_name: str) -> list[str]:
    source = (ROOT / f"{module_name}.py").read_text()
    return re.findall(r"@\w+\.tool\([^)]*\)\s*\n(?:@[^\n]*\n)*(?:async )?def (\w+)", source)


@pytest.mark.parametrize("module_name,count", [("opencode_bridge_mcp", BRIDGE_TOOL_COUNT), ("claude_control_mcp", 6)])
def test_every_mcp_tool_documented(module_name, count):
    tools = mcp_tools(module_name)
    assert len(tools) == count, tools
    for tool in tools:
        assert f"### `{tool}`" in TOOLS, f"MCP tool {tool} missing from docs/mcp-tools.md (run cog)"


def test_readme_states_the_bridge_tool_count_and_the_code_states_none():
    """The count lives in tests/helpers.BRIDGE_TOOL_COUNT and docs/components.md's file table only:
    a number in a docstring or comment goes stale with the next tool."""
    assert f"({BRIDGE_TOOL_COUNT} tools;" in COMPONENTS
    for path in SCRIPTS:
        stale = re.findall(r"\b\d+ (?:MCP |queue )?tools\b", path.read_text())
        assert stale == [], f"{path.name} states a tool count: {stale}"


def test_quick_start_has_two_commands_and_ci_runs_the_test_one():
    block = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.strip().splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_the_generated_parts_of_the_docs_are_what_the_code_says_now():
    """cog regenerates the CLI help, the knobs' ranges, the tools and the routes in memory and
    compares (docs/reference.py); a stale page names the command that refreshes it."""
    from cogapp import Cog
    pages = sorted(str(p) for p in DOCS.glob("*.md") if "[[[cog" in p.read_text())
    assert len(pages) >= 4, pages
    status = Cog().main(["cog", "--check", "-I", str(DOCS), *pages])
    assert status == 0, "docs are stale: run .venv/bin/cog -r -I docs docs/*.md"


def test_the_readme_is_a_front_page():
    assert README.count("\n") <= 500, "the README is the front page: move reference text to docs/"
    for page in ("install", "tasks", "connecting", "mcp-tools", "cli", "configuration", "security", "limits"):
        assert f"](docs/{page}.md" in README, f"the README does not link docs/{page}.md"


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors of a Markdown text (code blocks skipped)."""
    found, code = set(), False
    for line in text.splitlines():
        code ^= line.startswith("```")
        if not code and re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_every_link_between_the_pages_points_somewhere(page):
    text = page.read_text()
    for target, anchor in re.findall(r"\]\((?!https?:|mailto:)([^)#\s]*)(?:#([\w\-]+))?\)", text):
        linked = (page.parent / target).resolve() if target else page
        assert linked.exists(), f"{page.name}: a link to {target}, which does not exist"
        if anchor:
            assert anchor in _anchors(linked.read_text()), f"{page.name}: no heading #{anchor} in {linked.name}"


@pytest.mark.parametrize("script", sorted(p.name for p in ROOT.glob("*.py")))
def test_every_file_has_its_row_in_the_components_table(script):
    assert f"`{script}`" in COMPONENTS, f"{script} is missing from docs/components.md"
