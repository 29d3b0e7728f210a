#!/usr/bin/env bash
# Set everything up, then walk through the product on embedded defaults:
# mkfs, mount, write, snapshot, change, browse .snapshot, diff-free restore, unmount, fsck.
# DEMO_DIR (default: a new temp dir) holds the store and the mountpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

DEMO_DIR=${DEMO_DIR:-$(mktemp -d /tmp/mountfs-demo.XXXXXX)}
STORE="$DEMO_DIR/store"
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

step "restore one file from the snapshot (metadata only, no data copied)"
snapctl -m "$MNT" restore monday docs/report.txt --force
cat "$MNT/docs/report.txt"

step "roll the whole tree back to monday"
snapctl -m "$MNT" restore monday --force
ls -l "$MNT" "$MNT/docs"
cmp "$MNT/data.bin" "$MNT/.snapshot/monday/data.bin" && echo "data.bin is back, identical"

step "mountfs umount $MNT, then fsck"
mountfs umount "$MNT"
mountfs fsck "$STORE"
echo
echo "demo done: the store is in $STORE (mount it again with: mountfs mount $STORE $MNT)"
