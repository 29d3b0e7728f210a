"""What a Spark master may be, checked where the user writes it (``--spark-master``, the
daemon's ``spark_master``): a mistyped one would otherwise fail only when a cycle starts
Spark, in every cycle of a daemon that accepted it."""

from __future__ import annotations

import re

FORMS = ("local, local[N], local[*], spark://HOST:PORT[,HOST:PORT...], yarn, k8s://URL "
         "or mesos://URL")
_LOCAL = re.compile(r"^local(\[(\*|[1-9]\d{0,4})(,[1-9]\d{0,2})?\])?$")
_STANDALONE = re.compile(r"^spark://[A-Za-z0-9_.\-\[\]:]+:\d{1,5}(,[A-Za-z0-9_.\-\[\]:]+:\d{1,5})*$")
_OTHERS = re.compile(r"^(yarn|(k8s|mesos)://\S+)$")


def master_problem(master: str) -> str | None:
    """What is wrong with a Spark master URL, or None."""
    if any(p.match(master) for p in (_LOCAL, _STANDALONE, _OTHERS)):
        return None
    return f"not a Spark master: {master!r}; expected {FORMS}"
