"""Hugging Face dataset repos as data: ``hf://datasets/owner/name[@revision][/path]``, the
form ``datasets`` and pandas read (``pd.read_parquet("hf://datasets/...")``), as a
read-only pyarrow filesystem that ``raylora.storage`` hands out for the ``hf`` scheme.

Listing a repo is one request (its file list with sizes, at a revision); reading a file
downloads it once per machine into the hub cache, as ``datasets`` and raylora's hub
models do: every epoch after the first reads the node's copy, not the hub (which limits
requests per address), and the processes of a node share it. The first listing of a
revision that is not a commit (``main``, a tag) resolves it, and the paths it gives name
that commit (``@<40 hex digits>``): the driver plans with them, so every worker reads the
commit the plan counted, whatever is pushed to the repo meanwhile. The token is the one
huggingface_hub sends (``HF_TOKEN``, forwarded to the workers, or ``hf auth login``'s).
"""

from __future__ import annotations

import re
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.fs as pafs

PREFIX = "datasets/"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def split(path: str) -> tuple[str, str | None, str]:
    """(owner/name, revision or None, path in the repo) of ``datasets/owner/name[@rev]/...``
    (a URI without its ``hf://``)."""
    parts = path.strip("/").split("/")
    if len(parts) < 3 or parts[0] != PREFIX.rstrip("/") or not parts[1] or not parts[2]:
        raise ValueError(f"hf://{path.strip('/')}: not hf://datasets/owner/name[@revision][/path] "
                         "(a hub model is model.pretrained: owner/name)")
    name, _, revision = parts[2].partition("@")
    # A branch with a slash is written %2F, as huggingface_hub writes it: the dataset
    # viewer's parquet copy of any dataset is @refs%2Fconvert%2Fparquet.
    return f"{parts[1]}/{name}", unquote(revision) or None, "/".join(parts[3:])


class HubDatasets(pafs.FileSystemHandler):
    """The handler of ``pyarrow.fs.PyFileSystem`` for ``hf://datasets/...`` paths."""

    def __init__(self):
        # (repo, revision) → (commit, {path in repo: size}); a commit's entry never changes.
        self._trees: dict[tuple[str, str | None], tuple[str, dict[str, int]]] = {}

    def __reduce__(self):  # a process that unpickles one asks the hub itself
        return HubDatasets, ()

    def __eq__(self, other):
        return isinstance(other, HubDatasets)

    def __ne__(self, other):
        return not self == other

    def get_type_name(self) -> str:
        return "hf-datasets"

    def normalize_path(self, path: str) -> str:
        return path

    def _tree(self, repo: str, revision: str | None) -> tuple[str, dict[str, int]]:
        from huggingface_hub import HfApi

        from raylora.model.hub import _call

        if (repo, revision) not in self._trees:
            info = _call(HfApi().dataset_info, repo, revision, repo, revision=revision,
                         files_metadata=True, key=f"hf://{PREFIX}{repo}", kind="dataset")
            tree = info.sha, {s.rfilename: s.size or 0 for s in info.siblings or []}
            self._trees[(repo, revision)] = self._trees[(repo, info.sha)] = tree
        return self._trees[(repo, revision)]

    def _resolve(self, path: str) -> tuple[str, str, str, dict[str, int]]:
        repo, revision, inner = split(path)
        commit, files = self._tree(repo, revision)
        return repo, commit, inner, files

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        out = []
        for path in paths:
            repo, commit, inner, files = self._resolve(path)
            # named at the commit, as a listing names its files: a file the user named by
            # its branch (data.uri: one parquet) is planned at, and read by every worker
            # at, the commit this read, not whatever is pushed before a worker starts
            pinned = f"{PREFIX}{repo}@{commit}" + (f"/{inner}" if inner else "")
            if inner in files:
                out.append(pafs.FileInfo(pinned, pafs.FileType.File, size=files[inner]))
            elif not inner or any(f.startswith(inner + "/") for f in files):
                out.append(pafs.FileInfo(pinned, pafs.FileType.Directory))
            else:
                out.append(pafs.FileInfo(path, pafs.FileType.NotFound))
        return out

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        repo, commit, inner, files = self._resolve(selector.base_dir)
        root = f"{PREFIX}{repo}@{commit}"  # the commit, not the branch: what a plan pins
        prefix = f"{inner.strip('/')}/" if inner.strip("/") else ""
        under = sorted(f for f in files if f.startswith(prefix))
        if not under:
            if selector.allow_not_found:
                return []
            raise FileNotFoundError(f"hf://{selector.base_dir}: no such folder in the repo")
        out, dirs = [], set()
        for f in under:
            rest = f[len(prefix):].split("/")
            if not selector.recursive and len(rest) > 1:
                dirs.add(prefix + rest[0])
                continue
            dirs.update(prefix + "/".join(rest[:i]) for i in range(1, len(rest)))
            out.append(pafs.FileInfo(f"{root}/{f}", pafs.FileType.File, size=files[f]))
        out += [pafs.FileInfo(f"{root}/{d}", pafs.FileType.Directory) for d in sorted(dirs)]
        return out

    def open_input_file(self, path: str):
        from huggingface_hub import hf_hub_download

        from raylora.model.hub import _call

        repo, revision, inner = split(path)
        if revision is None or not _COMMIT.match(revision):
            commit, files = self._tree(repo, revision)
            if inner not in files:
                raise FileNotFoundError(f"hf://{path}: no such file in the repo")
        else:  # a planned file: no file list to ask for (a worker asks for nothing else;
            # offline, the hub cache answers)
            commit = revision
        local = _call(hf_hub_download, repo, commit, repo, inner, repo_type="dataset",
                      revision=commit, key=f"hf://{PREFIX}{repo}", kind="dataset")
        return pa.OSFile(local, "r")

    def open_input_stream(self, path: str):
        return self.open_input_file(path)

    def _read_only(self, path: str, *_):
        raise PermissionError(f"hf://{path}: a hub dataset is read here, not written (write "
                              "to a folder or bucket, and push with huggingface_hub)")

    create_dir = delete_dir = delete_dir_contents = delete_file = _read_only
    open_output_stream = open_append_stream = _read_only

    def delete_root_dir_contents(self, *_):
        raise PermissionError("a hub dataset is read here, not written")

    def move(self, src: str, dest: str):
        self._read_only(src)

    def copy_file(self, src: str, dest: str):
        self._read_only(dest)


# The split names Hugging Face's ``datasets`` finds in a repo's file names and folders
# (its data_files keywords), and the separators around them there.
SPLITS = {"train": ("train", "training"), "validation": ("validation", "valid", "val", "dev"),
          "test": ("test", "testing", "eval", "evaluation")}
_SEP = r"[-._ 0-9]"


def split_of(path: str) -> str | None:
    """The split a file in a repo belongs to by its path, as ``datasets`` resolves it
    (``data/train-00000-of-00001.parquet``, ``test/0001.png``, ``valid.csv``); None: none."""
    *folders, name = path.lower().split("/")
    # folders first, then the file's own name, as datasets tries its patterns
    for parts in (folders, [name.rsplit(".", 1)[0]]):
        for split, words in SPLITS.items():
            if any(re.match(rf"^(.*{_SEP})?{w}({_SEP}.*)?$", p) for p in parts for w in words):
                return split
    return None


def train_split(root: str, files: list[str]) -> list[str]:
    """Of the files under a repo's root ``root`` (``hf://datasets/o/n[@rev]``), those a run
    trains on: its ``train`` split when the files name splits, as ``datasets`` loads a repo
    (a push_to_hub repo's test and validation rows were trained on too); all of them when
    none does. Raises ValueError when splits are named but no train split."""
    import logging

    splits = [split_of(split(f[len("hf://"):])[2]) for f in files]
    named = sorted({s for s in splits if s})
    if not named:
        return files
    if "train" not in named:
        raise ValueError(f"{root}: its files name the splits {', '.join(named)} and no train "
                         "split; give the folder or files to train on (a /path after the repo)")
    # and an image folder's metadata file outside the splits, which datasets gives each
    kept = [f for f, s in zip(files, splits)
            if s == "train" or (s is None and f.rsplit("/", 1)[-1] in ("metadata.jsonl", "metadata.csv"))]
    logging.getLogger("raylora.data").info(
        "%s: training on its train split (%d of %d files; %s left out), as datasets loads it",
        root, len(kept), len(files), ", ".join(s for s in named if s != "train"))
    return kept


def unpinned(uri: str) -> str:
    """``uri`` (``hf://datasets/o/n@rev/path``) without its revision: what a glob the user
    wrote matches against the commit-pinned URIs a listing returns."""
    repo, _, inner = split(uri[len("hf://"):])
    return f"hf://{PREFIX}{repo}" + (f"/{inner}" if inner else "")


def planned_commit(uri: str) -> str | None:
    """The commit a planned file URI reads (``hf://datasets/o/n@<commit>/...``); None for
    any other URI."""
    if not uri.startswith("hf://"):
        return None
    _, revision, _ = split(uri[len("hf://"):])
    return revision if revision and _COMMIT.match(revision) else None


def filesystem() -> pafs.FileSystem:
    return pafs.PyFileSystem(HubDatasets())



