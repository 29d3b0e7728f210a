"""What every mountfs command line shares (click): one-line errors, the size and duration
parameter types (the same parsers as the daemon's config), --version, -m/--store accepted
before or after the command, and groups whose commands are imported only when run.

Kept light on purpose: it imports click and nothing of the store, so a command loads only
what it uses.
"""

from __future__ import annotations

import importlib
import sys

import click

from . import units

CONTEXT = {"help_option_names": ["-h", "--help"]}
INTERRUPTED = 130          # the shell's status for a command ended by Ctrl-C (128 + SIGINT)


def fail(msg: str, code: int = 1):
    """Print ``PROG: msg`` on stderr (PROG: the command the user ran) and exit."""
    ctx = click.get_current_context(silent=True)
    prog = ctx.find_root().info_name if ctx is not None else "mountfs"
    click.echo(f"{prog}: {msg}", err=True)
    sys.exit(code)


ESCAPES = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def escaped(name: str) -> str:
    """``name`` (a file or snapshot name, perhaps hostile) safe to print on a terminal, as
    ``ls --quoting-style=escape`` shows it: a backslash is doubled, a newline is ``\\n``,
    any other character that does not print (escape sequences, undecodable bytes) is
    ``\\xHH`` (or ``\\uHHHH``), so that one name is one unambiguous string on one line."""
    return "".join(c if c.isprintable() and c != "\\" else ESCAPES.get(c) or _hex(c)
                   for c in name)


def padded(text: str, width: int) -> str:
    """``text`` padded with spaces to ``width`` terminal columns, as ``f"{text:<width}"``
    would pad it if every character took one column: a CJK character takes two and a
    combining accent none, so a column of such names lined up with nothing else."""
    from wcwidth import wcswidth
    shown = wcswidth(text)
    return text + " " * (width - (shown if shown >= 0 else len(text)))


def _hex(c: str) -> str:
    """``\\xHH`` is a byte (ASCII, or one that was not UTF-8: surrogateescape), ``\\u``
    and ``\\U`` a character: U+0085 and the byte 0x85 read differently."""
    n = ord(c)
    if 0xDC80 <= n <= 0xDCFF:
        return f"\\x{n - 0xDC00:02x}"
    return f"\\x{n:02x}" if n < 0x80 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


class OneLineUsageError(click.UsageError):
    """A usage error shown as one line naming the command, like every other error (click's
    own form is four lines: usage, a hint, a blank line, then the error)."""

    def show(self, file=None) -> None:
        msg = self.format_message().rstrip(".")
        if self.ctx is not None:
            path = self.ctx.command_path
            msg = f"{path}: {msg} (see '{path} --help')"
        click.echo(msg, err=True)


def _one_line(e: click.UsageError) -> click.UsageError:
    if isinstance(e, (OneLineUsageError, click.exceptions.NoArgsIsHelpError)):
        return e                                  # no arguments at all: the help is right
    return OneLineUsageError(e.format_message(), e.ctx)


class _OneLine:
    """Usage errors, from parsing or raised by the command itself, as one line; Ctrl-C
    that no command handled itself as one line and status 130 (click's own is "Aborted!"
    and status 1, which ``verify`` uses for "the mirror differs")."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            raise _one_line(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise _one_line(e) from None
        except KeyboardInterrupt:
            click.echo(f"{ctx.command_path}: interrupted", err=True)
            ctx.exit(INTERRUPTED)


class OneLineCommand(_OneLine, click.Command):
    """A command (mountfsd) whose usage errors are one line on stderr with status 2."""


class OneLineGroup(_OneLine, click.Group):
    """A command group (mountfs, snapctl) whose usage errors, its own or its commands', are
    one line on stderr with status 2, and whose --help shows each command's whole first
    sentence (click cuts them at 45 characters). ``instead`` maps names that are not commands
    but that users of other tools type (zfs's ``destroy``, ``rollback``) to what to run:
    click's own "did you mean" only finds names spelt alike."""

    def __init__(self, *args, instead: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.instead = dict(instead or {})

    def resolve_command(self, ctx, args):
        name = args[0] if args else None
        if name in self.instead and self.get_command(ctx, name) is None:
            raise OneLineUsageError(f"there is no '{name}' command; {self.instead[name]}", ctx)
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=1000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class LazyGroup(OneLineGroup):
    """A group whose commands live in other modules (``"package.module:attribute"``), imported
    only when that command runs (or for --help): ``snapctl create`` never loads the
    replicator or the daemon."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx) -> list[str]:
        return sorted(set(self.lazy) | set(super().list_commands(ctx)))

    def get_command(self, ctx, name):
        if name in self.lazy:
            module, _, attr = self.lazy[name].partition(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


def version_option(prog: str):
    """--version, read from the installed package's metadata only when asked."""
    return click.version_option(package_name="mountfs", prog_name=prog,
                                message="%(prog)s %(version)s")


class _Units(click.ParamType):
    def __init__(self, name: str, parse):
        self.name = name
        self.parse = parse

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return self.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


SIZE = _Units("size", units.parse_size)
POSITIVE_SIZE = _Units("size", units.parse_positive_size)
DURATION = _Units("duration", units.parse_duration)
LISTEN = _Units("address", units.parse_listen)


def _remember(key: str):
    def callback(ctx, param, value):
        if value is not None:
            ctx.find_root().obj[key] = value
    return callback


# A mountpoint is taken as a plain string: click.Path stats its value, and a stat of a mount
# whose process is stopped or stuck waits forever, before the command could say anything.
MOUNTPOINT = click.STRING


def mountpoint_option(fn):
    """-m MOUNTPOINT after the command name too (``snapctl create -m MNT x``), like before."""
    return click.option("-m", "--mountpoint", type=MOUNTPOINT, metavar="PATH",
                        expose_value=False,
                        callback=_remember("mountpoint"),
                        help="The mounted filesystem (also accepted before the command).")(fn)


def target_options(fn):
    """-m MOUNTPOINT and --store STORE after the command name too, like before it."""
    fn = mountpoint_option(fn)
    return click.option("--store", type=click.Path(), expose_value=False,
                        callback=_remember("store"),
                        help="A store directory, mounted or not (also accepted before the "
                             "command).")(fn)
