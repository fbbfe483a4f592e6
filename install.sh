#!/usr/bin/env bash
# TaskBridge set-up: a virtualenv with the runtime dependencies, the pinned opencode binary,
# and the HTTP bearer token. Safe to run again (idempotent).
#
#   ./install.sh              runtime: .venv + requirements.txt, opencode (npm, pinned, node_modules/), token
#   ./install.sh --test       also the test dependencies and the other pinned binaries the tests drive
#                             (and, as root on Debian, chromium + chromium-driver for the board's browser tests)
#   ./install.sh --schedule   also install the every-60-s worker schedule (launchd on macOS,
#                             a systemd user timer on Linux, else print a cron line)
#
# Env: PYTHON (default python3), MCP_TOKEN_FILE (default .taskbridge/token).
set -euo pipefail
cd "$(dirname "$0")"
here="$(pwd)"
python="${PYTHON:-python3}"
want_test=0
want_schedule=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --schedule) want_schedule=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
  esac
done

say() { printf '==> %s\n' "$*" >&2; }

"$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || {
  echo "install.sh: Python >= 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$python" -m venv .venv
fi
say "installing Python dependencies"
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
if [ "$want_test" = 1 ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
fi

command -v npm >/dev/null || { echo "install.sh: npm (Node.js >= 20) is required for opencode" >&2; exit 1; }
# One copy of opencode, in node_modules/, for the worker and the tests alike: package.json pins it
# as the only runtime dependency; claude and the MCP Inspector are devDependencies (tests only).
if [ "$want_test" = 1 ]; then
  say "installing the pinned opencode, claude and MCP Inspector into node_modules/"
  # Not `npm ci`: npm 11 reports the lock's other-platform optional binaries as missing. With
  # exact versions in package.json and the lock present, `npm install` installs the locked tree.
  npm install --no-audit --no-fund --loglevel=error >&2
elif [ ! -x node_modules/.bin/opencode ]; then
  say "installing the pinned opencode into node_modules/"
  npm install --omit=dev --no-audit --no-fund --loglevel=error >&2
fi
if [ -d .taskbridge/opencode ] && [ -x node_modules/.bin/opencode ]; then
  say "removing the second copy of opencode an older install.sh put in .taskbridge/opencode/"
  rm -rf .taskbridge/opencode
fi

# --- The board's browser tests (pytest -m browser): Debian's chromium and chromium-driver. ---
if [ "$want_test" = 1 ] && ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing chromium and chromium-driver (apt-get) for the board's browser tests"
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } >&2 || \
      say "apt-get could not install chromium/chromium-driver: the browser tests skip (and fail under CI=true)"
  else
    say "the board's browser tests need chromium and chromedriver on PATH: run as root to apt-get them" \
        "(apt-get install chromium chromium-driver); without them they skip (and fail under CI=true)"
  fi
fi
# --- end of the browser block ---

token_file="${MCP_TOKEN_FILE:-$here/.taskbridge/token}"
if [ ! -s "$token_file" ]; then
  say "writing a new bearer token to $token_file"
  mkdir -p "$(dirname "$token_file")"
  (umask 077; .venv/bin/python -c 'import secrets; print(secrets.token_urlsafe(32))' > "$token_file")
fi

if [ "$want_schedule" = 1 ]; then
  .venv/bin/python launchd/schedule.py install
fi
say "ready: .venv/bin/python worker.py --watch (or tasks_cli.py, opencode_bridge_mcp.py; see README)"
