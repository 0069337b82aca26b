#!/usr/bin/env bash
# Start Prometheus and Alertmanager on 127.0.0.1 for a distgrad training job, in the
# foreground; Ctrl-C (or SIGTERM) stops both.
#
#   launch/monitoring_stack.sh                      # scrape 127.0.0.1:9400, temp data dir
#   launch/monitoring_stack.sh --target node17:9400 --data-dir runs/monitoring
#   launch/monitoring_stack.sh --webhook-url http://127.0.0.1:8080/hook
#
# Prometheus: http://127.0.0.1:9090 (alerts: /classic/alerts on Debian's build, or the HTTP
# API /api/v1/alerts); Alertmanager: http://127.0.0.1:9093. Rules: grafana/alerts/
# distgrad.rules.yml. Multi-node jobs: drop a file_sd file into the targets directory
# (default configs/targets/, see configs/prometheus.yml). Grafana: import
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
webhook_url="http://127.0.0.1:9095/"
targets_dir="$repo/configs/targets"
data_dir=""
runbook_url="file://$repo/docs/runbook.md"
keep=0
check_only=0

usage() {
  sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  cat <<EOF
Options:
  --target HOST:PORT        distgrad exporter to scrape as job "distgrad" (default $target)
  --prometheus-port PORT    Prometheus port on 127.0.0.1 (default $prom_port)
  --alertmanager-port PORT  Alertmanager port on 127.0.0.1 (default $am_port)
  --webhook-url URL         where Alertmanager posts alerts (default $webhook_url)
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
    --webhook-url) webhook_url="$2"; shift 2 ;;
    --targets-dir) targets_dir="$2"; shift 2 ;;
    --runbook-url) runbook_url="$2"; shift 2 ;;
    --data-dir) data_dir="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    --check) check_only=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
  esac
done

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
sed -e "s|url: http://127.0.0.1:9095/|url: $webhook_url|" "$repo/configs/alertmanager.yml" > "$am_cfg"
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
for name_url in "alertmanager http://127.0.0.1:$am_port/-/ready" "prometheus http://127.0.0.1:$prom_port/-/ready"; do
  set -- $name_url
  for _ in $(seq 1 100); do
    ready "$2" && break
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "$1 exited; log:" >&2; tail -n 20 "$data_dir/$1.log" >&2; exit 1; }
    done
    sleep 0.2
  done
  ready "$2" || { echo "$1 not ready after 20 s; see $data_dir/$1.log" >&2; exit 1; }
done

cat <<EOF
distgrad monitoring stack running (Ctrl-C stops it)
  Prometheus    http://127.0.0.1:$prom_port   scraping $target (job distgrad) and $targets_dir/*.json (job distgrad-file-sd)
  Alertmanager  http://127.0.0.1:$am_port   posting to $webhook_url
  data and logs $data_dir
EOF
wait -n "${pids[@]}"
echo "a monitoring process exited; see the logs in $data_dir" >&2
exit 1
