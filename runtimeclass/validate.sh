#!/usr/bin/env bash
# Validate every Kubernetes manifest in runtimeclass/ and node-installer/, and the rendered kustomization, against
# the schema of a recent Kubernetes release, offline (kubernetes-validate ships its schemas).
#
#   setup: pip install kubernetes-validate==1.37.0
#   run:   runtimeclass/validate.sh            (K8S_VERSION=1.34.0 runtimeclass/validate.sh for another release)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
k8s_version=${K8S_VERSION:-1.37.0}
# make setup installs the validator into a venv outside the checkout.
export PATH="${BULKHEAD_CACHE:-/var/cache/bulkhead}/venv/bin:$PATH"

if ! command -v kubernetes-validate >/dev/null 2>&1; then
  echo "SKIPPED: kubernetes-validate not installed (make setup installs it)"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 1. Render the kustomization with a small loader (resources: files and directories holding a kustomization.yaml;
#    that is all ours use), so kubectl is not required. If kubectl is there, its rendering must agree.
python3 - "$here" >"$work/rendered.yaml" <<'PY'
import os, sys, yaml

def render(d, seen):
    d = os.path.realpath(d)
    if d in seen:
        sys.exit(f"kustomization cycle at {d}")
    seen.add(d)
    with open(os.path.join(d, "kustomization.yaml")) as f:
        k = yaml.safe_load(f)
    unknown = set(k) - {"apiVersion", "kind", "resources"}
    if unknown:
        sys.exit(f"{d}/kustomization.yaml uses {sorted(unknown)}: extend this loader or use kubectl kustomize")
    docs = []
    for r in k.get("resources", []):
        p = os.path.join(d, r)
        if os.path.isdir(p):
            docs += render(p, seen)
        else:
            with open(p) as f:
                docs += [x for x in yaml.safe_load_all(f) if x]
    return docs

print(yaml.safe_dump_all(render(sys.argv[1], set()), sort_keys=False), end="")
PY

ids() { python3 -c 'import sys,yaml; [print(d["kind"], d["metadata"].get("namespace",""), d["metadata"]["name"]) for d in yaml.safe_load_all(open(sys.argv[1])) if d]' "$1" | sort; }
if command -v kubectl >/dev/null 2>&1 && kubectl kustomize "$here" >"$work/kubectl.yaml" 2>/dev/null; then
  if ! diff <(ids "$work/rendered.yaml") <(ids "$work/kubectl.yaml"); then
    echo "FAIL: loader and kubectl kustomize render different objects" >&2
    exit 1
  fi
  echo "kubectl kustomize agrees with the loader ($(ids "$work/rendered.yaml" | wc -l) objects)"
fi

# 2. The validator must reject a broken manifest, or a pass below would mean nothing.
cat >"$work/broken.yaml" <<'YAML'
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata:
  name: broken
handlr: bulkhead
overhead:
  podFixed:
    memory: lots
YAML
if kubernetes-validate --strict --quiet -k "$k8s_version" "$work/broken.yaml" >/dev/null 2>&1; then
  echo "FAIL: kubernetes-validate accepted a broken RuntimeClass; validation is not working" >&2
  exit 1
fi

# 3. Every manifest file (kustomization.yaml files are kustomize config, checked by rendering) plus the rendering.
mapfile -t files < <(find "$here" "$repo/node-installer" -path "$repo/node-installer/target" -prune -o \
  \( -name '*.yaml' -o -name '*.yml' \) ! -name 'kustomization.yaml' -print | sort)
kubernetes-validate --strict --quiet -k "$k8s_version" "${files[@]}" "$work/rendered.yaml"
echo "OK: ${#files[@]} manifest files and the rendered kustomization ($(ids "$work/rendered.yaml" | wc -l) objects) valid for Kubernetes $k8s_version"
