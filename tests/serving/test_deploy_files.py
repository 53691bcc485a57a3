"""The deployment files, checked without docker or a server: docker-compose.yml, prometheus.yml, and
each model's config.pbtxt parsed into Triton's ModelConfig protobuf."""

from __future__ import annotations

import re

import pytest

from .conftest import REPO

import yaml  # noqa: E402  (pyyaml: in the serve and test extras)


def test_docker_compose():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    triton = compose["services"]["triton"]
    assert triton["image"].startswith("nvcr.io/nvidia/tritonserver:") and triton["image"].endswith("-py3")
    command = " ".join(triton["command"])
    assert "pip install" in command and "tritonserver" in command
    mounts = {v.split(":")[1]: v.split(":")[0] for v in triton["volumes"]}
    repo_in_container = re.search(r"--model-repository=(\S+)", command).group(1)
    assert mounts[repo_in_container] == "./model_repository"
    src = re.search(r"cp -r (\S+) ", command).group(1)
    assert mounts[src] == "./"
    metrics_port = re.search(r"--metrics-port=(\d+)", command).group(1)
    assert any(p.endswith(f":{metrics_port}") for p in triton["ports"])
    assert all(p.startswith("127.0.0.1:") for p in triton["ports"])  # published on loopback only

    prom = compose["services"]["prometheus"]
    assert "triton" in prom["depends_on"]
    config_mount = next(v for v in prom["volumes"] if v.startswith("./prometheus.yml:"))
    assert config_mount.split(":")[1] in " ".join(prom["command"])
    scrape = yaml.safe_load((REPO / "prometheus.yml").read_text())
    targets = [t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert f"triton:{metrics_port}" in targets


@pytest.mark.parametrize("model", ["toktier_session", "toktier_encode"])
def test_model_config_parses(model):
    from tritonclient.grpc import model_config_pb2 as pb
    from google.protobuf import text_format

    cfg = text_format.Parse((REPO / "model_repository" / model / "config.pbtxt").read_text(), pb.ModelConfig())
    assert cfg.name == model and cfg.backend == "python" and cfg.max_batch_size > 0
    assert (REPO / "model_repository" / model / "1" / "model.py").is_file()
    assert cfg.parameters["tokenizer"].string_value == "${tokenizer}"  # no default: refused unfilled
    assert int(cfg.parameters["max_text_bytes"].string_value) > 0
    names = {i.name for i in cfg.input}
    assert {"TEXT", "ADD_SPECIAL_TOKENS"} <= names
    assert {o.name for o in cfg.output} >= {"INPUT_ID", "REQUEST_INPUT_LEN"}
    if model == "toktier_session":
        assert cfg.WhichOneof("scheduling_choice") == "sequence_batching"
        sb = cfg.sequence_batching
        assert sb.WhichOneof("strategy_choice") == "oldest"
        assert sb.max_sequence_idle_microseconds > 0
        assert not sb.control_input  # correlation_id() serves int and str IDs; see the config comment
        assert {"MODE", "REPLY"} <= names and {o.name for o in cfg.output} >= {"KEEP", "ROUTE"}
    else:
        assert cfg.WhichOneof("scheduling_choice") == "dynamic_batching"


def test_prepare_repository_substitutes(tmp_path):
    from toktier_backend.deploy.server import prepare_repository

    tok = REPO / "toktier_backend" / "data" / "gpt2" / "tokenizer.json"
    dst = prepare_repository(tmp_path / "models", tokenizer=str(tok), max_text_bytes=1234, session_idle_s=2.5)
    text = (dst / "toktier_session" / "config.pbtxt").read_text()
    assert f'string_value: "{tok.resolve()}"' in text
    assert 'string_value: "1234"' in text and "max_sequence_idle_microseconds: 2500000" in text
    assert f'string_value: "{tok.resolve()}"' in (dst / "toktier_encode" / "config.pbtxt").read_text()
    # preprocessing: TensorRT-LLM's template keys filled with the documented defaults, the tokenizer ours
    from tritonclient.grpc import model_config_pb2 as pb
    from google.protobuf import text_format

    pre = text_format.Parse((dst / "preprocessing" / "config.pbtxt").read_text(), pb.ModelConfig())
    assert pre.max_batch_size == 256 and [g.count for g in pre.instance_group] == [1]
    assert pre.parameters["tokenizer"].string_value == str(tok.resolve())
    assert pre.parameters["tokenizer_dir"].string_value == "${tokenizer_dir}"
    assert pre.parameters["add_special_tokens"].string_value == "true"


def test_docker_compose_fleet():
    """`docker compose --profile fleet up`: two more replicas of the triton service, nginx in front of the
    three with deploy/nginx/nginx.conf (session-affine consistent hash), Prometheus scraping every replica."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    triton = services["triton"]
    replicas = ["triton", "triton-2", "triton-3"]
    for name in replicas[1:]:
        r = services[name]
        assert r["profiles"] == ["fleet"] and not r["ports"]  # reached through nginx only
        assert r["image"] == triton["image"] and r["command"] == triton["command"]
        assert r["volumes"] == triton["volumes"] and r["healthcheck"] == triton["healthcheck"]
    nginx = services["nginx"]
    assert nginx["profiles"] == ["fleet"] and nginx["image"].startswith("nginx:")
    assert "./deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro" in nginx["volumes"]
    assert all(p.startswith("127.0.0.1:") for p in nginx["ports"])
    assert {p.rsplit(":", 1)[1] for p in nginx["ports"]} == {"8000", "8001"}
    assert all(nginx["depends_on"][r]["condition"] == "service_healthy" for r in replicas)
    conf = (REPO / "deploy" / "nginx" / "nginx.conf").read_text()
    assert conf.count("hash $http_x_toktier_session consistent;") == 2
    assert "listen 0.0.0.0:8001 http2;" in conf and "listen 0.0.0.0:8000;" in conf
    for r in replicas:
        assert f"server {r}:8001 " in conf and f"server {r}:8000 " in conf
    scrape = yaml.safe_load((REPO / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    metrics_port = re.search(r"--metrics-port=(\d+)", " ".join(triton["command"])).group(1)
    assert {f"{r}:{metrics_port}" for r in replicas} <= targets
