set -eu
while [ $# -gt 1 ]; do
  serial=$1; dir=$2; shift 2
  dev=
  for _ in $(seq 100); do
    for b in /sys/block/vd*; do
      if [ "$(cat "$b/serial" 2>/dev/null)" = "$serial" ]; then dev=/dev/${b##*/}; fi
    done
    [ -n "$dev" ] && [ -b "$dev" ] && break
    sleep 0.1
  done
  [ -n "$dev" ] || { echo "no device with serial $serial" >&2; exit 1; }
  mkdir -p "$dir"
  mount -t ext4 -o nosuid,nodev "$dev" "$dir"
done
