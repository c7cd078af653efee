#!/usr/bin/env bash
# The GPU check in one call, on a machine with a GPU and no network (benchmarks/gpu/README.md):
#
#   benchmarks/gpu/run.sh [OUT] [main.py's options]     # default OUT: $OUT, else out/gpu
#
# Installs the wheels `make gpu-wheels` put in benchmarks/gpu/wheels, each only where the
# machine's Python cannot import it already, into a folder of their own (the machine's own
# packages are left alone), then runs benchmarks/gpu/main.py with --device cuda.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-${OUT:-$root/out/gpu}}"
shift || true
python="${PYTHON:-python3}"
mkdir -p "$out"
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
missing=()
for wheel in "$here"/wheels/*.whl; do
    [ -e "$wheel" ] || { echo "no wheels in $here/wheels: run make gpu-wheels first" >&2; break; }
    name="$(basename "$wheel" | cut -d- -f1)"
    module="$name"
    case "$name" in
        absl_py) module=absl ;;
        protobuf) module=google.protobuf ;;
    esac
    "$python" -c "import $module" 2>/dev/null || missing+=("$wheel")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing ${#missing[@]} wheel(s) into $site: ${missing[*]##*/}" >&2
    if ! "$python" -m pip install --quiet --no-index --no-deps --target "$site" "${missing[@]}"; then
        echo "pip failed; unpacking the wheels instead (a wheel is a zip of site-packages)" >&2
        for wheel in "${missing[@]}"; do "$python" -m zipfile -e "$wheel" "$site"; done
    fi
fi
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
# the device tool returns at most 8 files: the run writes to a folder of its own, and OUT
# gets the summary, every number, the log and the profiles
full="$(mktemp -d)"
trap 'rm -rf "$site" "$full"' EXIT
status=0
"$python" -m benchmarks.gpu.main --device cuda -o "$full" "$@" 2>&1 | tee "$out/log.txt" || status=$?
for f in results.json table.md gpt.profile.json llama.profile.json cluster.json; do
    [ -e "$full/$f" ] && cp "$full/$f" "$out/"
done
exit "$status"
