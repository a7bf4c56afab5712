#!/usr/bin/env bash
# Build .ab/old (git-ignored: list it in .git/info/exclude): this tree's lab and package files with
# the optimizer core (dos/*.py but __main__.py, and csrc/) of commit $1.
set -eu
sha=$1
rm -rf .ab/old && mkdir -p .ab/old
git archive HEAD dos csrc pyproject.toml | tar -x -C .ab/old
rm -f .ab/old/dos/*.py
# --no-wildcards-match-slash: 'dos/*.py' is the core's files only (GNU tar's * matches '/' by
# default, and took the old commit's dos/lab too until session 33)
git archive "$sha" dos csrc | tar -x -C .ab/old --wildcards --no-wildcards-match-slash 'dos/*.py' 'csrc/*'
# the old core's lab modules (flat, before dos/lab/) are not used: the new lab drives both
rm -rf .ab/old/dos/bench
for f in sweep results figures plots plots_traces nvml cli; do rm -f .ab/old/dos/$f.py; done
cp dos/__main__.py .ab/old/dos/__main__.py
ls .ab/old/dos
