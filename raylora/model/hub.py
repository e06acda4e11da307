"""A hub id (``model.pretrained: org/name``) read on the driver before Ray starts: the
pipeline's small config files and its file list, through huggingface_hub (its cache,
``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, and the token it sends: ``token``), so a hub model
is checked as a folder is (``raylora.model.load.check_model``): its family, VAE,
scheduler and component folders, and that each loaded one holds weights. A gated repo
without access, a wrong id or revision is named here, not in a worker's traceback after
the cluster started. The workers download the weights themselves, each node into its own
hub cache, at the commit the driver read (``Repo.commit``;
``raylora.launch.Plan.model_commit``), so every worker trains on the same weights even if
the repo is pushed to while the run starts.
"""

from __future__ import annotations

import json
import os
from urllib.parse import unquote


class Unreachable(OSError):
    """The hub could not be asked (no network, ``HF_HUB_OFFLINE``) and the file is not in
    this machine's hub cache: nothing is known about the repo here."""


class Repo:
    """Model repo ``repo`` at ``revision`` (None: main), read through huggingface_hub.

    Its file list is asked for first: one request, which fails at once offline
    (``HF_HUB_OFFLINE``) and after huggingface_hub's retries (~20 s) without a network.
    Then ``files`` and ``sizes`` are None and every read comes from the cache only, so a
    missing network costs one wait, not one per file.

    ``commit``: the commit the first file read came from, and every later one (None
    before the first read): the hub's for ``revision`` or, offline, the one this
    machine's cache has for it."""

    def __init__(self, repo: str, revision: str | None):
        self.repo, self.revision, self.offline = repo, revision, ""
        self.commit: str | None = None
        try:  # (each file's size: what tells a git-lfs pointer, check_model)
            self.sizes: dict[str, int] | None = _call(_tree, repo, revision, repo, revision)
        except Unreachable as exc:
            self.sizes, self.offline = None, str(exc)
        self.files: set[str] | None = None if self.sizes is None else set(self.sizes)

    def read_json(self, filename: str) -> dict:
        """``filename`` (``vae/config.json``), parsed."""
        with open(self._download(filename)) as f:
            return json.load(f)

    def read_bytes(self, filename: str) -> bytes:
        """``filename``'s bytes (a small one: it is downloaded into the hub cache)."""
        with open(self._download(filename), "rb") as f:
            return f.read()

    def _download(self, filename: str) -> str:
        from huggingface_hub import hf_hub_download

        try:
            path = _call(hf_hub_download, self.repo, self.revision, self.repo, filename,
                         revision=self.revision, local_files_only=bool(self.offline))
        except Unreachable:
            raise Unreachable(self.offline or f"model.pretrained: {self.repo}: {filename} could "
                              "not be read from the hub") from None
        if self.commit is None:  # later reads at this commit: one commit's configs, however
            # the branch moves meanwhile
            self.commit = self.revision = snapshot_commit(path)
        return path


def _tree(repo: str, revision: str | None) -> dict[str, int]:
    """Each file of model repo ``repo`` at ``revision`` with its size: the listing
    ``HfApi.list_repo_files`` makes (one request per page), its sizes kept."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    return {f.rfilename: f.size for f in HfApi().list_repo_tree(repo, recursive=True, revision=revision)
            if isinstance(f, RepoFile)}


SCHEME = "hf://"


def fetch(uri: str, key: str) -> str:
    """A local path for ``hf://owner/name[@revision][/path]`` (``key``: the config key it
    came from, for errors), downloaded into the hub cache: a ``.safetensors`` path alone,
    else that folder's (or the repo's) ``.safetensors`` and ``.json`` files, which is what
    a LoRA or peft adapter folder holds (not its sample images)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    repo, revision, path = split_uri(uri, key)
    where = f"{key}: {uri}"
    if path.endswith(".safetensors"):
        return _call(hf_hub_download, repo, revision, repo, path, revision=revision, key=where)
    prefix = f"{path.rstrip('/')}/" if path else ""
    root = _call(snapshot_download, repo, revision, repo, revision=revision, key=where,
                 allow_patterns=[f"{prefix}*.safetensors", f"{prefix}*.json"])
    return os.path.join(root, prefix)


def configs(repo: str, revision: str | None) -> str:
    """A local folder (the hub cache's snapshot) of ``repo``'s configs at ``revision``:
    ``model_index.json`` and each component's ``config.json``, scheduler and tokenizer
    configs, no weights; what the memory estimate reads as it reads a model folder."""
    from huggingface_hub import snapshot_download

    return _call(snapshot_download, repo, revision, repo, revision=revision,
                 allow_patterns=["model_index.json", "*/config.json", "*/scheduler_config.json",
                                 "*/tokenizer_config.json"])


def pinned(uri: str, local: str, key: str) -> str:
    """``uri`` (``hf://owner/name[@revision][/path]``) at the commit ``fetch`` read it
    from (``local``, its answer: a path in the hub cache's ``snapshots/{commit}``), so a
    process that fetches it later reads the same files however the branch moves."""
    repo, _, path = split_uri(uri, key)
    commit = snapshot_commit(local)
    if commit is None:  # not in a hub cache: left as written
        return uri
    return f"{SCHEME}{repo}@{commit}" + (f"/{path}" if path else "")


def snapshot_commit(local: str) -> str | None:
    """The commit of a path huggingface_hub's cache gave
    (``.../models--{owner}--{name}/snapshots/{commit}/...``); None for any other path."""
    parts = os.path.normpath(local).split(os.sep)
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return parts[i + 2]
    return None


def split_uri(uri: str, key: str) -> tuple[str, str | None, str]:
    """(owner/name, revision or None, path in the repo) of an ``hf://`` URI."""
    owner, _, rest = uri[len(SCHEME):].strip("/").partition("/")
    name, _, path = rest.partition("/")
    name, _, revision = name.partition("@")
    if not owner or not name:
        raise ValueError(f"{key}: {uri}: not hf://owner/name[@revision][/path]")
    # A branch with a slash is written %2F, as huggingface_hub writes it and a dataset's
    # hf:// takes it (raylora.hubfs.split): a PR's refs/pr/1 is @refs%2Fpr%2F1.
    return f"{owner}/{name}", unquote(revision) or None, path


def token() -> str | None:
    """The token this machine's huggingface_hub sends (``get_token``: ``HF_TOKEN``, else
    the older ``HUGGING_FACE_HUB_TOKEN`` it still reads, else the one ``hf auth login``
    stored). What the driver checked the repo with, so what its workers on other nodes must
    send too (``raylora.storage.forwarded_env``, as ``HF_TOKEN``): reading fewer of them
    than huggingface_hub does let the driver's plan pass and every other node's load fail."""
    from huggingface_hub import get_token

    return get_token()


def _call(fn, repo_id: str, rev: str | None, *args, key: str = "", kind: str = "model", **kwargs):
    """``fn(*args, **kwargs)`` with the hub's answers turned into errors that name the
    config key (``key``, default ``model.pretrained: {repo_id}``): PermissionError (gated),
    FileNotFoundError (no such repo or file), ValueError (no such revision), ``Unreachable``.
    ``kind``: the kind of repo (model, dataset), as the errors call it."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HTTPError,  # httpx's, which huggingface_hub uses: its connection errors too
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    key = key or f"model.pretrained: {repo_id}"
    try:
        return fn(*args, **kwargs)
    except GatedRepoError:  # before RepositoryNotFoundError, its base class
        how = ("the token sent has no access" if token() else "no Hugging Face token is set")
        raise PermissionError(
            f"{key} is a gated repo and {how}: accept its terms on the hub, then set HF_TOKEN "
            "(or run `hf auth login`) to a token with access") from None
    except RepositoryNotFoundError:
        nor = ", nor a folder here" if key.startswith("model.pretrained") else ""
        raise FileNotFoundError(f"{key}: no such {kind} repo on the hub (or a private one "
                                f"this machine's token may not read: set HF_TOKEN){nor}") from None
    except RevisionNotFoundError:
        raise ValueError(f"{'model.revision' if key.startswith('model.') else key}: {rev}: "
                         f"no such revision of {repo_id}") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        # The hub was not asked (offline) or not reached, and the cache lacks the file.
        raise Unreachable(f"{key}: the hub could not be read here and this machine's hub "
                          f"cache lacks it ({_first_line(exc)})") from None
    except EntryNotFoundError:
        raise FileNotFoundError(f"{key}: the repo has no {args[-1] if args else 'such file'}"
                                ) from None
    except HfHubHTTPError as exc:  # 5xx, rate limits: the hub is there but did not answer
        raise Unreachable(f"{key}: the hub answered {_first_line(exc)}") from None
    except (HTTPError, OSError) as exc:  # connection refused, DNS, timeouts
        raise Unreachable(f"{key}: the hub could not be reached ({_first_line(exc)})") from None


def _first_line(exc: Exception) -> str:
    """An error's first line, a URL's password left out: httpx's errors quote the request
    URL, an HF_ENDPOINT mirror's user:pass@ with it."""
    from raylora.storage import masked

    text = str(exc).strip()
    return masked(text.splitlines()[0] if text else type(exc).__name__)[:300]
