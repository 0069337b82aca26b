#!/usr/bin/env bash
# Start Prometheus and Alertmanager on 127.0.0.1 for a distgrad training job, in the
# foreground; Ctrl-C (or SIGTERM) stops both.
#
#   launch/monitoring_stack.sh                      # scrape 127.0.0.1:9400, temp data dir,
#                                                   # print every notification here (echo receiver)
#   launch/monitoring_stack.sh --target node17:9400 --data-dir runs/monitoring
#   launch/monitoring_stack.sh --pager-url https://pager.example/hook --ticket-url https://tickets.example/hook
#
# Routing (configs/alertmanager.yml, generated from grafana/config.py ROUTING): critical alerts
# page (--pager-url), warnings open a ticket (--ticket-url), grouped per run; a NaN alert
# silences that run's spike alerts, a dead exporter its "stalled", a page its tickets. Without
# --pager-url/--ticket-url/--webhook-url, a built-in echo receiver (launch/echo_receiver.py) on
# 127.0.0.1:9095 prints each notification to this terminal as a person on call would get it.
#
# Prometheus: http://127.0.0.1:9090 (alerts: /classic/alerts on Debian's build, or the HTTP
# API /api/v1/alerts); Alertmanager: http://127.0.0.1:9093. Rules: grafana/alerts/
# distgrad.rules.yml. Runs register themselves: with exporter.file_sd_path set to the targets
# directory (default configs/targets/, see configs/prometheus.yml) global rank 0 writes its
# target there and removes it at a clean end, so multi-node jobs and many runs need no
# configuration edit. The static --target job is kept for the default single-node run (it
# does not page while no run is up). Grafana: import
# grafana/dashboards/*.json or mount grafana/provisioning (see docs/runbook.md).
#
# configs/prometheus.yml and configs/alertmanager.yml are rendered into the data dir with the
# chosen addresses (and absolute paths), checked with promtool / amtool when present, and used
# from there. Needs the Debian packages prometheus and prometheus-alertmanager (or binaries
# named by $PROMETHEUS / $ALERTMANAGER).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="127.0.0.1:9400"
prom_port=9090
am_port=9093
pager_url=""
ticket_url=""
echo=""
echo_port=9095
targets_dir="$repo/configs/targets"
data_dir=""
runbook_url="file://$repo/docs/runbook.md"
keep=0
check_only=0

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
  cat <<EOF
Options:
  --target HOST:PORT        distgrad exporter to scrape as job "distgrad" (default $target)
  --prometheus-port PORT    Prometheus port on 127.0.0.1 (default $prom_port)
  --alertmanager-port PORT  Alertmanager port on 127.0.0.1 (default $am_port)
  --pager-url URL           webhook of critical alerts (default: the echo receiver's /pager)
  --ticket-url URL          webhook of warnings (default: the echo receiver's /ticket)
  --webhook-url URL         both of the above
  --echo / --no-echo        start the echo receiver (default: on unless a URL above is given)
  --echo-port PORT          echo receiver port on 127.0.0.1 (default $echo_port)
  --targets-dir DIR         file_sd directory for job "distgrad-file-sd" (default configs/targets)
  --runbook-url URL         runbook base of the alerts' runbook_url links (URL#<alert in lower
                            case>; default file://<this clone>/docs/runbook.md)
  --data-dir DIR            TSDB, Alertmanager state, rendered configs and logs (default: a
                            temporary directory, removed on exit unless --keep)
  --keep                    keep a temporary data dir on exit
  --check                   render and validate the configs (promtool, amtool), start nothing
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    --target) target="$2"; shift 2 ;;
    --prometheus-port) prom_port="$2"; shift 2 ;;
    --alertmanager-port) am_port="$2"; shift 2 ;;
    --pager-url) pager_url="$2"; shift 2 ;;
    --ticket-url) ticket_url="$2"; shift 2 ;;
    --webhook-url) pager_url="$2"; ticket_url="$2"; shift 2 ;;
    --echo) echo=1; shift ;;
    --no-echo) echo=0; shift ;;
    --echo-port) echo_port="$2"; shift 2 ;;
    --targets-dir) targets_dir="$2"; shift 2 ;;
    --runbook-url) runbook_url="$2"; shift 2 ;;
    --data-dir) data_dir="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    --check) check_only=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
  esac
done

if [ -z "$echo" ]; then
  if [ -z "$pager_url" ] && [ -z "$ticket_url" ]; then echo=1; else echo=0; fi
fi
[ -n "$pager_url" ] || pager_url="http://127.0.0.1:$echo_port/pager"
[ -n "$ticket_url" ] || ticket_url="http://127.0.0.1:$echo_port/ticket"

prometheus="${PROMETHEUS:-$(command -v prometheus || true)}"
alertmanager="${ALERTMANAGER:-$(command -v prometheus-alertmanager || command -v alertmanager || true)}"
if [ "$check_only" = 0 ] && { [ -z "$prometheus" ] || [ -z "$alertmanager" ]; }; then
  echo "prometheus and prometheus-alertmanager are needed: apt-get install -y prometheus prometheus-alertmanager" >&2
  exit 1
fi

temp_dir=0
if [ -z "$data_dir" ]; then
  data_dir="$(mktemp -d "${TMPDIR:-/tmp}/distgrad-monitoring.XXXXXX")"
  temp_dir=1
fi
mkdir -p "$data_dir/prometheus" "$data_dir/alertmanager" "$targets_dir"
data_dir="$(cd "$data_dir" && pwd)"
targets_dir="$(cd "$targets_dir" && pwd)"

# Render the configs: addresses and absolute paths (sed with | as delimiter; the values are
# host:port pairs, URLs and paths).
prom_cfg="$data_dir/prometheus.yml"
am_cfg="$data_dir/alertmanager.yml"
rules="$data_dir/distgrad.rules.yml"
# the rule file with the runbook base (the committed one links docs/runbook.md, relative to
# this repository's root: grafana/config.py RUNBOOK_URL)
case "$runbook_url" in *"|"*) echo "--runbook-url must not contain '|'" >&2; exit 2 ;; esac
sed -e "s|^\( *runbook_url: \)docs/runbook.md#|\1${runbook_url%#}#|" "$repo/grafana/alerts/distgrad.rules.yml" > "$rules"
if [ "$(grep -c 'runbook_url: ' "$rules")" != "$(grep -c "runbook_url: ${runbook_url%#}#" "$rules")" ]; then
  echo "could not render the runbook links into $rules (is grafana/alerts/distgrad.rules.yml generated?)" >&2
  exit 1
fi
sed -e "s|\"127.0.0.1:9400\"|\"$target\"|" \
    -e "s|\"127.0.0.1:9093\"|\"127.0.0.1:$am_port\"|" \
    -e "s|\.\./grafana/alerts/distgrad.rules.yml|$rules|" \
    -e "s|\"targets/\*\.json\"|\"$targets_dir/*.json\"|" \
    "$repo/configs/prometheus.yml" > "$prom_cfg"
sed -e "s|url: http://127.0.0.1:9095/pager\$|url: $pager_url|" -e "s|url: http://127.0.0.1:9095/ticket\$|url: $ticket_url|" \
    "$repo/configs/alertmanager.yml" > "$am_cfg"
if command -v promtool >/dev/null 2>&1; then promtool check config "$prom_cfg" >/dev/null; fi
if command -v amtool >/dev/null 2>&1; then amtool check-config "$am_cfg" >/dev/null; fi
if [ "$check_only" = 1 ]; then
  echo "configs rendered into $data_dir and valid"
  [ "$temp_dir" = 1 ] && [ "$keep" = 0 ] && rm -rf "$data_dir"
  exit 0
fi

pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ "$temp_dir" = 1 ] && [ "$keep" = 0 ]; then rm -rf "$data_dir"; else echo "data kept in $data_dir"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ "$echo" = 1 ]; then
  # in the foreground's output: each notification is printed here as it arrives
  python3 -u "$repo/launch/echo_receiver.py" --port "$echo_port" &
  pids+=($!)
fi
"$alertmanager" --config.file="$am_cfg" --storage.path="$data_dir/alertmanager" \
  --web.listen-address="127.0.0.1:$am_port" --web.external-url="http://127.0.0.1:$am_port/" \
  --cluster.listen-address= >"$data_dir/alertmanager.log" 2>&1 &
pids+=($!)
"$prometheus" --config.file="$prom_cfg" --storage.tsdb.path="$data_dir/prometheus" \
  --web.listen-address="127.0.0.1:$prom_port" --web.external-url="http://127.0.0.1:$prom_port/" \
  >"$data_dir/prometheus.log" 2>&1 &
pids+=($!)

ready() {  # ready URL: 0 once it answers 200
  python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' "$1" 2>/dev/null
}
checks=("alertmanager http://127.0.0.1:$am_port/-/ready" "prometheus http://127.0.0.1:$prom_port/-/ready")
[ "$echo" = 1 ] && checks+=("echo-receiver http://127.0.0.1:$echo_port/")
for name_url in "${checks[@]}"; do
  set -- $name_url
  for _ in $(seq 1 100); do
    ready "$2" && break
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "$1 exited; log:" >&2; tail -n 20 "$data_dir/$1.log" >&2 || true; exit 1; }
    done
    sleep 0.2
  done
  ready "$2" || { echo "$1 not ready after 20 s; see $data_dir/$1.log" >&2; exit 1; }
done

cat <<EOF
distgrad monitoring stack running (Ctrl-C stops it)
  Prometheus    http://127.0.0.1:$prom_port   scraping $target (job distgrad) and $targets_dir/*.json (job distgrad-file-sd)
  Alertmanager  http://127.0.0.1:$am_port   critical -> $pager_url, warning -> $ticket_url
  Runbook       $runbook_url
  Runs register themselves with the distgrad config exporter.file_sd_path: $targets_dir/
  data and logs $data_dir
EOF
wait -n "${pids[@]}"
echo "a monitoring process exited; see the logs in $data_dir" >&2
exit 1
