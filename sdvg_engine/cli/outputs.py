"""Output paths of ``sdvg generate``: checked before anything loads, written atomically, and the manifest of what a
run wrote (so that ``--overwrite`` removes an earlier run's files and nothing else)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .common import UsageError


# ---- output paths ------------------------------------------------------------------------------------------
def _check_writable_folder(folder: Path, flag: str, shown) -> None:
    """``folder`` (or its nearest existing ancestor, where it will be created) must be a writable folder."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{flag} {shown}: {probe} is a file, not a folder; choose another path")
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".sdvg-write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {shown}: cannot write in {probe} ({e.strerror or e}); choose a writable folder") from None


def check_output_file(path: Path, flag: str, *, overwrite: bool) -> None:
    """An output file: not a folder, not existing (unless ``overwrite``), in a writable folder. Only a regular file is
    ever replaced: a device, FIFO or socket under that name is refused even with ``--overwrite`` (the atomic rename
    would replace the node itself; as root that could be /dev/null)."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name (e.g. {path / 'report.json'})")
    if path.exists() and not path.is_file():
        raise UsageError(f"{flag} {path}: exists and is not a regular file (a device, FIFO or socket); it is never "
                         "replaced: choose a file name")
    if path.exists() and not overwrite:
        raise UsageError(f"{flag} {path}: already exists; pass --overwrite to replace it or choose another name")
    _check_writable_folder(path.parent, flag, path)


#: What a run wrote into --out (file names), so that --overwrite removes an earlier set's leftovers and nothing else:
#: a file is deleted only if this tool wrote it, never because its name looks like an output.
MANIFEST = ".sdvg-outputs.json"


def check_manifest(out: Path) -> None:
    """The manifest's name in ``out`` is free or a regular file: a symbolic link there is refused, never followed (a
    link to a user's JSON with a ``files`` list would make ``--overwrite`` delete what it lists), and so is a folder
    or a device (the manifest could not be written after the videos)."""
    path = out / MANIFEST
    if path.is_symlink():
        raise UsageError(f"--out {out}: {MANIFEST} is a symbolic link (to {os.readlink(path)}); sdvg records the files "
                         "it wrote in that file and never follows a link there: remove the link or choose another "
                         "--out folder")
    if path.is_dir():
        raise UsageError(f"--out {out}: {MANIFEST} is a folder; sdvg records the files it wrote in a file of that "
                         "name: move the folder away or choose another --out folder")
    if path.exists() and not path.is_file():
        raise UsageError(f"--out {out}: {MANIFEST} exists and is not a regular file (a device, FIFO or socket); it is "
                         "never replaced: choose another --out folder")


def _read_manifest(path: Path) -> str:
    """The manifest's text, refusing (OSError) to follow a symbolic link even if one appeared after the checks."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, encoding="utf-8") as f:
        return f.read()


def written_by_earlier_run(out: Path) -> list[str]:
    """The names an earlier run in ``out`` recorded in its manifest that are still there (none if unreadable or not
    a regular file: a symbolic link is never followed)."""
    path = out / MANIFEST
    try:
        names = json.loads(_read_manifest(path)).get("files", []) if path.is_file() and not path.is_symlink() else []
    except (OSError, ValueError, AttributeError):
        return []  # an unreadable manifest: delete nothing
    return [n for n in names if isinstance(n, str) and n == Path(n).name and n not in (".", "..", MANIFEST)
            and (out / n).exists()]


def write_manifest(out: Path, names: list[str]) -> None:
    write_text_atomic(out / MANIFEST, json.dumps({"written_by": "sdvg generate", "files": sorted(set(names))}, indent=1))


def plan_generate_outputs(args, count: int, suffix: str) -> tuple[Path, list[tuple[Path, Path]], Path]:
    """Check ``--out`` / ``--report`` before anything loads: ``(out, [(video, mask)] * count, report)``.

    A folder that holds a file this run would write, or the files of an earlier run (its manifest), is refused
    (naming one) unless ``--overwrite``; then the earlier set's other files are removed after the new set is written
    (never a mix). Files this tool did not write are never touched, whatever their names.
    """
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder; choose a folder name")
    _check_writable_folder(out, "--out", out)
    check_manifest(out)
    files = [(out / f"video_{i:03d}{suffix}", out / f"mask_{i:03d}.png") for i in range(count)]
    report = Path(args.report).expanduser() if args.report else out / "report.json"
    if args.report:
        manifest = out / MANIFEST
        if report.resolve() == manifest.resolve() or (report.exists() and manifest.exists()
                                                     and os.path.samefile(report, manifest)):
            # The manifest is written after the report: the report would be lost.
            raise UsageError(f"--report {report}: is {manifest}, the manifest where sdvg records the files it wrote "
                             "in --out; choose another report name (e.g. report.json)")
        check_output_file(report, "--report", overwrite=args.overwrite)
        if report.resolve() in {p.resolve() for pair in files for p in pair}:
            raise UsageError(f"--report {report}: is also a video/mask output; choose another name")
    for path in [p for pair in files for p in pair] + [report]:
        if path.exists() and not path.is_file():
            raise UsageError(f"--out {out}: {path.name} exists and is not a regular file; it is never replaced: "
                             "choose another folder")
    if out.is_dir() and not args.overwrite:
        clashes = sorted({p.name for pair in files for p in pair if p.exists()}
                         | ({report.name} if report.parent.resolve() == out.resolve() and report.exists() else set()))
        earlier = written_by_earlier_run(out)
        if clashes or earlier:
            first = (clashes or earlier)[0]
            count = len(set(clashes) | set(earlier))
            more = f" (and {count - 1} more)" if count > 1 else ""
            what = "which this run would write" if clashes else "from an earlier run"
            raise UsageError(f"--out {out}: already holds {first}{more}, {what}; pass --overwrite to replace that set, "
                             "or choose an empty folder")
    return out, files, report


def write_text_atomic(path: Path, text: str) -> None:
    from ..video_io import atomic_output

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        tmp.write_text(text)



def _finish_outputs(args, out: Path, files: list[tuple[Path, Path]], report_path: Path, reports: list[dict]) -> None:
    """Write the report (atomically); with ``--overwrite`` remove an earlier set's leftovers from ``out``."""
    write_text_atomic(report_path, json.dumps(reports if len(reports) > 1 else reports[0], indent=2))
    written = [Path(r["video"]).name for r in reports if r.get("video")] + [mask.name for _, mask in files]
    if report_path.parent.resolve() == out.resolve():
        written.append(report_path.name)
    if args.overwrite:
        for name in written_by_earlier_run(out):  # only what an earlier run of this tool wrote
            stale = out / name
            if name not in written and stale.is_file() and not stale.is_symlink():
                stale.unlink()
    write_manifest(out, written)

