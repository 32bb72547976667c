#!/usr/bin/env bash
# Apply the series to PyTorch main's own files, as the filer will by hand.
#
#     bash torch_patch/apply_to_main.sh PYTORCH_CLONE [REF]
#
# prove.py applies the patches to an installed release's state_dict.py and to
# the stand-ins for the two test files; this applies them to the three files
# as they are at REF (default HEAD) of a pytorch/pytorch clone, read with
# `git show` into a scratch directory: each patch alone, then 0001 + 0002.
# It prints the commit, how each patch applied (clean, with one context line
# less, or not at all, with git's reason), and _init_optim_state as it is at
# REF, next to which 0001 adds its guard call. It runs no test: run both test
# files on each branch of the fork (UPSTREAM.md, filing checklist).
# recheck_upstream.py (RECHECK.md) applies every upstream piece to a checkout's
# working tree and runs the tests the patches add, in one command.
set -euo pipefail

clone=${1:?usage: apply_to_main.sh PYTORCH_CLONE [REF]}
ref=${2:-HEAD}
here=$(cd "$(dirname "$0")" && pwd)
files=(
    torch/distributed/checkpoint/state_dict.py
    test/distributed/checkpoint/fsdp/test_fsdp_dsd.py
    test/distributed/checkpoint/test_state_dict.py
)
patches=("$here"/0*.patch)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

echo "pytorch $(git -C "$clone" rev-parse "$ref") ($(git -C "$clone" log -1 --format='%cs %s' "$ref"))"
for file in "${files[@]}"; do
    mkdir -p "$scratch/main/$(dirname "$file")"
    git -C "$clone" show "$ref:$file" > "$scratch/main/$file"
done

status=0
apply() {  # apply TREE PATCH: print how PATCH applies in TREE, then apply it
    local tree=$1 patch=$2 context
    for context in "" -C1; do
        if err=$(cd "$tree" && git apply --check $context "$patch" 2>&1); then
            (cd "$tree" && git apply $context "$patch" 2>/dev/null)
            echo "  git apply $(basename "$patch"): ${context:+with }${context:-clean}"
            return 0
        fi
    done
    echo "  git apply $(basename "$patch"): FAILS"
    sed 's/^/    /' <<< "$err"
    status=1
    return 1
}

stage() {  # stage NAME PATCH...: apply the patches, in order, to a fresh copy
    local name=$1
    shift
    cp -r "$scratch/main" "$scratch/$name"
    echo "stage $name:"
    for patch in "$@"; do
        apply "$scratch/$name" "$patch" || return 0
    done
}

for patch in "${patches[@]}"; do
    stage "$(basename "$patch" | cut -c1-4)" "$patch"
done
stage series "${patches[@]}"

echo "_init_optim_state at $ref:"
awk '/^def _init_optim_state\(/ {on = 1} on && /^def / && !/_init_optim_state/ {exit} on' \
    "$scratch/main/${files[0]}" | sed 's/^/  | /'
exit $status
