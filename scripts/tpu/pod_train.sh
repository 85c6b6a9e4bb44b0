#!/usr/bin/env bash
# zerojax on a Cloud TPU pod slice (TPU VMs): run this on every worker, with the same arguments:
#   gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all \
#     --command="cd zerojax && bash scripts/tpu/pod_train.sh --config configs/gpt-1b.yaml train.out_dir=gs://..."
# Each worker's place in the slice comes from the TPU VM's metadata server, where JAX's own
# detection (jax/_src/clusters/cloud_tpu_cluster.py) reads it: agent-worker-number is this worker,
# worker-network-endpoints lists them all, in process order. They are passed to zerojax as the
# variables a GKE TPU slice sets (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES), which zerojax's
# mesh.distributed=auto reads: process id = worker (+ slice x workers with MEGASCALE_*), the
# coordinator is the first worker at port 8482, as in JAX. Variables already set are kept.
# Written from JAX's cluster detection; not run on a TPU pod by this project.
set -euo pipefail
metadata=http://${GCE_METADATA_IP:-metadata.google.internal}/computeMetadata/v1/instance/attributes
get() { curl -sf -H "Metadata-Flavor: Google" "$metadata/$1"; }
if [ -z "${TPU_WORKER_ID:-}" ]; then
  TPU_WORKER_ID=$(get agent-worker-number) || { echo "zerojax: pod_train: no TPU metadata at $metadata (not a TPU VM?)" >&2; exit 2; }
fi
if [ -z "${TPU_WORKER_HOSTNAMES:-}" ]; then
  # entries are hostnames, or name:id:address triples (JAX takes the address of those)
  TPU_WORKER_HOSTNAMES=$(get worker-network-endpoints | tr ',' '\n' | awk -F: '{print (NF == 3 ? $3 : $1)}' | paste -sd, -)
fi
export TPU_WORKER_ID TPU_WORKER_HOSTNAMES
if [ -n "${ZEROJAX_PYTHON:-}" ]; then exec "$ZEROJAX_PYTHON" -m zerojax train "$@"; else exec zerojax train "$@"; fi
