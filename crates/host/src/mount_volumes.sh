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
  # A volume grown on the host (`:resize`, or a restore made larger) has a
  # larger drive than file system: grow it online, here in the guest (the
  # host never reads what a guest wrote). Nothing to do when they agree; a
  # failure leaves the volume mounted at its old size.
  resize2fs "$dev" >/dev/null 2>&1 || echo "growing the file system on $dev failed" >&2
done
