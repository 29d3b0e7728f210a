"""What a mirror URL may be: one check for the command line and the daemon's config, so that
neither meets a URL it cannot use (a ValueError from deep inside a cycle), and a ``file://``
URL names exactly the directory the user wrote."""

from __future__ import annotations

import ipaddress
import os
import re
from urllib.parse import SplitResult, unquote, urlsplit

HOST = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_\-]*[A-Za-z0-9_])?"
                  r"(\.[A-Za-z0-9_]([A-Za-z0-9_\-]*[A-Za-z0-9_])?)*\.?$")
URL_FORMS = "expected file:///path or http(s)://host:port"


def url_problem(url: str) -> str | None:
    """What is wrong with a mirror URL, or None."""
    if not re.match(r"^(file|https?)://", url):
        return URL_FORMS
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"{e} in {url!r}; {URL_FORMS}"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "no ?query or #fragment allowed (in a path, write ? as %3F and # as %23)"
    if parts.scheme == "file":
        return _file_url_problem(parts)
    if not parts.hostname or not _host_ok(parts.hostname):
        return f"no valid host in {url!r}; {URL_FORMS}"
    if parts.username is not None or parts.password is not None:
        return "no user@ in the URL: the token goes in a token file"
    if port == 0:
        return "port 0 is out of range 1-65535"
    return None


def file_url_path(url: str) -> str:
    """The directory a checked ``file://`` URL names, its %XX escapes decoded."""
    return unquote(urlsplit(url).path)


def _file_url_problem(parts: SplitResult) -> str | None:
    if parts.netloc not in ("", "localhost"):
        return (f"names the host {parts.netloc!r}, not a path on this host: write "
                f"file:///{parts.netloc}{parts.path} (three slashes)")
    path = unquote(parts.path)
    if not path.startswith("/") or os.path.normpath(path) == "/":
        return "name a directory of the mirror's own, like file:///srv/mirror (not /)"
    if "\0" in path:
        return "no NUL byte (%00) in a path"
    return None


def _host_ok(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(HOST.match(host)) and len(host) <= 253
