# syntax=docker/dockerfile:1
# lorafleet: one image for the three services; the first argument names the module:
#   docker run IMAGE services.router --listen 0.0.0.0:7001 ...
# GPU image (default): torch from PyPI, whose Linux wheels bundle the CUDA runtime.
# CPU image (dev overlay, laptops, kind):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t lorafleet:dev .
ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: a virtualenv with the project, its stubs, and the tiny model --------------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# torch first: the largest layer and the one that changes least often.
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos protos
COPY tools tools
COPY services services
COPY kernels kernels
# Stubs go into services/common/gen before `pip install .`, so they ship inside the package.
RUN pip install "grpcio-tools>=1.60" \
 && python tools/gen_protos.py \
 && pip install ".[engine,otlp]" \
 && pip uninstall -y grpcio-tools
# The embedded default base model (deterministic), for dev and smoke tests: /app/models/tiny-llama.
RUN python tools/make_tiny_model.py --out /app/models

# ---- runtime: the virtualenv and the model, no sources, no build tools but a C compiler -----
FROM ${PYTHON_IMAGE}
# Triton builds its small GPU launcher with a C compiler the first time a kernel runs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 lorafleet \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
            --shell /usr/sbin/nologin lorafleet
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app/models /app/models
# The root filesystem is read-only in Kubernetes: everything that writes goes under /tmp
# (an emptyDir there); bytecode was compiled at install time.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    HF_HOME=/tmp/hf
WORKDIR /app
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
EXPOSE 7001 7002 7003 9101 9102 9103
ENTRYPOINT ["python", "-m"]
CMD ["services.router", "--help"]
