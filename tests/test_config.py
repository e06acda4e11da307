import glob
import os

import pytest
import yaml

from raylora.config import (ConfigError, DataSection, RayLoraConfig, apply_overrides, load_config,
                            parse_override, trial_tree, validate)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN = {"model": {"pretrained": "m"}, "data": {"uri": "d"}, "output": {"uri": "o"}}


def test_defaults_follow_diffusers_lora_recipe():
    cfg = validate(MIN)
    t, lo = cfg.train, cfg.lora
    assert (t.adam_beta1, t.adam_beta2, t.adam_weight_decay, t.adam_epsilon) == (0.9, 0.999, 1e-2, 1e-8)
    assert (lo.rank, lo.effective_alpha, t.learning_rate, t.lr_scheduler) == (4, 4.0, 1e-4, "constant")
    assert lo.target_modules is None  # the family's default (SD: the attention projections)
    assert (t.max_grad_norm, t.mixed_precision, t.gradient_accumulation_steps) == (1.0, "no", 1)
    assert cfg.data.image_column == "image" and cfg.data.caption_column == "text"


def test_validation_guidance_scale_unset_is_each_familys_default():
    from raylora.model import families

    cfg = validate(MIN)
    assert cfg.validation.guidance_scale is None and cfg.data.class_generation.guidance_scale is None
    want = {"sd": 7.5, "sdxl": 7.5, "flux": 3.5, "fluxkontext": 2.5, "chroma": 5.0, "sd3": 7.0, "qwenimage": 4.0, "qwenimageedit": 4.0,
            "zimage": 5.0, "lumina2": 4.0, "sana": 4.5,
            "flux2klein": 4.0, "flux2": 4.0, "wan": 5.0, "qwenimage21": 1.0}
    assert set(want) == set(families.names())
    got = {f: families.get(f).resolve_guidance(cfg.validation.guidance_scale) for f in want}
    assert got == want
    # What the preview renders with: the family's scale, in the argument its pipeline reads.
    assert families.get("flux").guidance_kwargs(cfg.validation.guidance_scale) == {"guidance_scale": 3.5}
    assert families.get("qwenimage").guidance_kwargs(cfg.validation.guidance_scale)["true_cfg_scale"] == 4.0
    set_ = validate({**MIN, "validation": {"guidance_scale": 2.0}}).validation.guidance_scale
    assert {f: families.get(f).resolve_guidance(set_) for f in want} == dict.fromkeys(want, 2.0)


def test_overrides_parse_yaml_scalars_and_flow_lists(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(MIN))
    cfg = load_config(
        path,
        [
            "train.learning_rate=2e-4",
            "scaling.num_workers=4",
            "lora.target_modules=[to_q,to_v]",
            "data.random_flip=true",
            "lora.alpha=8",
            "data.uri=[a, b]",
        ],
    )
    assert cfg.train.learning_rate == pytest.approx(2e-4)
    assert cfg.scaling.num_workers == 4
    assert cfg.lora.target_modules == ["to_q", "to_v"]
    assert cfg.data.random_flip is True
    assert cfg.lora.effective_alpha == 8.0
    assert cfg.data.uri == ["a", "b"]


def test_an_override_value_keeps_a_hash_yaml_would_take_for_a_comment():
    """`data.caption_prefix=photo #1` trained on "photo": YAML read ` #1` as a comment,
    which a command line never holds. The text is the value; quoted, it is YAML's."""
    assert parse_override("data.caption_prefix=photo #1") == (["data", "caption_prefix"], "photo #1")
    assert parse_override("data.caption_prefix='a #2' ") == (["data", "caption_prefix"], "a #2")
    assert parse_override("lora.target_modules=[to_q, 'x #y']") == (["lora", "target_modules"],
                                                                    ["to_q", "x #y"])
    assert parse_override("data.caption_prefix=no#comment") == (["data", "caption_prefix"], "no#comment")
    with pytest.raises(ConfigError, match="lora.rank: Input should be a valid integer"):
        validate(apply_overrides(MIN, ["lora.rank=8 #the default is 16"]))


def test_a_search_dimension_is_one_override_under_its_dotted_key():
    """Search-space keys are dotted config keys: `tune.search_space.lora.rank=...` sets
    the `lora.rank` dimension (not tune.search_space.lora.rank as nested sections); null
    drops one; an unknown config key is still named."""
    tree = {**MIN, "tune": {"metric": "train_loss", "search_space": {
        "train.learning_rate": {"loguniform": [1e-5, 1e-3]}, "lora.alpha": {"choice": [4, 8]}}}}
    cfg = validate(apply_overrides(tree, ["tune.search_space.lora.rank={choice: [8, 16]}",
                                          "tune.search_space.lora.alpha=null"]))
    space = cfg.tune.search_space
    assert list(space) == ["train.learning_rate", "lora.rank"]
    assert (space["lora.rank"].kind, list(space["lora.rank"].choice)) == ("choice", [8, 16])
    assert tuple(space["train.learning_rate"].loguniform) == (1e-5, 1e-3)
    with pytest.raises(ConfigError, match=r"tune.search_space.lora.rank.choice: Input should be a valid dict"):
        validate(apply_overrides(tree, ["tune.search_space.lora.rank.choice=[8, 16]"]))


def test_a_cached_search_cannot_search_what_the_cache_was_encoded_with():
    """Every trial reads one cache, encoded in the base config's precision: an fp32 trial
    trained and was scored on bf16-rounded latents (1.3 % off)."""
    tree = {**MIN, "data": {**MIN["data"], "cache": "latents", "center_crop": True},
            "train": {"mixed_precision": "bf16"},
            "tune": {"metric": "train_loss", "search_space": {
                "train.mixed_precision": {"choice": ["bf16", "no"]},
                "train.learning_rate": {"loguniform": [1e-5, 1e-3]}}}}
    with pytest.raises(ConfigError) as ei:
        validate(tree)
    assert ei.value.problems == [
        "tune.search_space.train.mixed_precision: with data.cache=latents every trial shares "
        "one cache, encoded once; model.*, data.* and train.mixed_precision cannot be searched"]
    del tree["tune"]["search_space"]["train.mixed_precision"]
    validate(tree)


def test_keys_of_a_feature_that_is_off_are_refused():
    """Nothing reads them: a mask_column without masked_loss trained unmasked, silently."""
    base = {"model": {"pretrained": "m"}, "output": {"uri": "o"}}
    with pytest.raises(ConfigError) as ei:
        validate({**base, "data": {"uri": "d", "mask_column": "alpha_mask",
                                   "control_column": "input_image"},
                  "train": {"prior_loss_weight": 0.5}})
    assert ei.value.problems == [
        "data.mask_column: set, but data.masked_loss is off (nothing reads it); turn it on or drop it",
        "data.control_column: set, but data.control_images is off (nothing reads it); turn it on or drop it",
        "train.prior_loss_weight: set, but prior preservation is off (no data.class_prompt or "
        "data.class_sources); set them or drop it"]
    with pytest.raises(ConfigError) as ei:
        validate({**base, "data": {"sources": [{"uri": "a"}, {"uri": "b", "mask_column": "m2"}]}})
    assert ei.value.problems == ["data.sources[1].mask_column: set, but data.masked_loss is off "
                                 "(nothing reads it); turn it on or drop it"]
    # with their features on, and at their defaults, they stand
    validate({**base, "data": {"uri": "d", "masked_loss": True, "mask_column": "alpha_mask",
                               "class_prompt": "a dog"}, "train": {"prior_loss_weight": 0.5}})
    validate({**base, "data": {"uri": "d", "mask_column": "mask"}, "train": {"prior_loss_weight": 1.0}})


def test_every_problem_reported_at_once_naming_keys():
    tree = apply_overrides(
        MIN,
        [
            "train.learning_rat=1",  # typo → unknown key
            "lora.rank=0",
            "train.mixed_precision=fp8",
            "data.resolution=abc",
            "train.max_steps,=10",  # the unknown key named as typed, not as "train"
            "lora.list=3",
        ],
    )
    with pytest.raises(ConfigError) as ei:
        validate(tree)
    msg = str(ei.value)
    assert len(ei.value.problems) == 6, msg
    assert "train.learning_rat: unknown key" in msg
    assert "train.max_steps,: unknown key" in msg and "lora.list: unknown key" in msg
    assert "lora.rank:" in msg and "greater than 0" in msg
    assert "train.mixed_precision:" in msg and "fp8" in msg
    assert "data.resolution:" in msg


def test_a_checks_own_message_reads_without_pydantics_prefix_or_a_second_value():
    """A check's ValueError is the problem as written, without "Value error, "; the value
    is added as "(got ...)" only where the message does not name it already."""
    def problem(*overrides: str) -> str:
        with pytest.raises(ConfigError) as ei:
            validate(apply_overrides(MIN, list(overrides)))
        assert len(ei.value.problems) == 1, ei.value.problems
        return ei.value.problems[0]

    assert problem("scaling.num_workers=0") == "scaling.num_workers: must be at least 1, not 0"
    assert problem("model.family=foo").startswith("model.family: unknown family 'foo' (auto or one of: ")
    assert not problem("model.family=foo").endswith("(got 'foo')")
    assert problem("lora.target_modules=[]") == "lora.target_modules: needs at least one module name (got [])"
    assert problem("lora.rank=0") == "lora.rank: Input should be greater than 0 (got 0)"


@pytest.mark.parametrize("overrides,expected", [
    (["train.lr_warmup_steps=100"],
     "train.lr_warmup_steps: 100, but train.lr_scheduler constant has no warmup; use "
     "constant_with_warmup, or set 0"),
    (["train.lr_scheduler=cosine", "train.lr_num_cycles=3"],
     "train.lr_num_cycles: 3, but only train.lr_scheduler cosine_with_restarts has cycles "
     "(not cosine); set 1"),
    (["train.lr_scheduler=linear", "train.lr_power=2"],
     "train.lr_power: 2, but only train.lr_scheduler polynomial has a power (not linear); set 1"),
    (["train.lr_scheduler=constant_with_warmup", "train.lr_warmup_steps=100"], None),
    (["train.lr_scheduler=cosine_with_restarts", "train.lr_num_cycles=3"], None),
    (["train.lr_scheduler=polynomial", "train.lr_power=2", "train.lr_warmup_steps=5"], None),
    # a flow density's settings likewise: the density drawn is not the one tuned
    (["train.flow.timestep_sampling=uniform", "train.flow.logit_mean=-0.5"],
     "train.flow.logit_mean: -0.5, but only train.flow.timestep_sampling logit_normal reads it "
     "(not uniform); drop it"),
    (["train.flow.logit_std=0.8"] + [f"train.flow.timestep_sampling={k}" for k in ("mode",)],
     "train.flow.logit_std: 0.8, but only train.flow.timestep_sampling logit_normal reads it "
     "(not mode); drop it"),
    (["train.flow.mode_scale=0.5"],
     "train.flow.mode_scale: 0.5, but only train.flow.timestep_sampling mode reads it "
     "(not logit_normal); drop it"),
    (["train.flow.logit_mean=-0.5", "train.flow.logit_std=0.8"], None),
    (["train.flow.timestep_sampling=mode", "train.flow.mode_scale=0.5"], None),
])
def test_schedule_settings_the_schedule_does_not_read_are_refused(overrides, expected):
    """diffusers' get_scheduler drops what a schedule does not take: warmup on constant
    trained at the full rate from step 0 while the model card said "100 steps"."""
    tree = apply_overrides(MIN, overrides)
    if expected is None:
        validate(tree)
        return
    with pytest.raises(ConfigError) as ei:
        validate(tree)
    assert ei.value.problems == [expected]


@pytest.mark.parametrize("override,expected", [
    ("data.uri=2024", "data.uri: Input should be a valid string; or a valid list (got 2024): "
     "YAML read it as a number (digits after a leading 0 as octal); quote it"),
    # an all-digit commit prefix with a leading 0 is octal to YAML 1.1: 0123456 is 42798
    ("model.revision=0123456", "model.revision: Input should be a valid string (got 42798): "
     "YAML read it as a number (digits after a leading 0 as octal); quote it"),
    ("scaling.num_workers=abc", "scaling.num_workers: Input should be a valid integer, unable to "
     "parse string as an integer; or a valid tuple (got 'abc')"),
    ("train.flow.shift=fast", "train.flow.shift: Input should be a valid number, unable to parse "
     "string as a number; or 'auto' (got 'fast')"),
])
def test_a_key_that_takes_several_types_is_one_problem_under_its_own_name(override, expected):
    """A union's members each failed as a problem of their own, under keys that do not
    exist (data.uri.str, data.uri.list[str]): one line, the key as written."""
    with pytest.raises(ConfigError) as ei:
        validate(apply_overrides(MIN, [override]))
    assert ei.value.problems == [expected]


def test_missing_required_sections_named():
    with pytest.raises(ConfigError) as ei:
        validate({"data": {"uri": "x"}})
    assert set(ei.value.problems) == {
        "model: required key is missing",
        "output: required key is missing",
    }


@pytest.mark.parametrize("overrides,expected", [
    (["model.pretrained=hf://org/x"], ("org/x", None)),
    (["model.pretrained=hf://org/x@v1"], ("org/x", "v1")),
    (["model.pretrained=hf://org/x@v1", "model.revision=v1"], ("org/x", "v1")),
    (["model.pretrained=hf://org/x", "model.revision=v2"], ("org/x", "v2")),
    (["model.pretrained=hf://org/x@v1", "model.revision=v2"],
     "model.pretrained: hf://org/x@v1 names revision v1, model.revision v2; give one"),
    (["model.pretrained=hf://org/x/unet"],
     "model.pretrained: hf://org/x/unet: not hf://owner/name[@revision] (a hub model is a "
     "whole repo: owner/name, or its folder downloaded)"),
    (["model.pretrained=hf://org"],
     "model.pretrained: hf://org: not hf://owner/name[@revision] (a hub model is a whole "
     "repo: owner/name, or its folder downloaded)"),
])
def test_a_hub_model_may_be_named_as_lora_init_from_names_a_hub_adapter(overrides, expected):
    """``hf://owner/name[@revision]``: the hub id and model.revision (before, "unsupported
    URI scheme 'hf'" from the plan)."""
    tree = apply_overrides(MIN, overrides)
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as ei:
            validate(tree)
        assert ei.value.problems == [expected]
    else:
        cfg = validate(tree)
        assert (cfg.model.pretrained, cfg.model.revision) == expected
        assert validate(cfg.to_dict()).model == cfg.model  # what a run records, read back


def test_fp16_on_cpu_rejected_with_key():
    with pytest.raises(ConfigError, match=r"train.mixed_precision: fp16 needs a GPU"):
        validate(apply_overrides(MIN, ["train.mixed_precision=fp16"]))
    cfg = validate(apply_overrides(MIN, ["train.mixed_precision=fp16", "scaling.use_gpu=true"]))
    assert cfg.train.mixed_precision == "fp16"


def test_cuda_graphs_named_where_a_graph_cannot_stand_for_the_step():
    gpu = ["train.cuda_graphs=true", "scaling.use_gpu=true"]
    cfg = validate(apply_overrides(MIN, gpu))  # compile auto: regional on a GPU
    assert cfg.train.cuda_graphs and cfg.compile_mode == "regional"
    cases = {
        "train.cuda_graphs: CUDA graphs need a GPU (scaling.use_gpu is false)":
            ["train.cuda_graphs=true", "train.compile=regional"],
        "train.cuda_graphs: the graphs are made by torch.compile, and train.compile is none "
        "(no compile here); use regional": gpu + ["train.compile=none"],
        "train.cuda_graphs: needs one micro-batch per optimizer step "
        "(train.gradient_accumulation_steps is 4)": gpu + ["train.gradient_accumulation_steps=4"],
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError) as ei:
            validate(apply_overrides(MIN, overrides))
        assert ei.value.problems == [message]


def test_override_syntax_errors_named():
    with pytest.raises(ConfigError, match="override must look like key.path=value"):
        apply_overrides(MIN, ["train.learning_rate"])
    with pytest.raises(ConfigError, match="model.pretrained: is a value, not a section"):
        apply_overrides(MIN, ["model.pretrained.x=1"])


def test_unreadable_or_bad_yaml_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: cannot read"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize("text,said", [
    ("model: {pretrained: m}\ntrain:\n  learning_rate: 5.0e-5\ndata: {uri: d}\n"
     "train:\n  max_steps: 10\noutput: {uri: o, uri: p}\n", "'train' is given twice (lines 2 and 5)"),
    # beside a merge key (<<: *b), a key given twice is still two explicit ones
    ("base: &b {uri: d}\nmodel: {pretrained: m}\ndata:\n  <<: *b\n"
     "  resolution: 64\n  resolution: 128\noutput: {uri: o}\n",
     "'resolution' is given twice (lines 5 and 6)"),
], ids=["sections", "beside-a-merge"])
def test_a_key_given_twice_in_a_yaml_file_is_refused_naming_both_lines(tmp_path, text, said):
    """YAML keeps the last of two equal keys: a second `train:` dropped the first one's
    learning rate and batch size, and the run trained with the defaults."""
    twice = tmp_path / "twice.yaml"
    twice.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(twice)
    assert said in str(err.value)


def test_settings_no_run_can_use_are_refused_before_anything_runs(tmp_path):
    """An empty path or URI (an unset environment variable: it read as the working
    directory, where the run wrote and resumed), inf/nan numbers (non-finite losses once
    the model loaded), an endpoint without its scheme ("Invalid S3 connection scheme"),
    a wandb project name wandb refuses once a worker opens the run."""
    tree = apply_overrides(MIN, [
        "output.uri=", "data.validation_uri=[v, ' ']", "lora.init_from=''",
        "train.learning_rate=.inf", "lora.alpha=.nan", "train.flow.shift=.nan",
        "storage.endpoint_url=minio.internal:9000", "tracking.project=a:b"])
    with pytest.raises(ConfigError) as err:
        validate(tree)
    assert sorted(err.value.problems) == sorted([
        "output.uri: empty; give a path or URI (an unset environment variable?)",
        "data.validation_uri[1]: empty; give a path or URI (an unset environment variable?)",
        "lora.init_from: empty; give a path or URI (an unset environment variable?)",
        "train.learning_rate: Input should be a finite number (got inf)",
        "lora.alpha: Input should be a finite number (got nan)",
        "train.flow.shift: Input should be a finite number; or 'auto' (got nan)",
        "storage.endpoint_url: 'minio.internal:9000' is not an http:// or https:// URL "
        "(e.g. http://minio.internal:9000)",
        "tracking.project: 'a:b': a wandb project name (at most 128 characters, none of "
        "/ \\ # ? % :), or team/project"])
    ok = validate(apply_overrides(MIN, ["storage.endpoint_url=http://minio:9000",
                                        "tracking.backend=wandb", "tracking.project=team/proj"]))
    assert ok.tracking.project == "team/proj"


def test_an_empty_section_is_its_defaults_and_list_items_are_overridden_by_index(tmp_path):
    """`lora:` with every key commented out is YAML's null: the section's defaults (but
    `tune: null`: no search). An override names a list item as the errors do."""
    cfg = validate({**MIN, "lora": None, "train": None, "tune": None})
    assert cfg.lora.rank == 4 and cfg.train.batch_size == 4 and cfg.tune is None
    tree = {**MIN, "data": {"sources": [{"uri": "a", "weight": 1}, {"uri": "b", "weight": "2x"}]}}
    with pytest.raises(ConfigError) as err:  # one problem: not also "weight: missing"
        validate(tree)
    assert [p.split(":")[0] for p in err.value.problems] == ["data.sources[1].weight"]
    fixed = validate(apply_overrides(tree, ["data.sources[1].weight=2"]))
    assert [s.weight for s in fixed.data.sources] == [1, 2]
    with pytest.raises(ConfigError, match=r"data.sources\[2\]: no such item \(data.sources is a list of 2\)"):
        apply_overrides(tree, ["data.sources[2].weight=2"])


def test_to_dict_round_trips():
    cfg = validate(apply_overrides(MIN, ["lora.rank=16", "train.lr_scheduler=cosine"]))
    again = RayLoraConfig.model_validate(cfg.to_dict())
    assert again == cfg
    assert set(cfg.to_dict()) == {
        "model", "data", "lora", "train", "scaling", "checkpoint", "failure", "storage", "validation",
        "export", "tracking",
        "output", "tune",
    }


def test_memory_keys_from_overrides_round_trip_through_yaml(tmp_path):
    """Quantization and optimizer keys as a user writes them on the command line; the
    resolved config (what raylora.json and the workers get) dumped to YAML validates to the
    same config."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(MIN))
    cfg = load_config(path, ["model.quantize=nf4", "model.quantize_text_encoders=int8",
                             "train.optimizer=adafactor", "train.adafactor.relative_step=true",
                             "train.adafactor.warmup_init=true", "train.adafactor.eps=[1e-30,2e-3]"])
    assert (cfg.model.quantize, cfg.model.quantize_text_encoders) == ("nf4", "int8")
    assert cfg.train.adafactor.warmup_init and cfg.train.adafactor.eps == (1e-30, 2e-3)
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(dumped) == cfg
    prodigy = load_config(path, ["train.optimizer=prodigy", "train.learning_rate=1.0",
                                 "train.prodigy.growth_rate=1.02", "train.prodigy.beta3=0.99"])
    dumped.write_text(yaml.safe_dump(prodigy.to_dict()))
    assert load_config(dumped) == prodigy


JOB_YAMLS = sorted(glob.glob(os.path.join(REPO, "jobs", "configs", "**", "*.yaml"), recursive=True))


def test_jobs_directory_has_configs():
    assert any(p.endswith("tiny-local.yaml") for p in JOB_YAMLS)


@pytest.mark.parametrize("path", JOB_YAMLS, ids=[os.path.relpath(p, REPO) for p in JOB_YAMLS])
def test_every_shipped_job_yaml_validates(path):
    cfg = load_config(path)
    assert cfg.output.uri and cfg.model.pretrained


def test_yaml_boolean_spellings_are_read_as_the_values_they_name():
    # `no` is YAML 1.1 for false: on the command line it must still mean "no mixed precision".
    cfg = validate(apply_overrides(MIN, ["train.mixed_precision=no"]))
    assert cfg.train.mixed_precision == "no"
    # compile: true/false from configs written before the modes existed
    assert validate(apply_overrides(MIN, ["train.compile=true"])).train.compile == "regional"
    assert validate(apply_overrides(MIN, ["train.compile=false"])).compile_mode == "none"
    auto = validate(MIN)
    assert (auto.train.compile, auto.compile_mode) == ("auto", "none")
    gpu = validate(apply_overrides(MIN, ["scaling.use_gpu=true"]))
    assert gpu.compile_mode == "regional"
    # peft's DoRA/LoHa/LoKr layers break a compiled block's graph at every adapter: eager
    for variant in ("dora", "loha", "lokr"):
        other = validate(apply_overrides(MIN, ["scaling.use_gpu=true", f"lora.variant={variant}"]))
        assert other.compile_mode == "none", variant
    with pytest.raises(ConfigError, match="train.compile"):
        validate(apply_overrides(MIN, ["train.compile=fast"]))


def test_data_sources_errors_name_their_keys():
    """data.uri or data.sources (one of them), weight or repeats (not both; weights for
    every source or none), no per-source resolution (it needs bucketing), nothing random
    about captions with the latent cache: every problem in one message, each by its key."""
    def problems(data: dict) -> list[str]:
        with pytest.raises(ConfigError) as exc:
            validate({**MIN, "data": data})
        return exc.value.problems

    assert problems({}) == ["data.uri: give data.uri or data.sources (a list of sources to "
                            "mix), neither is set"]
    assert problems({"uri": "d", "sources": [{"uri": "e"}]})[0].endswith("not both")
    assert problems({"sources": []}) == ["data.sources: needs at least one source"]
    got = problems({"sources": [{"uri": "a", "weight": 1, "repeats": 2}, {"uri": "b"},
                                {"uri": "c", "weight": 1, "wieght": 2, "resolution": 768},
                                {"weight": 0}]})
    assert got[:3] == ["data.sources[2].wieght: unknown key",
                       "data.sources[3].uri: required key is missing",
                       "data.sources[3].weight: Input should be greater than 0 (got 0)"]
    assert "data.sources[0]: give weight or repeats, not both" in got[3]
    assert got[4].startswith("data.sources[1].weight: missing; give every source a weight")
    assert got[5].startswith("data.sources[2].resolution: a per-source resolution needs "
                             "multi-resolution aspect bucketing")
    assert problems({"uri": "d", "keep_tokens": 1})[0].startswith(
        "data.keep_tokens: has no effect without data.shuffle_tags")
    cached = {"cache": "latents", "center_crop": True, "shuffle_tags": True, "caption_prefix": "sks",
              "sources": [{"uri": "a"}, {"uri": "b", "caption_dropout": 0.1, "shuffle_tags": False}]}
    got = problems(cached)
    assert [p.split(":")[0] for p in got] == ["data.shuffle_tags", "data.sources[1].caption_dropout"]
    assert "(here data.caption_dropout=0.0, data.sources[1].caption_dropout=0.1)" in got[1]
    # One rate for every source: the cache's rows get the empty prompt's embedding.
    same = validate({**MIN, "data": {**cached, "shuffle_tags": False, "caption_dropout": 0.1}})
    assert [s.caption_dropout for s in same.data.source_sections()] == [0.1, 0.1]
    # Valid: each source's keys over data's.
    cfg = validate({**MIN, "data": {"caption_dropout": 0.1, "shuffle_tags": True, "sources": [
        {"uri": "a", "weight": 3, "caption_prefix": "sks", "keep_tokens": 1},
        {"uri": "b", "weight": 1, "caption_dropout": 0.0, "format": "captionfolder"}]}})
    a, b = cfg.data.source_sections()
    assert (a.uri, a.caption_prefix, a.keep_tokens, a.caption_dropout) == ("a", "sks", 1, 0.1)
    assert (b.uri, b.format, b.caption_dropout, b.shuffle_tags) == ("b", "captionfolder", 0.0, True)


def _readme_config_rows() -> dict[str, str]:
    import re

    text = open(os.path.join(REPO, "README.md")).read()
    table = text[text.index("## Config keys"):]
    table = table[:table.index("\n## ", 5)]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \|(.*)$", table, re.M)}


def test_every_config_key_is_in_the_readme_table():
    import re

    """The README's config table is what users read; a key added to config.py without a row
    entry is a key nobody finds."""
    rows = _readme_config_rows()
    missing = []
    for section, field in RayLoraConfig.model_fields.items():
        cls = next((a for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                    if hasattr(a, "model_fields")), None)
        if cls is None:
            continue
        row = rows.get(section, "") + rows.get("validation", "") * (section == "data")
        missing += [f"{section}.{k}" for k in cls.model_fields if not re.search(rf"\b{k}\b", row)]
    assert len(rows) >= 12
    assert missing == [], ", ".join(missing)


@pytest.mark.parametrize("key,values", [("lora.factor", [-1, 4]), ("lora.decompose_both", [False, True]),
                                        ("lora.rank", [4, 8])])
def test_a_search_of_what_a_lokr_init_from_fixes_is_refused(key, values):
    """Every trial starts from the folder: a LoKr's factor and decompose_both are in its
    tensors' shapes as its rank is (the factor-4 trial failed on the worker, after the
    cluster started)."""
    tree = apply_overrides(MIN, ["lora.variant=lokr", "lora.init_from=/adapters/lokr"])
    tree["tune"] = {"search_space": {key: {"choice": values}}, "metric": "train_loss"}
    with pytest.raises(ConfigError) as ei:
        validate(tree)
    assert ei.value.problems == [
        f"tune.search_space.{key}: every trial starts from lora.init_from (/adapters/lokr), "
        f"whose {key.split('.')[1]} is fixed; search other keys"]
    # without init_from the same search is a search like any other
    del tree["lora"]["init_from"]
    validate(tree)


def test_a_config_file_is_read_as_yaml_reads_a_stream_and_other_bytes_are_named(tmp_path):
    """A config saved as cp1252 ("café") gave Python's "'utf-8' codec can't decode byte
    0xe9 in position 52", naming no file; one PowerShell 5 wrote (UTF-16 with a mark) the
    same at byte 0. UTF-16 with a mark and UTF-8 with one are read (YAML reads both); other
    bytes are refused naming the file and the fix."""
    from raylora import jobs

    text = 'model: {pretrained: m}\ndata: {uri: d, caption_prefix: "café style,"}\noutput: {uri: o}\n'
    for name, raw in (("utf16.yaml", text.encode("utf-16")), ("bom.yaml", text.encode("utf-8-sig"))):
        (tmp_path / name).write_bytes(raw)
        assert load_config(tmp_path / name).data.caption_prefix == "café style,"
    (tmp_path / "cp1252.yaml").write_bytes(text.encode("cp1252"))
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "cp1252.yaml")
    at = text.encode("cp1252").index(b"\xe9")
    assert exc.value.problems == [f"{tmp_path}/cp1252.yaml: not UTF-8 text (byte {at} is 0xe9); "
                                  "save it as UTF-8"]
    # a --runtime-env file likewise
    (tmp_path / "env.yaml").write_bytes("env_vars: {NOTE: café}\n".encode("cp1252"))
    with pytest.raises(ValueError, match=r"env.yaml: not UTF-8 text \(byte 20 is 0xe9\); save it as UTF-8"):
        jobs.load_runtime_env(str(tmp_path / "env.yaml"), str(tmp_path))
    (tmp_path / "env.yaml").write_bytes("env_vars: {NOTE: café}\n".encode("utf-16"))
    assert jobs.load_runtime_env(str(tmp_path / "env.yaml"), str(tmp_path)) == {"env_vars": {"NOTE": "café"}}


def test_yaml_merge_keys_merge_and_a_key_beside_them_overrides_the_merged_one(tmp_path):
    """`<<: *anchor` was refused as "could not determine a constructor for the tag
    'tag:yaml.org,2002:merge'". A key given beside `<<` overrides the merged one (not a
    key given twice), also when that mapping is merged in turn (two explicit ones are:
    test_a_key_given_twice_in_a_yaml_file_is_refused_naming_both_lines)."""
    path = tmp_path / "merge.yaml"
    path.write_text(
        "model: {pretrained: m}\n"
        "data:\n"
        "  sources:\n"
        "    - &common {uri: a, caption_prefix: sks, caption_dropout: 0.1, repeats: 2}\n"
        "    - <<: *common\n"
        "      uri: b\n"
        "    - &third\n"
        "      <<: *common\n"
        "      repeats: 3\n"
        "    - {<<: *third, uri: d}\n"
        "scaling:\n"
        "  <<: {num_workers: 1, use_gpu: false}\n"
        "  num_workers: 2\n"
        "output: {uri: o}\n")
    cfg = load_config(path)
    assert [(s.uri, s.caption_prefix, s.caption_dropout, s.repeats) for s in cfg.data.sources] == [
        ("a", "sks", 0.1, 2), ("b", "sks", 0.1, 2), ("a", "sks", 0.1, 3), ("d", "sks", 0.1, 3)]
    assert (cfg.scaling.num_workers, cfg.scaling.use_gpu) == (2, False)


@pytest.mark.parametrize("key", ["train.seed", "data.shuffle_seed", "validation.seed",
                                 "data.class_generation.seed", "tune.seed"])
def test_a_seed_numpy_or_torch_cannot_take_is_refused_before_the_workers(key):
    """A negative seed passed and failed in the workers once the model had loaded (numpy's
    SeedSequence: "expected non-negative integer"), one of 2**64 or more in torch.manual_seed
    (overflow); tune.seed and train.seed seed Optuna's 32-bit RandomState. The bound leaves
    room for the seeds derived from one: seed + 1000 × rank + step stays a torch seed."""
    import numpy as np
    import torch

    tree = apply_overrides(MIN, ["data.class_prompt=a dog", "tune.metric=train_loss",
                                 "tune.search_space.lora.rank={choice: [4, 8]}"])
    for value, why in ((-1, "greater than or equal to 0"), (2**32, "less than 4294967296"),
                       (2**64, "less than 4294967296")):
        with pytest.raises(ConfigError) as err:
            validate(apply_overrides(tree, [f"{key}={value}"]))
        assert err.value.problems == [f"{key}: Input should be {why} (got {value})"]
    top = 2**32 - 1
    cfg = validate(apply_overrides(tree, [f"{key}={top}"]))
    section, name = key.rsplit(".", 1)
    node = cfg
    for part in section.split("."):
        node = getattr(node, part)
    assert getattr(node, name) == top
    # what the run does with the largest: a data order, a 64-rank run's step seed, Optuna's
    assert np.random.default_rng([top, 7]).permutation(3).shape == (3,)
    assert torch.Generator().manual_seed(top + 1000 * 63 + 10**7).initial_seed() == top + 63_000 + 10**7
    assert np.random.RandomState(top).randint(10) in range(10)


def test_max_sequence_length_is_refused_for_a_family_with_clip_encoders_only():
    """SD and SDXL read 77 CLIP tokens of a caption whatever model.max_sequence_length said:
    `raylora plan` accepted 256 and trained on 77. Refused naming the family, as
    model.system_prompt is for a family without one; the long-context families take it."""
    from raylora.launch import family_problems
    from raylora.model import families

    def problems(family: str, tree: dict) -> list[str]:
        return [p for p in family_problems(validate(tree), families.get(family), 8, None)
                if "max_sequence_length" in p]

    long = {**MIN, "model": {"pretrained": "m", "max_sequence_length": 256}}
    assert problems("sd", long) == [
        "model.max_sequence_length: sd (StableDiffusionPipeline) has no long-context text "
        "encoder to set it for: its CLIP text encoder reads 77 tokens of each caption; leave it unset"]
    assert problems("sdxl", long) == [
        "model.max_sequence_length: sdxl (StableDiffusionXLPipeline) has no long-context text "
        "encoder to set it for: its 2 CLIP text encoders read 77 tokens of each caption; leave it unset"]
    searched = {**MIN, "tune": {"metric": "train_loss", "search_space": {
        "model.max_sequence_length": {"choice": [128, 256]}}}}
    assert [p.split(":")[0] for p in problems("sdxl", searched)] == [
        "tune.search_space.model.max_sequence_length"]
    assert problems("sd", MIN) == []
    assert [f for f in families.names() if problems(f, long)] == ["sd", "sdxl"]


def test_an_override_into_a_section_given_as_null_sets_that_key(tmp_path):
    """`lora:` with its keys commented out validates as lora's defaults, but `lora.rank=16`
    was refused as "lora: is a value, not a section". Nested sections read the same;
    `tune: null` (no search) takes an override as if tune were absent; a value stays one."""
    path = tmp_path / "job.yaml"
    path.write_text("model: {pretrained: m}\ndata: {uri: d}\noutput: {uri: o}\n"
                    "lora:\n  # rank: 16\ntune:\n")
    cfg = load_config(path, ["lora.rank=16"])
    assert (cfg.lora.rank, cfg.lora.effective_alpha, cfg.tune) == (16, 16.0, None)
    path.write_text(path.read_text() + "train:\n  flow:\n    # shift: 3.0\n")
    assert load_config(path).train.flow.shift == "auto"
    assert load_config(path, ["train.flow.shift=3.0"]).train.flow.shift == 3.0
    cfg = load_config(path, ["tune.metric=train_loss", "tune.search_space.lora.rank={choice: [4, 8]}"])
    assert list(cfg.tune.search_space) == ["lora.rank"]
    with pytest.raises(ConfigError) as err:
        apply_overrides({**MIN, "lora": {"target_modules": None}}, ["lora.target_modules.x=1"])
    assert err.value.problems == ["lora.target_modules: is a value, not a section"]


def test_a_yaml_boolean_is_not_read_as_a_number(tmp_path):
    """YAML reads on/yes/true as true, and pydantic took it as 1: `noise_offset: on`
    trained with an offset of 1.0, `lora.rank=true` at rank 1. Keys that take booleans
    still do."""
    path = tmp_path / "job.yaml"
    path.write_text("model: {pretrained: m}\ndata: {uri: d}\noutput: {uri: o}\n"
                    "train:\n  noise_offset: on\n  snr_gamma: yes\n")
    yaml_said = "(YAML reads true/false, yes/no and on/off as booleans)"
    with pytest.raises(ConfigError) as err:
        load_config(path, ["train.max_steps=on", "lora.rank=true", "scaling.num_workers=true",
                           "train.flow.shift=off", "data.background_color=[true, 0, 0]"])
    assert sorted(err.value.problems) == sorted([
        f"train.snr_gamma: a number, not True {yaml_said}",
        f"train.noise_offset: a number, not True {yaml_said}",
        f"train.max_steps: an integer, not True {yaml_said}",
        f"lora.rank: an integer, not True {yaml_said}",
        f"scaling.num_workers: an integer, not True {yaml_said}",
        f"train.flow.shift: a number, not False {yaml_said}",
        f"data.background_color: [True, 0, 0]: numbers, not booleans {yaml_said}"])
    cfg = validate(apply_overrides(MIN, ["data.random_flip=yes", "train.channels_last=on",
                                         "train.compile=true", "lora.rank=8", "train.noise_offset=0"]))
    assert (cfg.data.random_flip, cfg.train.channels_last, cfg.train.compile) == (True, True, "regional")
    assert (cfg.lora.rank, cfg.train.noise_offset) == (8, 0.0)


def test_keys_no_run_of_this_config_reads_are_refused():
    """More keys of a feature that is off, accepted though nothing read them. Not
    validation.guidance_scale: the model card's example samples with it."""
    overrides = ["data.cache_uri=s3://bucket/cache", "data.small_images=upscale",
                 "data.num_class_images=200", "data.validation_max_samples=500",
                 "scaling.resize_check_s=5", "validation.num_inference_steps=50",
                 "tracking.project=proj", "tracking.wandb_mode=offline", "tracking.run_name=r",
                 "validation.guidance_scale=3"]
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(MIN, overrides))
    wandb = "set tracking.backend: wandb or drop it"
    assert err.value.problems == [
        "data.cache_uri: set, but data.cache is none (no latent cache): nothing reads it; "
        "set data.cache: latents or drop it",
        "data.small_images: set, but data.min_size is 0 (no image is too small): nothing reads "
        "it; set data.min_size or drop it",
        "data.num_class_images: set, but prior preservation is off (no data.class_prompt or "
        "data.class_sources): nothing reads it; set them or drop it",
        "data.validation_max_samples: set, but there is no held-out data: nothing reads it; "
        "set data.validation_split or data.validation_uri, or drop it",
        "scaling.resize_check_s: set, but scaling.num_workers is a fixed count, not an elastic "
        "[min, max]: nothing reads it; drop it",
        "validation.num_inference_steps: set, but there are no validation.prompts to render: "
        "nothing reads it; add prompts or drop it",
        f"tracking.project: set, but tracking.backend is none: only wandb reads it; {wandb}",
        f"tracking.wandb_mode: set, but tracking.backend is none: only wandb reads it; {wandb}",
        f"tracking.run_name: set, but tracking.backend is none: only wandb reads it; {wandb}"]
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(MIN, ["tracking.backend=tensorboard", "tracking.project=proj"]))
    assert [p.split(":")[0] for p in err.value.problems] == ["tracking.project"]
    # each with its feature on
    validate(apply_overrides(MIN, overrides + [
        "data.cache=latents", "data.center_crop=true", "data.min_size=32", "data.class_prompt=a dog",
        "data.validation_uri=v", "scaling.num_workers=[1, 2]", "data.sharding=files",
        "validation.prompts=[a dog]", "tracking.backend=wandb"]))


def test_keys_only_another_setting_reads_are_refused_where_it_is_off():
    """tune.max_t with scheduler fifo (trials ran their whole max_steps), the held-out
    loss's timesteps or size without held-out data (or previews), bf16's GroupNorm choice under fp32, a shuffle
    buffer that bucketing does not use: accepted, and nothing read them."""
    overrides = ["validation.num_timesteps=16", "validation.resolution=128",
                 "train.groupnorm_fp32=true", "data.bucketing=true", "data.shuffle_buffer_size=16"]
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(MIN, overrides))
    assert err.value.problems == [
        "validation.num_timesteps: set, but there is no held-out data (its loss is what it "
        "sets the timesteps of): nothing reads it; set data.validation_split or "
        "data.validation_uri, or drop it",
        "validation.resolution: set, but there is neither held-out data nor validation.prompts "
        "(the size is theirs): nothing reads it; set one of them or drop it",
        "train.groupnorm_fp32: set, but train.mixed_precision is no (it chooses the "
        "GroupNorms' dtype under bf16 only): nothing reads it; drop it",
        "data.shuffle_buffer_size: set, but data.bucketing deals each bucket's batches in its "
        "own seeded order, with no shuffle buffer: nothing reads it; drop it"]
    validate(apply_overrides(MIN, overrides + [  # each with what reads it
        "data.validation_split=0.1", "train.mixed_precision=bf16", "data.bucketing=false"]))
    search = ["tune.metric=train_loss", "tune.scheduler=fifo", "tune.max_t=100",
              "tune.grace_period=50", "tune.reduction_factor=4",
              "tune.search_space.train.learning_rate={loguniform: [1e-5, 1e-3]}"]
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(MIN, search))
    fifo = "only asha reads it (a fifo search stops no trial early); set tune.scheduler: asha or drop it"
    assert err.value.problems == [f"tune.{k}: set, but tune.scheduler is fifo: {fifo}"
                                  for k in ("max_t", "grace_period", "reduction_factor")]
    validate(apply_overrides(MIN, search + ["tune.scheduler=asha"]))
    # A search whose values leave a key unread in some trials only: the buffer that
    # bucketing's trials do not read, the others do. Those trials' trees drop it.
    both = validate(apply_overrides(MIN, [
        "data.shuffle_buffer_size=16", "tune.metric=train_loss",
        "tune.search_space.data.bucketing={choice: [true, false]}"]))
    trees = [trial_tree(both.to_dict(), {"data.bucketing": b}) for b in (True, False)]
    assert [t["data"].get("shuffle_buffer_size") for t in trees] == [None, 16]
    assert [validate(t).data.shuffle_buffer_size for t in trees] == [
        DataSection.model_fields["shuffle_buffer_size"].default, 16]
    # ...but a searched key that one of its own values leaves unread is still refused.
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(MIN, ["tune.metric=train_loss",
                                       "tune.search_space.train.groupnorm_fp32={choice: [true, false]}"]))
    assert err.value.problems == [
        "tune.search_space.train.groupnorm_fp32=True: train.groupnorm_fp32: set, but "
        "train.mixed_precision is no (it chooses the GroupNorms' dtype under bf16 only): "
        "nothing reads it; drop it"]


def test_lr_find_takes_a_config_whose_wandb_and_elastic_keys_it_drops():
    """lr-find runs one worker with no tracker: the config it trains by drops the wandb
    keys and resize_check_s, which a run without wandb or an elastic size now refuses."""
    from types import SimpleNamespace

    from raylora.launch import _lr_find_config

    cfg = validate({"model": {"pretrained": "m"}, "data": {"uri": "d", "sharding": "files"},
                    "output": {"uri": "/tmp/x"},
                    "tracking": {"backend": "wandb", "project": "p", "wandb_mode": "offline",
                                 "run_name": "r"},
                    "scaling": {"num_workers": [1, 2], "resize_check_s": 30}})
    swept = _lr_find_config(cfg, SimpleNamespace(start_lr=1e-6, end_lr=1e-2, num_steps=10))
    assert (swept.tracking.backend, swept.tracking.run_name, swept.scaling.num_workers) == \
        ("none", None, 1)


def test_a_search_algorithm_that_cannot_be_imported_is_refused_before_ray(tmp_path, monkeypatch):
    """hyperopt 0.2.7 on today's setuptools is found (importlib's find_spec, all the check
    asked) but its import of pkg_resources fails: the search died inside Ray with
    "HyperOpt must be installed!" of an installed package."""
    import sys

    (tmp_path / "hyperopt").mkdir()
    (tmp_path / "hyperopt" / "__init__.py").write_text("import pkg_resources_gone_from_setuptools\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hyperopt", raising=False)
    tree = {**MIN, "tune": {"search_alg": "hyperopt", "num_samples": 2,
                            "search_space": {"train.learning_rate": {"loguniform": [1e-5, 1e-3]}}}}
    with pytest.raises(ConfigError) as ei:
        validate(tree)
    assert ("tune.search_alg: hyperopt is installed but cannot be imported (No module named "
            "'pkg_resources_gone_from_setuptools'); pip install -e '.[hyperopt]'") in ei.value.problems
