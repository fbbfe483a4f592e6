#!/usr/bin/env bash
# Serve TaskBridge's MCP server (streamable-http at /mcp, sse at /sse), the board and /api on one
# loopback port, and expose it on a public URL through a tunnel. The server stays bound to
# 127.0.0.1; only the tunnel reaches it, every route but /health and the board's shell needs the
# bearer token, and the Host allowlist admits the tunnel's host name only.
#
#   ./start_public.sh                 quick tunnel: cloudflared (or ngrok) on PATH, host learnt from it
#   TUNNEL_HOST=mcp.example.com ./start_public.sh --no-tunnel
#                                     your own tunnel/reverse proxy already points at the port
#
# Env: PORT (default 8765), TUNNEL_BIN (cloudflared or ngrok; default: whichever is on PATH),
#      TUNNEL_HOST, MCP_BEARER_TOKEN / MCP_TOKEN_FILE (default .taskbridge/token, from install.sh).
set -euo pipefail
cd "$(dirname "$0")"
port="${PORT:-8765}"
python=".venv/bin/python"
[ -x "$python" ] || { echo "start_public.sh: run ./install.sh first" >&2; exit 1; }
token_file="${MCP_TOKEN_FILE:-$(pwd)/.taskbridge/token}"
if [ -n "${MCP_BEARER_TOKEN+set}" ] && [ -z "$(printf '%s' "$MCP_BEARER_TOKEN" | tr -d '[:space:]')" ]; then
  echo "start_public.sh: MCP_BEARER_TOKEN is set but blank; unset it (the token file is used) or give a token" >&2
  exit 1
fi
if [ -z "${MCP_BEARER_TOKEN:-}" ] && [ ! -s "$token_file" ]; then
  echo "start_public.sh: no bearer token; run ./install.sh (writes $token_file) or set MCP_BEARER_TOKEN" >&2
  exit 1
fi

tunnel_pid=""
cleanup() { [ -n "$tunnel_pid" ] && kill "$tunnel_pid" 2>/dev/null || true; }
trap cleanup EXIT INT TERM

host="${TUNNEL_HOST:-}"
if [ "${1:-}" != "--no-tunnel" ]; then
  bin="${TUNNEL_BIN:-$(command -v cloudflared || command -v ngrok || true)}"
  [ -n "$bin" ] || { echo "start_public.sh: no tunnel binary (install cloudflared or ngrok, or set TUNNEL_BIN; or use --no-tunnel with TUNNEL_HOST)" >&2; exit 1; }
  log="$(mktemp)"
  case "$(basename "$bin")" in
    ngrok*) "$bin" http "127.0.0.1:$port" --log stdout --log-format logfmt >"$log" 2>&1 & ;;
    *)      "$bin" tunnel --no-autoupdate --url "http://127.0.0.1:$port" >"$log" 2>&1 & ;;
  esac
  tunnel_pid=$!
  for _ in $(seq 1 60); do
    host="$(grep -oE 'https://[A-Za-z0-9.-]+\.(trycloudflare\.com|ngrok-free\.app|ngrok\.io|ngrok\.app)' "$log" | head -n1 | sed 's#https://##')" || true
    [ -n "$host" ] && break
    kill -0 "$tunnel_pid" 2>/dev/null || { echo "start_public.sh: the tunnel exited:" >&2; cat "$log" >&2; exit 1; }
    sleep 0.5
  done
  [ -n "$host" ] || { echo "start_public.sh: the tunnel printed no public URL in 30 s" >&2; exit 1; }
fi
[ -n "$host" ] || { echo "start_public.sh: set TUNNEL_HOST to the public host name" >&2; exit 1; }

export MCP_ALLOWED_HOSTS="${MCP_ALLOWED_HOSTS:+$MCP_ALLOWED_HOSTS,}$host"
cat >&2 <<BOX
+--------------------------------------------------------------------------------+
  MCP connector (streamable-http): https://$host/mcp
  SSE transport:                   https://$host/sse
  Dispatch board:                  https://$host/
  Header:                          Authorization: Bearer <token in $token_file>
+--------------------------------------------------------------------------------+
BOX
"$python" opencode_bridge_mcp.py --transport streamable-http --host 127.0.0.1 --port "$port"
