#!/usr/bin/env bash
# Lint what the patch series adds, as PyTorch's lintrunner would, with the tool
# versions pinned in lint/requirements.txt (checked before anything runs):
#   ruff check and flake8 with upstream's plugin set, findings on added lines
#   only (the untouched lines of a release predate today's rules);
#   mypy and pyrefly on state_dict.py against the installed torch (upstream
#   type-checks torch/**, not these tests),
#   findings on added lines only;
#   ruff format and usort on the files the series touches, whole files.
#
#   python -m venv .venvlint && .venvlint/bin/pip install -r torch_patch/lint/requirements.txt
#   PATH=$PWD/.venvlint/bin:$PATH PYTHON=<python with torch> bash torch_patch/lint.sh
#
# PYTHON names the interpreter whose torch supplies state_dict.py and resolves
# imports for the type checkers (default: python); use the newest release.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python}

# A lint result from other versions is not this lint's result.
mismatch=0
while read -r pin; do
  name=${pin%%==*}
  want=${pin#*==}
  have=$(pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  if [ "$have" != "$want" ]; then
    echo "lint: $name $want is pinned, found ${have:-nothing}" >&2
    mismatch=1
  fi
done < <(grep -E '^[A-Za-z0-9_.-]+==' "$here/lint/requirements.txt")
[ $mismatch -eq 0 ] || { echo "lint: pip install -r $here/lint/requirements.txt" >&2; exit 2; }

tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
target=torch/distributed/checkpoint/state_dict.py
site=$("$python" -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
mkdir -p "$tree/$(dirname "$target")"
cp "$site/$target" "$tree/$target"
# The wheels ship no tests: the stand-ins hold what the series' test hunks edit.
for pair in fsdp/test_fsdp_dsd.py:test_fsdp_dsd_base.py test_state_dict.py:test_state_dict_base.py; do
  test_file=test/distributed/checkpoint/${pair%%:*}
  mkdir -p "$tree/$(dirname "$test_file")"
  cp "$here/${pair#*:}" "$tree/$test_file"
done
cd "$tree"
git init -q && git add -A && git -c user.name=lint -c user.email=lint@localhost commit -qm base
for patch in "$here"/0*.patch; do git apply "$patch"; done
git add -A
files=$(git diff --cached --name-only)
# "file:line" for every line the series adds.
git diff --cached -U0 | awk '
  /^\+\+\+ b\// { file = substr($0, 7) }
  /^@@/ { split($3, r, ","); start = substr(r[1], 2); n = (r[2] == "" ? 1 : r[2]);
          for (i = 0; i < n; i++) print file ":" start + i }' > added.txt
on_added_lines() { grep -F -f <(sed 's/$/:/' added.txt) || true; }
findings=$( {
  ruff check --config "$here/lint/ruff.toml" --output-format concise $files || true
  flake8 --config "$here/lint/flake8.ini" $files || true
  # The copied file type-checks against the installed torch.
  mypy --python-executable "$(command -v "$python")" --follow-imports=silent \
    --ignore-missing-imports --no-error-summary --show-absolute-path "$target" 2>/dev/null |
    sed "s|^$tree/||" || true
  pyrefly check --preset default --python-interpreter-path "$(command -v "$python")" \
    --output-format min-text "$target" 2>/dev/null | sed -E 's#^(ERROR|WARN) ##' || true
} | on_added_lines )
status=0
if [ -n "$findings" ]; then echo "$findings"; status=1; fi
ruff format --config "$here/lint/ruff.toml" --diff $files || status=1
printf '[tool.usort.known]\nfirst_party = ["torch", "test"]\n' > pyproject.toml
usort diff $files | grep . && status=1
[ $status -eq 0 ] && echo "lint clean: $(echo $files)"
exit $status
