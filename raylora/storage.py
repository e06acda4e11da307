"""The one place that turns a URI into a filesystem.

``s3://`` (AWS or any S3-compatible store: MinIO, Ceph, moto), ``gs://``, ``file://`` and
plain local paths. Local paths are made absolute because Ray workers do not share the
driver's working directory.

Credentials are never taken from the config and never stored: the AWS SDK inside pyarrow
reads ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN`` from the
environment of whichever process touches storage. Filesystem objects built here carry only
the endpoint and region, so pickling one into a Ray task or checkpoint leaks no secret.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

T = TypeVar("T")

# Read by the AWS SDK in every process; forwarded to Ray workers through runtime_env when
# joining a cluster that was started without them. Never logged or written anywhere.
AWS_ENV_VARS = (
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    # Tracking (tracking.backend=wandb) runs in the rank-0 worker, which needs the key too.
    "WANDB_API_KEY",
    "WANDB_BASE_URL",
    # gs:// against an emulator (GCS_EMULATOR_ENV) and its project. Not
    # GOOGLE_APPLICATION_CREDENTIALS: a key file's path on this machine, which a
    # cluster's nodes lack (they find their own default credentials).
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_CLOUD_PROJECT",
    # A hub id's model (gated: Flux.1 [dev], SD3.5) and its mirror, read by every worker;
    # the token also when ``hf auth login`` stored it or HUGGING_FACE_HUB_TOKEN holds it
    # (forwarded_env).
    "HF_TOKEN",
    "HF_ENDPOINT",
)
SECRET_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "WANDB_API_KEY",
                   "HF_TOKEN")


def is_local(uri: str) -> bool:
    scheme = urlparse(uri).scheme
    # A single letter is a Windows drive, not a scheme.
    return scheme in ("", "file") or len(scheme) == 1


def local_path(uri: str) -> str:
    """Absolute local path of a plain path or ``file:`` URI: ``file:///a/b%20c``
    (``Path.as_uri()``'s, percent-decoded), ``file:/a/b`` (Hadoop's and Spark's),
    ``file://localhost/a/b``; a ``file://`` URI naming another host is refused, as is a
    relative one (``file://a/b``: host ``a``)."""
    if uri.startswith("file:"):
        from urllib.parse import unquote

        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{uri}: a file:// URI names a path on this machine "
                             f"(file:///abs/path), not on host {parsed.netloc!r}")
        uri = unquote(parsed.path)
    return os.path.abspath(os.path.expanduser(uri))


def normalize(uri: str) -> str:
    """Local URIs become absolute paths; remote URIs are returned without a trailing /."""
    return local_path(uri) if is_local(uri) else uri.rstrip("/")


def join(uri: str, *parts: str) -> str:
    base = normalize(uri).rstrip("/")
    return "/".join([base, *[p.strip("/") for p in parts if p]])


# Attempts the AWS SDK makes at one request (the first and its retries).
S3_ATTEMPTS = 6
# Storage.download_dir: bytes per ranged read, and reads in flight (their buffers: 512 MiB).
DOWNLOAD_PART = 32 * 2**20
DOWNLOAD_THREADS = 16


class RetryingS3(pafs.S3FileSystem):
    """pyarrow's S3 filesystem whose transient errors (throttling, 5xx, resets) the SDK
    retries with backoff, S3_ATTEMPTS attempts in all, in every process it reaches.

    Why a subclass: ``S3FileSystem.__reduce__`` (pyarrow 26.0.1) leaves the retry strategy
    out, so each copy Ray pickled to another process (Ray Train's controller, which writes
    the run's checkpoint record, and workers, which upload checkpoints; Ray Data's read
    tasks) came back with arrow's default of 3 attempts. This one pickles the arguments it
    was made from (region, endpoint, timeouts: no credentials, which come from each
    process's environment) and is rebuilt whole."""

    def __init__(self, **kwargs):
        super().__init__(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=S3_ATTEMPTS),
                         **kwargs)
        self.kwargs = kwargs

    def __reduce__(self):
        return _retrying_s3, (self.kwargs,)


def _retrying_s3(kwargs: dict) -> RetryingS3:
    return RetryingS3(**kwargs)


# A failed read worth another try: the patterns Ray Data retries its own reads on
# (DataContext.retried_io_errors), and a plain 503.
TRANSIENT_READ_ERRORS = ("AWS Error INTERNAL_FAILURE", "AWS Error NETWORK_CONNECTION",
                         "AWS Error SLOW_DOWN", "AWS Error SERVICE_UNAVAILABLE", "(HTTP status 503)")


def retried_read(read: Callable[[], T]) -> T:
    """``read()``, tried again with backoff (S3_ATTEMPTS in all) when it fails as a
    throttled or dropped request does; a missing key or a refusal fails at once.

    Why the SDK's own retries are not enough: a 503 SlowDown to a GET of fewer bytes than
    the error's XML (a caption file, a small JSON, a download's last part) overflows the
    range's buffer, and the SDK fails it as ``INTERNAL_FAILURE ... Failed to flush response
    stream`` without retrying it: one throttled caption failed its read task."""
    for attempt in range(S3_ATTEMPTS):
        try:
            return read()
        except OSError as exc:
            if (attempt == S3_ATTEMPTS - 1 or isinstance(exc, FileNotFoundError)
                    or not any(p in str(exc) for p in TRANSIENT_READ_ERRORS)):
                raise
            time.sleep(0.05 * 2**attempt)


def endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with an S3 endpoint URL (``storage.endpoint_url``, checked with the
    config, or ``AWS_ENDPOINT_URL``), its password left out; None when nothing is."""
    if not re.match(r"https?://[^/]", endpoint):
        # "minio:9000" parses as the scheme "minio": S3 then failed with "Invalid S3
        # connection scheme", naming neither the key nor the value
        return f"{endpoint!r} is not an http:// or https:// URL (e.g. http://{endpoint})"
    if "@" in urlparse(endpoint).netloc:
        # pyarrow takes "user:pass@host" for the host name ("Could not resolve"), and the
        # config, printed and recorded, is no place for a password
        return (f"{masked(endpoint)}: a user or password in the URL is not read; give the "
                "keys as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    return None


def _s3(endpoint_url: str | None, region: str | None) -> pafs.S3FileSystem:
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
    kwargs: dict = {
        "region": region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        "connect_timeout": 10,
        "request_timeout": 60,
    }
    if endpoint:
        if problem := endpoint_problem(endpoint):
            raise ValueError(f"{'storage.endpoint_url' if endpoint_url else 'AWS_ENDPOINT_URL'}: {problem}")
        parsed = urlparse(endpoint)
        kwargs["endpoint_override"] = parsed.netloc or parsed.path
        kwargs["scheme"] = parsed.scheme or "https"
    return RetryingS3(**kwargs)


# Google's storage clients (and gcsfs) read this for an emulator ("host:port" or a URL:
# fake-gcs-server, gcp-storage-emulator). Set, gs:// goes there without credentials;
# GOOGLE_CLOUD_PROJECT names the project its buckets belong to.
GCS_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"


# Seconds GCS's client retries one request's transient errors (throttling, 5xx, no
# connection) before it fails. Its own default is 15 minutes: an unreachable endpoint or
# a machine without Google credentials hung the check before Ray starts that long
# (measured: still waiting after 300 s); with this limit it fails after about twice this.
GCS_RETRY_S = 20


def _gcs() -> pafs.GcsFileSystem:
    from datetime import timedelta

    kwargs: dict = {"retry_time_limit": timedelta(seconds=GCS_RETRY_S)}
    emulator = os.environ.get(GCS_EMULATOR_ENV)
    if emulator:  # else Google's default credentials, wherever this runs
        parsed = urlparse(emulator if "://" in emulator else f"http://{emulator}")
        kwargs |= {"anonymous": True, "scheme": parsed.scheme, "endpoint_override": parsed.netloc,
                   "project_id": os.environ.get("GOOGLE_CLOUD_PROJECT")}
    return pafs.GcsFileSystem(**kwargs)


def skipped(name: str) -> bool:
    """Files a listing leaves out: hidden ones, and the markers and metadata files that
    jobs leave beside their output with a leading "_" and no extension or ``.json`` /
    ``.crc`` (Spark's ``_SUCCESS`` and ``_metadata``, img2dataset's ``_stats.json``,
    ``raylora demo-data``'s ``_manifest.json``). Not every name with "_": cameras name
    photos _MG_1234.JPG and _DSC1234.JPG, captioned by _MG_1234.txt (Hugging Face's
    imagefolder, and kohya, read those)."""
    if name.startswith((".", "__")):
        return True
    return name.startswith("_") and os.path.splitext(name)[1].lower() in ("", ".json", ".crc")


def hidden_folder(root: str, uri: str) -> bool:
    """Whether ``uri`` lies in a hidden folder below ``root``: one whose name starts with
    "." or "__" (.ipynb_checkpoints, .thumbnails, .git, __MACOSX, __pycache__), whose files
    Hugging Face datasets leaves out too (a notebook's checkpoint copy of an image trained
    twice). ``root`` and the folders above it are not judged: data may live in ~/.cache."""
    folders = uri.split("/")[len(root.rstrip("/").split("/")):-1]
    return any(f.startswith((".", "__")) for f in folders)


def skipped_below(root: str, uri: str) -> bool:
    """What a listing of ``root`` leaves out: ``skipped`` file names, and every file in a
    ``hidden_folder``."""
    return skipped(uri.rsplit("/", 1)[-1]) or hidden_folder(root, uri)


def fs_path(uri: str) -> str:
    """The path of ``uri`` inside its filesystem: ``bucket/key`` for remote URIs."""
    if is_local(uri):
        return local_path(uri)
    # Not urlparse: it ends the path at '#' or '?', which S3 and GCS keys may hold (a
    # camera's "photo #2.png"): s3://runs/exp#2/adapter became runs/exp, and publishing an
    # adapter there replaced that whole folder.
    return uri.split("://", 1)[1].rstrip("/")


def check_scheme(uri: str) -> None:
    """Raise ValueError naming ``uri`` when no filesystem here reads its scheme (without
    reaching the storage)."""
    scheme = "" if is_local(uri) else urlparse(uri).scheme
    if scheme not in ("", "s3", "s3a", "gs", "gcs", "hf"):
        raise ValueError(f"{uri}: unsupported URI scheme {scheme!r} (use s3://, gs://, "
                         "hf://datasets/ or a path)")


def filesystem(
    uri: str, endpoint_url: str | None = None, region: str | None = None
) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a URI. ``path`` has no scheme (``bucket/key``)."""
    check_scheme(uri)
    if is_local(uri):
        return pafs.LocalFileSystem(), local_path(uri)
    scheme = urlparse(uri).scheme
    if scheme in ("s3", "s3a"):
        return _s3(endpoint_url, region), fs_path(uri)
    if scheme == "hf":  # Hugging Face dataset repos, read only
        from raylora import hubfs

        return hubfs.filesystem(), fs_path(uri)
    return _gcs(), fs_path(uri)


def to_uri(uri_like: str, path: str) -> str:
    """Re-attach the scheme of ``uri_like`` to a filesystem-internal ``path``."""
    if is_local(uri_like):
        return path
    return f"{urlparse(uri_like).scheme}://{path}"


def glob_root(uri: str, there) -> tuple[str, str]:
    """(the folder a glob lists, the pattern below it). The folder is the path before
    the first segment with a wildcard; a segment whose only wildcard is a ``[...]`` is
    a folder name where that folder is there (``there(path)``: "photos [2023]/*.png"
    lists that folder, as README's object-storage section reads "photos [2023]" itself;
    its brackets as a class matched nothing, or "photos 2/"), asked only for such
    segments."""
    segments = uri.split("/")
    n = 0
    for k, seg in enumerate(segments[:-1]):
        if "*" in seg or "?" in seg or ("[" in seg and not there("/".join(segments[:k + 1]))):
            break
        n = k + 1
    return "/".join(segments[:n]), "/".join(segments[n:])


class Storage:
    """Filesystem operations on URIs, with the endpoint/region of one job's config."""

    def __init__(self, endpoint_url: str | None = None, region: str | None = None):
        self.endpoint_url = endpoint_url
        self.region = region
        # One filesystem per scheme: reads of single images (imagefolder, shard builder)
        # would otherwise build a new S3 client per object.
        self._fs: dict[str, pafs.FileSystem] = {}

    def fs(self, uri: str) -> tuple[pafs.FileSystem, str]:
        scheme = "" if is_local(uri) else urlparse(uri).scheme
        if scheme not in self._fs:
            self._fs[scheme] = filesystem(uri, self.endpoint_url, self.region)[0]
        return self._fs[scheme], fs_path(uri)

    def info(self, uri: str) -> pafs.FileInfo:
        fs, path = self.fs(uri)
        try:
            return fs.get_file_info(path)
        except (FileNotFoundError, PermissionError):  # the store answered (hub: no such repo)
            raise
        except OSError as exc:
            raise OSError(f"{uri}: cannot reach storage: {_short(exc)}") from None

    def exists(self, uri: str) -> bool:
        return self.info(uri).type != pafs.FileType.NotFound

    def list_files(self, uri: str) -> list[str]:
        """Every file under ``uri`` (recursive), as URIs, sorted."""
        fs, path = self.fs(uri)
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
        except OSError as exc:
            raise OSError(f"{uri}: cannot list: {_short(exc)}") from None
        return sorted(to_uri(uri, i.path) for i in infos if i.type == pafs.FileType.File)

    def data_files(self, uri: str) -> list[str]:
        """The files under folder ``uri`` that data is read from: ``list_files`` less what
        ``skipped_below`` leaves out (training's listing, and ``raylora shards build``'s)."""
        return [f for f in self.list_files(uri) if not skipped_below(uri, f)]

    def expand(self, uris: str | list[str], suffixes: tuple[str, ...] | None = None) -> list[str]:
        """Files behind a file, directory, glob or list of those (hidden files, files in
        hidden folders below the directory or the glob's fixed part, and job markers
        skipped: ``skipped_below``), filtered by suffix. Brace notation as WebDataset
        writes shard lists (``shard-{00000..00099}.tar``, ``{train,extra}/``) stands for
        each URI it spells.
        Raises FileNotFoundError naming the URI that matched nothing."""
        out: list[str] = []
        for uri in [uris] if isinstance(uris, str) else uris:
            uri = normalize(uri)
            spelled = braces(uri)
            if len(spelled) > 1:
                found = self._spelled(uri, spelled)
            elif _is_glob(uri) and not ("[" in uri and self._there(uri)):
                # (a "[" in a name that is there, "photos [2023]", is that name: the glob
                # class it would spell matched nothing, and said so)
                root, rest = self._glob_root(uri)
                pattern = re.compile(re.escape(_unpinned(root) + "/") + _glob_regex(rest).pattern)
                # a pattern that names a hidden folder itself (root/*/.thumbs/*.png) asks for it
                hidden_ok = hidden_folder(root, uri)
                found = [f for f in self.list_files(root) if pattern.fullmatch(_unpinned(f))
                         and (hidden_ok or not hidden_folder(root, f))]
            else:
                info = self.info(uri)
                if info.type == pafs.FileType.NotFound:
                    raise FileNotFoundError(f"{uri}: no such file or directory")
                if info.type != pafs.FileType.File:
                    found = self.data_files(uri)
                elif uri.startswith("hf://"):  # named at the commit read (hubfs): what workers read
                    found = [to_uri(uri, info.path)]
                else:
                    found = [uri]
                if uri.startswith("hf://") and info.type == pafs.FileType.Directory:
                    from raylora import hubfs

                    if not hubfs.split(uri[len("hf://"):])[2]:  # the repo itself
                        found = hubfs.train_split(uri, found)
            found = [f for f in found if not skipped(os.path.basename(f))
                     and (suffixes is None or f.lower().endswith(suffixes))]
            if not found:
                what = "/".join(suffixes) if suffixes else "data"
                raise FileNotFoundError(f"{uri}: matched no {what} files")
            out.extend(found)
        return sorted(dict.fromkeys(out))

    def _glob_root(self, uri: str) -> tuple[str, str]:
        return glob_root(uri, self._there)

    def _there(self, uri: str) -> bool:
        """``exists``, False where the URI cannot be asked about (a glob's odd characters)."""
        try:
            return self.exists(uri)
        except (OSError, ValueError):
            return False

    def _spelled(self, pattern: str, uris: list[str]) -> list[str]:
        """The files behind the URIs a brace pattern spells: globs as globs, the others
        found in one listing of each folder they are in (not a request each: a thousand
        shards were a thousand HEADs one after another), folders listed. Raises
        FileNotFoundError naming the pattern and the spelled URIs that are not there."""
        found = [f for u in uris if _is_glob(u) for f in self.expand(u)]
        plain = [u for u in uris if not _is_glob(u)]
        listed = {_unpinned(u): i for u, i in self.beside(plain).items()}
        missing = [u for u in plain if _unpinned(u) not in listed]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise FileNotFoundError(f"{pattern}: no such file or directory: "
                                    f"{', '.join(missing[:3])}{more}")
        for u in plain:
            info = listed[_unpinned(u)]
            # the listed name: a hub file's names the commit listed, which workers read
            found += [to_uri(u, info.path)] if info.type == pafs.FileType.File else self.data_files(u)
        return found

    def beside(self, uris: list[str]) -> dict[str, pafs.FileInfo]:
        """URI → FileInfo of what the folders of ``uris`` hold (files and folders, not
        below them): one listing per folder, not one request per URI."""
        out: dict[str, pafs.FileInfo] = {}
        for folder in dict.fromkeys(u.rsplit("/", 1)[0] for u in uris):
            fs, path = self.fs(folder)
            try:
                infos = fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
            except OSError as exc:
                raise OSError(f"{folder}: cannot list: {_short(exc)}") from None
            out.update((to_uri(folder, i.path), i) for i in infos)
        return out

    def read_bytes(self, uri: str) -> bytes:
        fs, path = self.fs(uri)

        def read() -> bytes:
            with fs.open_input_stream(path) as f:
                return f.read()

        return read() if is_local(uri) else retried_read(read)

    def write_bytes(self, uri: str, data: bytes) -> None:
        """``data`` at ``uri``, all or nothing: readers see the old file or the new one,
        never a part (an object store's single PUT already is; a local file is replaced)."""
        if is_local(uri):
            _replace_file(local_path(uri), data)
            return
        fs, path = self.fs(uri)
        with fs.open_output_stream(path) as f:
            f.write(data)

    def write_problem(self, uri: str) -> str | None:
        """Why nothing can be written under ``uri`` (one line), or None. Checked before a
        run starts Ray: otherwise a wrong bucket, endpoint or key surfaces from Ray Train's
        own storage setup or the first checkpoint, as a stack trace, minutes in.

        Local: the nearest folder that exists must be a folder this process can write
        to, tested by making a file there and removing it: permission bits
        (``os.access``) pass root wherever they stand, also where the write itself fails
        (an NFS export that squashes root, a pseudo filesystem such as /proc), and Ray
        Train's controller then died on it with a stack trace. No folder is created (a
        run refused later must leave no output folder behind).
        Object storage: one empty object is written under ``uri`` and deleted, since only a
        write tests the bucket, the credentials and the endpoint together. Its name is
        unique, so nothing already there is touched; pyarrow's delete leaves the zero-byte
        folder marker (``key/``) that Ray Train's own storage setup writes anyway."""
        if is_local(uri):
            existing = local_path(uri)
            while not os.path.lexists(existing):
                existing = os.path.dirname(existing)
            if not os.path.isdir(existing):
                return f"{uri}: {existing} is a file, not a folder"
            probe = os.path.join(existing, _unique(".raylora-write-check-"))
            try:
                os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except PermissionError:
                return f"{uri}: no permission to write in {existing}"
            except OSError as exc:
                return f"{uri}: cannot write in {existing}: {exc.strerror or exc}"
            os.unlink(probe)
            return None
        try:
            check_scheme(uri)
        except ValueError as exc:
            return str(exc)
        parsed = urlparse(uri)
        if not parsed.netloc:
            return f"{uri}: no bucket (scheme://bucket/prefix)"
        if "//" in parsed.path:  # pyarrow's "Empty path component" (ArrowInvalid), no key named
            return f"{uri}: an empty path segment (//); write the prefix with single slashes"
        try:
            fs, path = self.fs(uri)
            probe = f"{path.rstrip('/')}/{_unique('.raylora-write-check-')}"
            with fs.open_output_stream(probe):
                pass
        except (OSError, ValueError) as exc:
            return f"{uri}: cannot write there: {_short(exc)}"
        try:
            fs.delete_file(probe)
        except OSError as exc:  # runs delete old checkpoints and unrecorded folders
            return f"{uri}: can write but not delete there (left {to_uri(uri, probe)}): {_short(exc)}"
        return None

    def open_input(self, uri: str):
        """A seekable file object (tar and parquet readers need random access)."""
        fs, path = self.fs(uri)
        return fs.open_input_file(path)

    def upload_dir(self, local_dir: str, uri: str, growing: bool = False) -> None:
        """Copy a local directory's files under ``uri``, each one checked to have arrived
        (``complete_upload``). ``growing``: files may still be appended to while this runs
        (a tracker's logs), so only their presence is checked, not their size."""
        fs, path = self.fs(uri)
        pafs.copy_files(local_dir, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs,
                        use_threads=not _S3_COPY_DEADLOCKS or not isinstance(fs, pafs.S3FileSystem))
        complete_upload(local_dir, fs, path, what=uri, sizes=not growing)

    def download_dir(self, uri: str, local_dir: str,
                     keep: Callable[[str], bool] | None = None) -> None:
        """Copy every file under ``uri`` into ``local_dir`` (created), in parts of
        ``DOWNLOAD_PART`` bytes read concurrently (``DOWNLOAD_THREADS``). ``keep``: which
        files, by name relative to ``uri`` (default: all).

        Why not ``pyarrow.fs.copy_files``: it reads each file as one stream of 1 MiB
        ranged GETs, one after another, so a 10 GB weights shard costs 10,000 requests in a
        row, each waiting for its first byte. Here it is ~300 GETs of 32 MiB, 16 in flight
        (bench/download.py)."""
        fs, path = self.fs(uri)
        found = {n: i for n, i in listed_files(fs, path).items() if keep is None or keep(n)}
        if not found:
            raise FileNotFoundError(f"{uri}: no files there")
        os.makedirs(local_dir, exist_ok=True)
        parts, files = [], {}
        for name, info in found.items():
            dest = os.path.join(local_dir, name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.truncate(info.size)
            files[name] = dest
            parts += [(name, offset) for offset in range(0, info.size, DOWNLOAD_PART)]
        # One handle per file, shared by its parts: each ReadAt is its own ranged GET.
        with contextlib.ExitStack() as stack:
            handles = {name: stack.enter_context(fs.open_input_file(found[name].path))
                       for name in {n for n, _ in parts}}

            def fetch(part: tuple[str, int]) -> None:
                name, offset = part
                want = min(DOWNLOAD_PART, found[name].size - offset)
                # copy_files failed small files of a throttled store so (retried_read).
                data = retried_read(lambda: handles[name].read_at(want, offset))
                if len(data) != want:  # the object shrank since it was listed
                    raise OSError(f"{to_uri(uri, found[name].path)}: {len(data)} bytes at "
                                  f"{offset}, expected {want}: changed while downloading")
                fd = os.open(files[name], os.O_WRONLY)
                try:
                    os.pwrite(fd, data, offset)
                finally:
                    os.close(fd)

            pool = ThreadPoolExecutor(DOWNLOAD_THREADS)
            try:
                for _ in pool.map(fetch, parts):
                    pass
            finally:  # a failed part: the parts not started yet are not fetched for nothing
                pool.shutdown(cancel_futures=True)

    def delete_dir(self, uri: str) -> None:
        fs, path = self.fs(uri)
        if self.exists(uri):
            delete_tree(fs, path)

    def publish_dir(self, src_dir: str, dest_uri: str) -> str:
        """Make a finished local directory visible at ``dest_uri`` without a reader ever
        seeing half of it.

        Local: copied under a temporary sibling name, then swapped in by rename (atomic on
        POSIX). Object stores have no directory rename, so the files are uploaded to a
        staging prefix, the old copy at ``dest_uri`` is removed, the files are copied into
        place with the weights last, and ``manifest.json`` (names, sizes) is written after
        everything else: readers treat the adapter as complete only once the manifest exists.
        What an earlier publish to ``dest_uri`` left when it was killed midway (its
        temporary or staging copy, or the previous copy it had moved aside) is removed
        first: this one supersedes them, and on an object store each is a whole adapter.
        """
        dest_uri = normalize(dest_uri)
        name = os.path.basename(dest_uri)
        if is_local(dest_uri):
            tmp_prefix, old_prefix = f".{name}.tmp-", f".{name}.old-"
            self._remove_leftovers(dest_uri, (tmp_prefix, old_prefix))
            dest = Path(local_path(dest_uri))
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(_unique(tmp_prefix))
            shutil.copytree(src_dir, tmp)
            old = None
            if dest.exists():
                old = dest.with_name(_unique(old_prefix))
                os.replace(dest, old)
            os.replace(tmp, dest)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            return str(dest)
        names = sorted(os.listdir(src_dir))
        manifest = "manifest.json"
        # Weights last among the payload, manifest after all.
        ordered = sorted((n for n in names if n != manifest), key=lambda n: n.endswith(".safetensors"))
        self._remove_leftovers(dest_uri, (f"{name}.staging-",))
        staging = _unique(f"{dest_uri}.staging-")  # the sibling named as just above
        self.upload_dir(src_dir, staging)
        self.delete_dir(dest_uri)
        fs, _ = self.fs(dest_uri)
        for n in ordered + ([manifest] if manifest in names else []):
            fs.copy_file(fs_path(join(staging, n)), fs_path(join(dest_uri, n)))
        self.delete_dir(staging)
        return dest_uri

    def _remove_leftovers(self, dest_uri: str, prefixes: tuple[str, ...]) -> None:
        """Delete the siblings of ``dest_uri`` named ``_unique(prefix)`` for one of
        ``prefixes`` (``publish_dir``'s temporary names). Tidying only: a storage error
        here is a warning, and the publish goes on."""
        fs, path = self.fs(dest_uri)
        leftover = re.compile("(" + "|".join(map(re.escape, prefixes)) + ")" + _UNIQUE_SUFFIX)
        parent = path.rsplit("/", 1)[0]
        try:
            for info in fs.get_file_info(pafs.FileSelector(parent, allow_not_found=True)):
                if leftover.fullmatch(info.base_name):
                    if info.type == pafs.FileType.Directory:
                        delete_tree(fs, info.path)
                    else:
                        fs.delete_file(info.path)
        except OSError as exc:
            logging.getLogger(__name__).warning(
                "%s: could not remove an earlier publish's leftovers beside it: %s",
                dest_uri, _short(exc))


def delete_tree(fs: pafs.FileSystem, path: str) -> None:
    """The folder ``path`` and everything under it. On GCS a "folder" written object by
    object has no marker object (``key/``), and pyarrow's ``delete_dir`` (26.0.1), having
    deleted the contents, deletes that marker too and fails on its 404: the contents
    are gone, so that one is not an error here (nor is a folder that no longer shows,
    having been its contents only)."""
    fs.delete_dir_contents(path, missing_dir_ok=True)
    if fs.get_file_info(path).type == pafs.FileType.Directory:  # a local folder, a marker
        try:
            fs.delete_dir(path)
        except FileNotFoundError:
            pass


def complete_upload(local_dir: str, fs: pafs.FileSystem, dest: str, what: str = "",
                    sizes: bool = True) -> list[str]:
    """Check that every file of ``local_dir`` is at ``dest`` (with its size, unless
    ``sizes`` is False), upload again the ones that are not, and return their relative
    names (usually none).

    Why: ``pyarrow.fs.copy_files`` to S3 (pyarrow 26; Ray Train uploads checkpoints with it)
    returns normally when a file's part upload fails for good (an error the SDK does not
    retry, or a 503 after its S3_ATTEMPTS): the error is logged as "Error ignored when
    destroying file" and the file is simply absent. (Arrow's C++ ``CopyFiles`` closes each
    destination with ``CloseAsync()``, waits on those futures and returns OK without
    reading their status.) A single stream's ``close()`` raises the same error, so a file
    written again here either arrives or raises. One listing of ``dest`` when everything
    arrived (a second after uploading again); other writers' files there (the other ranks
    of one checkpoint) are left alone. Raises OSError naming the files still missing or
    short after the second upload.
    """
    dest = dest.rstrip("/")
    want = local_sizes(local_dir)

    def wrong() -> list[str]:
        have = listed_sizes(fs, dest)
        return sorted(rel for rel, size in want.items()
                      if rel not in have or (sizes and have[rel] != size))

    bad = wrong()
    if not bad:
        return []
    where = what or dest
    logging.getLogger(__name__).warning(
        "%s: %d file(s) missing or short after the upload, uploading them again: %s",
        where, len(bad), ", ".join(bad))
    for rel in bad:
        target = f"{dest}/{rel}"
        if fs.type_name == "local":
            os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(os.path.join(local_dir, rel), "rb") as src, fs.open_output_stream(target) as out:
            shutil.copyfileobj(src, out, 16 << 20)
    still = wrong()
    if still:
        raise OSError(f"{where}: still missing or short after a second upload: {', '.join(still)}")
    return bad


def local_sizes(directory: str) -> dict[str, int]:
    """Every file under the local ``directory``: its path relative to it, '/'-separated
    (as in a bucket), → size in bytes."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, directory).replace(os.sep, "/")] = os.path.getsize(full)
    return out


def listed_files(fs: pafs.FileSystem, path: str) -> dict[str, pafs.FileInfo]:
    """Relative name → ``FileInfo`` of every file under a folder on ``fs``, in one listing
    ({} when it does not exist)."""
    path = path.rstrip("/")
    found = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return {i.path[len(path) + 1:]: i for i in found if i.type == pafs.FileType.File}


def listed_sizes(fs: pafs.FileSystem, path: str) -> dict[str, int]:
    """``local_sizes`` of a folder on ``fs``, in one listing ({} when it does not exist)."""
    return {name: i.size for name, i in listed_files(fs, path).items()}


# What ``_unique`` appends: a name made by it is found again by this pattern.
_UNIQUE_SUFFIX = "[0-9a-f]{8}"


def _unique(prefix: str) -> str:
    """``prefix`` + 8 random hex digits: a temporary name no other writer picks."""
    return prefix + uuid.uuid4().hex[:8]


def _replace_file(path: str, data: bytes) -> None:
    """Write a hidden temporary sibling, then rename it over ``path`` (atomic on POSIX in
    one directory): a write that dies midway otherwise leaves a truncated file that readers
    take as whole (a class image counted as present, a half manifest). The temporary is
    removed when the write fails; a killed process can leave one, hidden (``.`` prefix,
    no data suffix) from ``expand`` and from the folders' own listings."""
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, _unique(f".{name}.tmp-"))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _unpinned(uri: str) -> str:
    """What a URI the user wrote and the URIs a listing returns are compared by: a hub
    repo is listed pinned to a commit (``hubfs``), so a hub URI without its revision."""
    if not uri.startswith("hf://"):
        return uri
    from raylora.hubfs import unpinned

    return unpinned(uri)


def _is_glob(uri: str) -> bool:
    return any(ch in uri for ch in "*?[")


# A brace group's integer range (``0..9``, ``000..099``, ``0..100..10``), as in
# WebDataset's (braceexpand's) shard lists.
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")


def braces(uri: str) -> list[str]:
    """The URIs a brace pattern spells, in order: ``s-{00..02}.tar`` → s-00.tar, s-01.tar,
    s-02.tar (the width of a bound with a leading zero pads every number), ``{a,b}/x`` →
    a/x, b/x, nested groups too. A group that is neither (``{}``, ``{x}``) is kept as
    written."""
    depth, start = 0, -1
    for i, c in enumerate(uri):
        if c == "{":
            depth, start = depth + 1, i if depth == 0 else start
        elif c == "}" and depth:
            depth -= 1
            if depth == 0:
                break
    else:
        return [uri]
    head, inner, tail = uri[:start], uri[start + 1:i], uri[i + 1:]
    r = _RANGE.match(inner)
    if r:
        lo, hi = int(r.group(1)), int(r.group(2))
        step = abs(int(r.group(3) or 1)) or 1
        padded = any(len(g.lstrip("-")) > 1 and g.lstrip("-").startswith("0") for g in r.group(1, 2))
        pad = max(len(r.group(1)), len(r.group(2))) if padded else 0
        seq = range(lo, hi + 1, step) if lo <= hi else range(lo, hi - 1, -step)
        words = [f"{n:0{pad}d}" for n in seq]
    else:
        words, depth, last = [], 0, 0  # split at the group's own commas, not nested ones
        for j, c in enumerate(inner):
            depth += (c == "{") - (c == "}")
            if c == "," and depth == 0:
                words.append(inner[last:j])
                last = j + 1
        if not words:  # no comma: a literal group, whatever is inside it spelled
            return [head + "{" + w + "}" + t for w in braces(inner) for t in braces(tail)]
        words.append(inner[last:])
    return [out for w in words for out in braces(head + w + tail)]


def _glob_regex(pattern: str) -> re.Pattern:
    """Shell-style glob as a regex: ``*`` and ``?`` stay within one path segment, ``**``
    crosses segments (fnmatch's ``*`` would match ``/`` too); a ``**/`` segment is zero or
    more folders, as Python's ``glob(recursive=True)`` and fsspec read it (``d/**/*.png``
    holds ``d/a.png``: ``.*/`` left out the images directly in ``d``)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i) and (i == 0 or pattern[i - 1] == "/"):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i)
            if j == -1:
                out.append(re.escape(c))
            else:
                out.append("[" + pattern[i + 1 : j].replace("!", "^", 1) + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


# pyarrow before 19 deadlocked copying a folder of 8 or more files to S3 with threads
# (apache/arrow GH-15233): pyproject asks for 19, but a cluster image's own pyarrow is what
# a job there runs with (Ray Train copies to S3 without threads for the same reason).
_S3_COPY_DEADLOCKS = int(pa.__version__.split(".")[0]) < 19


def _short(exc: Exception) -> str:
    """First line of a storage error, which is the cause; the rest is SDK noise. A URL's
    password is left out (``masked``)."""
    return masked(str(exc).strip().splitlines()[0])[:300]


def forwarded_env() -> dict[str, str]:
    """``AWS_ENV_VARS`` set in this process (S3, tracking, GCS-emulator and hub settings,
    despite the name), to forward to Ray workers via runtime_env. ``HF_TOKEN`` is the token
    this machine's huggingface_hub sends, however it was given (``raylora.model.hub.token``:
    ``HF_TOKEN``, ``HUGGING_FACE_HUB_TOKEN``, ``hf auth login``'s file): the one the driver
    checked a gated repo with, which workers on other nodes lack. Sent under the one name
    ``SECRET_ENV_VARS`` keeps out of logged env_vars."""
    from raylora.model.hub import token

    env = {k: os.environ[k] for k in AWS_ENV_VARS if os.environ.get(k)}
    hf = token()
    return {**env, "HF_TOKEN": hf} if hf else env


# A URL's user:password@ part (an HF_ENDPOINT mirror's basic auth).
_USERINFO = re.compile(r"(?<=//)[^/@\s]+@")


def masked(text: str) -> str:
    """``text`` with the password of every URL in it left out: ``https://user:pass@host``
    → ``https://***@host``. Errors and log lines quote URLs (httpx's name the whole
    request URL)."""
    return _USERINFO.sub("***@", text)


def split_secrets(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(settings, credentials) of ``env``: the credentials (``SECRET_ENV_VARS``, and any
    setting that is a URL with a user or password in it, such as an HF_ENDPOINT mirror's)
    must travel where Ray does not log them; the settings may go as plain ``env_vars``."""
    secret = {k: v for k, v in env.items() if k in SECRET_ENV_VARS or masked(v) != v}
    return {k: v for k, v in env.items() if k not in secret}, secret
