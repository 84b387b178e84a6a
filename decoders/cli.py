"""What the command lines share: output paths checked before any work starts, results that survive a
write failing later, and an argument parser whose refusals are one line.

    out = cli.check_records_file(args.out, "--out")       # UsageError now, not after the sweep
    sink = cli.JsonlSink(out)
    sink.append(record)                                    # a failed write moves to a fallback file
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from decoders.base import UsageError

# Formats the figures are written in (matplotlib picks the format from the suffix).
FIGURE_SUFFIXES = (".png", ".pdf", ".svg")


def nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    return path


def check_output_file(path, option: str) -> Path:
    """`path` as a file the command can append to: its folder made now, refused (UsageError) when it is
    a folder, or its folder cannot be made or written."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a folder, not a file")
    if not nearest_existing(path.parent).is_dir():
        raise UsageError(f"{option} {path}: {nearest_existing(path.parent)} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot make its folder ({e.strerror})") from None
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: not writable")
    return path


def check_records_file(path, option: str) -> Path:
    """`path` as a JSON lines file records are appended to (`check_output_file`), refused when it
    already holds something whose last line is not a JSON object: appending would mix the records
    into a file nothing can read back as records."""
    path = check_output_file(path, option)
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - (1 << 16)))
            lines = [x for x in f.read().splitlines() if x.strip()]
        try:
            last = json.loads(lines[-1]) if lines else {}
        except (UnicodeDecodeError, ValueError):
            last = None
        if not isinstance(last, dict):
            raise UsageError(f"{option} {path}: not a JSON lines file (its last line is not a JSON object); name a new file")
    return path


def check_figure_file(path, option: str) -> Path:
    """An output file for a figure: a suffix matplotlib writes (.png, .pdf, .svg) and writable."""
    path = Path(path)
    if path.suffix.lower() not in FIGURE_SUFFIXES:
        raise UsageError(f"{option} {path}: a figure must end in {', '.join(FIGURE_SUFFIXES)}")
    return check_output_file(path, option)


def check_output_dir(path, option: str) -> Path:
    """`path` as a folder the command may create or write into, checked without creating anything."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path}: is a file, not a folder")
    base = nearest_existing(path)
    if not base.is_dir():
        raise UsageError(f"{option} {path}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: {base} is not writable")
    return path


class JsonlSink:
    """JSON lines appended to `path` one record at a time; when a write fails (the disk filled, the
    folder went away) this and every later record go to a fallback file in the temporary folder, and
    stderr says so once, so nothing measured is lost."""

    def __init__(self, path):
        self.path = Path(path)
        self.fallback: Path | None = None

    @property
    def where(self) -> str:
        """Where the records are: the path, and the fallback file when one was needed."""
        return str(self.path) if self.fallback is None else f"{self.path} and {self.fallback}"

    def append(self, record: dict) -> None:
        from decoders.records import append_jsonl

        if self.fallback is None:
            try:
                append_jsonl(self.path, record)
                return
            except OSError as e:
                handle, name = tempfile.mkstemp(prefix=f"{self.path.stem}-", suffix=".jsonl")
                os.close(handle)
                self.fallback = Path(name)
                print(f"warning: cannot write {self.path} ({e.strerror or e}); this and later records go to {self.fallback}", file=sys.stderr)
        append_jsonl(self.fallback, record)



def reports_refusals() -> bool:
    """Whether this process says what it refuses: under torchrun (RANK set) every rank finds the same
    mistake and exits with 2, and rank 0 alone prints the line."""
    return os.environ.get("RANK", "0") == "0"


class Parser(argparse.ArgumentParser):
    """argparse whose refusals are one line (`error: ...`, exit code 2) like the lab's own checks,
    not a usage block followed by the message."""

    def error(self, message: str):
        if reports_refusals():
            print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def run_command(build_parser, run, argv=None) -> int:
    """A command line's main: `run(parsed arguments)`'s exit status, or 2 with one line on stderr when
    the lab refuses the input (a bad option, preset or checkpoint)."""
    from decoders import USER_ERRORS

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except USER_ERRORS as e:
        if reports_refusals():
            print(f"error: {e}", file=sys.stderr)
        return 2
