#!/usr/bin/env bash
# A batch longer than one device call, run as one process that outlives each call:
#   bash experiments/scripts/h200_daemon.sh start WAIT_S BUDGET "PYTEST_ARGS" "NOTEBOOKS" [SPEC ...]
#   bash experiments/scripts/h200_daemon.sh wait WAIT_S
# `start` copies the checkout to $DOS_DAEMON_DIR/repo (default /root/dos-daemon: the next call
# re-copies the checkout in place, under the running sweep) and runs h200_call.sh there, with its
# arguments (BUDGET seconds; SPEC as h200_call.sh's) and its $OUT at $DOS_DAEMON_DIR/out, in a new
# process session: the device kills what a call leaves running except such a one, which runs on
# until the machine goes back. Then, like `wait`, it waits up to WAIT_S for it to end and copies
# its files (per-sweep packs after each run, logs, the calibration, at its end results.tar.gz) to
# $OUT. Why: a batch that spans calls by `--continue-batch` pays each call's setup (two timed imports,
# the calibration, the sweep's server) and its end margin (no run started that would not end 35 s
# before the call's limit): ~1.5 min a call, a 3B planner batch's 21 runs in two calls leaving no
# room for a second shape in a session's 30 minutes (session 24). The machine goes back ~30 s
# after a call ends (`idle_release_s`), the daemon with it: issue each `wait` at once; what it
# returned so far (the packs) holds every run that finished.
set -u
D=${DOS_DAEMON_DIR:-/root/dos-daemon}
cmd=${1:-}; wait_s=${2:-}
case $cmd in start|wait) ;; *) echo "usage: $0 start WAIT_S BUDGET PYTEST NOTEBOOKS [SPEC...] | wait WAIT_S" >&2; exit 2;; esac
[[ $wait_s =~ ^[0-9]+$ ]] || { echo "WAIT_S must be seconds, got '$wait_s'" >&2; exit 2; }
shift 2
start=$(date +%s)
running() { [ -f $D/pid ] && [ ! -f $D/rc ] && kill -0 "$(cat $D/pid)" 2>/dev/null; }
if [ $cmd = start ]; then
  [ $# -ge 3 ] || { echo "start needs BUDGET, PYTEST_ARGS and NOTEBOOKS (h200_call.sh's arguments)" >&2; exit 2; }
  if running; then echo "a daemon is running already (pid $(cat $D/pid)): use wait" >&2; exit 1; fi
  rm -rf $D && mkdir -p $D/out && touch $D/stamp
  cp -a . $D/repo
  # setsid runs the script in its own session (a background job of a shell without job control is
  # no group leader: setsid does not fork, so $! is the daemon's pid)
  setsid bash -c 'cd "$1/repo" && OUT="$1/out" bash experiments/scripts/h200_call.sh "${@:2}" \
      > "$1/out/daemon.log" 2>&1; echo $? > "$1/rc"' _ "$D" "$@" < /dev/null > /dev/null 2>&1 &
  echo $! > $D/pid
  echo "daemon started: pid $(cat $D/pid), in $D/repo"
elif [ ! -f $D/pid ]; then
  echo "no daemon on this machine ($D/pid missing): a fresh machine, or none was started" >&2; exit 1
fi
while [ $(( $(date +%s) - start )) -lt $wait_s ] && running; do sleep 3; done
# the packs are replaced atomically (dos.lab.sweep.pack_dir: a .tmp file, then a rename): a copy
# is of one of them, whole
for f in $D/out/*.tar.gz $D/out/*.txt $D/out/*.log; do [ -f "$f" ] && cp "$f" $OUT/; done
new=$(cd $D/repo && find experiments/results/calibration -newer $D/stamp -type f 2>/dev/null)
[ -n "$new" ] && (cd $D/repo && tar -czf $OUT/calibration.tar.gz $new)
if running; then echo "daemon running (pid $(cat $D/pid)) after $(( $(date +%s) - start )) s of this call"
else echo "daemon ended: rc=$(cat $D/rc 2>/dev/null || echo '? (killed)')"; cat $D/out/daemon.log 2>/dev/null | tail -8; fi
tail -4 $D/out/sweeps.log 2>/dev/null
ls $OUT
