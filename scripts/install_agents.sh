#!/usr/bin/env bash
# The coding agents the agent-client tests drive, pinned, installed once from npm into a
# folder outside the clone (default ~/.cache/prepos-agents; AGENTS_CACHE names another):
# Claude Code, Codex CLI and OpenCode. Needs node and npm (Node 20 runs all three).
set -euo pipefail
CACHE="${AGENTS_CACHE:-$HOME/.cache/prepos-agents}"
PACKAGES=("@anthropic-ai/claude-code@2.1.328" "@openai/codex@0.169.0" "opencode-ai@1.18.33")
command -v npm >/dev/null || { echo "install_agents: npm is not installed" >&2; exit 1; }
mkdir -p "$CACHE"
stamp="$CACHE/.installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${PACKAGES[*]}" ] &&
   [ -x "$CACHE/node_modules/.bin/claude" ] && [ -x "$CACHE/node_modules/.bin/codex" ] &&
   [ -x "$CACHE/node_modules/.bin/opencode" ]; then
  exit 0
fi
npm install --no-audit --no-fund --loglevel=error --prefix "$CACHE" "${PACKAGES[@]}"
for bin in claude codex opencode; do "$CACHE/node_modules/.bin/$bin" --version >/dev/null; done
echo "${PACKAGES[*]}" > "$stamp"
