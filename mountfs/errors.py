"""The error every user-facing failure of the store raises, in a module of its own so that a
command line can catch it without loading the store (LMDB, blake3)."""


class StoreError(Exception):
    """A user-facing error about a store: printed as one line, exit status 1."""


class StoreFull(StoreError):
    """The disk under the store is full (ENOSPC reaches the writer)."""
