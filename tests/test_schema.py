"""Inode records: the hand-built fast paths (``pack_at``, ``unpack``, ``evolve``, which build
the tuple directly because they run several times per created file on the trio thread)
agree with NamedTuple's own ``_replace`` and with each other, for any record."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mountfs import schema as S

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-2**63, 2**63 - 1)

inodes = st.builds(
    S.Inode, U32, U32, U32, U32, U64, I64, I64, I64, U64, U64, U64,
    st.binary(max_size=S.NAME_MAX), st.binary(max_size=300))


@given(inodes)
def test_unpack_inverts_pack(rec):
    """From bytes, and from the memoryview LMDB gives (``buffers=True``): a record must own
    its name and target, since the engine keeps records past the transaction."""
    for packed in (rec.pack(), memoryview(rec.pack())):
        back = S.Inode.unpack(packed)
        assert back == rec and type(back) is S.Inode
        assert type(back.name) is bytes and type(back.target) is bytes


@given(inodes, U64)
def test_pack_at_is_evolve_then_pack(rec, mepoch):
    assert rec.pack_at(mepoch) == rec._replace(mepoch=mepoch).pack()
    assert S.Inode.unpack(rec.pack_at(mepoch)) == rec._replace(mepoch=mepoch)


@given(inodes, st.dictionaries(st.sampled_from(S.Inode._fields),
                                st.one_of(U32, st.binary(max_size=300)), max_size=5))
def test_evolve_is_replace(rec, changes):
    new = rec.evolve(**changes)
    assert new == rec._replace(**changes) and type(new) is S.Inode


def test_evolve_refuses_an_unknown_field():
    rec = S.Inode(0o100644, 0, 0, 1, 0, 0, 0, 0, 0, 1)
    with pytest.raises(KeyError):
        rec.evolve(sise=3)
