#!/usr/bin/env bash
# The wheels the services import that the device image lacks (or has too old), for its
# python3.12, into .whl (ignored by git; carry it: run(carry=[".whl", ...])). Run here, from the
# repository's root, where pip reaches an index: `bash bench/device/wheels.sh`.
# - grpcio and protobuf at the versions the generated stubs were made with (the image's grpcio
#   1.84 is older than the stubs' 1.85.4: their import refuses it);
# - llguidance >= 1.7 (pyproject's floor; 1.6, the newest manylinux_2_28 wheel, fails the
#   worker's start): its wheels from 1.7 are manylinux_2_31, hence the platform list;
# - the store's boto3 stack, OpenTelemetry and the gRPC health/reflection/status packages.
# h200_serve.sh and h200_mixed.sh install all of .whl into /tmp/site; h200_run.sh llguidance's.
set -euo pipefail
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}  # make venv's
stub_grpc=$($PY -c "import grpc; print(grpc.__version__)")
stub_pb=$($PY -c "import google.protobuf as p; print(p.__version__)")
plat=()
for n in 17 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
rm -rf .whl && mkdir -p .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl "grpcio==$stub_grpc" "protobuf==$stub_pb" "llguidance>=1.7" \
  grpcio-health-checking grpcio-status grpcio-reflection googleapis-common-protos \
  boto3 botocore s3transfer jmespath \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  importlib-metadata 2>&1 | { grep -v "^WARNING: Location" || true; }
ls .whl
du -sh .whl
