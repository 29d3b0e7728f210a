"""Directories this mount made, and every name that may be in each: a lookup of any other
name there is answered "no such name" from memory, without reading the tree.

Why: unpacking an archive, checking out a branch or copying a tree in looks up each new
name once before creating it (the kernel's LOOKUP before CREATE or MKDIR), and almost every
such directory was made by the same mount moments earlier. Reading the tree for that answer
was the largest part of a negative lookup's cost on the trio thread.

Invariant: for a directory ``ino`` held here, every name its live tree holds (committed,
answered or on its way) is in ``names[ino]``; a name may stay after it went (an unlink, a
rename away, a create that failed), which only sends that lookup to the tree. Kept by:
* ``made(ino)``: the mount made ``ino`` empty (its MKDIR answered), and no change behind
  the kernel's back (rollback, restore) began since ``begin()`` was read;
* ``naming(parent, name)``: before every call that may put a name in a live directory
  (CREATE, MKNOD, MKDIR, SYMLINK, LINK, RENAME's target) is sent or answered;
* ``behind()``: a rollback or restore (TXN steps that change the live tree behind the
  kernel's back) drops everything, when it starts and again when it ends, and nothing is
  taken up while one runs.
Inode numbers are never reused (the store's next number only grows, a rollback
included), so a removed directory held here costs only memory until it is evicted.

Bounded: at most ``MAX_NAMES`` names in all, a directory counting as one; past it the
directories made longest ago go first.
"""

from __future__ import annotations

MAX_NAMES = 1 << 18         # ~20 MB of names at most (a name ~80 bytes with its set slot)


class NewDirs:
    def __init__(self, max_names: int = MAX_NAMES):
        self.max_names = max_names
        self.names: dict[int, set[bytes]] = {}      # oldest first (insertion order)
        self.count = 0                              # names and directories held
        self.generation = 0                         # moved on by every ``behind``
        self.rewriting = 0                          # changes behind the kernel in progress

    def absent(self, parent: int, name: bytes) -> bool:
        """Whether live ``parent``/``name`` is known not to exist."""
        held = self.names.get(parent)
        return held is not None and name not in held

    def begin(self) -> int:
        """Read before a MKDIR is sent; ``made`` takes it back."""
        return self.generation

    def made(self, ino: int, since: int) -> None:
        """The mount made directory ``ino`` (empty); ``since``: ``begin()`` before it."""
        if since != self.generation or self.rewriting or ino in self.names:
            return
        self._make_room(1)
        self.names[ino] = set()
        self.count += 1

    def naming(self, parent: int, name: bytes) -> None:
        """A call may put ``name`` in live directory ``parent``: call before it is sent."""
        held = self.names.get(parent)
        if held is None or name in held:
            return
        if self.count >= self.max_names:
            self._make_room(1, keep=parent)
            held = self.names.get(parent)
            if held is None:                        # evicted: the bound left no room
                return
        held.add(name)
        self.count += 1

    def behind(self, starting: bool) -> None:
        """A change behind the kernel's back (rollback, restore) starts or ends."""
        self.rewriting += 1 if starting else -1
        self.generation += 1
        self.names.clear()
        self.count = 0

    def _make_room(self, n: int, keep: int | None = None) -> None:
        """Evict the directories made longest ago until ``n`` more names fit (``keep``:
        last, as it is the one about to grow)."""
        while self.count + n > self.max_names and self.names:
            oldest = next(iter(self.names))
            if oldest == keep and len(self.names) > 1:
                self.names[oldest] = self.names.pop(oldest)     # to the young end
                continue
            self.count -= len(self.names.pop(oldest)) + 1
