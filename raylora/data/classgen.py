"""Prior preservation's class images: the user's, plus the missing ones generated.

``data.class_sources`` may hold fewer than ``data.num_class_images`` images; the rest are
drawn from the base model (the family's stock pipeline, bf16 on GPUs, fp32 on CPUs) with
``data.class_prompt``, as diffusers' DreamBooth scripts do, but as a Ray Data
``map_batches`` stage over an actor pool (one pipeline per actor, loaded once, one GPU or
CPU each) so that the cluster's accelerators share the work.

Generated images go to ``{root}/{key}/NNNNN.png`` with the prompt beside each in
``NNNNN.txt`` (a caption folder any run can read), ``key`` a hash of the model, prompt,
count, seed, resolution, steps and guidance. The folder's ``manifest.json`` is written
last: a folder with it is complete and reused as is; one without it (a build that died)
is completed, keeping the images it holds (image i always comes from seed + i, so a
completed folder equals one built in one go). The driver then reads every class row
(bytes + prompt) once and ships them to the workers in the plan (``raylora.data.prior``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from dataclasses import dataclass

from raylora import storage
from raylora.config import DataSection, RayLoraConfig
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


def generated_root(cfg: RayLoraConfig) -> str:
    d = cfg.data
    if d.class_generation.uri is not None:
        return storage.normalize(d.class_generation.uri)
    if isinstance(d.class_sources, str) and not any(c in d.class_sources for c in "*?["):
        return storage.join(storage.normalize(d.class_sources), "raylora-generated")
    return storage.join(storage.normalize(cfg.output.uri), "class_images")


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
    generated images, left out), each ``{image, text}`` with its prompt where it has no
    caption. Raises ValueError naming the key for a row that has neither."""
    from raylora.data.plan import iter_plan_rows, plan_data

    rows: list[dict] = []
    for i, (section, prompt) in enumerate(class_sections(d)):
        key = "data.class_sources" if isinstance(d.class_sources, str) else f"data.class_sources[{i}]"
        try:
            plan = plan_data(section, store)
        except FileNotFoundError as exc:
            if prompt is None:
                raise ValueError(f"{key}: {exc}") from None
            log.warning("%s: %s; all of its images will be generated", key, exc)
            continue
        for s in plan.sources:
            keep = [j for j, f in enumerate(s.files) if not f.startswith(skip_root + "/")]
            plan.sources[s.index] = s.subset(keep)
        for row in iter_plan_rows(section, plan, store):
            if len(rows) >= want:
                return rows
            text = row["text"] if row["text"] else prompt
            if text is None:
                raise ValueError(f"{key}: {row['key']} has no caption, and there is no "
                                 "prompt for it (data.class_prompt or the source's prompt)")
            rows.append({"image": row["image"], "text": str(text)})
    return rows


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
                     "text": store.read_bytes(png[:-4] + ".txt").decode("utf-8")})
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
    root = generated_root(cfg)
    user = read_user_rows(d, store, root, d.num_class_images)
    missing = d.num_class_images - len(user)
    if missing <= 0:
        return ClassImages(user, len(user))
    if d.class_prompt is None:
        raise ValueError(f"data.num_class_images: {d.num_class_images} wanted, "
                         f"data.class_sources has {len(user)}; set data.class_prompt to "
                         f"generate the other {missing} (or lower data.num_class_images)")
    uri = storage.join(root, generation_key(cfg, family, model_path, store))
    manifest_uri = storage.join(uri, MANIFEST)
    # the images 0..count-1 its manifest says are complete (more asked: topped up)
    made = json.loads(store.read_bytes(manifest_uri))["count"] if store.exists(manifest_uri) else 0
    generated = 0
    if made < missing:
        todo = sorted(set(range(missing)) - (_present(uri, store) if store.exists(uri) else set()))
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
    return ClassImages(user + folder_rows(uri, missing, store), len(user), uri, generated)


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
        extra = {}
        if "safety_checker" in fam.pipeline_class()._optional_components:
            extra = {"safety_checker": None, "requires_safety_checker": False}
        quiet.diffusers_bars_off()
        path = materialize(model_path, self.store, (model or {}).get("revision"))
        section = ModelSection(**{**(model or {}), "pretrained": path})
        self.pipe = load_pipeline_as_trained(path, fam, dtype, read_index(section, path), section,
                                             self.device, **extra).to(self.device)
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
