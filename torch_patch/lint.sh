#!/usr/bin/env bash
# Lint what the patch adds, as PyTorch's lintrunner would: ruff check, flake8 +
# bugbear (findings on added lines only: the untouched lines of older releases
# predate today's rules), ruff format and usort (whole files).
#   pip install ruff flake8 flake8-bugbear usort && bash torch_patch/lint.sh
# PYTHON names the interpreter whose torch supplies state_dict.py (default:
# python); use the newest release, the stand-in for main.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
target=torch/distributed/checkpoint/state_dict.py
site=$("${PYTHON:-python}" -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
mkdir -p "$tree/$(dirname "$target")"
cp "$site/$target" "$tree/$target"
cd "$tree"
git init -q && git add -A && git -c user.name=lint -c user.email=lint@localhost commit -qm base
for patch in "$here"/0*.patch; do git apply "$patch"; done
git add -A
files=$(git diff --cached --name-only)
# "file:line" for every line the patch adds.
git diff --cached -U0 | awk '
  /^\+\+\+ b\// { file = substr($0, 7) }
  /^@@/ { split($3, r, ","); start = substr(r[1], 2); n = (r[2] == "" ? 1 : r[2]);
          for (i = 0; i < n; i++) print file ":" start + i }' > added.txt
on_added_lines() { grep -F -f <(sed 's/$/:/' added.txt) || true; }
findings=$( {
  ruff check --config "$here/lint/ruff.toml" --output-format concise $files || true
  flake8 --config "$here/lint/flake8.ini" $files || true
} | on_added_lines )
status=0
if [ -n "$findings" ]; then echo "$findings"; status=1; fi
ruff format --config "$here/lint/ruff.toml" --diff $files || status=1
printf '[tool.usort.known]\nfirst_party = ["torch", "test"]\n' > pyproject.toml
usort diff $files | grep . && status=1
[ $status -eq 0 ] && echo "lint clean: $(echo $files)"
exit $status
