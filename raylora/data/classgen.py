"""Prior preservation's class images: the user's, plus the missing ones generated.

``data.class_sources`` may hold fewer than ``data.num_class_images`` images; the rest are
drawn from the base model (the family's stock pipeline, bf16 on GPUs, fp32 on CPUs) with
``data.class_prompt``, as diffusers' DreamBooth scripts do, but as a Ray Data
``map_batches`` stage over an actor pool (one pipeline per actor, loaded once, one GPU or
CPU each) so that the cluster's accelerators share the work.

Generated images go to ``{root}/{key}/NNNNN.png`` (``root``: ``generated_place``) with the
prompt beside each in ``NNNNN.txt`` (a caption folder any run can read), ``key`` a hash of
the model, prompt, seed, resolution, steps and guidance (``generation_key``: not the
count). The folder's ``manifest.json`` is written last: a folder with it is complete
and reused as is; one without it (a build that died) is completed, keeping the images it
holds (image i always comes from seed + i, so a completed folder equals one built in one
go). The driver then reads every class row (bytes + prompt) once, judges each as the
workers' class stage will (``bad_class_rows``: a class image that stage drops stops the
run when a batch draws it, so one is refused here, by file, before any is generated) and
ships them to the workers in the plan (``raylora.data.prior``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass

from raylora import storage
from raylora.config import ConfigError, DataSection, RayLoraConfig
from raylora.storage import Storage

log = logging.getLogger("raylora.classgen")

GEN_VERSION = 1
MANIFEST = "manifest.json"


@dataclass
class ClassImages:
    """The run's class rows ``{image: bytes, text}`` and where the generated ones are."""

    rows: list[dict]
    user_rows: int  # of them, from data.class_sources
    uri: str | None = None  # the generated folder (None: nothing had to be generated)
    generated: int = 0  # images this call generated (0: none, or all reused)

    def summary(self) -> dict:
        return {"class_images": len(self.rows), "class_images_given": self.user_rows,
                "class_images_generated": self.generated, "class_images_uri": self.uri}


GENERATED_FOLDER = "raylora-generated"


def generated_root(cfg: RayLoraConfig, store: Storage | None = None) -> str:
    """Where the missing class images are generated (``{root}/{key}/``): see
    ``generated_place``."""
    return generated_place(cfg, store)[1]


def generated_place(cfg: RayLoraConfig, store: Storage | None = None) -> tuple[str, str]:
    """``(key, root)``: the generated root and the key that put it there.
    data.class_generation.uri; else ``{data.class_sources}/raylora-generated`` when
    data.class_sources is one folder this process can write to (where earlier runs put
    them, and still find them); else ``{output.uri}/class_images``. Not inside a single
    file (``dogs.parquet/raylora-generated`` is no path), a glob, a brace list or a
    read-only place (hf://, a mount without write permission): the generation actors
    died there on their first write, after Ray had started and every one had loaded the
    pipeline."""
    d = cfg.data
    if d.class_generation.uri is not None:
        return "data.class_generation.uri", storage.normalize(d.class_generation.uri)
    # Without data.class_prompt nothing is generated (the root is only what reading leaves
    # out): no write probe in the user's class folder
    if isinstance(d.class_sources, str) and (d.class_prompt is None or _writable_folder(
            d.class_sources, store or cfg.storage.client())):
        return ("data.class_sources",
                storage.join(storage.normalize(d.class_sources), GENERATED_FOLDER))
    return "output.uri", storage.join(storage.normalize(cfg.output.uri), "class_images")


def _writable_folder(uri: str, store: Storage) -> bool:
    """Whether ``uri`` is one folder (or nothing yet: a class folder to be filled, as
    diffusers' DreamBooth scripts create their class_data_dir) that can be written to."""
    from pyarrow import fs as pafs

    if any(c in uri for c in "*?[") or len(storage.braces(uri)) > 1 or uri.startswith("hf://"):
        return False  # (hf:// is read only: not asked, which would reach the hub)
    try:
        if store.info(uri).type == pafs.FileType.File:
            return False
    except OSError:  # storage that does not answer: not a place to write (reading it fails
        return False  # with its own message)
    return store.write_problem(uri) is None


def generation_may_write(cfg: RayLoraConfig) -> bool:
    """Whether the run may generate class images (there is a prompt to draw them with):
    then the generated root is one of the places it writes to (launch.write_problems)."""
    return cfg.data.prior_preservation and cfg.data.class_prompt is not None


def holds_generated(root: str, store: Storage) -> bool:
    """Whether ``root`` holds a generated folder complete up to its count (a manifest): a
    root that cannot be written may still serve a run whose images are all there."""
    try:
        return any(f.endswith("/" + MANIFEST) for f in store.list_files(root))
    except OSError:
        return False


def in_generated_folder(source_uri: str | list[str], uri: str) -> bool:
    """Whether file ``uri`` of a class source lies in a ``raylora-generated`` folder
    below the source's root (any depth): images an earlier run generated there, not the
    user's, whatever this run's generated root is (data.class_generation.uri set later,
    the same folder given as a list entry, a folder now read only). A source that is
    itself such a folder (given on purpose) is read whole: only folders below count."""
    from raylora.data.formats.captionfolder import below_root, data_roots

    below = below_root(data_roots(source_uri, beneath=[uri]), uri)
    return below is not None and GENERATED_FOLDER in below.split("/")[:-1]


def class_sections(d: DataSection) -> list[tuple[DataSection, str | None]]:
    """Each class source as a data section to plan and read it with, and its prompt."""
    given = d.class_sources
    entries = [{"uri": given}] if isinstance(given, str) else \
        [s.model_dump(exclude_none=True) for s in given or []]
    out = []
    for e in entries:
        prompt = e.pop("prompt", d.class_prompt)
        # Class folders are images without captions (they take the prompt): the caption
        # check of the instance data does not apply. Nothing else reads these keys here.
        # Their format is their own (a folder of PNGs beside parquet instance shards: the
        # instance data's data.format found no files in it, and every image was drawn).
        base = dict(sources=None, caption_prefix="", caption_dropout=0.5, shuffle_tags=False,
                    keep_tokens=0, validation_split=0.0, class_sources=None, format="auto")
        out.append((d.model_copy(update={**base, **e}).as_class_source(), prompt))
    return out


def read_user_rows(d: DataSection, store: Storage, skip_root: str, want: int) -> list[dict]:
    """Up to ``want`` rows of ``data.class_sources`` (files under ``skip_root``, the
    generated images, and in any ``raylora-generated`` folder below a source left out),
    each ``{image, text, key}`` (``key``: where it is) with its prompt where it has no
    caption. Raises ValueError naming the key for a row that has neither, and ConfigError
    listing every row the class stage would drop (``bad_class_rows``)."""
    from raylora.data.plan import iter_plan_rows, plan_data

    rows: list[dict] = []
    labels: list[str] = []  # each row's source key, for bad_class_rows
    for i, (section, prompt) in enumerate(class_sections(d)):
        key = "data.class_sources" if isinstance(d.class_sources, str) else f"data.class_sources[{i}]"
        if len(rows) >= want:
            break
        try:
            plan = plan_data(section, store)
        except FileNotFoundError as exc:
            if prompt is None:
                raise ValueError(f"{key}: {exc}") from None
            log.warning("%s: %s; all of its images will be generated", key, exc)
            continue
        for s in plan.sources:
            keep = [j for j, f in enumerate(s.files) if not f.startswith(skip_root + "/")
                    and not in_generated_folder(s.uri or section.uri, f)]
            plan.sources[s.index] = s.subset(keep)
        # A caption folder's images and caption files, as planned: an image in a kohya
        # N_name folder without a caption file has its folder's class tokens as its text
        # (reg folder 1_dog: "dog"), which a prompt set for it (the source's, else
        # data.class_prompt) overrides, as it does where there is no caption: README.
        from raylora.data.formats.captionfolder import caption_uri

        folder = [s for s in plan.sources if s.format == "captionfolder"]
        images = {f for s in folder for f in s.files}
        captioned = {c for s in folder for c in s.companions}
        for row in iter_plan_rows(section, plan, store):
            if len(rows) >= want:
                break
            where = str(row["key"])
            tokens_only = (prompt is not None and where in images
                           and caption_uri(where, section.caption_extension) not in captioned)
            text = row["text"] if row["text"] and not tokens_only else prompt
            if text is None:
                raise ValueError(f"{key}: {row['key']} has no caption, and there is no "
                                 "prompt for it (data.class_prompt or the source's prompt)")
            rows.append({"image": row["image"], "text": str(text), "key": str(row["key"])})
            labels.append(key)
    bad = bad_class_rows(d, rows, labels)
    if bad:
        raise ConfigError(bad + [f"{_one_key(labels)}: replace or remove the {len(bad)} class "
                                 "image(s) above: the workers would drop them, and a batch "
                                 "short of class images stops the run (prior preservation "
                                 "pairs every batch with as many)"])
    return rows


def _one_key(labels: list[str]) -> str:
    """The source key the rows share (data.class_sources[1]), else the whole list's."""
    return labels[0] if len(set(labels)) == 1 else "data.class_sources"


def bad_class_rows(d: DataSection, rows: list[dict], labels: list[str]) -> list[str]:
    """``label: where: reason: detail; hint`` for each class row that the class stage on the
    workers would drop (raylora.data.prior.class_row_problem, with the run's decode
    settings). Judged here, where the bytes already are, because a dropped class image
    does not just go missing: the batch that draws it is short, and the run stops there,
    any number of steps in. Decoded on threads (PIL releases the GIL): a few hundred
    images at most."""
    from concurrent.futures import ThreadPoolExecutor

    from raylora.data.plan import SAMPLE_HINTS
    from raylora.data.prior import class_row_problem

    judge = dict(masks=d.masked_loss, max_pixels=d.max_image_pixels, min_size=d.min_size,
                 small_images=d.small_images)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        found = list(pool.map(lambda r: class_row_problem(r, **judge), rows))
    out = []
    for row, label, problem in zip(rows, labels, found):
        if problem is not None:
            hint = SAMPLE_HINTS.get(problem.reason)
            out.append(f"{label}: {row.get('key', 'a class image')}: {problem}"
                       + (f"; {hint[0].lower()}{hint[1:]}" if hint else ""))
    return out


def generation_key(cfg: RayLoraConfig, family: str, model_path: str, store: Storage) -> str:
    """The generated folder's name: a hash of everything that changes its images. Not
    their count: image i is drawn from seed + i whatever the count, so a run that wants
    more tops the folder up (as diffusers' DreamBooth scripts do) instead of drawing all
    of them again in a folder of its own."""
    from raylora.checkpoint.export import data_fingerprint
    from raylora.data.cache import hub_revision
    from raylora.model.load import is_hub_id

    g, h = cfg.data.class_generation, hashlib.sha256()
    q = cfg.model.quantize_text_encoders
    h.update(json.dumps({
        "version": GEN_VERSION, "model": model_path, "revision": hub_revision(cfg, model_path),
        "variant": cfg.model.variant, "family": family, "prompt": cfg.data.class_prompt,
        "seed": g.seed, "resolution": cfg.data.max_resolution(),
        "steps": g.num_inference_steps,
        "guidance": _guidance_key(family, guidance_scale(cfg, family)),
        # model.system_prompt (Lumina-Image 2.0): only when set, as quantize below
        **({"system_prompt": cfg.model.system_prompt} if cfg.model.system_prompt is not None else {}),
        # the prompt's padded length (T5 in Flux and SD3: the call passes it; Flux no mask)
        **({"max_sequence_length": cfg.model.max_sequence_length}
           if cfg.model.max_sequence_length is not None else {}),
        # quantized encoders condition the images a little differently; only when on, so
        # the folders of unquantized runs keep their keys
        **({"quantize_text_encoders": q} if q != "none" else {}),
    }, sort_keys=True).encode())
    # A push to a hub repo: new images (model.revision, pinned to the plan's commit:
    # RayLoraConfig.at_commit). Retrained weights in a folder: new images.
    if not is_hub_id(model_path):
        h.update(data_fingerprint(store.list_files(model_path), store).encode())
    return h.hexdigest()[:16]


def guidance_scale(cfg: RayLoraConfig, family: str) -> float:
    from raylora.model import families

    return families.get(family).resolve_guidance(cfg.data.class_generation.guidance_scale)


def _guidance_key(family: str, scale: float):
    """The key's guidance: the number alone for the plain ``guidance_scale`` call, as keys
    were before families had their own call (folders built then stay valid); the whole
    call otherwise, so images drawn without it (Qwen-Image's were, before true CFG) are
    not reused as if they had been."""
    from raylora.model import families

    call = families.get(family).guidance_kwargs(scale)
    return scale if call == {"guidance_scale": scale} else call


def image_name(index: int) -> str:
    return f"{index:05d}.png"


def folder_rows(uri: str, count: int, store: Storage) -> list[dict]:
    """The ``count`` images of a generated folder with their prompts, in index order."""
    rows = []
    for i in range(count):
        png = storage.join(uri, image_name(i))
        rows.append({"image": store.read_bytes(png),
                     "text": store.read_bytes(png[:-4] + ".txt").decode("utf-8"), "key": png})
    return rows


def _present(uri: str, store: Storage) -> set[int]:
    """Indices whose image and prompt are both in the folder (a partial build's)."""
    names = {f.rsplit("/", 1)[-1] for f in store.list_files(uri)}
    return {int(n[:-4]) for n in names
            if n.endswith(".png") and n[:-4].isdigit() and n[:-4] + ".txt" in names}


def ensure_class_images(cfg: RayLoraConfig, family: str, model_path: str,
                        store: Storage) -> ClassImages:
    """The run's ``data.num_class_images`` class rows: the user's first, then generated
    ones (generated now, or reused). Needs Ray when something must be generated. Raises
    ValueError naming the key when images are missing and there is no prompt."""
    d = cfg.data
    root_key, root = generated_place(cfg, store)
    user = read_user_rows(d, store, root, d.num_class_images)
    missing = d.num_class_images - len(user)
    if missing <= 0:
        return ClassImages(user, len(user))
    if d.class_prompt is None:
        raise ValueError(f"data.num_class_images: {d.num_class_images} wanted, "
                         f"data.class_sources has {len(user)}; set data.class_prompt to "
                         f"generate the other {missing} (or lower data.num_class_images)")
    size = d.max_resolution()
    if d.small_images == "skip" and d.min_size > size:
        # Drawn at data.resolution: every one would be dropped as too_small
        raise ConfigError([f"data.min_size: {d.min_size} is above data.resolution {size}, the "
                           f"size the {missing} missing class image(s) are generated at: "
                           "the class stage would drop every one (data.small_images: skip); "
                           "lower data.min_size, or set data.small_images: upscale"])
    uri = storage.join(root, generation_key(cfg, family, model_path, store))
    manifest_uri = storage.join(uri, MANIFEST)
    # the images 0..count-1 its manifest says are complete (more asked: topped up)
    made = json.loads(store.read_bytes(manifest_uri))["count"] if store.exists(manifest_uri) else 0
    generated = 0
    if made < missing:
        todo = sorted(set(range(missing)) - (_present(uri, store) if store.exists(uri) else set()))
        # Checked before any actor loads a pipeline (launch.write_problems let through a
        # root it cannot write that held complete folders, maybe not this one)
        if problem := store.write_problem(uri):
            raise ConfigError([f"{root_key}: {len(todo)} class image(s) to generate into "
                               f"{uri}, but {problem}"])
        if todo:  # else an interrupted build got every image out before its manifest
            generate(cfg, family, model_path, uri, todo)
        generated = len(todo)
        manifest = {"version": GEN_VERSION, "prompt": d.class_prompt, "count": missing,
                    "files": [image_name(i) for i in range(missing)], "model": model_path,
                    "seed": d.class_generation.seed}
        # Written last: its presence marks the folder complete up to its count.
        store.write_bytes(manifest_uri, json.dumps(manifest, indent=1).encode())
    else:
        log.info("class images: reusing %d generated image(s) in %s", missing, uri)
    drawn = folder_rows(uri, missing, store)
    bad = bad_class_rows(d, drawn, [root_key] * len(drawn))
    if bad:
        raise ConfigError(bad + [f"{root_key}: the workers would drop the generated class "
                                 f"image(s) above; delete {uri} to have them drawn again"])
    return ClassImages(user + drawn, len(user), uri, generated)


def generate(cfg: RayLoraConfig, family: str, model_path: str, uri: str,
             indices: list[int]) -> None:
    """Images ``indices`` of the folder ``uri``, by a Ray Data actor pool of stock
    pipelines: one actor per training worker (a GPU each with scaling.use_gpu, else a CPU)."""
    import ray.data

    g = cfg.data.class_generation
    log.info("class images: generating %d with %s into %s", len(indices), model_path, uri)
    items = [{"index": i, "seed": g.seed + i} for i in indices]
    actors = max(1, min(cfg.scaling.num_workers, -(-len(items) // g.batch_size)))
    res = {"num_gpus": 1} if cfg.scaling.use_gpu else {"num_cpus": 1}
    stage = dict(model_path=model_path, family=family, prompt=cfg.data.class_prompt,
                 out_uri=uri, resolution=cfg.data.max_resolution(),
                 steps=g.num_inference_steps, guidance=guidance_scale(cfg, family),
                 endpoint_url=cfg.storage.endpoint_url, region=cfg.storage.region,
                 max_sequence_length=cfg.model.max_sequence_length,
                 model=cfg.model.model_dump(mode="json"))
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items) // g.batch_size))
    written = ds.map_batches(GenerateStage, fn_constructor_kwargs=stage, batch_size=g.batch_size,
                             batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=actors),
                             **res).take_all()
    if len(written) != len(indices):
        raise RuntimeError(f"class images: {len(written)} of {len(indices)} were written")


class GenerateStage:
    """Ray Data actor: ``{index, seed}`` rows → images written to storage (PNG + prompt).
    Loads the family's stock pipeline once (bf16 on a GPU, fp32 on a CPU), with the text
    encoders and VAE as a training worker holds them
    (``raylora.model.load.load_pipeline_as_trained``: quantized as
    ``model.quantize_text_encoders`` says). ``model``: the run's ``model`` section
    (``ModelSection`` fields)."""

    def __init__(self, model_path: str, family: str, prompt: str, out_uri: str, resolution: int,
                 steps: int, guidance: float, endpoint_url=None, region=None,
                 max_sequence_length=None, model: dict | None = None):
        import torch

        from raylora import quiet
        from raylora.config import ModelSection
        from raylora.model import families
        from raylora.model.load import load_pipeline_as_trained, materialize, read_index

        self.store = Storage(endpoint_url, region)
        fam = families.get(family)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        quiet.diffusers_bars_off()
        path = materialize(model_path, self.store, (model or {}).get("revision"))
        section = ModelSection(**{**(model or {}), "pretrained": path})
        self.pipe = load_pipeline_as_trained(path, fam, dtype, read_index(section, path), section,
                                             self.device).to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        self.call = dict(num_inference_steps=steps, height=resolution, width=resolution)
        self.family, self.guidance = fam, guidance  # the call's guidance: per batch size
        if max_sequence_length and "max_sequence_length" in _call_args(self.pipe):
            self.call["max_sequence_length"] = max_sequence_length
        self.call.update(fam.prompt_kwargs(section.system_prompt))  # model.system_prompt
        self.prompt, self.out_uri = prompt, out_uri

    def __call__(self, batch: dict) -> dict:
        import numpy as np
        import torch

        seeds = [int(s) for s in batch["seed"]]
        with torch.no_grad():
            # prompt by name: Flux2KleinPipeline's first parameter is a reference image
            images = self.family.images(
                self.pipe, prompt=[self.prompt] * len(seeds), **self.call,
                **self.family.guidance_kwargs(self.guidance, batch=len(seeds)),
                generator=[torch.Generator().manual_seed(s) for s in seeds])
        for i, img in zip(batch["index"], images):
            png = storage.join(self.out_uri, image_name(int(i)))
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            # The prompt first: an image without its prompt is not counted as present.
            self.store.write_bytes(png[:-4] + ".txt", self.prompt.encode("utf-8"))
            self.store.write_bytes(png, buf.getvalue())
        return {"index": np.asarray(batch["index"])}


def _call_args(pipe) -> set[str]:
    import inspect

    return set(inspect.signature(pipe.__call__).parameters)
