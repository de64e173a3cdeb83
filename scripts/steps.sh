# steps.sh — sourced by the long scripts (.ci/run, test.sh, setup.sh, fresh-system.sh): named steps, timed.
#   step NAME DESCRIPTION   ends the step before, prints "== DESCRIPTION", starts NAME
#   step_end                ends the running step
#   steps_table TITLE       prints the steps ended since this script started (those of the scripts it
#                           ran included), with their seconds and the total
#   steps_finish NAME       for `trap 'steps_finish NAME' EXIT`: ends the running step, prints the table
#                           titled "NAME: OK in S s" or "NAME: FAILED in step 'STEP' (exit N)", cleans up
# Ended steps go to $HEADS_STEPS_FILE as "NAME SECONDS" lines: the first script that sources this
# makes the file and exports it, so the scripts it runs add theirs. HEADS_STEPS_PREFIX is put before
# the names (.ci/run marks the steps it runs beside others).

if [ -z "${HEADS_STEPS_FILE:-}" ]; then
  HEADS_STEPS_FILE=$(mktemp "${TMPDIR:-/tmp}/heads-steps.XXXXXX")
  export HEADS_STEPS_FILE
  STEPS_OWN_FILE=1
else
  STEPS_OWN_FILE=0
fi
STEPS_FROM=$(($(wc -l <"$HEADS_STEPS_FILE") + 1)) STEP_NAME="" STEP_T0=0 STEPS_T0=$(date +%s)

step() {
  step_end
  STEP_NAME=${HEADS_STEPS_PREFIX:-}$1 STEP_T0=$(date +%s)
  echo "== $2"
}

step_end() {
  [ -n "$STEP_NAME" ] || return 0
  echo "$STEP_NAME $(($(date +%s) - STEP_T0))" >>"$HEADS_STEPS_FILE"
  STEP_NAME=""
}

steps_table() {
  tail -n "+$STEPS_FROM" "$HEADS_STEPS_FILE" | awk -v title="$1" '
    { name[NR] = $1; secs[NR] = $2; total += $2; if (length($1) > w) w = length($1) }
    END {
      if (NR == 0) exit
      if (w < 5) w = 5
      printf "== %s\n", title
      for (i = 1; i <= NR; ++i) printf "   %-*s %6d s  %5.1f min\n", w, name[i], secs[i], secs[i] / 60
      printf "   %-*s %6d s  %5.1f min\n", w, "sum", total, total / 60
    }'
}

# The file goes when the script that made it exits (call from its EXIT trap).
steps_cleanup() {
  if ((STEPS_OWN_FILE)); then rm -f "$HEADS_STEPS_FILE"; fi
}

steps_finish() {
  local rc=$? failed_in=$STEP_NAME
  step_end
  if [ "$rc" -eq 0 ]; then
    steps_table "$1: OK in $(($(date +%s) - STEPS_T0)) s"
  else
    steps_table "$1: FAILED${failed_in:+ in step '$failed_in'} (exit $rc)"
  fi
  steps_cleanup
}

# apt-get with a lock of this project's own around it, and waiting up to 10 minutes for dpkg's: CI
# installs the host's packages (setup.sh) beside the fresh root's first step, which may itself
# apt-get debootstrap on the host; the second to start failed on apt's lock (exit 100).
apt_get() {
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo flock /tmp/heads-apt.lock apt-get -o DPkg::Lock::Timeout=600 "$@"
}
