"""Every manifest under k8s/ is checked against the schema the cluster will apply, in strict
mode (unknown fields rejected, as `kubectl apply` does), plus the contracts users rely on:
pinned images, GPU limits, credentials only from the Secret, non-root pods, self-cleaning jobs.
"""

from __future__ import annotations

import copy
import hashlib
import posixpath
import re
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from raylora.storage import AWS_ENV_VARS

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
# Vendored KubeRay CRDs (source commit and checksums in their README).
CRD_DIR = REPO / "tests" / "data" / "kuberay-crds"
CRD_FILES = ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml")
K8S_VERSION = "1.30.0"  # oldest Kubernetes these manifests target (kubernetes-validate schema)
SECRET_NAME = "raylora-s3"
HF_SECRET_NAME = "raylora-hf"  # HF_TOKEN, optional on every Ray container
SECRET_ONLY = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")  # required on every Ray container
ENTRYPOINT = re.compile(r"^python -m raylora (train|tune) (jobs/configs/[\w.-]+\.ya?ml)(\s|$)")


def ray_version() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [m.group(1) for d in deps if (m := re.match(r"ray(?:\[[^\]]*\])?==([\w.]+)$", d))]
    assert len(pins) == 1, f"expected one ray==X pin in pyproject.toml, found {pins}"
    return pins[0]


def _load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


MANIFESTS = {p.name: _load(p) for p in sorted(K8S.glob("*.yaml"))}
DOCS = [(name, doc) for name, docs in MANIFESTS.items() for doc in docs]
RAY_DOCS = [(n, d) for n, d in DOCS if d.get("kind") in ("RayJob", "RayCluster")]
RAYJOBS = [(n, d) for n, d in DOCS if d.get("kind") == "RayJob"]


def test_expected_manifests_present():
    # Guards against the parametrized tests below passing because nothing was collected.
    kinds = {(n, d["kind"]) for n, d in DOCS}
    assert {
        ("rayjob-finetune.yaml", "RayJob"),
        ("rayjob-tune.yaml", "RayJob"),
        ("raycluster.yaml", "RayCluster"),
        ("secret-example.yaml", "Secret"),
        ("kustomization.yaml", "Kustomization"),
    } <= kinds


# ---- schema validation ---------------------------------------------------------------------


def _strict(schema):
    """Copy of an OpenAPI schema that rejects unknown fields. The API server prunes or (with
    kubectl's default strict field validation) rejects them; plain jsonschema would ignore a
    typo such as `shutdownAfterJobFinish` and pass."""
    if not isinstance(schema, dict):
        return schema
    s = dict(schema)
    if "properties" in s:
        s["properties"] = {k: _strict(v) for k, v in s["properties"].items()}
        if "additionalProperties" not in s and not s.get("x-kubernetes-preserve-unknown-fields"):
            s["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(s.get(key), dict):
            s[key] = _strict(s[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in s:
            s[key] = [_strict(x) for x in s[key]]
    return s


@pytest.fixture(scope="module")
def crd_validators() -> dict[str, jsonschema.Draft7Validator]:
    validators = {}
    for fname in CRD_FILES:
        with open(CRD_DIR / fname) as f:
            crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        # The CRD schema describes the whole object (apiVersion, kind, metadata, spec, status).
        validators[crd["spec"]["names"]["kind"]] = jsonschema.Draft7Validator(
            _strict(v1["schema"]["openAPIV3Schema"])
        )
    return validators


def test_vendored_crds_match_their_readme():
    # The README is the record of where the schemas came from; a replaced file must update it.
    readme = (CRD_DIR / "README.md").read_text()
    recorded = dict(re.findall(r"`(ray\.io_\w+\.yaml)`\s+([0-9a-f]{64})", readme))
    actual = {f: hashlib.sha256((CRD_DIR / f).read_bytes()).hexdigest() for f in CRD_FILES}
    assert recorded == actual


def test_crds_define_both_kinds(crd_validators):
    assert sorted(crd_validators) == ["RayCluster", "RayJob"]


def crd_errors(doc: dict, validators) -> list[str]:
    if doc.get("apiVersion") != "ray.io/v1":
        return [f"apiVersion {doc.get('apiVersion')!r}, expected ray.io/v1"]
    errors = validators[doc["kind"]].iter_errors(doc)
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d.get('kind')}" for n, d in DOCS])
def test_manifest_validates(name, doc, crd_validators):
    kind = doc.get("kind")
    if kind in ("RayJob", "RayCluster"):
        errors = crd_errors(doc, crd_validators)
        assert not errors, f"{name}: " + "\n".join(errors)
    elif kind == "Kustomization":
        # Not applied to the cluster; it only has to list files that exist.
        assert doc["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
        missing = [r for r in doc["resources"] if not (K8S / r).is_file()]
        assert doc["resources"] and not missing, f"{name} lists missing files: {missing}"
    else:
        # Core kinds: the Kubernetes OpenAPI schema; raises with the offending field.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _finetune() -> dict:
    (doc,) = MANIFESTS["rayjob-finetune.yaml"]
    return copy.deepcopy(doc)


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (lambda d: d["spec"]["rayClusterSpec"].pop("headGroupSpec"), "headGroupSpec"),
        (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas="eight"),
         "'eight' is not of type 'integer'"),
        (lambda d: d["spec"].update(shutdownAfterJobFinish=True), "shutdownAfterJobFinish"),
        (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
         ["containers"][0]["resources"]["limits"].update(memory="48 GB"), "48 GB"),
    ],
    ids=["no-head-group", "replicas-string", "unknown-field", "bad-quantity"],
)
def test_crd_validation_rejects_broken_manifest(mutate, expected, crd_validators):
    doc = _finetune()
    mutate(doc)
    errors = crd_errors(doc, crd_validators)
    assert any(expected in e for e in errors), errors


def test_core_validation_rejects_broken_secret():
    (secret,) = copy.deepcopy(MANIFESTS["secret-example.yaml"])
    secret["stringdata"] = secret.pop("stringData")  # a typo the API server would reject
    with pytest.raises(kubernetes_validate.ValidationError, match="stringdata"):
        kubernetes_validate.validate(secret, K8S_VERSION, strict=True)


# ---- contracts -----------------------------------------------------------------------------


def cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def pod_templates(doc: dict):
    """(group name, pod template) for the head and every worker group."""
    spec = cluster_spec(doc)
    yield "head", spec["headGroupSpec"]["template"]
    for group in spec.get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]


def containers(doc: dict):
    for group, tmpl in pod_templates(doc):
        for c in tmpl["spec"]["containers"]:
            yield group, c


def _images(node):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from [v] if k == "image" else _images(v)
    elif isinstance(node, list):
        for v in node:
            yield from _images(v)


def test_images_pinned_to_pyproject_ray():
    version = ray_version()
    images = [(n, img) for n, d in DOCS for img in _images(d)]
    assert images
    for name, image in images:
        assert re.fullmatch(rf"rayproject/ray:{re.escape(version)}-py311(-gpu)?", image), (
            f"{name}: image {image} is not rayproject/ray pinned to ray=={version}"
        )
    for name, doc in RAY_DOCS:
        assert cluster_spec(doc)["rayVersion"] == version, name


def secret_env_problems(doc: dict) -> list[str]:
    problems = []
    for group, c in containers(doc):
        env = {e["name"]: e for e in c.get("env", [])}
        for var in SECRET_ONLY:
            if var not in env:
                problems.append(f"{group}/{c['name']}: {var} missing")
        for var, e in env.items():
            if not var.startswith("AWS_"):
                continue
            ref = e.get("valueFrom", {}).get("secretKeyRef", {})
            if "value" in e or ref.get("name") != SECRET_NAME:
                problems.append(f"{group}/{c['name']}: {var} must come from Secret {SECRET_NAME}")
            elif var in SECRET_ONLY and ref.get("optional"):
                problems.append(f"{group}/{c['name']}: {var} must not be optional")
        # The hub token: from its own Secret, optional (a public model needs none, and a
        # placeholder token would be refused by the hub even for public repos).
        hf = env.get("HF_TOKEN", {})
        ref = hf.get("valueFrom", {}).get("secretKeyRef", {})
        if "value" in hf or ref.get("name") != HF_SECRET_NAME or not ref.get("optional"):
            problems.append(f"{group}/{c['name']}: HF_TOKEN must come from Secret "
                            f"{HF_SECRET_NAME}, optional")
    return problems


@pytest.mark.parametrize("name,doc", RAY_DOCS, ids=[n for n, _ in RAY_DOCS])
def test_credentials_only_from_secret(name, doc):
    assert not secret_env_problems(doc), secret_env_problems(doc)


def test_credential_check_catches_literal_key():
    doc = _finetune()
    _, worker = list(containers(doc))[-1]
    worker["env"][1] = {"name": "AWS_SECRET_ACCESS_KEY", "value": "not-a-real-key"}
    assert secret_env_problems(doc) == [
        "gpu/ray-worker: AWS_SECRET_ACCESS_KEY must come from Secret raylora-s3"
    ]


def test_secret_example_matches_the_references():
    (secret,) = MANIFESTS["secret-example.yaml"]
    assert secret["metadata"]["name"] == SECRET_NAME and secret["type"] == "Opaque"
    data = secret["stringData"]
    # Placeholders only: a real key in the repository is a leaked key.
    assert data["AWS_ACCESS_KEY_ID"] == data["AWS_SECRET_ACCESS_KEY"] == "REPLACE_ME"
    required = {
        e["valueFrom"]["secretKeyRef"]["key"]
        for _, d in RAY_DOCS
        for _, c in containers(d)
        for e in c.get("env", [])
        if "valueFrom" in e and not e["valueFrom"]["secretKeyRef"].get("optional")
    }
    assert required <= set(data), f"Secret lacks non-optional keys {required - set(data)}"


@pytest.mark.parametrize("name,doc", RAY_DOCS, ids=[n for n, _ in RAY_DOCS])
def test_secure_pods_and_gpu_workers(name, doc):
    # Without a token, anyone who reaches the head Service runs code with the S3 credentials.
    assert cluster_spec(doc)["authOptions"]["mode"] == "token", name
    for group, tmpl in pod_templates(doc):
        pod = tmpl["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, f"{name}/{group}"
        for c in tmpl["spec"]["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, f"{name}/{group}"
    gpu_groups = 0
    for g in cluster_spec(doc)["workerGroupSpecs"]:
        where = f"{name}/{g['groupName']}"
        spec = g["template"]["spec"]
        ray = spec["containers"][0]  # KubeRay treats the first container as the Ray container
        gpus = int(ray["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        # GPU image <=> GPU limit: without the limit the pod lands on a node with no GPU.
        assert (gpus >= 1) == ray["image"].endswith("-gpu"), f"{where}: image vs nvidia.com/gpu"
        if gpus:
            gpu_groups += 1
            shm = [m["name"] for m in ray.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            assert shm, f"{where}: /dev/shm not mounted"
            (vol,) = [v for v in spec["volumes"] if v["name"] == shm[0]]
            assert vol["emptyDir"]["medium"] == "Memory", where
    assert gpu_groups, f"{name}: no GPU worker group"


def _cpus(quantity) -> float:
    q = str(quantity)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def gpu_pods(doc: dict) -> list[tuple[int, int, float]]:
    """(max pods, GPUs per pod, CPUs per pod) of each worker group with GPUs."""
    out = []
    for g in cluster_spec(doc)["workerGroupSpecs"]:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        if int(limits.get("nvidia.com/gpu", 0)):
            out.append((g["maxReplicas"], int(limits["nvidia.com/gpu"]), _cpus(limits["cpu"])))
    return out


@pytest.mark.parametrize("name,doc", RAYJOBS, ids=[n for n, _ in RAYJOBS])
def test_rayjob_contract(name, doc):
    spec = doc["spec"]
    # The cluster (and its GPUs) goes away once the job ends.
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec.get("ttlSecondsAfterFinished"), int)

    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict), "runtimeEnvYAML must be a YAML mapping"
    assert any(p.startswith("raylora") for p in runtime_env["pip"]), "raylora not installed"
    # raylora's driver forwards these itself; Ray rejects a job env that repeats a key, and a
    # secret in the runtime env shows up in job metadata.
    clash = set(runtime_env.get("env_vars", {})) & set(AWS_ENV_VARS)
    assert not clash, f"runtimeEnvYAML env_vars must not set {clash}"

    m = ENTRYPOINT.match(spec["entrypoint"])
    assert m, f"entrypoint {spec['entrypoint']!r} is not `python -m raylora train|tune CONFIG`"
    config = m.group(2)
    # The driver runs on the head: the config's directory must be mounted under its workingDir.
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mount_path = posixpath.join(head["containers"][0]["workingDir"], posixpath.dirname(config))
    (mount,) = [v for v in head["containers"][0]["volumeMounts"] if v["mountPath"] == mount_path]
    (vol,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
    assert "configMap" in vol, f"{mount_path} is not mounted from a ConfigMap"

    if not (REPO / config).is_file():
        pytest.fail(f"{name}: entrypoint names {config}, which does not exist")
    job = yaml.safe_load((REPO / config).read_text())
    assert ("tune" in job) == (m.group(1) == "tune"), f"{config}: tune section vs entrypoint"
    scaling = job.get("scaling", {})
    if scaling.get("use_gpu"):
        # Each Ray Train worker (of the run, or of one Tune trial) takes 1 GPU +
        # cpus_per_worker CPUs on one pod.
        pods = gpu_pods(doc)
        gpus = sum(n * gpu for n, gpu, _ in pods)
        assert scaling.get("num_workers", 1) <= gpus, f"{config} needs more GPUs than {name}"
        cpus = max(cpu / gpu for _, gpu, cpu in pods)
        assert scaling.get("cpus_per_worker", 1) <= cpus, f"{config}: too many CPUs per worker"


@pytest.mark.parametrize("name,doc", RAY_DOCS, ids=[n for n, _ in RAY_DOCS])
def test_pods_give_a_clean_stop_its_time(name, doc):
    """#23 item 5: a deleted pod's SIGTERM stops the run at a step with a checkpoint within
    failure.stop_timeout_s; Kubernetes' default grace (30 s) would SIGKILL it first."""
    from raylora.config import FailureSection

    stop = FailureSection().stop_timeout_s
    for group, tmpl in pod_templates(doc):
        grace = tmpl["spec"].get("terminationGracePeriodSeconds", 30)
        assert grace >= stop + 15, f"{name}/{group}: {grace} s for a {stop} s stop"


@pytest.mark.parametrize("name,job", RAYJOBS, ids=[n for n, _ in RAYJOBS])
def test_a_rayjob_stopped_through_ray_gives_the_run_its_time(name, job):
    """A RayJob stopped through Ray (suspend, activeDeadlineSeconds, `ray job stop`) has
    its driver SIGTERMed, then SIGKILLed after RAY_JOB_STOP_WAIT_TIME_S from the job's
    env_vars, 3 s by default: the run's clean stop (a checkpoint within
    failure.stop_timeout_s) needs longer, as `raylora submit` gives it."""
    import yaml

    from raylora.config import FailureSection

    stop = FailureSection().stop_timeout_s
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= stop + 15, name


RAYCLUSTERS = [(n, d) for n, d in DOCS if d.get("kind") == "RayCluster"]


@pytest.mark.parametrize("name,cluster", RAYCLUSTERS, ids=[n for n, _ in RAYCLUSTERS])
def test_a_plain_ray_job_submit_to_a_raycluster_gets_the_runs_stop_time(name, cluster):
    """A job submitted to a long-lived RayCluster with plain `ray job submit` carries no
    RAY_JOB_STOP_WAIT_TIME_S of its own: its supervisor, which Ray runs on the head, reads
    the head's environment, and Ray's default of 3 s SIGKILLs the driver before the clean
    stop's checkpoint."""
    from raylora.config import FailureSection

    stop = FailureSection().stop_timeout_s
    head = next(c for group, c in containers(cluster) if group == "head")
    env = {e["name"]: e.get("value") for e in head.get("env", [])}
    assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= stop + 15, name


def _required_refs(node, found: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """(kind, name) of every Secret and ConfigMap a manifest needs to exist (those not
    marked optional), anywhere under ``node``."""
    if isinstance(node, dict):
        for kind, key in (("secret", "secretKeyRef"), ("configmap", "configMap"),
                          ("secret", "secretRef"), ("configmap", "configMapKeyRef")):
            ref = node.get(key)
            if isinstance(ref, dict) and not ref.get("optional"):
                found.add((kind, ref["name"]))
        for value in node.values():
            _required_refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _required_refs(value, found)
    return found


@pytest.mark.parametrize("name", ["rayjob-finetune.yaml", "rayjob-tune.yaml"])
def test_the_readmes_kubernetes_steps_create_what_the_jobs_need(name):
    """Followed as written, README's steps create every Secret and ConfigMap the RayJob
    mounts or reads without `optional` (the job-config ConfigMap was missing: the head pod
    could not start)."""
    readme = (REPO / "README.md").read_text()
    steps = readme.split("### 3. Kubernetes (KubeRay)", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    needed = set().union(*(_required_refs(d, set()) for d in MANIFESTS[name]))
    assert ("configmap", "raylora-job-configs") in needed and ("secret", SECRET_NAME) in needed
    for kind, ref in sorted(needed):
        made = (f"kubectl create configmap {ref} " if kind == "configmap"
                else f"kubectl create secret generic {ref} ")
        assert made in steps, f"{name} needs {kind} {ref}; README's steps do not create it"


@pytest.mark.parametrize("path,head", [
    ("k8s/raycluster.yaml", {"CPU": 0.0}),  # rayStartParams num-cpus "0", GPU replicas 0
    ("cluster/aws-gpu.yaml", {"CPU": 8.0}),  # m5.2xlarge head, gpu_worker min_workers 0
])
def test_an_autoscaling_clusters_commands_ask_for_autoscaling(path, head):
    """A cluster whose GPU workers start at 0 holds none when a job's driver checks the
    cluster (check_cluster_fits): the commands its header gives must say
    scaling.autoscaling=true, which skips that check, or the job was refused in seconds
    and the autoscaler never added a worker."""
    from raylora.config import ConfigError, load_config
    from raylora.launch import check_cluster_fits, fitted_to

    header = " ".join(line[1:].strip() for line in (REPO / path).read_text().splitlines()
                      if line.startswith("#"))
    # each command as one line: its continuation backslashes joined
    lines = re.split(r"(?<!\\) (?=raylora submit |ray job submit )", header.replace("\\ ", ""))
    commands = [re.search(r"raylora (?:train|submit) (jobs/configs/\S+)((?: [^ #(]+)*)", c)
                for c in lines if "jobs/configs/" in c]
    assert len(commands) == {"k8s/raycluster.yaml": 2, "cluster/aws-gpu.yaml": 1}[path]
    for config, rest in (c.groups() for c in commands):
        overrides = [w for w in rest.split() if "=" in w and not w.startswith("-")]
        cfg = load_config(REPO / config, overrides)
        assert cfg.scaling.autoscaling, f"{path}: `{config}{rest}` lacks scaling.autoscaling=true"
        assert check_cluster_fits(cfg) is cfg  # no look at the cluster as it is
        with pytest.raises(ConfigError, match="scaling.autoscaling: true"):
            fitted_to(load_config(REPO / config), [head])  # as it is: refused
