"""Models named, not pathed: a worker started from one checkout serves jobs submitted from
another checkout at another path, by the default names, by an alias and by a hub id
(a model placed in a local hub cache); refusals never show the worker's paths."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.contract.model_names import ModelCatalog, job_default, parse_aliases
from jobs.contract.spec import JobSpecError, build_spec, spec_from_payload
from jobs.settings import SHIPPED_MODELS, Settings
from tests.support.worker_procs import WorkerProcess
from worker.models import ModelPool, locate

ROOT = Path(__file__).resolve().parents[2]
CODE = ("specprefill", "cache_store", "jobs", "worker", "specprefill_cli", "specprefill_server", "models", "pyproject.toml")
REVISION = "0123456789abcdef0123456789abcdef01234567"
HUB_ID = "acme/tiny-draft"


def checkout(dest: Path) -> Path:
    """A copy of the project's code and models at ``dest`` (another path, another "Mac")."""
    dest.mkdir(parents=True)
    for name in CODE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def hub_cache(root: Path, repo_id: str, model: Path) -> Path:
    """``model`` as a downloaded hub snapshot (HF_HUB_CACHE layout: snapshots/ and refs/)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / REVISION
    shutil.copytree(model, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return root


CLIENT = r"""
import json, sys
import jobs
from jobs.client import Client, JobFailed
from jobs.settings import Settings
url, names = sys.argv[1], json.loads(sys.argv[2])
c = Client.from_url(url, Settings.from_env())
out = {"jobs_from": jobs.__file__}
for label, name in names.items():
    fields = dict(tokens=[5 + (i * 7) % 240 for i in range(395)], threshold=64, tail_tokens=32,
                  chunk_size=16)  # ids below 250: inside any shipped vocabulary
    if name is not None:
        fields["draft_model"] = name
    h = c.submit(**fields)
    try:
        r = h.result(timeout=120)
        out[label] = {"model": r.model, "draft_name": r.draft_name, "kept": r.kept, "total": r.total,
                      "kinds": [e.kind for e in h.events(timeout=5)]}
    except JobFailed as exc:
        out[label] = {"error": str(exc)}
print(json.dumps(out))
"""


def _env(code: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_")}
    return dict(env, PYTHONPATH=str(code), **extra)


@pytest.fixture(scope="module")
def two_checkouts(tmp_path_factory):
    base = tmp_path_factory.mktemp("macs")
    return checkout(base / "mac-a" / "specprefill"), checkout(base / "elsewhere" / "b" / "sp")


def test_worker_from_one_checkout_serves_named_jobs_from_another(two_checkouts, redis_url, tmp_path):
    worker_code, client_code = two_checkouts
    srv = tmp_path / "srv" / "models"
    shutil.copytree(worker_code / "models" / "draft-tiny", srv / "qwen-draft")
    hub = hub_cache(tmp_path / "hub", HUB_ID, worker_code / "models" / "draft-tiny")
    name = f"mac-a-{os.getpid()}"
    env = _env(worker_code, SPECPREFILL_MODELS=f"qwen-draft={srv / 'qwen-draft'}",
               SPECPREFILL_ALLOWED_MODELS=f"qwen-draft,{HUB_ID},acme/not-here",
               HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", SPECPREFILL_BLOCK_SIZE="64")
    w = WorkerProcess([sys.executable, "-m", "worker", "--redis-url", redis_url, "--name", name],
                      env, name, redis_url, tmp_path / "worker.log", ready_timeout=60,
                      cwd=worker_code)
    try:
        names = {"default": None, "alias": "qwen-draft", "hub": HUB_ID,
                 "missing": "acme/not-here", "refused": "evil/model"}
        run = subprocess.run([sys.executable, "-c", CLIENT, redis_url, json.dumps(names)],
                             cwd=client_code, env=_env(client_code), capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        w.stop()
    assert out["jobs_from"].startswith(str(client_code))  # the client really ran the other copy
    for label, job_name in (("default", "draft"), ("alias", "qwen-draft"), ("hub", HUB_ID)):
        r = out[label]
        assert "error" not in r, (label, r, w.text()[-3000:])
        assert r["draft_name"] == job_name and r["total"] == 395 and 0 < r["kept"] < 395
        assert "loading_model" in r["kinds"] and r["kinds"][-1] == "done"
    # one set of weights, three names: the same identity, so the same block-store keys
    assert out["hub"]["model"] == f"hub:{HUB_ID}@{REVISION}"
    assert out["default"]["model"] == out["alias"]["model"] and out["default"]["model"].startswith("local:")
    missing = out["missing"]["error"]
    assert f"hf download acme/not-here" in missing and "SPECPREFILL_ALLOW_DOWNLOADS" in missing
    assert "'evil/model' is not an allowed model" in out["refused"]["error"]
    assert "draft, qwen-draft" in out["refused"]["error"]
    for r in (missing, out["refused"]["error"]):
        assert str(worker_code) not in r and str(srv) not in r and str(hub) not in r
    assert f"{HUB_ID}" in w.text()  # the worker's own log may say where it loaded from


def test_defaults_are_sent_as_names_and_configured_models_as_given():
    assert job_default(Settings(), "draft") == "draft" and job_default(Settings(), "target") == "target"
    assert build_spec(Settings(), tokens=[1]).to_payload()["draft_model"] == "draft"
    assert job_default(Settings(draft_model="qwen-draft"), "draft") == "qwen-draft"


def test_aliases_parse_and_resolve():
    cat = ModelCatalog.from_settings(Settings(models=("q=/srv/q", "h=org/name"), draft_model="q"))
    assert cat.source("draft") == "/srv/q" and cat.source("h") == "org/name"
    assert cat.source("org/other") == "org/other" and cat.names() == ["draft", "target", "q", "h"]
    for bad in ("noequals", "=x", "a/b=x", "draft=x"):
        with pytest.raises(ValueError, match="^models: "):
            parse_aliases((bad,))


def test_missing_alias_folder_is_refused_without_its_path(tmp_path):
    gone = tmp_path / "secret-place" / "m"
    pool = ModelPool(1, catalog=ModelCatalog.from_settings(Settings(models=(f"m={gone}",))))
    with pytest.raises(ValueError) as info:
        pool.get("m")
    assert str(info.value) == "draft_model: 'm': its folder is missing on this worker"


def test_hub_download_is_announced_and_used(tmp_path, monkeypatch):
    """With allow_downloads, a hub id missing from the cache is downloaded (here by a fake
    snapshot_download that fills the cache), after the ``on_download`` announcement."""
    import huggingface_hub

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    real = huggingface_hub.snapshot_download
    calls = []

    def fake_download(repo_id, local_files_only=False, **kw):
        if not local_files_only:
            calls.append(repo_id)
            hub_cache(cache, repo_id, SHIPPED_MODELS / "draft-tiny")
        return real(repo_id, local_files_only=True, cache_dir=str(cache), **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    cat = ModelCatalog.from_settings(Settings())
    with pytest.raises(ValueError, match="hf download acme/dl"):
        locate("acme/dl", cat)
    announced = []
    where = locate("acme/dl", cat, allow_download=True, on_download=lambda: announced.append(1))
    assert announced == [1] and calls == ["acme/dl"]
    assert where.identity == f"hub:acme/dl@{REVISION}" and Path(where.path, "config.json").is_file()


def test_allowed_models_refusal_lists_names_not_paths(tmp_path):
    s = Settings(allowed_models=(str(tmp_path / "private"), "org/ok"), models=(f"q={tmp_path}",))
    with pytest.raises(JobSpecError) as info:
        spec_from_payload({"draft_model": "org/no", "tokens": [1]}, s)
    msg = str(info.value)
    assert "allowed: draft, org/ok, q, target" in msg and str(tmp_path) not in msg


def test_a_job_naming_a_hub_id_reports_downloading(tmp_path, monkeypatch):
    """Through a job: with allow_downloads the worker downloads the hub id (a fake
    snapshot_download filling the cache) and the job's progress shows ``downloading``;
    without, the job fails saying how to pre-download it."""
    import fakeredis
    import huggingface_hub

    from tests.support.fake_worker import FakeModel, FakeTokenizer, _events, _run, fake_runtime

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    real = huggingface_hub.snapshot_download

    def fake_download(repo_id, local_files_only=False, **kw):
        if not local_files_only:
            hub_cache(cache, repo_id, SHIPPED_MODELS / "draft-tiny")
        return real(repo_id, local_files_only=True, cache_dir=str(cache), **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    for allow in (False, True):
        rt = fake_runtime(fakeredis.FakeRedis())
        rt.models = ModelPool(1, loader=lambda path: (FakeModel(), FakeTokenizer()),
                              profile=lambda m: None, fingerprint=lambda m, i, bs: "fp-" + i,
                              warm=lambda m: None, catalog=ModelCatalog.from_settings(rt.settings),
                              allow_downloads=allow)
        # threshold 0: the draft is loaded (a shorter prompt needs only its tokenizer, issue 17)
        payload = build_spec(rt.settings, text="x" * 100, draft_model="acme/fresh", threshold=0).to_payload()
        if not allow:
            with pytest.raises(ValueError, match="hf download acme/fresh"):
                _run(rt, payload, "no")
            continue
        out = _run(rt, payload, "yes")
        kinds = [e.kind for e in _events(rt.connection, "yes")]
        assert kinds[0] == "downloading" and "loading_model" in kinds and kinds[-1] == "done"
        assert out["model"] == f"hub:acme/fresh@{REVISION}" and out["draft_name"] == "acme/fresh"
