#!/usr/bin/env bash
# Set everything up, then walk through the product on embedded defaults (a local store, a
# local mirror, Spark in local mode): mkfs, mount, write, snapshot, change, browse .snapshot,
# diff, replicate twice (the second time only the changes travel), verify, restore, run the
# daemon for a few seconds, unmount, fsck.
# DEMO_DIR (default: a new temp dir) holds the store, the mirror and the mountpoint.
set -euo pipefail
# from where you are (before the cd below); the daemon's config wants absolute paths
[ -z "${DEMO_DIR:-}" ] || DEMO_DIR=$(realpath -m -- "$DEMO_DIR")
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

DEMO_DIR=${DEMO_DIR:-$(mktemp -d /tmp/mountfs-demo.XXXXXX)}
STORE="$DEMO_DIR/store"
MIRROR="$DEMO_DIR/mirror"
MNT="$DEMO_DIR/mnt"
mkdir -p "$MNT"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
cleanup() { mountpoint -q "$MNT" && mountfs umount "$MNT" || true; }
trap cleanup EXIT

step "mountfs mkfs $STORE"
mountfs mkfs "$STORE"
step "mountfs mount $STORE $MNT"
mountfs mount "$STORE" "$MNT"

step "write some files"
mkdir -p "$MNT/docs"
echo "the first draft" > "$MNT/docs/report.txt"
head -c 3000000 /dev/urandom > "$MNT/data.bin"
ls -l "$MNT" "$MNT/docs"

step "snapctl create monday (O(1), everything written so far is in it)"
snapctl -m "$MNT" create monday

step "change things: edit, delete, add"
echo "the second draft" > "$MNT/docs/report.txt"
rm "$MNT/data.bin"
echo "new" > "$MNT/docs/notes.txt"
ls -l "$MNT" "$MNT/docs"

step "browse the snapshot read-only at $MNT/.snapshot/monday"
snapctl -m "$MNT" list
ls -l "$MNT/.snapshot/monday" "$MNT/.snapshot/monday/docs"
cat "$MNT/.snapshot/monday/docs/report.txt"
if (echo x > "$MNT/.snapshot/monday/docs/report.txt") 2>/dev/null; then
    echo "ERROR: a snapshot accepted a write" >&2; exit 1
else
    echo "(writing into the snapshot fails: read-only file system, as it should)"
fi

step "what changed since monday (found without walking the tree)"
snapctl -m "$MNT" create tuesday
snapctl -m "$MNT" diff monday tuesday
snapctl -m "$MNT" diff monday tuesday --stat

step "replicate to a local mirror (file://$MIRROR; Spark runs embedded, local[*])"
snapctl -m "$MNT" replicate --to "file://$MIRROR" --snapshot monday --spark-threshold 0
snapctl -m "$MNT" replicate --to "file://$MIRROR" --snapshot tuesday
echo "(the first cycle ran a Spark job; the second sent only what changed between monday and"
echo " tuesday: a few bytes, below --spark-threshold, so without starting Spark)"
snapctl -m "$MNT" verify --mirror "file://$MIRROR"

step "restore one file from the snapshot (metadata only, no data copied)"
snapctl -m "$MNT" restore monday docs/report.txt --force
cat "$MNT/docs/report.txt"

step "roll the whole tree back to monday"
snapctl -m "$MNT" restore monday --force
ls -l "$MNT" "$MNT/docs"
cmp "$MNT/data.bin" "$MNT/.snapshot/monday/data.bin" && echo "data.bin is back, identical"

step "the daemon: snapshot on change, replicate, report the lag"
cat > "$DEMO_DIR/demo.toml" <<EOF
[daemon]
state_dir = "$DEMO_DIR/state"
[[filesystem]]
name = "demo"
mountpoint = "$MNT"
min_interval = "1s"
[[filesystem.mirror]]
url = "file://$MIRROR"
EOF
mountfsd --config "$DEMO_DIR/demo.toml" 2> "$DEMO_DIR/mountfsd.log" &
daemon=$!
echo "written while the daemon runs" > "$MNT/docs/live.txt"
caught_up() {   # the mirror holds the newest snapshot and nothing changed since
    snapctl status --config "$DEMO_DIR/demo.toml" --json | python3 -c '
import json, sys
r = json.load(sys.stdin)
sys.exit(0 if all(m["base"] == r["newest"] and m["lag_seconds"] == 0
                  for m in r["mirrors"].values()) else 1)'
}
for _ in $(seq 120); do
    caught_up && break
    sleep 1
done
snapctl status --config "$DEMO_DIR/demo.toml"
kill -TERM "$daemon"; wait "$daemon" || true

step "mountfs umount $MNT, then fsck the store and the mirror"
mountfs umount "$MNT"
mountfs fsck "$STORE"
mountfs fsck "$MIRROR"
echo
echo "demo done: the store is in $STORE, its mirror in $MIRROR"
echo "(mount them again with: mountfs mount $STORE $MNT; mountfs mount --read-only $MIRROR DIR)"
