"""The one place that turns a URI into a filesystem.

Plain paths and ``file://`` URIs are local; anything else goes through pyarrow's
filesystem registry. Local paths are made absolute because Ray workers do not share the
driver's working directory.
"""

from __future__ import annotations

import glob as _glob
import os
import shutil
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs


def is_local(uri: str) -> bool:
    scheme = urlparse(uri).scheme
    # A single letter is a Windows drive, not a scheme.
    return scheme in ("", "file") or len(scheme) == 1


def local_path(uri: str) -> str:
    """Absolute local path of a plain path or ``file://`` URI."""
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    return os.path.abspath(os.path.expanduser(uri))


def normalize(uri: str) -> str:
    """Local URIs become absolute paths; remote URIs are returned unchanged."""
    return local_path(uri) if is_local(uri) else uri


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a URI."""
    if is_local(uri):
        return pafs.LocalFileSystem(), local_path(uri)
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path


def join(uri: str, *parts: str) -> str:
    base = normalize(uri).rstrip("/")
    return "/".join([base, *[p.strip("/") for p in parts]])


def expand(uris: str | list[str], suffixes: tuple[str, ...]) -> list[str]:
    """Files behind a file, directory, glob or list of those, with one of ``suffixes``.

    Returns sorted absolute paths; raises FileNotFoundError naming the URI that matched
    nothing.
    """
    out: list[str] = []
    for uri in [uris] if isinstance(uris, str) else uris:
        if not is_local(uri):
            raise NotImplementedError(f"{uri}: only local data URIs are supported so far")
        path = local_path(uri)
        if any(ch in path for ch in "*?["):
            found = [p for p in _glob.glob(path, recursive=True) if os.path.isfile(p)]
        elif os.path.isdir(path):
            found = [
                os.path.join(root, f)
                for root, _, files in os.walk(path)
                for f in files
                if not f.startswith((".", "_"))
            ]
        elif os.path.isfile(path):
            found = [path]
        else:
            raise FileNotFoundError(f"{uri}: no such file or directory")
        found = sorted(p for p in found if p.lower().endswith(suffixes))
        if not found:
            raise FileNotFoundError(f"{uri}: matched no {'/'.join(suffixes)} files")
        out.extend(found)
    return out


def publish_dir(src_dir: str, dest_uri: str) -> str:
    """Copy a finished local directory to ``dest_uri`` so that readers never see half of it.

    Local: copy under a temporary sibling name, then swap it in with renames (atomic on
    POSIX for the final rename). Returns the destination path.
    """
    if not is_local(dest_uri):
        raise NotImplementedError(f"{dest_uri}: only local output URIs are supported so far")
    dest = Path(local_path(dest_uri))
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    shutil.copytree(src_dir, tmp)
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return str(dest)
