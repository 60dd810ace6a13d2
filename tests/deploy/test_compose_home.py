"""Every compose service keeps a writable $HOME for the images' user, though its root is read-only.

The images set HOME=/home/seer and run as USER 10001 (docker/Dockerfile); the compose services run
with `read_only: true`. With only /tmp on a tmpfs, $HOME was on the read-only root, and everything
that writes there failed in the containers: torch / Triton JIT caches, ~/.cache/seer (the worker's
compiled kernels and step-time table, the model cache) and `seer profile` output. The Helm chart
mounts an emptyDir there (tests/deploy/test_helm_chart.py); this checks the compose file, statically
(the compose suite itself takes minutes and a Docker daemon)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from deploy_render import COMPOSE, REPO

DOCKERFILE = REPO / "docker" / "Dockerfile"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return data


def _image_home_and_user() -> tuple[str, str]:
    """(HOME, uid) of the images, from docker/Dockerfile: one HOME and one USER for every stage."""
    text = DOCKERFILE.read_text(encoding="utf-8")
    homes = set(re.findall(r"^\s*(?:ENV\s+)?.*\bHOME=(\S+)", text, flags=re.MULTILINE))
    users = set(re.findall(r"^USER\s+(\d+)(?::\d+)?\s*$", text, flags=re.MULTILINE))
    assert len(homes) == 1, f"docker/Dockerfile sets HOME to {sorted(homes)}"
    assert len(users) == 1, f"docker/Dockerfile runs as {sorted(users)}"
    return homes.pop(), users.pop()


def _tmpfs_options(svc: dict[str, Any], path: str) -> list[str] | None:
    """The mount options of the service's tmpfs at `path` ([] when given none), None when none is there."""
    entries = svc.get("tmpfs", [])
    for entry in [entries] if isinstance(entries, str) else entries:
        target, _, options = str(entry).partition(":")
        if target.rstrip("/") == path.rstrip("/"):
            return [o for o in options.split(",") if o]
    return None


def _volume_targets(svc: dict[str, Any]) -> set[str]:
    targets = set()
    for v in svc.get("volumes", []):
        if isinstance(v, dict):
            targets.add(str(v.get("target", "")).rstrip("/"))
        else:
            parts = str(v).split(":")
            targets.add((parts[1] if len(parts) > 1 else parts[0]).rstrip("/"))
    return targets


def test_the_dockerfile_makes_home_the_users() -> None:
    """Without a mount (a plain `docker run`), HOME is the image's own directory: created and
    owned by the user the image runs as."""
    home, uid = _image_home_and_user()
    text = DOCKERFILE.read_text(encoding="utf-8")
    runs = " ".join(re.findall(r"^RUN\s+((?:.*\\\n)*.*)$", text, flags=re.MULTILINE))
    assert re.search(rf"mkdir -p [^&]*{re.escape(home)}\b", runs), f"{home} is not created"
    assert re.search(rf"chown (?:-R )?{uid}:\d+ [^&]*{re.escape(home)}\b", runs), f"{home} is not chowned to {uid}"


def test_every_read_only_service_has_a_writable_home(compose: dict[str, Any]) -> None:
    home, uid = _image_home_and_user()
    checked = 0
    for name, svc in compose["services"].items():
        if not svc.get("read_only"):
            continue
        checked += 1
        options = _tmpfs_options(svc, home)
        if options is None:
            # A volume works too: a new named volume takes the image directory's ownership.
            assert home.rstrip("/") in _volume_targets(svc), (
                f"{name}: read_only root and no tmpfs or volume at $HOME ({home}): nothing can write there")
            continue
        opts = dict(o.partition("=")[::2] for o in options)
        # A tmpfs is root's (mode 1777 with sticky bit at best) unless uid= says otherwise; an
        # explicit mode that lets everyone write would do as well.
        world_writable = "mode" in opts and int(opts["mode"], 8) & 0o002
        assert opts.get("uid") == uid or world_writable, (
            f"{name}: the tmpfs at {home} is not owned by the images' user {uid}: {options}")
        # Docker mounts tmpfs noexec unless told: compiled kernels cached there could not be loaded.
        assert "exec" in opts and "noexec" not in opts, f"{name}: the tmpfs at {home} is noexec: {options}"
    assert checked >= 5, "every service runs with a read-only root (the chart's securityContext)"
