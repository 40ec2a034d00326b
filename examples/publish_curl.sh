#!/usr/bin/env bash
# Publish over nsqd's HTTP API with curl: one message, then several in one /mpub.
#   examples/publish_curl.sh                 # against `make run` (127.0.0.1:4151)
#   NSQD_HTTP=host:port TOPIC=t examples/publish_curl.sh
set -euo pipefail
NSQD_HTTP=${NSQD_HTTP:-127.0.0.1:4151}
TOPIC=${TOPIC:-example}
curl -sS -f -d 'hello from curl' "http://$NSQD_HTTP/pub?topic=$TOPIC"; echo
printf 'one\ntwo\nthree' | curl -sS -f --data-binary @- "http://$NSQD_HTTP/mpub?topic=$TOPIC"; echo
curl -sS -f "http://$NSQD_HTTP/stats?format=json&topic=$TOPIC" | python3 -c \
  'import json,sys; t=json.load(sys.stdin)["topics"][0]; print("topic", t["topic_name"], "message_count", t["message_count"])'
