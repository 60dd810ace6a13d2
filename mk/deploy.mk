# Deployment targets (included by the root Makefile through `-include mk/*.mk`).
#   make base-image     local Debian bookworm base image, no registry (debootstrap + docker import)
#   make wheelhouse     every wheel the images install, built on the host into wheelhouse/
#   make images         all CPU images seer-{buffer,scheduler,draft,kvstore,worker}:$(IMAGE_TAG)
#   make compose-smoke  docker-compose up, a rollout through the public API (Python and Node.js
#                       clients), every response checked, docker-compose down
#   make helm-test      render/lint/validate the Helm chart, check docker-compose.yml (no cluster)
# BASE_IMAGE=python:3.11-slim make images   builds FROM the official image where a registry is reachable.
.PHONY: base-image wheelhouse images compose-smoke helm-test

IMAGE_TAG ?= dev

base-image:
	bash docker/build_base_image.sh

wheelhouse: setup
	PYTHON=$(PY) bash docker/build_wheelhouse.sh

images: model
	PYTHON=$(PY) TAG=$(IMAGE_TAG) bash docker/build_images.sh

compose-smoke: images
	SEER_IMAGE_TAG=$(IMAGE_TAG) $(PY) scripts/compose_smoke.py

helm-test: setup
	$(VENV)/bin/pytest -q -m "not docker" tests/deploy
