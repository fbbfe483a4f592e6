#!/usr/bin/env bash
# Restart public mode: TaskBridge's MCP server (/mcp, /sse), the board and a worker on 127.0.0.1,
# behind a fresh tunnel, with the existing token (quick-tunnel hosts change on every start, so the
# Host allowlist is paired with the new one). Same as `./install.sh --tunnel auto` without set-up.
#
#   ./start_public.sh                 a tunnel: TUNNEL_BIN, else cloudflared, else ngrok on PATH
#   ./start_public.sh --tunnel ngrok  that one (also: cloudflare)
#   TUNNEL_HOST=mcp.example.com ./start_public.sh --no-tunnel
#                                     your own tunnel/reverse proxy already points at the port
#
# Env: PORT (default 8765), TUNNEL_BIN, TUNNEL_HOST, MCP_BEARER_TOKEN / MCP_TOKEN_FILE (default
#      .taskbridge/token, from install.sh). Ctrl-C stops the server, the worker and the tunnel.
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || { echo "start_public.sh: run ./install.sh first" >&2; exit 1; }
args=(--tunnel auto)
while [ $# -gt 0 ]; do
  case "$1" in
    --no-tunnel)
      [ -n "${TUNNEL_HOST:-}" ] || { echo "start_public.sh: --no-tunnel needs TUNNEL_HOST (the public host name)" >&2; exit 1; }
      args=(--tunnel none) ;;
    --tunnel) [ $# -ge 2 ] || { echo "start_public.sh: --tunnel needs cloudflare or ngrok" >&2; exit 1; }
      args=(--tunnel "$2"); shift ;;
    --port) [ $# -ge 2 ] || { echo "start_public.sh: --port needs a number" >&2; exit 1; }
      args+=(--port "$2"); shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "start_public.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
exec .venv/bin/python serve.py "${args[@]}"
