#!/usr/bin/env bash
# The cluster's front door: HAProxy with deploy/haproxy.cfg, on --port, in front of the
# given nodes (each --node a URL, http://HOST:PORT). Runs in the foreground until stopped.
#   scripts/front_door.sh --port 9000 --node http://node1:8000 --node http://node2:8000
# --host ADDR binds one address (default: all); --config-out FILE writes the config and
# exits, without starting HAProxy. Every front door of one cluster lists its nodes in the
# same order: a node's place on the hash ring is its place in the list.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
PATH="$PATH:/usr/sbin:/usr/local/sbin"  # where Debian puts haproxy
template="$here/deploy/haproxy.cfg"
port="" host="" out="" nodes=()
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port="$2"; shift 2 ;;
    --host) host="$2"; shift 2 ;;
    --node) nodes+=("$2"); shift 2 ;;
    --config-out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "front_door.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$port" ] || { echo "front_door.sh: --port is required" >&2; exit 2; }
[ ${#nodes[@]} -gt 0 ] || { echo "front_door.sh: give at least one --node URL" >&2; exit 2; }
servers=""
i=0
for url in "${nodes[@]}"; do
  i=$((i + 1))
  case "$url" in
    http://*) addr="${url#http://}"; addr="${addr%%/*}" ;;
    *) echo "front_door.sh: a node is an http:// URL, got $url" >&2; exit 2 ;;
  esac
  case "$addr" in *:*) ;; *) addr="$addr:80" ;; esac
  servers+="    server n$i $addr"$'\n'
done
# the template with its bind and server lines replaced
config="$(awk -v bind="    bind $host:$port" -v servers="$servers" '
  /^    bind / { print bind; next }
  /^    server / { if (!done) { printf "%s", servers; done = 1 } next }
  { print }' "$template")"
if [ -n "$out" ]; then
  printf '%s\n' "$config" > "$out"
  exit 0
fi
command -v haproxy >/dev/null || { echo "front_door.sh: haproxy is not installed (apt-get install haproxy)" >&2; exit 1; }
# checked, then run in the foreground (-db) in this process's place, so that a signal to it
# stops HAProxy; the config is read from stdin, leaving no file behind
haproxy -q -c -f /dev/stdin <<<"$config"
exec haproxy -db -f /dev/stdin <<<"$config"
