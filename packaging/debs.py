#!/usr/bin/python3
"""Builds the Debian packages from a clean copy of the tree (`make debs` runs this).

    packaging/debs.py build [--out DIR] [--version-suffix SUFFIX] [--source REVISION|worktree]
    packaging/debs.py lintian [--out DIR]
    packaging/debs.py version [--version-suffix SUFFIX]

build: copies the tree as committed in HEAD (default) or another git revision (`git archive`), or
with --source worktree every file of the working tree that git does not ignore (tracked or not, as
they are now), into a temporary directory, adds packaging/debian as debian/ with a changelog whose version comes from
dsv41/version.py (the copy's VERSION is set to it, suffix included), runs `dpkg-buildpackage -A` in a
fixed environment (system PATH, C.UTF-8, UTC, SOURCE_DATE_EPOCH of the commit, umask 022) and leaves
the .deb, .buildinfo and .changes files in DIR (default packaging/out). The same files and commit give byte-identical .deb files.

lintian: runs lintian on the .changes file in DIR; exits 1 when lintian reports an error.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import email.utils
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "packaging" / "out"
SOURCE_NAME = "dsv41"
DISTRIBUTION = "unstable"
# Debian's tools only: a pyenv or venv python3 ahead of these breaks dh_python3 and pybuild.
BUILD_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
# Directories whose untracked files would be silently left out of a build: worth a warning.
PACKAGED_DIRS = ("agent", "coordinator", "dsv41", "adapter", "sim", "units", "packaging")
_SUFFIX = re.compile(r"[A-Za-z0-9.+~]*")
_UPSTREAM = re.compile(r"[0-9][A-Za-z0-9.+~]*")
BUILD_OUTPUTS = ("*.deb", "*.buildinfo", "*.changes")


class BuildError(RuntimeError):
    """The packages could not be built; the message says why."""


@dataclass(frozen=True)
class SourceState:
    commit: str          # full hash of the revision built (of HEAD for the working tree)
    epoch: int           # its committer time: SOURCE_DATE_EPOCH
    modified: tuple[str, ...]   # tracked files that differ from HEAD
    untracked: tuple[str, ...]  # untracked, not ignored files under PACKAGED_DIRS


# ----- pure decisions -----

def read_version(version_py: str) -> str:
    """VERSION = "x.y.z" from the text of dsv41/version.py, without importing it."""
    for node in ast.parse(version_py).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "VERSION"
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return node.value.value
    raise BuildError("dsv41/version.py: no VERSION = \"...\" assignment")


def stamp_version(version_py: str, version: str) -> str:
    """dsv41/version.py's text with VERSION set to the package's version (the suffix included), so
    that every installed copy names the package it came from: the agent compares the adapter a rank
    loaded with the one installed by reading it (dsv41/adapterversion.py)."""
    stamped, count = re.subn(r'^VERSION = "[^"\n]*"$', f'VERSION = "{version}"', version_py, count=1,
                             flags=re.MULTILINE)
    if not count:
        raise BuildError('dsv41/version.py: no line VERSION = "..." to set the package version on')
    return stamped


def debian_version(version: str, suffix: str = "") -> str:
    """The native package's version: the project version, plus an optional suffix that makes a
    rebuild of the same version sort higher (+1, +2, ...) or lower (~rc1) for dpkg."""
    if not _UPSTREAM.fullmatch(version):
        raise BuildError(f"version {version!r}: must start with a digit and hold only letters, digits and . + ~")
    if not _SUFFIX.fullmatch(suffix):
        raise BuildError(f"version suffix {suffix!r}: only letters, digits and . + ~ are allowed (e.g. +1)")
    if suffix and suffix[0] not in "+~.":
        raise BuildError(f"version suffix {suffix!r}: must start with + (sorts higher), ~ (lower) or .")
    return version + suffix


def changelog(version: str, maintainer: str, epoch: int, commit: str, modified: bool) -> str:
    """debian/changelog with one entry; dated SOURCE_DATE_EPOCH so that rebuilds are identical."""
    when = email.utils.format_datetime(datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc))
    what = f"Build of commit {commit[:12]}" + (" with uncommitted changes" if modified else "")
    return (f"{SOURCE_NAME} ({version}) {DISTRIBUTION}; urgency=medium\n\n"
            f"  * {what}.\n\n"
            f" -- {maintainer}  {when}\n")


def maintainer(control: str) -> str:
    match = re.search(r"^Maintainer:\s*(.+)$", control, re.MULTILINE)
    if not match:
        raise BuildError("debian/control: no Maintainer field")
    return match.group(1).strip()


def build_environment(epoch: int, home: str) -> dict[str, str]:
    """A fixed environment: nothing from the caller's shell (PATH, locale, time zone, umask-free)."""
    return {
        "PATH": BUILD_PATH,
        "HOME": home,
        "LC_ALL": "C.UTF-8",
        "LANG": "C.UTF-8",
        "TZ": "UTC",
        "SOURCE_DATE_EPOCH": str(epoch),
        "DEB_BUILD_OPTIONS": "nocheck",
    }


def lintian_counts(output: str) -> dict[str, int]:
    """Tags per severity letter in lintian's output (E:, W:, I:, P:, X:, O:, N: lines)."""
    counts: dict[str, int] = {}
    for line in output.splitlines():
        if len(line) > 2 and line[1] == ":" and line[0] in "EWIPXON":
            counts[line[0]] = counts.get(line[0], 0) + 1
    return counts


# ----- effects -----

def _git(repo: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                              text=True, env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise BuildError(f"git {' '.join(args)} failed in {repo}: {detail.strip()}") from None


def source_state(repo: Path, revision: str = "HEAD") -> SourceState:
    commit = _git(repo, "rev-parse", "--verify", f"{revision}^{{commit}}").strip()
    epoch = int(_git(repo, "log", "-1", "--format=%ct", commit).strip())
    modified = tuple(sorted(filter(None, _git(repo, "diff", "--name-only", "-z", "HEAD").split("\0"))))
    untracked = tuple(sorted(filter(None, _git(repo, "ls-files", "--others", "--exclude-standard", "-z", "--",
                                                 *PACKAGED_DIRS).split("\0"))))
    return SourceState(commit, epoch, modified, untracked)


def export_worktree(repo: Path, dest: Path) -> None:
    """Every file git does not ignore, as it is in the working tree, with mode 0755 or 0644 only
    (so that the copy does not depend on umask or on who checked it out). Files deleted but not
    yet committed as deleted are left out."""
    paths = _git(repo, "ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0")
    for path in sorted(set(filter(None, paths))):
        src, dst = repo / path, dest / path
        if src.is_symlink():
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src), dst)
        elif src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o755 if src.stat().st_mode & 0o111 else 0o644)
        # else: deleted in the working tree, or a submodule directory: not part of the packages


def export_commit(repo: Path, dest: Path, commit: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar", commit],
                               stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True, text=True)
    archive.stdout.close()  # type: ignore[union-attr]
    if archive.wait() != 0 or untar.returncode != 0:
        raise BuildError(f"git archive {commit} | tar -x failed: {untar.stderr.strip()}")


def _listing(paths: Sequence[str], limit: int = 6) -> str:
    return ", ".join(paths[:limit]) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def build(repo: Path, out: Path, suffix: str = "", source: str = "HEAD",
          log: object = sys.stderr) -> list[Path]:
    """source: "worktree", or a git revision (pin a commit hash to build the same tree twice while
    others commit)."""
    state = source_state(repo, "HEAD" if source == "worktree" else source)
    changes = [*state.modified, *state.untracked]
    if changes and source == "worktree":
        print(f"debs: building uncommitted files: {_listing(changes)}", file=log)
    elif changes and source == "HEAD":
        print(f"debs: building HEAD {state.commit[:12]}; not included (uncommitted): {_listing(changes)}", file=log)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dsv41-debs.") as tmp:
        top = Path(tmp)
        src = top / SOURCE_NAME
        if source == "worktree":
            export_worktree(repo, src)
        else:
            export_commit(repo, src, state.commit)
        version_py = src / "dsv41" / "version.py"
        version = debian_version(read_version(version_py.read_text()), suffix)
        version_py.write_text(stamp_version(version_py.read_text(), version))
        if (src / "debian").exists():
            raise BuildError("the tree has a top-level debian/ directory; the packaging lives in packaging/debian")
        shutil.copytree(src / "packaging" / "debian", src / "debian", symlinks=True)
        control = (src / "debian" / "control").read_text()
        modified = bool(changes) and source == "worktree"
        (src / "debian" / "changelog").write_text(
            changelog(version, maintainer(control), state.epoch, state.commit, modified))
        home = top / "home"
        home.mkdir()
        env = build_environment(state.epoch, str(home))
        old_umask = os.umask(0o022)
        try:
            result = subprocess.run(["dpkg-buildpackage", "-A", "-us", "-uc"], cwd=src, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        finally:
            os.umask(old_umask)
        if result.returncode != 0:
            raise BuildError(f"dpkg-buildpackage failed (exit {result.returncode}):\n{result.stdout[-6000:]}")
        for line in result.stdout.splitlines():
            if line.startswith("debian/rules: warning:"):
                print(line, file=log)
        for pattern in BUILD_OUTPUTS:
            for old in out.glob(pattern):
                old.unlink()
        made = []
        for pattern in BUILD_OUTPUTS:
            for path in sorted(top.glob(pattern)):
                target = out / path.name
                shutil.move(str(path), target)
                os.chmod(target, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
                made.append(target)
    debs = [p for p in made if p.suffix == ".deb"]
    if not debs:
        raise BuildError("dpkg-buildpackage succeeded but made no .deb files")
    return debs


def run_lintian(out: Path) -> tuple[int, str]:
    changes = sorted(out.glob("*.changes"))
    if len(changes) != 1:
        raise BuildError(f"{out}: expected one .changes file from `make debs`, found {len(changes)}")
    result = subprocess.run(["lintian", "--display-info", "--pedantic", "--tag-display-limit", "0",
                             str(changes[0])], capture_output=True, text=True,
                            env={"PATH": BUILD_PATH, "LC_ALL": "C.UTF-8", "HOME": os.environ.get("HOME", "/")})
    counts = lintian_counts(result.stdout)
    return (1 if counts.get("E") or result.returncode not in (0, 1, 2) else 0), result.stdout + result.stderr


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="packaging/debs.py", description="Build the dsv41 Debian packages.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build every package into --out")
    b.add_argument("--out", type=Path, default=DEFAULT_OUT)
    b.add_argument("--version-suffix", default="", help="appended to the version, e.g. +1 for an upgrade test")
    b.add_argument("--source", default="HEAD",
                   help="a git revision (default HEAD), or `worktree`: every file of the working tree "
                        "that git does not ignore")
    lint = sub.add_parser("lintian", help="run lintian on what `build` left in --out")
    lint.add_argument("--out", type=Path, default=DEFAULT_OUT)
    v = sub.add_parser("version", help="print the Debian version a build would have")
    v.add_argument("--version-suffix", default="")
    args = parser.parse_args(argv)
    try:
        if args.command == "version":
            print(debian_version(read_version((REPO / "dsv41" / "version.py").read_text()), args.version_suffix))
            return 0
        if args.command == "build":
            for deb in build(REPO, args.out.resolve(), args.version_suffix, args.source):
                print(deb)
            return 0
        code, text = run_lintian(args.out.resolve())
        print(text, end="")
        counts = lintian_counts(text)
        print(f"lintian: {counts.get('E', 0)} error(s), {counts.get('W', 0)} warning(s), "
              f"{counts.get('I', 0)} info, {counts.get('P', 0)} pedantic (see packaging/LINTIAN.md)")
        return code
    except BuildError as e:
        print(f"debs: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
