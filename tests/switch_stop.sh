# Stopping a switch process in the switch tests and saying how it ended, so
# that a crash reads as a crash and not as the missing statistics file that
# follows from it. Source it; it sets no shell options.
#
#   gsw_stop PID NAME [SECONDS]   SIGINT, then up to SECONDS (default 5) for it
#                                 to exit, else SIGKILL. Returns 0 if NAME
#                                 exited cleanly on the SIGINT; otherwise says
#                                 "FAIL: NAME crashed (SIGSEGV)", "... exited
#                                 with status 1 before it was stopped", ... and
#                                 returns 1.
#   gsw_stop_logged PID NAME LOG  gsw_stop, and on failure the last lines of
#                                 LOG (the switch's output).
#
# PID may be timeout(1) around the switch (timeout passes SIGINT on, and dies
# of the switch's signal when the switch does) or `ip netns exec` that became it.

gsw_exit_text() {  # STATUS → how a process ended
  local rc=$1
  if ((rc == 0)); then
    echo "exited cleanly"
  elif ((rc == 124)); then
    echo "ran out of time (stopped by timeout(1))"
  elif ((rc > 128 && rc < 128 + 65)); then
    local sig
    sig=$(kill -l $((rc - 128)) 2>/dev/null) && sig=SIG$sig || sig="signal $((rc - 128))"
    case $sig in
      SIGINT | SIGTERM | SIGHUP | SIGKILL) echo "was killed by $sig" ;;
      *) echo "crashed ($sig)" ;;
    esac
  else
    echo "exited with status $rc"
  fi
}

gsw_stop() {  # PID NAME [SECONDS]
  local pid=$1 name=$2 secs=${3:-5} rc i
  if ! kill -0 "$pid" 2>/dev/null; then
    wait "$pid" 2>/dev/null
    rc=$?
    echo "FAIL: $name $(gsw_exit_text "$rc") before it was stopped"
    return 1
  fi
  kill -INT "$pid" 2>/dev/null
  for ((i = 0; i < secs * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    # timeout(1) leads its own process group: take the switch down with it.
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    echo "FAIL: $name did not exit within $secs s of SIGINT (killed)"
    return 1
  fi
  wait "$pid" 2>/dev/null
  rc=$?
  [[ $rc == 0 ]] && return 0
  echo "FAIL: $name $(gsw_exit_text "$rc") when stopped"
  return 1
}

gsw_stop_logged() {  # PID NAME LOG
  gsw_stop "$1" "$2" && return 0
  echo "-- $2 log, last lines:"
  tail -15 "$3"
  return 1
}
