#!/usr/bin/env bash
# TaskBridge: set up, then serve. Safe to run again (idempotent).
#
#   curl -fsSL <url>/install.sh | bash       clone into ~/TaskBridge first, then as below
#   ./install.sh                  set up (.venv, pinned opencode, token), then serve in the foreground:
#                                 MCP (/mcp, /sse) and the board on 127.0.0.1:8765, a worker beside
#                                 it; Ctrl-C stops all of it
#   ./install.sh --setup-only     set up and print the client snippets; serve nothing
#   ./install.sh --test           set up with the test dependencies and binaries; serve nothing (CI)
#   ./install.sh --schedule       set up and install the every-60-s worker schedule; serve nothing
#   --tunnel none|cloudflare|ngrok   public mode (asked in a terminal; never public unless asked)
#   --rotate                      a new bearer token (says which clients to update)
#   --port N                      the loopback port (default 8765)
#   --write-claude-desktop        merge the taskbridge entry into Claude Desktop's config (backup kept)
#   --db URL                      the queue: a postgresql:// URL or a SQLite file (exported as
#                                 TASK_DB_URL for serve.py: never on a command line `ps` shows)
#
# Env: TASKBRIDGE_REPO (what the one-liner clones), TASKBRIDGE_DIR (where; default ~/TaskBridge),
#      PYTHON (a Python >= 3.11), OPENCODE_BIN (an opencode to use instead of installing one),
#      PORT, MCP_TOKEN_FILE (default .taskbridge/token), TUNNEL_BIN, TUNNEL_HOST, TASK_DB_URL.
set -euo pipefail

# Everything sits in functions called on the last line: piped into bash, the whole script is read
# before any command runs, so nothing can swallow the rest of it from stdin.

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }

os_name() { case "$(uname -s)" in Darwin) echo macos ;; Linux) echo linux ;; *) echo other ;; esac; }

advice() {  # advice WHAT: the exact way to get it on this system
  local os; os="$(os_name)"
  case "$1:$os" in
    python:macos) echo "brew install python@3.12   (Homebrew: https://brew.sh), or the installer from https://www.python.org/downloads/" ;;
    python:linux) echo "Debian/Ubuntu: sudo apt install python3.11 python3.11-venv (Ubuntu 22.04: first sudo add-apt-repository ppa:deadsnakes/ppa); Fedora: sudo dnf install python3.12" ;;
    venv:linux)   echo "Debian/Ubuntu: sudo apt install python3-venv (or python3.11-venv for that version)" ;;
    git:macos)    echo "xcode-select --install   (or brew install git)" ;;
    git:linux)    echo "Debian/Ubuntu: sudo apt install git; Fedora: sudo dnf install git" ;;
    node:macos)   echo "brew install node   (Node.js >= 20 with npm), or https://nodejs.org/en/download" ;;
    node:linux)   echo "Node.js >= 20 with npm: https://nodejs.org/en/download (or nvm: nvm install 22); distro packages are often older than 20" ;;
    *)            echo "see https://www.python.org/downloads/, https://git-scm.com/downloads and https://nodejs.org/en/download" ;;
  esac
}

find_python() {  # prints a Python >= 3.11 with venv, or nothing
  local candidate
  for candidate in ${PYTHON:-} python3 python3.13 python3.12 python3.11; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null || continue
    echo "$candidate"; return 0
  done
}

check_prerequisites() {  # one message naming everything that is missing and how to get it
  local need_node=$1 missing=()
  python="$(find_python)"
  if [ -z "$python" ]; then
    missing+=("Python >= 3.11 (found: $( (${PYTHON:-python3} --version) 2>&1 | head -n1 || echo none)); $(advice python); then PYTHON=/path/to/python3.12 ./install.sh")
  elif ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
    missing+=("the venv module of $python; $(advice venv)")
  fi
  command -v git >/dev/null 2>&1 || missing+=("git; $(advice git)")
  if [ "$need_node" = 1 ]; then
    if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
      missing+=("Node.js >= 20 and npm (they install the pinned opencode); $(advice node); or set OPENCODE_BIN to an opencode you have")
    elif ! node -e 'process.exit(parseInt(process.versions.node) >= 20 ? 0 : 1)' 2>/dev/null; then
      missing+=("Node.js >= 20 (found $(node --version)); $(advice node)")
    fi
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    printf 'install.sh: missing:\n' >&2
    printf '  - %s\n' "${missing[@]}" >&2
    exit 1
  fi
}

bootstrap() {  # piped into bash (or run outside a checkout): clone, then run the clone's install.sh
  local repo="${TASKBRIDGE_REPO:-https://github.com/taskbridge/taskbridge.git}"
  local dir="${TASKBRIDGE_DIR:-$HOME/TaskBridge}"
  command -v git >/dev/null 2>&1 || die "git is required to fetch TaskBridge; $(advice git)"
  if [ -d "$dir/.git" ]; then
    say "updating the TaskBridge checkout in $dir"
    git -C "$dir" pull --ff-only -q || die "cannot update $dir (local changes?); update it yourself, then run $dir/install.sh"
  elif [ -e "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
    die "$dir exists and is not a TaskBridge checkout; set TASKBRIDGE_DIR to another folder"
  else
    say "cloning $repo into $dir"
    git clone -q "$repo" "$dir" || die "cannot clone $repo; check the URL (TASKBRIDGE_REPO) and your network"
  fi
  # A prompt needs the terminal: piped, stdin was the script.
  if (exec </dev/tty) 2>/dev/null; then
    exec bash "$dir/install.sh" "$@" </dev/tty
  fi
  exec bash "$dir/install.sh" "$@" </dev/null
}

install_opencode() {
  # One copy of opencode, in node_modules/, for the worker and the tests alike: package.json pins it
  # as the only runtime dependency; claude and the MCP Inspector are devDependencies (tests only).
  if [ "$want_test" = 1 ]; then
    say "installing the pinned opencode, claude and MCP Inspector into node_modules/"
    # Not `npm ci`: npm 11 reports the lock's other-platform optional binaries as missing. With
    # exact versions in package.json and the lock present, `npm install` installs the locked tree;
    # --no-save keeps npm from rewriting the tracked lock (a fresh clone stayed dirty).
    npm install --no-save --no-audit --no-fund --loglevel=error >&2
  elif [ -n "${OPENCODE_BIN:-}" ]; then
    [ -x "$OPENCODE_BIN" ] || command -v "$OPENCODE_BIN" >/dev/null || die "OPENCODE_BIN=$OPENCODE_BIN is not an executable"
  elif [ ! -x node_modules/.bin/opencode ]; then
    say "installing the pinned opencode into node_modules/"
    npm install --omit=dev --no-save --no-audit --no-fund --loglevel=error >&2
  fi
  if [ -d .taskbridge/opencode ] && [ -x node_modules/.bin/opencode ]; then
    say "removing the second copy of opencode an older install.sh put in .taskbridge/opencode/"
    rm -rf .taskbridge/opencode
  fi
}

apt_get() {  # WHY FAILED_NOTE ELSE_NOTE PACKAGE...: apt-get the packages as root, else say how
  local why=$1 failed=$2 otherwise=$3; shift 3
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing $* (apt-get) $why"
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"; } >&2 || say "apt-get could not install $*: $failed"
  else
    say "$otherwise"
  fi
}

install_browser() {  # the board's browser tests (pytest -m browser): Debian's chromium and chromium-driver
  if [ "$want_test" = 1 ] && ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }; then
    apt_get "for the board's browser tests" "the browser tests skip (and fail under CI=true)" \
      "the board's browser tests need chromium and chromedriver on PATH: run as root to apt-get them (apt-get install chromium chromium-driver); without them they skip (and fail under CI=true)" \
      chromium chromium-driver
  fi
}

install_postgres() {  # the PostgreSQL store tests (pytest -m postgres): Debian's postgresql
  if [ "$want_test" = 1 ] && ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    apt_get "for the PostgreSQL store tests" "the PostgreSQL tests skip (and fail under CI=true)" \
      "the PostgreSQL store tests need Debian's postgresql (/usr/lib/postgresql/*/bin): run as root to apt-get it (apt-get install postgresql); without it they skip (and fail under CI=true)" \
      postgresql
  fi
}

install_faketime() {  # the skewed-clock tests (tests/test_clocks.py): Debian's faketime (libfaketime)
  if [ "$want_test" = 1 ] && ! command -v faketime >/dev/null 2>&1; then
    apt_get "for the skewed-clock tests" "the skewed-clock tests skip (and fail under CI=true)" \
      "the skewed-clock tests need faketime on PATH: run as root to apt-get it (apt-get install faketime); without it they skip (and fail under CI=true)" \
      faketime
  fi
}

install_box() {  # the agent box: bubblewrap on Linux (every run; sandbox-exec ships with macOS)
  if [ "$(os_name)" = linux ] && ! command -v bwrap >/dev/null 2>&1; then
    apt_get "for the agent box (every agent run is boxed by it)" \
      "agents run unboxed and restricted tasks fail (tasks_cli.py doctor says how to fix it)" \
      "bubblewrap is not installed: agents would run unboxed and readonly/no-shell/no-network tasks fail; install it: sudo apt install bubblewrap (Fedora: sudo dnf install bubblewrap)" \
      bubblewrap
  fi
  if [ "$(os_name)" = linux ] && ! command -v rg >/dev/null 2>&1; then   # OpenCode takes rg from PATH
    apt_get "for OpenCode's grep and glob tools in the agent box (a box cannot download it)" \
      "OpenCode's grep and glob tools fail in the agent box (tasks_cli.py doctor says so)" \
      "ripgrep is not installed: OpenCode's grep and glob tools fail in the agent box; install it: sudo apt install ripgrep" \
      ripgrep
  fi
}

check_port() {   # NAME VALUE: a port number 1-65535, or stop before installing anything
  case "$2" in
    ''|*[!0-9]*) die "$1='$2' is not a port number from 1 to 65535; fix it or leave it out (default 8765)" ;;
  esac
  [ "${#2}" -le 5 ] && [ "$2" -ge 1 ] && [ "$2" -le 65535 ] \
    || die "$1='$2' is not a port number from 1 to 65535; fix it or leave it out (default 8765)"
}

check_db() {   # VALUE: a postgresql:// URL or a file path (serve.py checks the rest); never echoes a URL
  case "$1" in
    '') die "--db is empty; give a postgresql://USER@HOST/DB URL or the SQLite file's path" ;;
    postgresql://*|postgres://*) ;;
    *://*) die "--db is a ${1%%://*}:// URL; only postgresql:// and postgres:// URLs are understood (for SQLite give the file's path)" ;;
  esac
}

main() {
  local script="${BASH_SOURCE[0]:-}"
  if [ -z "$script" ] || [ ! -f "$script" ] || [ ! -f "$(dirname "$script")/worker.py" ]; then
    bootstrap "$@"
  fi
  cd "$(dirname "$script")"
  here="$(pwd)"
  want_test=0; want_schedule=0; setup_only=0
  local serve_args=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --test) want_test=1 ;;
      --schedule) want_schedule=1 ;;
      --setup-only) setup_only=1 ;;
      --rotate|--write-claude-desktop) serve_args+=("$1") ;;
      --tunnel|--port)
        [ $# -ge 2 ] || die "$1 needs a value (try --help)"
        [ "$1" != --port ] || check_port "--port" "$2"
        serve_args+=("$1" "$2"); shift ;;
      --port=*) check_port "--port" "${1#--port=}"; serve_args+=("$1") ;;
      --db)
        [ $# -ge 2 ] || die "--db needs a value (try --help)"
        check_db "$2"; export TASK_DB_URL="$2"; shift ;;
      --db=*) check_db "${1#--db=}"; export TASK_DB_URL="${1#--db=}" ;;
      --tunnel=*) serve_args+=("$1") ;;
      -h|--help) sed -n '2,20p' "$here/install.sh"; exit 0 ;;
      *) die "unknown option $1 (try --help)" ;;
    esac
    shift
  done
  # Checked before the install, not after it (serve.py checks its other knobs the same way).
  [ -z "${PORT:-}" ] || check_port "PORT" "$PORT"
  # A second ./install.sh while the first serves: say so before reinstalling or asking anything.
  if [ "$want_test$want_schedule$setup_only" = 000 ] && [ -x .venv/bin/python ]; then
    .venv/bin/python serve.py --check-port ${serve_args[@]+"${serve_args[@]}"} || exit 1
  fi
  local need_node=0   # npm installs opencode (and, for --test, the test binaries)
  if [ "$want_test" = 1 ] || { [ -z "${OPENCODE_BIN:-}" ] && [ ! -x node_modules/.bin/opencode ]; }; then
    need_node=1
  fi
  check_prerequisites "$need_node"

  if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $python"
    "$python" -m venv .venv
  fi
  say "installing Python dependencies"
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
  if [ "$want_test" = 1 ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
  fi
  install_opencode
  install_box
  install_browser
  install_postgres
  install_faketime

  if [ "$want_test" = 1 ]; then
    exec .venv/bin/python serve.py --setup-only --quiet ${serve_args[@]+"${serve_args[@]}"}
  fi
  if [ "$want_schedule" = 1 ]; then
    .venv/bin/python serve.py --setup-only ${serve_args[@]+"${serve_args[@]}"}
    exec .venv/bin/python launchd/schedule.py install
  fi
  if [ "$setup_only" = 1 ]; then
    exec .venv/bin/python serve.py --setup-only ${serve_args[@]+"${serve_args[@]}"}
  fi
  exec .venv/bin/python serve.py ${serve_args[@]+"${serve_args[@]}"}
}

main "$@"
